"""One scheduling decision on a large cluster: 10,000 pending jobs, 1,024 nodes x 8 GPUs,
half of the GPUs busy. Prints milliseconds per decision for each policy, and the
machine-speed figure before and after the runs.

    python bench/decision_bench.py [--pending 10000] [--nodes 1024] [--repeat 5]
        [--age 0] [--policy synergy-fifo ...]

``--age S`` decides S seconds after the running jobs started (ones changes a job only
after an epoch at its size, ``min_run_s`` = 120 s without an epoch length: with an age
past that every running job may be resized or preempted, the most work ones does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies import POLICIES, make_policy

GPU_COUNTS = (1, 1, 1, 1, 1, 1, 1, 2, 4, 8)


def build_snapshot(pending: int, nodes: int, seed: int = 7, age: float = 0.0) -> Snapshot:
    rng = random.Random(seed)
    perf = load_performance_model(None)
    models = perf.models()
    cluster = Cluster.uniform(nodes, 8)
    running: list[JobView] = []
    # fill the first half of every node so that half of all GPUs are busy
    for node in range(nodes):
        gpus = list(cluster.node_gpus(node))[:4]
        while gpus:
            size = min(rng.choice((1, 1, 2, 4)), len(gpus))
            held, gpus = tuple(gpus[:size]), gpus[size:]
            model = rng.choice(models)
            batch = perf.default_batch_size(model) * size
            running.append(
                JobView(
                    job_id=f"r{len(running)}",
                    submit_time=0.0,
                    model=model,
                    gpus=size,
                    batch_size=batch,
                    est_remaining_s=rng.lognormvariate(8, 1.5),
                    state=JobState.RUNNING,
                    gpu_ids=held,
                    progress_rate=1.0,
                )
            )
    queue = []
    for i in range(pending):
        model = rng.choice(models)
        gpus = rng.choice(GPU_COUNTS)
        queue.append(
            JobView(
                job_id=f"p{i:05d}",
                submit_time=float(i),
                model=model,
                gpus=gpus,
                batch_size=perf.default_batch_size(model) * gpus,
                est_remaining_s=rng.lognormvariate(8, 1.5),
                queued_since=float(i),
            )
        )
    return Snapshot.of_jobs(age, cluster, tuple(queue), tuple(running), perf)


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--age", type=float, default=0.0)
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES))
    args = parser.parse_args()
    snapshot = build_snapshot(args.pending, args.nodes, age=args.age)
    print(
        f"{args.pending} pending, {len(snapshot.running)} running, "
        f"{snapshot.cluster.total_gpus} GPUs ({snapshot.free_gpus} idle)"
    )
    print(f"{'policy':<12} {'median ms':>10} {'min ms':>8} {'starts':>7} {'shared':>7}")
    names = args.policy or list(POLICIES)
    for name in names:
        times = []
        decision = None
        for _ in range(args.repeat):
            policy = make_policy(name)  # fresh: no memo carried between repeats
            began = time.perf_counter()
            decision = policy.decide(snapshot)
            times.append((time.perf_counter() - began) * 1e3)
        assert decision is not None
        shared = sum(1 for s in decision.starts if s.shares_with)
        print(
            f"{name:<12} {statistics.median(times):>10.1f} {min(times):>8.1f} "
            f"{len(decision.starts):>7} {shared:>7}",
            flush=True,
        )
    print_machine_speed()


if __name__ == "__main__":
    main()
