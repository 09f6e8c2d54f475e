"""What live policies act on beyond starts: a resize (in place by one command to the
node, across nodes by a preemption and a start with the new shape), the learning rate
the real worker trains with across a resize, and the GPU service each job has attained."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.schemas import JobState
from gpusched.libs.core.decision import Decision, Resize
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.live import LiveScheduler, SchedulerService
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.base import Capabilities, Policy, QueueSort
from tests.limits import process_limit_s
from tests.live import fast_scheduler, record, spec, store_job, wait_state
from tests.test_live_scheduling import nodes
from tests.test_nodeagent_service import PROCESS_TIMINGS


@dataclasses.dataclass
class ResizeOnceRunning:
    """FIFO, plus one resize of ``job_id`` the first time it is seen running."""

    job_id: str
    resize: Resize
    inner: Policy = dataclasses.field(default_factory=lambda: make_policy("fifo"))
    #: and, besides running, this holds
    ready: Callable[[], bool] = lambda: True
    sent: bool = False
    name: str = "fifo+resize"
    # an elastic policy decides on running jobs too, not only when some job waits
    preemptive: bool = True
    capabilities = Capabilities()

    @property
    def queue_sort(self) -> QueueSort | None:
        return self.inner.queue_sort

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.inner.decide(snapshot)
        running = any(v.job_id == self.job_id and v.progress_rate > 0 for v in snapshot.running)
        if running and not self.sent and self.ready():
            self.sent = True
            return dataclasses.replace(decision, resizes=(self.resize,))
        return decision


async def leading(service: SchedulerService) -> LiveScheduler:
    await wait_until(lambda: service.scheduler is not None)
    assert service.scheduler is not None
    return service.scheduler


async def test_a_resize_in_place_restarts_the_job_with_its_new_shape_and_it_finishes(
    nats_server, stores: Stores, tmp_path: Path
):
    async with nodes(nats_server.url, tmp_path, count=1), SchedulerService(
        fast_scheduler(nats_server.url)
    ) as service:
        await leading(service)
        job_id = await store_job(stores, spec(batch_size=32, iterations=3000, max_batch_size=256))
        service.use_policy(ResizeOnceRunning(
            job_id, Resize(job_id, (0, 1), batch_size=128, accum_steps=2, reason="grow")
        ))
        first = await wait_state(stores, job_id, JobState.RUNNING)
        assert first.run_id == 1 and first.placement[0].gpus == [0]

        async def resized():
            current = await record(stores, job_id)
            return current if current.history[-1].reason.startswith("resized") else None

        grown = await wait_until(resized, timeout_s=15)
        assert (grown.run_id, grown.batch_size, grown.gpus, grown.accum_steps) == (2, 128, 2, 2)
        assert grown.placement[0].gpus == [0, 1]
        assert grown.history[-1].reason == "resized to batch 128 on 2 GPUs"
        assert grown.preemptions == 0
        live = (await leading(service)).jobs[job_id]
        assert live.attained_gpu_s > 0, "the first run's GPU service was not counted"
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=30)
    assert done.progress.iteration == 3000 and done.run_id == 2
    assert [c.state for c in done.history] == [
        JobState.QUEUED, JobState.RUNNING, JobState.RUNNING, JobState.SUCCEEDED
    ]


async def test_a_resize_onto_another_node_preempts_and_starts_with_the_new_shape(
    nats_server, stores: Stores, tmp_path: Path
):
    async with nodes(nats_server.url, tmp_path, count=2), SchedulerService(
        fast_scheduler(nats_server.url)
    ) as service:
        await leading(service)
        job_id = await store_job(stores, spec(batch_size=32, iterations=3000))
        # node-1's GPUs are global ids 4-7
        service.use_policy(ResizeOnceRunning(
            job_id, Resize(job_id, (4, 5, 6), batch_size=96)
        ))
        await wait_state(stores, job_id, JobState.RUNNING)

        async def restarted():
            current = await record(stores, job_id)
            return current if current.run_id == 2 and current.placement else None

        moved = await wait_until(restarted, timeout_s=15)
        assert (moved.batch_size, moved.gpus) == (96, 3)
        assert sum(len(p.gpus) for p in moved.placement) == 3
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=30)
    assert done.progress.iteration == 3000 and done.preemptions == 1
    assert [c.state for c in done.history] == [
        JobState.QUEUED, JobState.RUNNING, JobState.PREEMPTED, JobState.RUNNING,
        JobState.SUCCEEDED,
    ]


async def test_a_resize_outside_the_jobs_batch_range_is_ignored(
    nats_server, stores: Stores, tmp_path: Path
):
    async with nodes(nats_server.url, tmp_path, count=1), SchedulerService(
        fast_scheduler(nats_server.url)
    ) as service:
        await leading(service)
        job_id = await store_job(stores, spec(batch_size=32, iterations=300, max_batch_size=64))
        policy = ResizeOnceRunning(job_id, Resize(job_id, (0, 1), batch_size=128))
        service.use_policy(policy)
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=30)
    assert policy.sent
    assert (done.run_id, done.batch_size, done.gpus) == (1, None, None)


def progress_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def resumed(lines: list[dict[str, Any]]) -> int:
    """The iteration of a run's last checkpoint: where the next run starts."""
    return int([line for line in lines if line["event"] == "checkpoint"][-1]["iteration"])


async def test_the_worker_scales_its_learning_rate_with_a_resize_up_to_its_cap_over_an_epoch(
    nats_server, stores: Stores, tmp_path: Path
):
    base_lr, max_lr, base_batch, new_batch = 0.01, 0.03, 16, 64
    dataset_size = 40 * new_batch  # an epoch at the new batch: 40 iterations
    async with (
        nodes(nats_server.url, tmp_path, count=1, jobs_mode="process", **PROCESS_TIMINGS),
        SchedulerService(fast_scheduler(nats_server.url)) as service,
    ):
        await leading(service)
        job_id = await store_job(stores, spec(
            model="ncf", batch_size=base_batch, iterations=10**6, max_batch_size=new_batch,
            base_lr=base_lr, max_lr=max_lr, dataset_size=dataset_size, checkpoint_every=10,
        ))  # fmt: skip
        job_dir = tmp_path / "work" / job_id

        def trained_a_while() -> bool:
            lines = progress_lines(job_dir / "progress-1.jsonl")
            return any(line["event"] == "checkpoint" for line in lines)

        # kept by a leadership taken back after a lease lost on a busy machine
        service.use_policy(ResizeOnceRunning(
            job_id,
            Resize(job_id, (0, 1), batch_size=new_batch, reason="grow"),
            ready=trained_a_while,
        ))
        ramp = math.ceil(dataset_size / new_batch)

        def ramped() -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
            # the second run starts once the first has saved its last iteration and ended
            after = progress_lines(job_dir / "progress-2.jsonl")
            before = progress_lines(job_dir / "progress-1.jsonl")
            if not after or after[-1]["iteration"] < resumed(before) + ramp + 10:
                return None
            return before, after

        # two ranks now, on the two GPUs
        before, lines = await wait_until(ramped, timeout_s=process_limit_s(3))

    resumed_at = resumed(before)
    # before: the base rate at the base batch
    assert [line["lr"] for line in before] == pytest.approx([base_lr] * len(before))

    # after: 4x the batch would be 4x the rate, capped at max_lr, reached linearly over
    # one epoch at the new batch from the iteration the new run started at
    def expected(iteration: int) -> float:
        done = min(1.0, (iteration - resumed_at) / ramp)
        return base_lr + (max_lr - base_lr) * done

    assert [line["lr"] for line in lines] == pytest.approx(
        [expected(line["iteration"]) for line in lines]
    )
    inside = [line for line in lines if line["iteration"] < resumed_at + ramp]
    assert inside, "no line from inside the ramp (the checkpoints every 10 make some)"
    assert all(base_lr < line["lr"] < max_lr for line in inside)
    assert lines[-1]["lr"] == pytest.approx(max_lr)
    # epochs done and the held-out accuracy, for a progress predictor
    last = lines[-1]
    samples = resumed_at * base_batch + (last["iteration"] - resumed_at) * new_batch
    assert last["epoch"] == pytest.approx(samples / dataset_size)
    assert last["epoch"] >= 1 and 0 <= last["accuracy"] <= 1


async def test_tiresias_live_demotes_a_job_by_its_attained_service_at_the_clusters_time_scale(
    nats_server, stores: Stores, tmp_path: Path
):
    scale = 0.0005  # Tiresias' first threshold, 3,600 GPU-seconds, is 1.8 s of wall time
    async with nodes(nats_server.url, tmp_path, count=1, gpus=1, time_scale=scale), \
            SchedulerService(fast_scheduler(nats_server.url, policy="tiresias",
                                            time_scale=scale)) as service:
        scheduler = await leading(service)
        old = await store_job(stores, spec(iterations=10**8))
        await wait_state(stores, old, JobState.RUNNING)
        await wait_until(lambda: scheduler.jobs[old].attained_at(time.time()) > 2.5, 10)
        new = await store_job(stores, spec(iterations=10**8))
        await wait_state(stores, new, JobState.RUNNING)
        demoted = await record(stores, old)
    assert JobState.PREEMPTED in [c.state for c in demoted.history]
    assert demoted.preemptions == 1
