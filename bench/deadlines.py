"""Deadline workloads at loads 0.6 to 1.2: `genie` against `edf`, `sjf` and `fifo` on the
share of deadlines met (QoS) and makespan. Synthetic jobs (the built-in profiles, no
data needed) on 8 x 8 GPUs; every job's deadline is submit + s x its run time alone, s
uniform in 1.2-3 (``simulate --deadlines 1.2-3``). Load is offered GPU-seconds per second
over the cluster's GPUs: the arrival rate is set from the jobs' mean GPU-seconds.

    python bench/deadlines.py [--jobs 500] [--loads 0.6,0.8,1.0,1.2] [--seed 0]

GENIE's paper reports up to +67.4 % QoS guarantee and -28.2 % makespan against its
baselines; the target here is genie ahead of edf on QoS at every load and no worse than
fifo on makespan.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from speed import print_machine_speed  # bench/ is the script's own directory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpusched.libs.core.workload import alone_run_s, with_deadlines  # noqa: E402
from gpusched.services.scheduler.policies import make_policy  # noqa: E402
from gpusched.services.scheduler.runner import build_cluster, build_models, load_workload  # noqa: E402
from gpusched.services.scheduler.simulator import simulate  # noqa: E402

POLICIES = ("genie", "edf", "sjf", "fifo")
SLACK = (1.2, 3.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--loads", default="0.6,0.8,1.0,1.2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print_machine_speed()
    truth, _ = build_models(None)
    cluster = build_cluster("8x8", None)
    trace = f"synthetic:{args.jobs}"
    # the same seed draws the same jobs whatever the rate: only the gaps scale
    probe = load_workload(trace, None, truth, seed=args.seed, rate_per_h=1.0, cluster=cluster)
    gpu_s = sum(j.gpus * alone_run_s(j, truth, cluster) for j in probe.jobs)
    mean_gpu_s = gpu_s / len(probe.jobs)
    print(f"{args.jobs} jobs, mean {mean_gpu_s / 3600:.1f} GPU-hours each, 8x8 GPUs")
    for load in (float(x) for x in args.loads.split(",")):
        rate_per_h = load * cluster.total_gpus * 3600 / mean_gpu_s
        jobs = load_workload(
            trace, None, truth, seed=args.seed, rate_per_h=rate_per_h, cluster=cluster
        ).jobs
        jobs = with_deadlines(jobs, truth, cluster, SLACK, args.seed)
        print(f"load {load:.1f} ({rate_per_h:.2f} jobs/h)")
        for name in POLICIES:
            began = time.perf_counter()
            summary = simulate(cluster, jobs, make_policy(name), truth).summary()
            wall = time.perf_counter() - began
            print(
                f"  {name:<6} QoS {summary['qos_pct']:5.1f} %  makespan "
                f"{summary['makespan_s'] / 86_400:6.2f} d  avg JCT "
                f"{summary['avg_jct_s'] / 3600:6.1f} h  wall {wall:4.1f} s"
            )
    print_machine_speed()


if __name__ == "__main__":
    main()
