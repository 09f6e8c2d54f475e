"""Full Philly replay (82,247 jobs) on 64x8 GPUs, one run per policy.

Prints wall seconds, simulated jobs per second and peak Python memory per policy, and
the scheduling-quality summary. The trace is not shipped: point --data-dir at a folder
holding traces/philly/philly.csv (see docs/trace-format.md).

    python bench/philly_replay.py --data-dir ../shared/data [--policy sjf-bsbf ...]
        [--resident-cap 1.5 ...]

``x ref`` is jobs/s over the reference simulator's (``--reference-jobs-per-s``, default
27.5: the Alibaba v2020 simulator replaying the first 2,000 Philly jobs on this 2-core
machine). The reference is not run here (it is not part of this tree): the figure is
read, so compare it with runs whose machine_speed_s is alike.

``--resident-cap X`` adds a run of SJF-BSBF that also refuses partners it would slow by
more than X (``max_resident_slowdown``), labelled ``bsbf<=X``. ``--workers N`` runs N
policies at a time (default: the cores; bench/parallel.py); the peak memory is then that
of the worker process a run ran in.
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.traces import load_trace
from gpusched.libs.core.workload import materialize
from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import ProgressCallback
from gpusched.services.scheduler.simulation.sweep import SimRun

#: the Alibaba v2020 simulator on the first 2,000 Philly jobs, on this 2-core machine
REFERENCE_JOBS_PER_S = 27.5


@dataclass(frozen=True)
class WithPeak:
    """A run that also reports the peak memory of the process it ran in."""

    run: SimRun

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def total(self) -> int:
        return self.run.total

    def __call__(self, progress: ProgressCallback | None = None) -> tuple[SimResult, int]:
        result = self.run(progress)
        return result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data")
    )
    parser.add_argument("--cluster", default="64x8")
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--resident-cap", type=float, action="append", default=[])
    parser.add_argument("--reference-jobs-per-s", type=float, default=REFERENCE_JOBS_PER_S)
    add_options(parser)
    args = parser.parse_args()
    trace_path = Path(args.data_dir) / "traces" / "philly" / "philly.csv"
    if not trace_path.exists():
        print(f"skipped: {trace_path} is absent (see docs/trace-format.md for where to get it)")
        sys.exit(0)
    cluster = Cluster.parse(args.cluster)
    began = time.perf_counter()
    perf = load_performance_model(args.data_dir)
    # run times are converted at the placement a job gets alone on this cluster, as
    # `gpusched simulate` does, so a job alone takes exactly its trace duration here
    jobs = materialize(load_trace(trace_path, "philly").jobs, perf, seed=args.seed, cluster=cluster)
    if args.limit:
        jobs = jobs[: args.limit]
    print(f"loaded {len(jobs)} jobs in {time.perf_counter() - began:.1f} s; cluster {args.cluster}")
    header = (
        f"{'policy':<13} {'wall s':>7} {'jobs/s':>8} {'x ref':>6} {'peak RSS MiB':>12} "
        f"{'avg JCT h':>10} "
        f"{'p50 h':>7} {'p99 h':>8} {'queue h':>8} {'util':>6} {'preempt':>8} {'shared':>7}"
    )
    print(header)
    names = args.policy or ([] if args.resident_cap else list(POLICIES))
    runs = [WithPeak(SimRun(name, cluster, jobs, name, perf)) for name in names]
    runs += [
        WithPeak(SimRun(f"bsbf<={cap:g}", cluster, jobs,
                        functools.partial(SjfBsbf, max_resident_slowdown=cap), perf))
        for cap in args.resident_cap
    ]  # fmt: skip
    began = time.perf_counter()
    for run, (result, peak) in zip(runs, run_all(runs, args), strict=True):
        s = result.summary()
        print(
            f"{run.label:<13} {result.wall_s:>7.1f} {len(jobs) / result.wall_s:>8.0f} "
            f"{len(jobs) / result.wall_s / args.reference_jobs_per_s:>6.0f} "
            f"{peak / 2**20:>12.0f} {s['avg_jct_s'] / 3600:>10.2f} {s['p50_jct_s'] / 3600:>7.2f} "
            f"{s['p99_jct_s'] / 3600:>8.1f} {s['avg_queue_s'] / 3600:>8.2f} "
            f"{s['gpu_util']:>6.1%} {s['preemptions']:>8} {s['shared_pairs']:>7}",
            flush=True,
        )
    print(f"all {len(runs)} runs: {time.perf_counter() - began:.1f} s wall")
    print_machine_speed()


if __name__ == "__main__":
    main()
