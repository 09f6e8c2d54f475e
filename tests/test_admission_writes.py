"""The submission path's JetStream writes (services/admission/publisher.py): each returns
only once the stream stored it, with the stored sequence, and fails as nats-py's own
writes fail, so that the submission path's refusals and withdrawals still apply. Real
nats-server; the last test goes through the real HTTP API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, StreamConfig
from nats.js.errors import KeyWrongLastSequenceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.schemas import JobRecord, JobSubmitted
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.admission.publisher import JetStreamWriter
from tests.test_admission_api import TOKENS, Api, spec


@pytest.fixture
async def writer(nc: Client, stores: Stores) -> AsyncIterator[JetStreamWriter]:
    async with JetStreamWriter(nc) as started:
        yield started


@pytest.fixture
async def api(nats_server: NatsServer) -> AsyncIterator[Api]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        yield Api(session, service.url)


async def test_a_put_returns_the_revision_the_bucket_stored(
    writer: JetStreamWriter, stores: Stores
):
    revisions = await asyncio.gather(
        *(writer.put(stores.live, f"j{n}", codec.encode(float(n))) for n in range(50))
    )

    for n, revision in enumerate(revisions):
        entry = await stores.live.get(f"j{n}")
        assert entry.revision == revision
        assert entry.value == codec.encode(float(n))
    assert len(set(revisions)) == 50


async def test_create_refuses_a_key_that_holds_a_value_and_keeps_that_value(
    writer: JetStreamWriter, stores: Stores
):
    first = await writer.create(stores.jobs, "j1", b"first")

    with pytest.raises(KeyWrongLastSequenceError):
        await writer.create(stores.jobs, "j1", b"second")

    entry = await stores.jobs.get("j1")
    assert (entry.revision, entry.value) == (first, b"first")


async def test_create_writes_over_a_deleted_or_purged_key(
    writer: JetStreamWriter, stores: Stores
):
    await writer.create(stores.jobs, "deleted", b"old")
    await stores.jobs.delete("deleted")
    await writer.create(stores.jobs, "purged", b"old")
    await stores.jobs.purge("purged")

    for key in ("deleted", "purged"):
        revision = await writer.create(stores.jobs, key, b"new")
        entry = await stores.jobs.get(key)
        assert (entry.revision, entry.value) == (revision, b"new")


async def test_a_publish_is_deduplicated_by_its_message_id_like_the_clients_own(
    writer: JetStreamWriter, stores: Stores
):
    headers = codec.headers({"Nats-Msg-Id": "j1"})
    event = codec.encode(JobSubmitted("j1", 1.0))

    first = await writer.publish(subjects.job_submitted("j1"), event, headers)
    again = await writer.publish(subjects.job_submitted("j1"), event, headers)

    assert again == first
    info = await stores.js.stream_info(subjects.JOBS_STREAM)
    assert info.state.messages == 1


async def test_a_stream_that_refuses_the_write_raises_its_error_code(
    writer: JetStreamWriter, stores: Stores
):
    await stores.js.add_stream(StreamConfig(
        name="FULL", subjects=["full.>"], max_msgs=1, discard=DiscardPolicy.NEW
    ))
    await writer.publish("full.a", b"1")

    with pytest.raises(nats.js.errors.APIError) as refused:
        await writer.publish("full.b", b"2")

    assert refused.value.err_code is not None
    assert (await stores.js.stream_info("FULL")).state.messages == 1


async def test_a_subject_no_stream_holds_fails_at_once(writer: JetStreamWriter):
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await asyncio.wait_for(writer.publish("nowhere.at.all", b"x"), 2.0)


async def test_a_write_nobody_acknowledges_times_out(nc: Client, stores: Stores):
    # a plain subscriber takes the message and never answers, as a stream that lost
    # its leader would
    silent = await nc.subscribe("silent.subject")
    async with JetStreamWriter(nc, ack_timeout_s=0.2) as short:
        with pytest.raises(nats.errors.TimeoutError):
            await short.publish("silent.subject", b"x")
        assert not short._pending
    await silent.unsubscribe()


async def test_a_writer_must_be_started_and_takes_only_a_positive_timeout(nc: Client):
    with pytest.raises(RuntimeError, match="not started"):
        await JetStreamWriter(nc).publish("x", b"")
    with pytest.raises(ValueError, match="ack_timeout_s"):
        JetStreamWriter(nc, ack_timeout_s=0)


async def test_every_accepted_submission_is_stored_indexed_and_published_by_its_answer(
    api: Api, stores: Stores
):
    answers = await asyncio.gather(*(api.submit(spec(name=f"job-{n}")) for n in range(40)))

    assert [answer.status for answer in answers] == [201] * 40
    live = set(await stores.live_job_ids())
    for answer in answers:
        job_id = answer.body["id"]
        entry = await stores.jobs.get(job_id)
        assert entry.value is not None
        assert codec.decode(entry.value, JobRecord).spec.name == answer.body["spec"]["name"]
        assert job_id in live
        event = await stores.js.get_last_msg(subjects.JOBS_STREAM,
                                             subjects.job_submitted(job_id))
        assert codec.decode(event.data or b"", JobSubmitted).job_id == job_id
