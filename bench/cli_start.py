"""How long `gpusched decode` and `gpusched tap --help` take from start to exit: decode
runs once per message under `nats sub --translate 'gpusched decode'`, so its start is
its cost. Prints the median wall time of N runs of each (a fresh process every time,
through the installed `gpusched` script) and the machine-speed figure of the same run.

    .venv/bin/python bench/cli_start.py [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from speed import print_machine_speed  # bench/ is the script's own directory

GPUSCHED = Path(sys.executable).with_name("gpusched")
#: a job state event, as the scheduler publishes one
SAMPLE = {
    "job_id": "j018f2b3c4d5e1a2b3c4d", "state": "RUNNING", "at": 1717171717.25,
    "placement": [{"node": "n0", "gpus": [0, 1]}], "reason": "",
}  # fmt: skip


def median_wall_s(argv: list[str], stdin: bytes, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(argv, input=stdin, capture_output=True, check=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    payload = msgspec.msgpack.encode(SAMPLE)
    decode = median_wall_s([str(GPUSCHED), "decode"], payload, args.runs)
    tap = median_wall_s([str(GPUSCHED), "tap", "--help"], b"", args.runs)
    bare = median_wall_s([sys.executable, "-c", "pass"], b"", args.runs)
    print(f"runs {args.runs}")
    print(f"decode_median_s {decode:.3f}")
    print(f"tap_help_median_s {tap:.3f}")
    print(f"python_alone_median_s {bare:.3f}")
    print_machine_speed()


if __name__ == "__main__":
    main()
