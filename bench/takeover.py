"""How long a new leader takes to schedule with a large store: seconds from winning the
lease to the first job started, with many finished jobs and some unfinished ones stored.
A real nats-server (JetStream on disk), the real scheduler service, no node agents (the
nodes are registered and beat; the start commands go unanswered, which does not hold up
the round that sent them).

    python bench/takeover.py [--finished 100000] [--live 1000] [--nodes 8] [--unindexed]

Target: under 2 s with 100,000 finished and 1,000 unfinished jobs stored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.common.schemas import (
    GpuInfo,
    Heartbeat,
    JobRecord,
    JobSpec,
    JobState,
    NodeInfo,
    StateChange,
)
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import SchedulerService

BATCH = 2_000


def record(index: int, state: JobState) -> JobRecord:
    now = time.time()
    spec = JobSpec(name=f"bench-{index}", model="resnet50", batch_size=64, iterations=1_000)
    return JobRecord(
        id=f"job{index:07d}", tenant="bench", spec=spec, total_iterations=1_000,
        state=state, submitted_at=now, history=[StateChange(state, now, "bench")],
    )


async def fill(stores: Stores, finished: int, live: int, indexed: bool) -> None:
    began = time.perf_counter()
    total = finished + live
    for first in range(0, total, BATCH):
        writes = []
        for index in range(first, min(total, first + BATCH)):
            state = JobState.SUCCEEDED if index < finished else JobState.QUEUED
            job = record(index, state)
            writes.append(stores.jobs.put(job.id, codec.encode(job)))
            if state is JobState.QUEUED and indexed:
                writes.append(stores.mark_live(job.id))
        await asyncio.gather(*writes)
    if indexed:
        await stores.mark_live_index_complete()
    print(f"stored {finished} finished and {live} unfinished jobs "
          f"in {time.perf_counter() - began:.1f} s")


async def beat(nc, names: list[str]) -> None:  # type: ignore[no-untyped-def]
    while True:
        for name in names:
            await nc.publish(subjects.node_heartbeat(name),
                             codec.encode(Heartbeat(node=name, at=time.time())),
                             headers=codec.headers())
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="gpusched-takeover-") as tmp, NatsServer(
        store_dir=Path(tmp) / "nats"
    ) as server:
        async with connection(server.url, "bench") as nc:
            stores = await Stores.open(nc)
            await fill(stores, args.finished, args.live, indexed=not args.unindexed)
            names = [f"node{i}" for i in range(args.nodes)]
            gpus = [GpuInfo(index=g, uuid=f"u{g}", model="emu", memory_mb=40_000)
                    for g in range(8)]
            for name in names:
                info = NodeInfo(name=name, gpus=gpus, cpus=64, host_mem_gb=512)
                await stores.nodes.put(name, codec.encode(info))
            beating = asyncio.create_task(beat(nc, names))
            config = SchedulerConfig(nats_url=server.url, policy="fifo", instance="bench")
            try:
                async with SchedulerService(config) as service:
                    await wait_until(
                        lambda: service.scheduler is not None
                        and service.scheduler.first_start_at is not None,
                        timeout_s=600, every_s=0.005,
                    )
                    leader = service.scheduler
                    assert leader is not None and leader.first_start_at is not None
                    took = leader.first_start_at - leader.leading_since
                    print(f"takeover_to_first_start_s {took:.3f} "
                          f"(jobs taken over {len(leader.jobs)}, target 2.0)")
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--live", type=int, default=1_000)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument(
        "--unindexed", action="store_true",
        help="a store written before the live index: the leader reads every record once",
    )
    args = parser.parse_args()
    configure_logging("warning")
    print_machine_speed()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
