"""The live scheduler under load and during handovers: liveness follows heartbeats as
they arrive, a finished job never runs again, a takeover reads only unfinished jobs, and a
write that lost a compare-and-set race never replaces the newer record."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from msgspec.structs import replace

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import (
    CancelRequest,
    GpuInfo,
    Heartbeat,
    JobExit,
    JobRecord,
    JobState,
    NodeInfo,
    Placement,
    Progress,
    RunningJob,
    RunRef,
    StateChange,
)
from gpusched.services.scheduler.live import Beat, Durable, LiveScheduler, RecordConflict, Sweep
from tests.live import fast_scheduler, spec, store_job

NODE = "n1"


async def register_node(stores: Stores, name: str = NODE, gpus: int = 4) -> None:
    info = NodeInfo(
        name=name, cpus=16, host_mem_gb=64,
        gpus=[GpuInfo(index=g, uuid=f"{name}-{g}", model="emu", memory_mb=40_000)
              for g in range(gpus)],
    )
    await stores.nodes.put(name, codec.encode(info))


async def rewrite_record(stores: Stores, job_id: str, **changes: Any) -> None:
    """Change a stored record as a scheduler would (compare-and-set on its revision)."""
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None and entry.revision is not None
    record = replace(codec.decode(entry.value, JobRecord), **changes)
    await stores.jobs.update(job_id, codec.encode(record), last=entry.revision)


async def store_running_job(stores: Stores, run_id: int = 1) -> str:
    """A job the previous leader started on NODE, as its record says."""
    job_id = await store_job(stores, spec())
    record = await record_of(stores, job_id)
    await rewrite_record(
        stores, job_id, state=JobState.RUNNING, run_id=run_id,
        placement=[Placement(NODE, [0])],
        history=[*record.history, StateChange(JobState.RUNNING, time.time(), "started")],
    )
    return job_id


async def store_job_being_started(stores: Stores, run_id: int = 1) -> str:
    """A job a leader was starting when it died: its record names the run and placement
    but still waits (the start's result never came back)."""
    job_id = await store_job(stores, spec())
    await rewrite_record(stores, job_id, run_id=run_id, placement=[Placement(NODE, [0])],
                         pending_reason="starting")
    return job_id


def succeeded(job_id: str, run_id: int) -> JobExit:
    """The exit a node stores when the run ``run_id`` of a job trains to its end."""
    return JobExit(job_id=job_id, run_id=run_id, node=NODE, outcome="succeeded",
                   exit_code=0, iteration=10, at=time.time())


async def store_exit(stores: Stores, exit: JobExit, node: str | None = None) -> None:
    """Store ``exit`` as ``node`` (by default the node it names) would publish it."""
    await stores.js.publish(subjects.job_exit(node or exit.node, exit.job_id),
                            codec.encode(exit), headers=codec.headers())


async def stream_message(stores: Stores, subject: str, payload: Any) -> Durable:
    """``payload`` as the scheduler's consumer delivers it: a real message of the jobs
    stream (or the exits stream, for an exit), stored and fetched back."""
    await stores.js.publish(subject, codec.encode(payload), headers=codec.headers())
    stream = subjects.EXITS_STREAM if subjects.node_of(subject) else subjects.JOBS_STREAM
    pull = await stores.js.pull_subscribe(subject, stream=stream)
    (msg,) = await pull.fetch(1, timeout=5)
    return Durable(msg)


@contextlib.asynccontextmanager
async def idle_scheduler(nats_url: str, nc: Any, stores: Stores, **overrides: Any
                         ) -> AsyncIterator[LiveScheduler]:
    """A leader that has loaded the stored state but whose inbox nobody reads: each
    message is handed to it by the test, as a backlogged actor would meet it late."""
    scheduler = LiveScheduler(fast_scheduler(nats_url, **overrides), nc, stores)
    await scheduler.on_start()
    try:
        yield scheduler
    finally:
        await asyncio.sleep(0)  # let its helper tasks begin, so they end cleanly
        await scheduler.__aexit__(None, None, None)


async def record_of(stores: Stores, job_id: str) -> JobRecord:
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    return codec.decode(entry.value, JobRecord)


async def test_a_node_whose_heartbeats_arrive_stays_alive_while_the_scheduler_is_backlogged(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=1.0, missing_job_grace_s=1.0
    ) as scheduler:
        await asyncio.sleep(1.5)  # longer than both limits since the load
        # the beats arrived (and were registered on arrival) but wait in the inbox
        beat = Heartbeat(node=NODE, at=time.time(),
                         running=[_running(job_id, 1)])
        scheduler.liveness.saw(beat, arrived=time.time())
        await scheduler.handle(Sweep())
        assert NODE in scheduler.nodes
        assert scheduler.jobs[job_id].record.state is JobState.RUNNING
        assert (await record_of(stores, job_id)).state is JobState.RUNNING


async def test_a_node_whose_heartbeats_stopped_is_lost_and_its_job_requeued(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=1.0, missing_job_grace_s=1.0
    ) as scheduler:
        await asyncio.sleep(1.5)
        await scheduler.handle(Sweep())
        assert NODE not in scheduler.nodes
        record = await record_of(stores, job_id)
        assert record.state is JobState.QUEUED
        assert "lost" in record.history[-1].reason


async def test_a_job_whose_exit_waits_in_the_stream_finishes_instead_of_running_again(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        # the run ended: its node stored the exit and stopped listing it; the scheduler
        # has not come to the exit message yet
        await store_exit(stores, succeeded(job_id, 1))
        scheduler.liveness.saw(Heartbeat(node=NODE, at=time.time()), arrived=time.time())
        await asyncio.sleep(1.0)
        await scheduler.handle(Sweep())
        record = await record_of(stores, job_id)
        assert record.state is JobState.SUCCEEDED
        assert [c.state for c in record.history].count(JobState.QUEUED) == 1
        assert job_id not in scheduler.jobs
        assert job_id not in await stores.live_job_ids()


async def test_an_exit_of_an_earlier_run_does_not_end_the_current_one(nats_server, nc, stores):
    await register_node(stores)
    job_id = await store_running_job(stores, run_id=2)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        await store_exit(stores, succeeded(job_id, 1))
        await asyncio.sleep(1.0)
        await scheduler.handle(Sweep())
        record = await record_of(stores, job_id)
        assert record.state is JobState.QUEUED  # run 2 vanished without an exit: requeued
        assert "no longer reports it running" in record.history[-1].reason


async def test_a_run_whose_exit_is_still_being_delivered_is_not_taken_for_lost(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        await asyncio.sleep(1.0)
        beat = Heartbeat(node=NODE, at=time.time(), exiting=[RunRef(job_id, 1)])
        scheduler.liveness.saw(beat, arrived=time.time())
        await scheduler.handle(Sweep())
        assert (await record_of(stores, job_id)).state is JobState.RUNNING


async def test_a_write_that_lost_the_race_keeps_the_newer_record_of_the_other_leader(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)
    # two schedulers both believe they lead, and both loaded the job
    async with idle_scheduler(nats_server.url, nc, stores, node_timeout_s=60.0) as first, \
            idle_scheduler(nats_server.url, nc, stores, node_timeout_s=60.0) as second:
        ours, theirs = first.jobs[job_id], second.jobs[job_id]
        await first._write(ours, replace(ours.record, pending_reason="first was here"))
        newer = await record_of(stores, job_id)
        try:
            await second._write(theirs, replace(theirs.record, cancel_requested=True))
        except RecordConflict as conflict:
            assert conflict.job_id == job_id
        else:
            raise AssertionError("the stale write went through")
        stored = await record_of(stores, job_id)
        assert stored == newer
        assert not stored.cancel_requested
        # the loser reads the winner's record back and carries on from it
        cancel = CancelRequest(job_id, "default", time.time())
        await second.handle(await stream_message(stores, subjects.job_cancel(job_id), cancel))
        assert second.jobs[job_id].record.pending_reason == "first was here"


async def test_a_takeover_reads_only_the_unfinished_jobs(nats_server, nc, stores):
    live = await store_job(stores, spec())
    finished = []
    for _ in range(20):
        job_id = await store_job(stores, spec())
        await rewrite_record(stores, job_id, state=JobState.SUCCEEDED)
        await stores.unmark_live(job_id)
        finished.append(job_id)
    await stores.mark_live_index_complete()
    reads: list[str] = []
    get = stores.jobs.get

    async def counted_get(key: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(key)
        return await get(key, *args, **kwargs)

    stores.jobs.get = counted_get  # type: ignore[method-assign]
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        assert set(scheduler.jobs) == {live}
    assert not set(reads) & set(finished)


async def test_a_store_written_before_the_live_index_gets_one_built_once(nats_server, nc, stores):
    queued = await store_job(stores, spec())
    done = await store_job(stores, spec())
    await rewrite_record(stores, done, state=JobState.FAILED)
    for job_id in (queued, done):  # as a store from before the index
        await stores.unmark_live(job_id)
    assert not await stores.live_index_complete()
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        assert set(scheduler.jobs) == {queued}
    assert await stores.live_index_complete()
    assert set(await stores.live_job_ids()) == {queued}


def _running(job_id: str, run_id: int) -> RunningJob:
    return RunningJob(job_id, run_id, Progress())


async def test_the_exit_of_a_run_started_by_the_previous_leader_finishes_the_job(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_job_being_started(stores)
    async with idle_scheduler(nats_server.url, nc, stores, node_timeout_s=60.0) as scheduler:
        exit = succeeded(job_id, 1)
        await scheduler.handle(await stream_message(stores, subjects.job_exit(NODE, job_id), exit))
        record = await record_of(stores, job_id)
        assert record.state is JobState.SUCCEEDED
        assert job_id not in scheduler.jobs


async def test_a_run_started_by_the_previous_leader_is_running_once_its_node_lists_it(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_job_being_started(stores)
    async with idle_scheduler(nats_server.url, nc, stores, node_timeout_s=60.0) as scheduler:
        assert scheduler.jobs[job_id].holds_gpus  # nobody else gets its GPU meanwhile
        beat = Heartbeat(node=NODE, at=time.time(), running=[_running(job_id, 1)])
        await scheduler.handle(Beat(beat))
        record = await record_of(stores, job_id)
        assert record.state is JobState.RUNNING
        assert record.run_id == 1


async def test_a_start_no_node_confirms_is_requeued_after_the_grace(nats_server, nc, stores):
    await register_node(stores)
    job_id = await store_job_being_started(stores)
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        scheduler.liveness.saw(Heartbeat(node=NODE, at=time.time()), arrived=time.time())
        await scheduler.handle(Sweep())
        assert (await record_of(stores, job_id)).state is JobState.QUEUED
        assert scheduler.jobs[job_id].holds_gpus  # within the grace it may still appear
        await asyncio.sleep(1.0)
        await scheduler.handle(Sweep())
        record = await record_of(stores, job_id)
        assert record.state is JobState.QUEUED
        assert "never reported its start" in record.history[-1].reason
        assert not scheduler.jobs[job_id].holds_gpus
