"""A job that admission accepted is scheduled even when its submission event never
reaches the scheduler: what a NATS server dying in the middle of a submit can leave
behind, built here step by step against the real services (nats-server, admission,
scheduler, an emulated node)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    JobRecord,
    JobSpec,
    JobState,
    JobSubmitted,
    StateChange,
)
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.admission.ids import idempotent_job_id
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService, timing
from tests.live import fast_scheduler

TOKEN = "tok-recovery"
BODY = {"name": "recover", "model": "resnet50", "batch_size": 32, "iterations": 200}
#: a job of 200 iterations at time scale 0.01 runs well under a second; the scheduler
#: rescans its index every RESCAN_S below: a limit far above both
SUCCEEDED_WITHIN_S = 60.0


@dataclass
class Running:
    url: str
    session: aiohttp.ClientSession
    stores: Stores

    async def submit(self, key: str) -> tuple[int, str, dict[str, str]]:
        async with self.session.post(f"{self.url}/v1/jobs", json=BODY,
                                     headers={"Idempotency-Key": key}) as response:
            body = await response.json()
            assert response.status in (200, 201), body
            return response.status, str(body["id"]), dict(response.headers)

    async def state(self, job_id: str) -> str:
        async with self.session.get(f"{self.url}/v1/jobs/{job_id}") as response:
            assert response.status == 200
            return str((await response.json())["state"])

    async def succeeds(self, job_id: str) -> None:
        async def done() -> bool:
            return await self.state(job_id) == "SUCCEEDED"

        try:
            await wait_until(done, timeout_s=SUCCEEDED_WITHIN_S, every_s=0.2)
        except TimeoutError:
            raise AssertionError(f"{job_id} is {await self.state(job_id)}, "
                                 "never scheduled") from None

    async def submitted_events(self, job_id: str) -> int:
        info = await self.stores.js.stream_info(
            subjects.JOBS_STREAM, subjects_filter=subjects.job_submitted(job_id)
        )
        return (info.state.subjects or {}).get(subjects.job_submitted(job_id), 0)


async def running(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Running]:
    """Admission, the scheduler and one emulated node. No predictor: it also tells the
    scheduler of each submission it hears (its predicted size), but it hears them over
    core NATS, only while connected, so no job's scheduling may rest on it."""
    url = nats_server.url
    admission = AdmissionConfig(nats_url=url, port=0, tokens={TOKEN: "default"})
    async with EmulatedCluster.of(
        url, 1, 4, work_dir=tmp_path / "work", heartbeat_s=0.2, progress_s=0.2,
        time_scale=0.01,
    ), SchedulerService(fast_scheduler(url, time_scale=0.01)), AdmissionService(
        admission
    ) as service, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=aiohttp.ClientTimeout(total=30),
    ) as session, connection(url, "test") as nc:
        yield Running(service.url, session, await Stores.open(nc))


@pytest.fixture
async def rescanning(nats_server, tmp_path, monkeypatch) -> AsyncIterator[Running]:
    """A cluster whose scheduler rescans its index of unfinished jobs every second."""
    monkeypatch.setattr(timing, "RESCAN_S", 1.0)
    async for up in running(nats_server, tmp_path):
        yield up


@pytest.fixture
async def never_rescanning(nats_server, tmp_path, monkeypatch) -> AsyncIterator[Running]:
    """A cluster whose scheduler learns of jobs from submission events alone."""
    monkeypatch.setattr(timing, "RESCAN_S", 24 * 3600.0)
    async for up in running(nats_server, tmp_path):
        yield up


async def test_a_retried_submission_whose_event_was_consumed_before_its_record_existed_still_runs(
    rescanning: Running,
) -> None:
    up, key, job_id = rescanning, "lost-ack", idempotent_job_id("default", "lost-ack")
    # The first attempt's event reached the stream but its acknowledgement was lost with
    # the server, so admission withdrew the record and answered 503. The scheduler takes
    # the event while no record exists and acknowledges it.
    ack = await up.stores.js.publish(
        subjects.job_submitted(job_id), codec.encode(JobSubmitted(job_id, time.time())),
        headers=codec.headers({"Nats-Msg-Id": job_id}),
    )

    async def consumed() -> bool:
        info = await up.stores.js.consumer_info(subjects.JOBS_STREAM,
                                                subjects.SCHEDULER_CONSUMER)
        return info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= ack.seq

    await wait_until(consumed, timeout_s=SUCCEEDED_WITHIN_S, every_s=0.05)
    # the client retries with the same key: a new record, whose event the stream drops
    # as a duplicate of the first attempt's
    status, answered, _ = await up.submit(key)
    assert (status, answered) == (201, job_id)
    assert await up.submitted_events(job_id) == 1
    await up.succeeds(job_id)


async def test_a_queued_job_stored_without_its_event_runs_once_its_submission_is_retried(
    never_rescanning: Running,
) -> None:
    up, key = never_rescanning, "crashed-before-publish"
    job_id = idempotent_job_id("default", key)
    # what admission leaves when it stops between storing a job and publishing its event
    at = time.time()
    spec = JobSpec(**BODY)
    record = JobRecord(id=job_id, tenant="default", spec=spec, total_iterations=200,
                       submitted_at=at, history=[StateChange(JobState.QUEUED, at, "submitted")],
                       pending_reason="waiting for the scheduler")
    await up.stores.mark_live(job_id)
    await up.stores.jobs.create(job_id, codec.encode(record))
    assert await up.submitted_events(job_id) == 0
    status, answered, headers = await up.submit(key)
    assert (status, answered, headers.get("Idempotent-Replayed")) == (200, job_id, "true")
    assert await up.submitted_events(job_id) == 1
    await up.succeeds(job_id)
    # a replay of a finished job publishes nothing more
    status, _, _ = await up.submit(key)
    assert status == 200
    assert await up.submitted_events(job_id) == 1
