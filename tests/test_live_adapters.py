"""The live scheduler's adapters against a real nats-server: the job store (records
written only at the revision read, the index of unfinished jobs, stored exits) and the
node commands and predictor asks, whose answers come back to the actor as messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import nats.errors
import pytest
import structlog
from msgspec.structs import replace
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.schemas import (
    CommandReply,
    JobExit,
    JobRecord,
    JobState,
    Placement,
    StateChange,
    StopJob,
)
from gpusched.services.scheduler.live import (
    JobStore,
    Message,
    NodeCommands,
    PredictorAsks,
    RecordConflict,
    RecordUnsure,
    StartResult,
    StopFailed,
)
from gpusched.services.scheduler.live.gpu_types import GpuTypes
from gpusched.services.scheduler.live.state import LiveJob
from tests.live import fast_scheduler, spec, store_job

log = structlog.get_logger("test")


class Inbox:
    """What an adapter tells the actor, and the tasks it spawns beside it."""

    def __init__(self) -> None:
        self.told: list[Message] = []
        self.tasks: list[asyncio.Future[None]] = []

    def spawn(self, work: Awaitable[None]) -> None:
        self.tasks.append(asyncio.ensure_future(work))

    def tell(self, message: Message) -> None:
        self.told.append(message)

    async def settled(self) -> list[Message]:
        await asyncio.gather(*self.tasks)
        return self.told


async def read_job(store: JobStore, job_id: str) -> LiveJob:
    stored = await store.read(job_id)
    assert stored is not None
    return LiveJob(*stored, est_iteration_s=0.0)


async def test_a_record_is_written_at_the_revision_read_and_a_stale_write_conflicts(
    stores: Stores,
) -> None:
    store = JobStore(stores, log)
    job_id = await store_job(stores, spec())
    job, stale = await read_job(store, job_id), await read_job(store, job_id)

    written = replace(job.record, pending_reason="written")
    await store.write(job, written)

    assert job.revision > stale.revision and job.record is written
    with pytest.raises(RecordConflict) as conflict:
        await store.write(stale, replace(stale.record, pending_reason="stale"))
    assert not isinstance(conflict.value, RecordUnsure) and conflict.value.job_id == job_id
    assert stale.record.pending_reason != "stale"  # the picture keeps what it read
    stored = await store.read(job_id)
    assert stored is not None and stored[0].pending_reason == "written"


async def test_a_write_without_a_verdict_is_unsure(stores: Stores) -> None:
    store = JobStore(stores, log)
    job = await read_job(store, await store_job(stores, spec()))
    before = job.record

    async def times_out(*_: object, **__: object) -> int:
        raise nats.errors.TimeoutError

    stores.jobs.update = times_out  # type: ignore[method-assign]
    with pytest.raises(RecordUnsure):
        await store.write(job, replace(job.record, pending_reason="unsure"))
    assert job.record is before


async def test_the_index_of_unfinished_jobs_is_built_once_where_the_store_has_none(
    stores: Stores,
) -> None:
    # records written before the index existed: one waits, one has finished
    now = time.time()
    for job_id, state in (("waiting", JobState.QUEUED), ("finished", JobState.SUCCEEDED)):
        record = JobRecord(id=job_id, tenant="default", spec=spec(), total_iterations=10,
                           submitted_at=now, state=state,
                           history=[StateChange(state, now, "stored")])
        await stores.jobs.create(job_id, codec.encode(record))
    store = JobStore(stores, log)
    assert not await stores.live_index_complete()

    unfinished = await store.unfinished()

    assert [(key, record.state) for key, record, _ in unfinished] == [
        ("waiting", JobState.QUEUED)
    ]
    assert await stores.live_index_complete()
    assert await store.live_job_ids() == ["waiting"]


async def test_a_stored_exit_counts_only_from_the_leading_node_for_the_current_run(
    stores: Stores,
) -> None:
    store = JobStore(stores, log)
    job = await read_job(store, await store_job(stores, spec()))
    job.record = replace(job.record, run_id=2, placement=[Placement("node-a", [0]),
                                                          Placement("node-b", [0])])
    assert await store.stored_exit(job) is None

    async def stored(node: str, run_id: int) -> None:
        exit = JobExit(job_id=job.id, run_id=run_id, node=node, outcome="succeeded",
                       exit_code=0, iteration=10, at=time.time())
        await stores.js.publish(subjects.job_exit(node, job.id), codec.encode(exit),
                                headers=codec.headers())

    await stored("node-b", 2)  # a follower's subject: not read
    assert await store.stored_exit(job) is None
    await stored("node-a", 1)  # an earlier run's
    assert await store.stored_exit(job) is None
    await stored("node-a", 2)
    found = await store.stored_exit(job)
    assert found is not None and (found.node, found.run_id) == ("node-a", 2)


async def test_node_commands_report_back_as_messages(nats_server: NatsServer, nc: Client) -> None:
    config = fast_scheduler(nats_server.url, command_timeout_s=0.2, command_retries=1)
    inbox = Inbox()
    commands = NodeCommands(nc, config, log, inbox.spawn, inbox.tell)
    received: list[StopJob] = []

    async def node(msg: Msg) -> None:
        received.append(codec.decode(msg.data, StopJob))
        await msg.respond(codec.encode(CommandReply(ok=True)))

    await nc.subscribe(subjects.node_command("up"), cb=node)

    commands.stop("up", "j1", 3, "preempt")  # answered: nothing to tell
    commands.stop("gone", "j1", 3, "preempt")  # nobody listens there
    record = JobRecord(id="j2", tenant="default", spec=spec(), total_iterations=10,
                       submitted_at=time.time(), run_id=1, placement=[Placement("gone", [0])])
    commands.start(record, record.placement)

    told = await inbox.settled()
    assert [(s.job_id, s.run_id, s.reason) for s in received] == [("j1", 3, "preempt")]
    stop_failed, start_result = told
    assert isinstance(stop_failed, StopFailed) and stop_failed.error.startswith("no answer")
    assert isinstance(start_result, StartResult)
    assert (start_result.job_id, start_result.run_id) == ("j2", 1)
    # no answer at all: the node may have started it and its reply been lost
    assert start_result.unanswered and start_result.error.startswith("gone: no answer")


async def test_a_predictor_that_does_not_answer_leaves_the_profiles_to_ask_again(
    nats_server: NatsServer, nc: Client,
) -> None:
    config = fast_scheduler(nats_server.url, predictor_timeout_s=0.2)
    inbox, gpu_types = Inbox(), GpuTypes()
    gpu_types.asked.add("h100")
    predictor = PredictorAsks(nc, config, gpu_types, lambda: None, log, inbox.spawn,
                              inbox.tell)
    record = JobRecord(id="j1", tenant="default", spec=spec(), total_iterations=10,
                       submitted_at=time.time())

    predictor.ask_estimate(record)
    predictor.ask_compute_profile("resnet50")
    predictor.ask_compute_profile("resnet50")  # asked once while the first is out
    predictor.ask_gpu_profile("h100")

    assert len(inbox.tasks) == 3
    assert await inbox.settled() == []
    assert predictor.compute_asked == set() and gpu_types.asked == set()
