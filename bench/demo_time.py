"""How long ``./scripts/demo`` takes, without its pip install.

Runs the very commands the demo runs on the Philly trace (``gpusched simulate`` on its
first ``DEMO_JOBS`` jobs, 64 x 8 GPUs, every policy but ones; then ones on the first
``ONES_JOBS``), each in a process of its own, and prints their wall times, each policy's
wall time and simulated jobs per second (the rates ``runner.POLICY_RATES`` holds), what
``runner.estimate_s`` said beforehand, and the machine-speed figure of the same run.
The trace is not shipped: point --data-dir at a folder holding
traces/philly/philly.csv (see docs/trace-format.md).

    python bench/demo_time.py --data-dir ../shared/data [--limit 10000] [--ones-limit 1000]
        [--workers N]

``--workers N`` is passed as ``simulate --jobs N`` (default: the demo's, the cores); the
per-policy rates ``POLICY_RATES`` holds are those of ``--workers 1``, each run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.simulation.runner import estimate_s

#: as scripts/demo has them (DEMO_JOBS there)
DEMO_JOBS = 10_000
ONES_JOBS = 1_000
DEMO_CLUSTER = "64x8"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data")
    )
    parser.add_argument("--limit", type=int, default=DEMO_JOBS)
    parser.add_argument("--ones-limit", type=int, default=ONES_JOBS)
    parser.add_argument("--workers", type=int, help="simulate --jobs (default: the cores)")
    args = parser.parse_args()
    trace = Path(args.data_dir) / "traces" / "philly" / "philly.csv"
    if not trace.exists():
        print(f"skipped: {trace} is absent (see docs/trace-format.md for where to get it)")
        sys.exit(0)
    print_machine_speed()
    names = [name for name in POLICIES if name != "ones"]
    each = [estimate_s([name], args.limit) for name in names]
    workers = args.workers or os.cpu_count() or 1
    # as simulate announces it: no faster than the slowest run
    ahead = max(max(each), sum(each) / min(workers, len(names)))
    ones_ahead = estimate_s(["ones"], args.ones_limit)
    print(f"estimate beforehand: {ahead:.0f} s, then ones {ones_ahead:.0f} s")
    total = 0.0
    for policies_run, limit in ((names, args.limit), (["ones"], args.ones_limit)):
        wall, policies = _simulate(args, trace, policies_run, limit)
        total += wall
        simulated = sum(summary["wall_s"] for summary in policies.values())
        print(f"{'policy':<14} {'wall s':>7} {'jobs/s':>8}")
        for name, summary in policies.items():
            rate = summary["jobs"] / summary["wall_s"]
            print(f"{name:<14} {summary['wall_s']:>7.1f} {rate:>8.0f}")
        print(
            f"command: {wall:.1f} s wall for {limit:,} jobs x {len(policies)} policies "
            f"({simulated:.1f} s in the simulations, summed over policies that may have run "
            "side by side)"
        )
    print(f"demo: {total:.1f} s wall in all")
    print_machine_speed()


def _simulate(
    args: argparse.Namespace, trace: Path, names: list[str], limit: int
) -> tuple[float, dict[str, dict[str, float]]]:
    gpusched = Path(sys.executable).with_name("gpusched")
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(gpusched), "simulate", "--trace", str(trace), "--format", "philly",
            "--data-dir", args.data_dir, "--cluster", DEMO_CLUSTER, "--limit", str(limit),
            "--policy", ",".join(names), "--out", out,
            *(["--jobs", str(args.workers)] if args.workers else []),
        ]  # fmt: skip
        began = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - began
        policies = json.loads((Path(out) / "summary.json").read_text())["policies"]
    return wall, policies

if __name__ == "__main__":
    main()
