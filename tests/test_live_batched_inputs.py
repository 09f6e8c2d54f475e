"""The live scheduler's shortcuts under load, against a real nats-server: the record
writes of different jobs are under way together while each job's effects keep their
order; heartbeats and progress wait as the latest per sender behind one inbox message;
nodes that join together are laid out once; the stream messages waiting are read
together and acknowledged only after what they changed is written."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from msgspec.structs import replace

from gpusched.libs.common import subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.schemas import Heartbeat, JobRecord, Progress, RunningJob
from gpusched.services.scheduler.live import LiveScheduler, RecordConflict, timing
from gpusched.services.scheduler.live.effects import StartRun, WriteRecord
from gpusched.services.scheduler.live.messages import InputsDue, Resync
from gpusched.services.scheduler.live.state import LiveJob
from tests.live import spec, store_job
from tests.test_scheduler_hardening import idle_scheduler, record_of, register_node


async def adopted(scheduler: LiveScheduler, stores: Stores, count: int) -> list[LiveJob]:
    jobs = []
    for _ in range(count):
        job = await scheduler._adopt(await store_job(stores, spec()))
        assert job is not None
        jobs.append(job)
    await scheduler._carry_out()
    return jobs


def reason(job: LiveJob, text: str) -> WriteRecord:
    job.record = replace(job.record, pending_reason=text)
    return WriteRecord(job, job.record)


def queued(scheduler: LiveScheduler) -> list[Any]:
    return list(scheduler._inbox._queue)  # type: ignore[attr-defined]


async def test_writes_of_two_jobs_are_under_way_together_and_a_start_waits_for_its_own(
    nats_server: Any, nc: Any, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        a, b = await adopted(scheduler, stores, 2)
        events: list[tuple[str, str]] = []
        b_begun = asyncio.Event()
        real_write = scheduler.store.write

        async def write(job: LiveJob, record: JobRecord) -> None:
            events.append(("write", job.id))
            if job is a:
                # done one after the other, b's write would never begin meanwhile
                await asyncio.wait_for(b_begun.wait(), timeout=10)
            else:
                b_begun.set()
            await real_write(job, record)
            events.append(("written", job.id))

        monkeypatch.setattr(scheduler.store, "write", write)
        monkeypatch.setattr(scheduler.commands, "start",
                            lambda record, placement: events.append(("start", record.id)))
        scheduler.core.effects += [reason(a, "a"), StartRun(a.record, []), reason(b, "b")]
        await scheduler._carry_out()
        assert events.index(("start", a.id)) > events.index(("written", a.id))
        assert (await record_of(stores, a.id)).pending_reason == "a"
        assert (await record_of(stores, b.id)).pending_reason == "b"


async def test_a_jobs_second_write_waits_for_its_first(nats_server: Any, nc: Any,
                                                       stores: Stores) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        (a,) = await adopted(scheduler, stores, 1)
        # the second is written at the revision the first gives: both together would
        # conflict
        scheduler.core.effects += [reason(a, "first"), reason(a, "second")]
        await scheduler._carry_out()
        assert (await record_of(stores, a.id)).pending_reason == "second"


async def test_a_failed_write_stops_its_own_jobs_effects_only(
    nats_server: Any, nc: Any, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        a, b, c = await adopted(scheduler, stores, 3)
        started: list[str] = []
        real_write = scheduler.store.write

        async def write(job: LiveJob, record: JobRecord) -> None:
            if job is not b:
                raise RecordConflict(job.id)
            await real_write(job, record)

        monkeypatch.setattr(scheduler.store, "write", write)
        monkeypatch.setattr(scheduler.commands, "start",
                            lambda record, placement: started.append(record.id))
        scheduler.core.effects += [
            reason(a, "a"), StartRun(a.record, []), reason(b, "b"), StartRun(b.record, []),
            reason(c, "c"), StartRun(c.record, []),
        ]
        with pytest.raises(RecordConflict) as raised:
            await scheduler._carry_out()
        assert raised.value.job_id == a.id  # the caller reads it back
        assert started == [b.id]
        assert (await record_of(stores, b.id)).pending_reason == "b"
        assert Resync(c.id) in queued(scheduler)  # the other failed job is read back


def heartbeat(node: str, at: float, *running: RunningJob) -> Heartbeat:
    return Heartbeat(node=node, at=at, running=list(running))


async def test_heartbeats_wait_as_the_latest_per_node_behind_one_message(
    nats_server: Any, nc: Any, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        for name in ("n1", "n2", "n3"):
            await register_node(stores, name)
        layouts = 0
        relayout = scheduler.core._relayout

        def counted() -> None:
            nonlocal layouts
            layouts += 1
            relayout()

        monkeypatch.setattr(scheduler.core, "_relayout", counted)
        now = time.time()
        scheduler.beat_arrived(heartbeat("n1", now - 3.0))
        scheduler.beat_arrived(heartbeat("n1", now, RunningJob("j", 4, Progress(iteration=0))))
        scheduler.beat_arrived(heartbeat("n2", now))
        scheduler.beat_arrived(heartbeat("n3", now))
        assert sum(isinstance(m, InputsDue) for m in queued(scheduler)) == 1
        await scheduler.handle(InputsDue())
        assert set(scheduler.nodes) == {"n1", "n2", "n3"}
        assert layouts == 1  # three nodes joined in one step: one layout
        assert scheduler.nodes["n1"].reported == {"j": 4}  # the latest heartbeat
        # the replaced heartbeat's wait counts in the input lag
        assert max(scheduler.beat_lag_s) >= 3.0
        scheduler.beat_arrived(heartbeat("n2", time.time()))
        assert sum(isinstance(m, InputsDue) for m in queued(scheduler)) == 2


async def test_stream_messages_are_read_together_and_acknowledged_after_their_writes(
    nats_server: Any, nc: Any, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        ids = [await store_job(stores, spec()) for _ in range(3)]
        pull = await stores.js.pull_subscribe(subjects.ALL_JOB_SUBMISSIONS, durable="batch",
                                              stream=subjects.JOBS_STREAM)
        msgs = await pull.fetch(3, timeout=5)
        assert len(msgs) == 3
        reading = most = 0
        real_read = scheduler.store.read

        async def read(job_id: str) -> Any:
            nonlocal reading, most
            reading += 1
            most = max(most, reading)
            await asyncio.sleep(0.05)
            try:
                return await real_read(job_id)
            finally:
                reading -= 1

        pending_at_marks: list[int] = []
        real_mark = scheduler.store.mark_live

        async def mark_live(job_id: str) -> None:
            info = await pull.consumer_info()
            pending_at_marks.append(info.num_ack_pending)
            await real_mark(job_id)

        monkeypatch.setattr(scheduler.store, "read", read)
        monkeypatch.setattr(scheduler.store, "mark_live", mark_live)
        scheduler.durables_arrived(msgs)
        await scheduler.handle(InputsDue())
        assert most == 3  # read together, not one round trip after another
        assert set(ids) <= set(scheduler.jobs)
        assert pending_at_marks == [3, 3, 3]  # none acknowledged before its effects


        async def acknowledged() -> bool:
            return (await pull.consumer_info()).num_ack_pending == 0

        await wait_until(acknowledged, timeout_s=10)


async def test_a_step_keeps_at_most_its_bound_of_effects_under_way(
    nats_server: Any, nc: Any, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
        jobs = await adopted(scheduler, stores, 5)
        monkeypatch.setattr(timing, "EFFECTS_IN_FLIGHT", 2)
        writing = most = 0
        real_write = scheduler.store.write

        async def write(job: LiveJob, record: JobRecord) -> None:
            nonlocal writing, most
            writing += 1
            most = max(most, writing)
            await asyncio.sleep(0.02)
            try:
                await real_write(job, record)
            finally:
                writing -= 1

        monkeypatch.setattr(scheduler.store, "write", write)
        scheduler.core.effects += [reason(job, "bounded") for job in jobs]
        await scheduler._carry_out()
        assert most == 2
        for job in jobs:
            assert (await record_of(stores, job.id)).pending_reason == "bounded"
