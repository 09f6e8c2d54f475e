"""A-SRPT on a recurring workload: learned sizes against oracle, declared and none.

Generates ``--jobs`` recurring jobs (``gpusched.libs.core.recurring``) on ``--cluster`` and runs
asrpt with the random forest (``--predictor rf``), srtf (oracle sizes), asrpt with the
true sizes (its own oracle), sjf on declared sizes, and tiresias (no sizes). Then varies
the per-submission noise of the true sizes and prints asrpt's average JCT beside the
forest's error. Prints the machine-speed figure first.

    python bench/recurring.py [--jobs 400] [--cluster 8x8] [--rate 40] [--seed 0]
        [--plot docs/asrpt_error.png]

``--plot PATH`` also draws asrpt's average JCT against the prediction error (MAPE) of
each predictor at every noise level (oracle sizes at 0 %).
"""

from __future__ import annotations

import argparse

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.recurring import RecurringConfig, recurring_jobs
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.simulator import SimConfig
from gpusched.services.scheduler.simulation.sweep import SimRun

#: (label, policy, predictor)
RUNS = (
    ("srtf (oracle)", "srtf", "truth"),
    ("asrpt (oracle)", "asrpt", "truth"),
    ("asrpt rf", "asrpt", "rf"),
    ("asrpt declared", "asrpt", "declared"),
    ("sjf declared", "sjf", "declared"),
    ("tiresias", "tiresias", "truth"),
    ("auto rf", "auto", "rf"),
)
NOISES = (0.05, 0.2, 0.5, 1.0)
#: (policy, predictor) of each run at every noise level
NOISE_RUNS = (
    ("asrpt", "truth"), ("asrpt", "rf"), ("asrpt", "declared"), ("srtf", "truth"),
    ("tiresias", "truth"),
)  # fmt: skip


def run(
    cluster: Cluster, jobs: list[JobSpec], perf: PerformanceModel, policy: str, predictor: str,
    label: str = "",
) -> SimRun:
    config = SimConfig(predictor=predictor)
    return SimRun(label or f"{policy} {predictor}", cluster, jobs, policy, perf, config=config)


def error_cells(result: SimResult) -> str:
    p = result.prediction
    if p is None:
        return f"{'-':>7} {'-':>6} {'-':>6} {'-':>6}"
    return (
        f"{p['mape_pct']:>7.1f} {p['within_10_pct']:>6.1f} {p['within_25_pct']:>6.1f} "
        f"{p['within_50_pct']:>6.1f}"
    )


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--cluster", default="8x8")
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="also write a PNG of average JCT against MAPE here")
    add_options(parser)
    args = parser.parse_args()
    cluster = Cluster.parse(args.cluster)
    perf = load_performance_model(None)
    jobs, note = recurring_jobs(
        args.jobs, perf, seed=args.seed, arrival_rate_per_h=args.rate, cluster=cluster
    )
    print(note)
    print(
        f"{'run':<16} {'avg JCT h':>9} {'p50 h':>6} {'p99 h':>6} {'queue h':>7} {'preempt':>7} "
        f"{'MAPE %':>7} {'<=10%':>6} {'<=25%':>6} {'<=50%':>6} {'rho':>5} {'wall s':>6}"
    )
    runs = [run(cluster, jobs, perf, policy, predictor, label) for label, policy, predictor in RUNS]
    for noise in NOISES:
        varied, _ = recurring_jobs(
            args.jobs,
            perf,
            seed=args.seed,
            arrival_rate_per_h=args.rate,
            cluster=cluster,
            config=RecurringConfig(noise_sigma=noise),
        )
        runs += [run(cluster, varied, perf, policy, predictor) for policy, predictor in NOISE_RUNS]
    results = run_all(runs, args)
    for (label, _, _), result in zip(RUNS, results, strict=False):
        s = result.summary()
        rho = f"{result.rho:>5.2f}" if result.rho is not None else f"{'-':>5}"
        print(
            f"{label:<16} {s['avg_jct_s'] / 3600:>9.2f} {s['p50_jct_s'] / 3600:>6.2f} "
            f"{s['p99_jct_s'] / 3600:>6.1f} {s['avg_queue_s'] / 3600:>7.2f} "
            f"{s['preemptions']:>7} {error_cells(result)} {rho} {result.wall_s:>6.1f}",
            flush=True,
        )
    print()
    print("noise sigma: asrpt's average JCT (h) with each predictor; the forest's and the")
    print("declared sizes' MAPE (%)")
    print(
        f"{'sigma':>5} {'oracle':>7} {'rf':>7} {'declared':>8} {'srtf':>7} {'tiresias':>8} "
        f"{'rf MAPE':>8} {'decl MAPE':>9}"
    )
    #: predictor -> [(MAPE %, asrpt's average JCT h)] over the noise levels
    points: dict[str, list[tuple[float, float]]] = {"oracle": [], "rf": [], "declared": []}
    for k, noise in enumerate(NOISES):
        first = len(RUNS) + k * len(NOISE_RUNS)
        cells = dict(zip(NOISE_RUNS, results[first : first + len(NOISE_RUNS)], strict=True))

        def jct(key: tuple[str, str], cells: dict[tuple[str, str], SimResult] = cells) -> float:
            return float(cells[key].summary()["avg_jct_s"]) / 3600

        rf, declared = cells[("asrpt", "rf")].prediction, cells[("asrpt", "declared")].prediction
        assert rf is not None and declared is not None
        points["oracle"].append((0.0, jct(("asrpt", "truth"))))
        points["rf"].append((float(rf["mape_pct"]), jct(("asrpt", "rf"))))
        points["declared"].append((float(declared["mape_pct"]), jct(("asrpt", "declared"))))
        print(
            f"{noise:>5.2f} {jct(('asrpt', 'truth')):>7.2f} {jct(('asrpt', 'rf')):>7.2f} "
            f"{jct(('asrpt', 'declared')):>8.2f} {jct(('srtf', 'truth')):>7.2f} "
            f"{jct(('tiresias', 'truth')):>8.2f} {rf['mape_pct']:>8.1f} "
            f"{declared['mape_pct']:>9.1f}",
            flush=True,
        )
    if args.plot:
        plot(points, args.plot)


def plot(points: dict[str, list[tuple[float, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = {"oracle": "true sizes", "rf": "random forest", "declared": "declared sizes"}
    for name, marker in (("oracle", "s"), ("rf", "o"), ("declared", "^")):
        xs, ys = zip(*points[name], strict=True)
        ax.plot(xs, ys, marker=marker, linestyle="", label=labels[name])
        for (x, y), noise in zip(points[name], NOISES, strict=True):
            ax.annotate(f"σ {noise:g}", (x, y), textcoords="offset points", xytext=(4, 3),
                        fontsize=7)  # fmt: skip
    ax.set_xlabel("size prediction error, MAPE (%)")
    ax.set_ylabel("asrpt average JCT (h)")
    ax.set_title("A-SRPT on recurring jobs: JCT against prediction error")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
