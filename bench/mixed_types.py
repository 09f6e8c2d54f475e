"""A cluster of three GPU types: mean JCT and busy GPU-hours per type, per policy.

Replays a Gavel-style synthetic workload (models with a Gavel job type: ResNet-18/50,
Transformer, LM, Recommendation, A3C, in equal shares; Poisson arrivals; lognormal run
times of median 1 h, given at the reference type) on Gavel's three GPU types,
``8x4:V100,8x4:P100,16x4:K80`` (V100 first: the reference), with each model's speed per
type from Gavel's throughputs in ``--data-dir`` (docs/gpu-types.md), and, for scale, on
``32x4`` V100-class GPUs alone. Prints one row per policy and cluster, and the machine
speed beside the wall times.

    python bench/mixed_types.py [--jobs 1000] [--rate 20] [--seed 0] [--policy fifo ...]
        [--workers N] [--executor dask]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

from gpusched.services.scheduler.simulation.runner import build_cluster, build_models, load_workload
from gpusched.services.scheduler.simulation.sweep import SimRun

MIXED = "8x4:V100,8x4:P100,16x4:K80"
ONE_TYPE = "32x4"
POLICIES = ("fifo", "sjf-bsbf", "tiresias", "genie", "asrpt", "synergy-fifo")
GAVEL_MODELS = ("resnet18", "resnet50", "transformer", "lm", "recommendation", "a2c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data")
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per hour")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", action="append")
    add_options(parser)
    args = parser.parse_args()
    print_machine_speed()
    gavel = Path(args.data_dir) / "profiles" / "gavel" / "simulation_throughputs.json"
    if not gavel.is_file():
        print(f"skipped: no {gavel}")
        return
    truth, estimates = build_models(args.data_dir, seed=args.seed)
    mix = {model: 1.0 for model in GAVEL_MODELS}
    print(f"{args.jobs} jobs, {args.rate:g}/h, seed {args.seed}, models {', '.join(mix)}")
    print(f"{'cluster':<28} {'policy':<13} {'mean JCT':>9} {'p99 JCT':>9} "
          f"{'makespan':>9}  busy GPU-hours by type{'':<22} wall")
    runs = []
    for spec in (MIXED, ONE_TYPE):
        cluster = build_cluster(spec, args.data_dir)
        jobs = load_workload(
            f"synthetic:{args.jobs}", None, truth, seed=args.seed, data_dir=args.data_dir,
            rate_per_h=args.rate, mix=mix, cluster=cluster,
        ).jobs  # fmt: skip
        runs += [SimRun(spec, cluster, jobs, name, truth, estimates)
                 for name in args.policy or POLICIES]  # fmt: skip
    for run, result in zip(runs, run_all(runs, args), strict=True):
        s, cluster = result.summary(), run.cluster
        hours = result.gpu_hours_by_type or {
            cluster.gpu_types[0]: s["gpu_util"] * cluster.total_gpus * s["makespan_s"] / 3600
        }
        each = ", ".join(f"{k} {v:,.0f}" for k, v in hours.items())
        mean, p99 = s["avg_jct_s"] / 3600, s["p99_jct_s"] / 3600
        print(
            f"{run.label:<28} {result.policy:<13} {mean:>7.2f} h {p99:>7.1f} h "
            f"{s['makespan_s'] / 86400:>7.2f} d  {each:<44} {result.wall_s:.1f} s",
            flush=True,
        )

if __name__ == "__main__":
    main()
