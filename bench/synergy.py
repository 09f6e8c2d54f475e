"""Synergy's evaluation workload: fifo (GPU-proportional CPU and memory) against
synergy-fifo (TUNE) on 16 servers x 8 GPUs, 24 CPUs and 500 GB each, 9 jobs/h, the
artifact's binary speed model and 300 s rounds, statistics over jobs 4000-4999. Needs the
Synergy profiles in ../shared/data (its ten own models); prints the simulate table.

    python bench/synergy.py [--jobs 6000] [--rate 9] [--data-dir ../shared/data] [--opt-bound]

``--opt-bound`` also prints each policy's throughput against Synergy-OPT's bound (mean
over simulated time, and its worst decision).

Published (the artifact's own draw of this workload): FIFO+TUNE mean JCT 21.9 h, p99
156.9 h.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speed import print_machine_speed  # bench/ is the script's own directory

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=6_000)
    parser.add_argument("--rate", type=float, default=9.0)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--opt-bound", action="store_true")
    # passed to `simulate --jobs` (here --jobs counts the trace's jobs, as in bench/parallel.py)
    parser.add_argument("--workers", type=int, help="policies at a time (default: the cores)")
    args = parser.parse_args()
    print_machine_speed()
    if not (args.data_dir / "profiles" / "synergy" / "models.json").is_file():
        sys.exit(f"no Synergy profiles under {args.data_dir}: see docs/trace-format.md")
    with tempfile.TemporaryDirectory(prefix="gpusched-synergy-") as out:
        began = time.perf_counter()
        subprocess.run(
            [
                sys.executable, "-m", "gpusched.services.cli.main", "simulate",
                "--trace", f"synergy:{args.jobs}", "--rate", str(args.rate),
                "--cluster", "16x8", "--cpus-per-node", "24", "--mem-gb-per-node", "500",
                "--speed-model", "binary", "--round-s", "300",
                "--data-dir", str(args.data_dir), "--measure-ids", "4000-4999",
                "--policy", "fifo", "--policy", "synergy-fifo", "--out", out,
                *(["--opt-bound"] if args.opt_bound else []),
                *(["--jobs", str(args.workers)] if args.workers else []),
            ],
            cwd=ROOT, check=True,
        )  # fmt: skip
        wall_s = time.perf_counter() - began
        summary = json.loads((Path(out) / "summary.json").read_text())
    for name, figures in summary["policies"].items():
        mean_h = figures.get("avg_jct_s", 0) / 3600
        p99_h = figures.get("p99_jct_s", 0) / 3600
        print(f"{name:<14} mean JCT {mean_h:7.1f} h   p99 JCT {p99_h:7.1f} h")
        bound = figures.get("opt_bound")
        if bound and bound["decisions"]:
            print(
                f"{'':<14} throughput {bound['policy_throughput_mean']:.1f} of OPT's "
                f"{bound['opt_throughput_mean']:.1f} ({bound['policy_to_opt_mean']:.1%}; "
                f"worst decision {bound['policy_to_opt_min']:.1%}) over "
                f"{bound['decisions']} decisions"
            )
    print(f"both policies in {wall_s:.1f} s")


if __name__ == "__main__":
    main()
