"""Pollux workloads on 16 nodes x 4 GPUs: the elastic `ones` (several seeds, at each
search interval of --intervals; with --ask also with new jobs starting at up to the GPUs
they asked for, `start_on_one_gpu=False`) against `tiresias` and `srtf`, with jobs that
end on convergence (each model's curve from the Pollux training-progress traces). Prints
average, median and p99 JCT per policy.

    python bench/pollux_elastic.py [--workloads 6] [--seeds 3] [--intervals 0,300] [--ask]
        [--data-dir ../shared/data] [--workers N] [--executor dask]

Published (an elastic reference simulator on workload-6, 16 x 4 GPUs): Tiresias 3,470 s,
Optimus 5,302 s, Pollux 2,446 s average JCT.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpusched.services.scheduler.policies.base import Policy  # noqa: E402
from gpusched.services.scheduler.policies.ones import Ones  # noqa: E402
from gpusched.services.scheduler.simulation.runner import build_cluster, build_models, load_workload  # noqa: E402
from gpusched.services.scheduler.simulation.sweep import SimRun  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default="6", help="comma-separated workload numbers")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of ones to average")
    parser.add_argument(
        "--intervals", default="default",
        help="comma-separated search intervals of ones, simulated seconds (0: every "
        "decision; default: the policy's, 1 s per GPU, 64 s here)",
    )  # fmt: skip
    parser.add_argument("--ask", action="store_true", help="also start new jobs at the ask")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    add_options(parser)
    args = parser.parse_args()
    print_machine_speed()
    folder = args.data_dir / "traces" / "pollux-workloads" / "workloads"
    if not folder.is_dir():
        sys.exit(f"no Pollux workloads under {folder}: see docs/trace-format.md")
    truth, _ = build_models(args.data_dir)
    cluster = build_cluster("16x4", None)
    workloads = []
    runs = []
    counts: list[int] = []
    intervals = [None if x == "default" else float(x) for x in args.intervals.split(",")]
    for number in args.workloads.split(","):
        path = folder / f"workload-{number.strip()}.csv"
        jobs = load_workload(path, "pollux", truth, data_dir=args.data_dir, cluster=cluster).jobs
        workloads.append((path.name, len(jobs)))
        policies: dict[str, str | Callable[[], Policy]] = {"tiresias": "tiresias", "srtf": "srtf"}
        for interval in intervals:
            for ask in (False, True) if args.ask else (False,):
                for s in range(args.seeds):
                    every = "default" if interval is None else f"{interval:g}s"
                    label = f"{'ask' if ask else 'ones'} {every} seed {s}"
                    policies[label] = functools.partial(
                        Ones, seed=s, start_on_one_gpu=not ask, search_interval_s=interval
                    )
        runs += [SimRun(label, cluster, jobs, policy, truth) for label, policy in policies.items()]
        counts.append(len(policies))
    results = iter(zip(runs, run_all(runs, args), strict=True))
    for (name, count), n_runs in zip(workloads, counts, strict=True):
        print(f"{name}: {count} jobs")
        means: dict[str, list[float]] = {}
        for _ in range(n_runs):
            run, result = next(results)
            label = run.label
            jct = [o.jct_s for o in result.jobs if o.jct_s is not None]
            mean = statistics.mean(jct)
            if " seed " in label:
                means.setdefault(label.split(" seed ")[0], []).append(mean)
            p99 = statistics.quantiles(jct, n=100)[98]
            print(
                f"  {label:<20} avg JCT {mean:7.0f} s  median {statistics.median(jct):6.0f} s"
                f"  p99 {p99:7.0f} s  util {result.gpu_util:5.1%}  resizes {result.resizes:4d}"
                f"  preemptions {result.preemptions:4d}  wall {result.wall_s:5.1f} s"
            )
        for what, found in means.items():
            print(f"  {what} over {len(found)} seeds: avg JCT {statistics.mean(found):.0f} s")
    print_machine_speed()


if __name__ == "__main__":
    main()
