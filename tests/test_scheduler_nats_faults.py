"""A NATS call of the scheduler that fails (a timeout: a server died, or its store cannot
write) never makes it forget a job it had not yet taken. Each test injects exactly one
failure, at the moment a server dying under load produced it, into the scheduler's own
KV calls against a real nats-server, and shows the job still runs to the end, once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.schemas import JobRecord, JobState, StateChange
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler import live
from gpusched.services.scheduler.live import SchedulerService, timing
from tests.live import fast_scheduler, spec, store_job, wait_state

#: a job of 200 iterations at time scale 0.01 runs well under a second; a start that is
#: never confirmed is requeued after the scheduler's missing-job grace (2 s), a failed
#: record read asked again after a second, a failed event handed back within a second
SUCCEEDED_WITHIN_S = 60.0


@dataclass
class Cluster:
    scheduler: SchedulerService
    stores: Stores

    @property
    def scheduler_stores(self) -> Stores:
        assert self.scheduler.stores is not None
        return self.scheduler.stores


@pytest.fixture
async def cluster(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Cluster]:
    url = nats_server.url
    async with EmulatedCluster.of(
        url, 1, 4, work_dir=tmp_path / "work", heartbeat_s=0.2, progress_s=0.2,
        time_scale=0.01,
    ), SchedulerService(fast_scheduler(url, time_scale=0.01)) as scheduler, connection(
        url, "test"
    ) as nc:
        yield Cluster(scheduler, await Stores.open(nc))


class FailOnce:
    """Stands in for one method of one of the scheduler's KV buckets: the first call
    that ``matches`` raises nats' TimeoutError before it reaches the server or, with
    ``stored``, after the server has stored it (its answer lost). With ``passes`` that
    call is not failed but answered, after ``during`` ran: what the server answered
    came before ``during`` changed it."""

    def __init__(
        self, target: Any, method: str, matches: Callable[..., bool], *, stored: bool = False,
        passes: bool = False, during: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.real = getattr(target, method)
        self.matches = matches
        self.stored = stored
        self.passes = passes
        self.during = during
        self.failed = 0
        setattr(target, method, self)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed or not self.matches(*args, **kwargs):
            return await self.real(*args, **kwargs)
        self.failed += 1
        if self.passes:
            try:
                return await self.real(*args, **kwargs)
            finally:
                if self.during is not None:
                    await self.during()
        if self.stored:
            await self.real(*args, **kwargs)
        raise nats.errors.TimeoutError


def a_start(key: str, value: bytes, **_: Any) -> bool:
    """A write of a job's record that places it (what ``_start`` writes)."""
    record = codec.decode(value, JobRecord)
    return record.state is JobState.QUEUED and bool(record.placement)


def states(record: JobRecord) -> list[JobState]:
    return [change.state for change in record.history]


async def test_a_job_whose_start_could_not_be_written_starts_once_its_record_is_read_back(
    cluster: Cluster,
) -> None:
    fault = FailOnce(cluster.scheduler_stores.jobs, "update", a_start)
    job_id = await store_job(cluster.stores, spec(iterations=200))

    done = await wait_state(cluster.stores, job_id, JobState.SUCCEEDED,
                            timeout_s=SUCCEEDED_WITHIN_S)

    assert fault.failed == 1
    assert states(done) == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]


async def test_a_job_whose_start_was_stored_but_unanswered_runs_once(cluster: Cluster) -> None:
    # the record says the job is placed, but no start command was ever sent: its node
    # never reports it, so it is requeued and started again, once
    fault = FailOnce(cluster.scheduler_stores.jobs, "update", a_start, stored=True)
    job_id = await store_job(cluster.stores, spec(iterations=200))

    done = await wait_state(cluster.stores, job_id, JobState.SUCCEEDED,
                            timeout_s=SUCCEEDED_WITHIN_S)

    assert fault.failed == 1
    assert states(done).count(JobState.RUNNING) == 1
    assert states(done)[-1] is JobState.SUCCEEDED
    assert done.run_id == 2  # the first start, never sent, and the one that ran


async def test_a_submission_whose_record_could_not_be_read_is_taken_when_its_event_comes_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no rescan would find it: the event, handed back, is the only way to the job
    monkeypatch.setattr(timing, "RESCAN_S", 24 * 3600.0)
    job_id = "unread"
    fault = FailOnce(cluster.scheduler_stores.jobs, "get", lambda key, **_: key == job_id)
    await store_job(cluster.stores, spec(iterations=200), job_id=job_id)

    done = await wait_state(cluster.stores, job_id, JobState.SUCCEEDED,
                            timeout_s=SUCCEEDED_WITHIN_S)

    assert fault.failed == 1
    assert states(done) == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]


async def test_a_job_entered_again_while_a_rescan_drops_its_stale_entry_is_adopted(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A first attempt to submit left an index entry and no record. A rescan reads that
    # entry, finds no record and drops the entry as an orphan; in between, the client's
    # retry enters the job again and stores its record, and the retry's event is dropped
    # by the stream as a duplicate of the first attempt's. The index entry is all that
    # leads to the job: the rescan may drop only the entry it read.
    monkeypatch.setattr(timing, "RESCAN_S", 1.0)
    monkeypatch.setattr(timing, "ORPHAN_INDEX_S", 0.0)
    took_over = asyncio.Event()
    real_on_start = live.LiveScheduler.on_start

    async def on_start(self: live.LiveScheduler) -> None:
        await real_on_start(self)
        took_over.set()

    monkeypatch.setattr(live.LiveScheduler, "on_start", on_start)
    job_id, url = "retried", nats_server.url
    async with EmulatedCluster.of(
        url, 1, 4, work_dir=tmp_path / "work", heartbeat_s=0.2, progress_s=0.2,
        time_scale=0.01,
    ), SchedulerService(fast_scheduler(url, time_scale=0.01)) as scheduler, connection(
        url, "test"
    ) as nc:
        stores = await Stores.open(nc)
        await took_over.wait()  # from now on only a rescan reads the index
        assert scheduler.stores is not None

        async def retried() -> None:
            # admission's retry: the job entered first, then its record; no event
            await stores.mark_live(job_id)
            await store_record(stores, job_id)
            stored.set()

        stored = asyncio.Event()

        # the rescan's read of the record comes just before the retry stores it
        fault = FailOnce(scheduler.stores.jobs, "get", lambda key, **_: key == job_id,
                         passes=True, during=retried)
        await stores.mark_live(job_id)  # the first attempt's entry
        await asyncio.wait_for(stored.wait(), SUCCEEDED_WITHIN_S)  # the next rescan

        done = await wait_state(stores, job_id, JobState.SUCCEEDED,
                                timeout_s=SUCCEEDED_WITHIN_S)

    assert fault.failed == 1
    assert states(done) == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]


async def store_record(stores: Stores, job_id: str) -> None:
    """The record alone, as admission stores it, with no submission event."""
    at = time.time()
    record = JobRecord(
        id=job_id, tenant="default", spec=spec(iterations=200), total_iterations=200,
        submitted_at=at, history=[StateChange(JobState.QUEUED, at, "submitted")],
        pending_reason="waiting for the scheduler",
    )
    await stores.jobs.create(job_id, codec.encode(record))


async def test_a_scheduler_whose_takeover_failed_gives_up_the_lease_and_leads_again(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the takeover's first read of the index of unfinished jobs times out: a scheduler
    # that kept the lease without running would leave every job waiting for good
    reads: list[bool] = []
    real = Stores.live_index_complete

    async def first_read_fails(self: Stores) -> bool:
        reads.append(True)
        if len(reads) == 1:
            raise nats.errors.TimeoutError
        return await real(self)

    monkeypatch.setattr(Stores, "live_index_complete", first_read_fails)
    url = nats_server.url
    async with EmulatedCluster.of(
        url, 1, 4, work_dir=tmp_path / "work", heartbeat_s=0.2, progress_s=0.2,
        time_scale=0.01,
    ), SchedulerService(fast_scheduler(url, time_scale=0.01)), connection(url, "test") as nc:
        stores = await Stores.open(nc)
        job_id = await store_job(stores, spec(iterations=200))

        done = await wait_state(stores, job_id, JobState.SUCCEEDED,
                                timeout_s=SUCCEEDED_WITHIN_S)

    assert len(reads) >= 2  # the failed takeover, and the one that led
    assert states(done) == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
