"""One round of the live scheduler over a long queue: building the snapshot from its jobs
and deciding, the first round and the rounds after it (which reuse the views of waiting
jobs that have not changed). No NATS: the scheduler's own state, as a round sees it.

    python bench/live_round.py [--queued 10000] [--nodes 1024] [--rounds 5]
        [--policy sjf-bsbf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common.schemas import GpuInfo, JobRecord, JobSpec, NodeInfo
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.scheduler.live.state import Layout, LiveJob, build_snapshot
from gpusched.services.scheduler.policies import POLICIES, make_policy


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--policy", default="sjf-bsbf", choices=sorted(POLICIES))
    args = parser.parse_args()
    perf = load_performance_model(None)
    gpus = [GpuInfo(index=g, uuid=f"gpu-{g}", model="emulated", memory_mb=40_000) for g in range(8)]
    nodes = [
        NodeInfo(name=f"node-{i}", gpus=gpus, cpus=64, host_mem_gb=512) for i in range(args.nodes)
    ]
    layout = Layout.of(nodes)
    assert layout is not None
    rng = random.Random(1)
    jobs: dict[str, LiveJob] = {}
    for i in range(args.queued):
        model = rng.choice(perf.models())
        size = rng.choice((1, 1, 1, 2, 4, 8))
        spec = JobSpec(
            name=f"job-{i}",
            model=model,
            gpus=size,
            batch_size=perf.default_batch_size(model) * size,
            iterations=1_000,
        )
        record = JobRecord(
            id=f"job-{i:05d}",
            tenant="bench",
            spec=spec,
            total_iterations=1_000,
            submitted_at=float(i),
        )
        jobs[record.id] = LiveJob(record, 1, rng.uniform(0.05, 0.5), queued_since=float(i))
    policy = make_policy(args.policy)
    print(f"{args.queued} queued jobs, {layout.cluster.total_gpus} idle GPUs, {args.policy}")
    print(f"{'round':<6} {'snapshot ms':>12} {'decide ms':>10} {'starts':>7}")
    later: list[float] = []
    for number in range(1, args.rounds + 1):
        began = time.perf_counter()
        snapshot = build_snapshot(float(args.queued + number), layout, jobs, perf, policy)
        built = time.perf_counter()
        decision = policy.decide(snapshot)
        decided = time.perf_counter()
        if number > 1:
            later.append((built - began) * 1e3)
        print(
            f"{number:<6} {(built - began) * 1e3:>12.1f} {(decided - built) * 1e3:>10.1f} "
            f"{len(decision.starts):>7}"
        )
    if later:
        print(f"snapshot after the first round: median {statistics.median(later):.1f} ms")


if __name__ == "__main__":
    main()
