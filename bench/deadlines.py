"""Deadline workloads at loads 0.6 to 1.2: `genie` against `edf`, `sjf` and `fifo` on the
share of deadlines met (QoS) and makespan. Synthetic jobs (the built-in profiles, no
data needed) on 8 x 8 GPUs by default; every job's deadline is submit + s x its run time
alone, s uniform in the slack range (default 1.2-3, ``simulate --deadlines 1.2-3``).
Load is offered GPU-seconds per second over the cluster's GPUs: the arrival rate is set
from the jobs' mean GPU-seconds.

    python bench/deadlines.py [--jobs 500] [--loads 0.6,0.8,1.0,1.2] [--seed 0,1,2]
                              [--slack 1.2-3] [--cluster 8x8] [--workers N]

Prints each seed's figures, then per load the QoS averaged over the seeds and how many
seeds genie led, tied or trailed edf. GENIE's paper reports up to +67.4 % QoS guarantee
and -28.2 % makespan against its baselines; the target here is genie ahead of edf on QoS
at every load and no worse than fifo on makespan.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpusched.libs.core.workload import alone_run_s, parse_slack_range, with_deadlines  # noqa: E402
from gpusched.services.scheduler.simulation.runner import build_cluster, build_models, load_workload  # noqa: E402
from gpusched.services.scheduler.simulation.sweep import SimRun  # noqa: E402

POLICIES = ("genie", "edf", "sjf", "fifo")

#: (load, seed, policy) -> the run's summary
Results = dict[tuple[float, int, str], dict[str, float]]


def run(
    policies: Sequence[str],
    args: argparse.Namespace,
    *,
    jobs: int = 500,
    loads: Sequence[float] = (0.6, 0.8, 1.0, 1.2),
    seeds: Sequence[int] = (0,),
    slack: tuple[float, float] = (1.2, 3.0),
    cluster_spec: str = "8x8",
    show: bool = True,
) -> Results:
    """Every policy on every (load, seed) workload, swept as ``args`` say (--workers,
    --executor); prints a line per run with ``show``."""
    truth, _ = build_models(None)
    cluster = build_cluster(cluster_spec, None)
    trace = f"synthetic:{jobs}"
    heads: list[list[str]] = []  # lines printed before each (seed, load)'s runs
    runs = []
    for seed in seeds:
        # the same seed draws the same jobs whatever the rate: only the gaps scale
        probe = load_workload(trace, None, truth, seed=seed, rate_per_h=1.0, cluster=cluster)
        gpu_s = sum(j.gpus * alone_run_s(j, truth, cluster) for j in probe.jobs)
        mean_gpu_s = gpu_s / len(probe.jobs)
        head = [f"seed {seed}: {jobs} jobs, mean {mean_gpu_s / 3600:.1f} GPU-hours each, "
                f"{cluster_spec} GPUs, slack {slack[0]:g}-{slack[1]:g}"]  # fmt: skip
        for load in loads:
            rate_per_h = load * cluster.total_gpus * 3600 / mean_gpu_s
            workload = load_workload(
                trace, None, truth, seed=seed, rate_per_h=rate_per_h, cluster=cluster
            ).jobs
            dated = with_deadlines(workload, truth, cluster, slack, seed)
            heads.append([*head, f" load {load:.1f} ({rate_per_h:.2f} jobs/h)"])
            head = []
            runs += [SimRun(f"{load}/{seed}/{name}", cluster, dated, name, truth)
                     for name in policies]  # fmt: skip
    summaries = iter(result.summary() for result in run_all(runs, args))
    results: Results = {}
    for k, (seed, load) in enumerate((seed, load) for seed in seeds for load in loads):
        for line in heads[k] if show else []:
            print(line)
        for name in policies:
            summary = results[(load, seed, name)] = next(summaries)
            if show:
                print(
                    f"  {name:<6} QoS {summary['qos_pct']:5.1f} %  makespan "
                    f"{summary['makespan_s'] / 86_400:6.2f} d  avg JCT "
                    f"{summary['avg_jct_s'] / 3600:6.1f} h  wall {summary['wall_s']:4.1f} s"
                )
    return results


def print_means(
    results: Results, names: Sequence[str], lead: str = "genie", rival: str = "edf"
) -> None:
    """Per load: each policy's QoS and makespan averaged over the seeds, and in how many
    seeds ``lead`` was ahead of, level with or behind ``rival`` on QoS."""
    loads = sorted({load for load, _, _ in results})
    seeds = sorted({seed for _, seed, _ in results})
    print(f"mean over seeds {','.join(map(str, seeds))}")
    for load in loads:
        cells = []
        for name in names:
            qos = [results[(load, s, name)]["qos_pct"] for s in seeds]
            span = [results[(load, s, name)]["makespan_s"] for s in seeds]
            days = sum(span) / len(span) / 86_400
            cells.append(f"{name} {sum(qos) / len(qos):5.1f} % {days:5.2f} d")
        line = f" load {load:.1f}  " + "  ".join(cells)
        if lead in names and rival in names:
            diff = [results[(load, s, lead)]["qos_pct"] - results[(load, s, rival)]["qos_pct"]
                    for s in seeds]  # fmt: skip
            ahead = sum(d > 1e-9 for d in diff)
            behind = sum(d < -1e-9 for d in diff)
            level = len(diff) - ahead - behind
            line += f"  {lead}-{rival} ahead {ahead} level {level} behind {behind}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--loads", default="0.6,0.8,1.0,1.2")
    parser.add_argument("--seed", default="0", help="one seed or several: 0,1,2")
    parser.add_argument("--slack", default="1.2-3", help="deadline slack range LO-HI")
    parser.add_argument("--cluster", default="8x8", help="NODESxGPUS")
    parser.add_argument("--policies", default=",".join(POLICIES))
    add_options(parser)
    args = parser.parse_args()
    try:
        seeds = [int(x) for x in args.seed.split(",")]
    except ValueError:
        parser.error(f"--seed {args.seed!r}: expected integers separated by commas")
    try:
        slack = parse_slack_range(args.slack)
    except ValueError as error:
        parser.error(f"--slack: {error}")
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    print_machine_speed()
    results = run(
        names,
        args,
        jobs=args.jobs,
        loads=[float(x) for x in args.loads.split(",")],
        seeds=seeds,
        slack=slack,
        cluster_spec=args.cluster,
    )
    print_means(results, names)
    print_machine_speed()


if __name__ == "__main__":
    main()
