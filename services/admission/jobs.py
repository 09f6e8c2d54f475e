"""The job routes of the API: a tenant's jobs listed (``GET /v1/jobs``), one read
(``GET /v1/jobs/{id}``) or cancelled (``DELETE /v1/jobs/{id}``), and its server-sent
event stream of state transitions and progress (``GET /v1/jobs/{id}/events``). A
tenant sees only its own jobs; the submission path is submission.py's."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

import msgspec
import nats.errors
import structlog
from aiohttp import ClientConnectionResetError, web
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import (
    CancelRequest,
    JobProgressEvent,
    JobRecord,
    JobStateEvent,
    now,
)
from gpusched.services.admission import params
from gpusched.services.admission.http import (
    EVENT_STREAM_HEADERS,
    KEEPALIVE_S,
    MAX_BUFFERED_PROGRESS,
    TENANT,
    decode_event,
    json_response,
    send_event,
    unavailable,
)
from gpusched.services.admission.ids import is_job_id
from gpusched.services.admission.metrics import Metrics
from gpusched.services.admission.problems import ProblemError
from gpusched.services.admission.state import JobIndex
from gpusched.services.admission.views import JobList, job_detail

log = structlog.get_logger("gpusched.admission")

LIST_PARAMETERS = frozenset({"state", "limit", "after"})

_json = msgspec.json.Encoder()


class JobParts(Protocol):
    """What the job routes read of the admission API (app.py's ``AdmissionApi``): its
    connection, stores and job index, its metrics, the open event streams (which the
    API ends when it shuts down), and its read of a job's record from the store."""

    nc: Client
    stores: Stores
    jobs: JobIndex
    metrics: Metrics
    _streams: set[asyncio.Queue[tuple[str, bytes]]]

    async def read_record(self, job_id: str) -> JobRecord | None: ...


class JobRoutes:
    def __init__(self, api: JobParts) -> None:
        self.api = api

    async def list_jobs(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        query = request.query
        for name in query:
            if name not in LIST_PARAMETERS:
                raise ProblemError(
                    400,
                    "invalid-parameter",
                    f"{name}: unknown query parameter; known: {', '.join(sorted(LIST_PARAMETERS))}",
                    field=name,
                )
        states = params.states(query.getall("state", []))
        limit = params.limit(query.get("limit"))
        after = query.get("after")
        if after is not None and not is_job_id(after):
            raise ProblemError(
                400, "invalid-parameter", "after: not a job id", field="after"
            )
        jobs, next_id = self.api.jobs.page(tenant, states=states, after=after, limit=limit)
        at = now()
        return json_response(JobList(jobs=[job_detail(j, at) for j in jobs], next=next_id))

    async def get_job(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        return json_response(job_detail(record, now()), 200)

    async def cancel_job(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        if record.state.terminal:
            raise ProblemError(
                409,
                "job-finished",
                f"job {record.id} has already finished ({record.state.value})",
            )
        await self.api.stores.js.publish(
            subjects.job_cancel(record.id),
            codec.encode(CancelRequest(record.id, record.tenant, now())),
            headers=codec.headers({"Nats-Msg-Id": f"{record.id}-cancel"}),
        )
        self.api.metrics.cancels_requested.inc()
        log.info("cancel requested", job_id=record.id, tenant=record.tenant)
        return json_response(job_detail(record, now()), 202)

    async def _owned(self, request: web.Request) -> JobRecord:
        job_id = request.match_info["id"]
        record = await self.api.read_record(job_id) if is_job_id(job_id) else None
        if record is None or record.tenant != request[TENANT]:
            raise ProblemError(404, "job-not-found", f"no job {job_id!r}")
        return record

    # ------------------------------------------------------------------ event stream

    async def job_events(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        if not is_job_id(job_id):
            raise ProblemError(404, "job-not-found", f"no job {job_id!r}")
        if not self.api.nc.is_connected:
            raise unavailable()
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

        async def on_state(msg: Msg) -> None:
            queue.put_nowait(("state", msg.data))

        async def on_progress(msg: Msg) -> None:
            if queue.qsize() < MAX_BUFFERED_PROGRESS and _from_its_sender(msg):
                queue.put_nowait(("progress", msg.data))

        # subscribe before reading the record, so no transition falls between the two
        subscriptions = [
            await self.api.nc.subscribe(subjects.job_state(job_id), cb=on_state),
            await self.api.nc.subscribe(
                subjects.job_progress_from_any_node(job_id), cb=on_progress
            ),
        ]
        self.api._streams.add(queue)
        self.api.metrics.event_streams.inc()
        try:
            record = await self._owned(request)
            response = web.StreamResponse(headers=EVENT_STREAM_HEADERS)
            await response.prepare(request)
            with contextlib.suppress(ConnectionResetError, ClientConnectionResetError):
                await self._stream(response, record, queue)
                await response.write_eof()
            return response
        finally:
            self.api._streams.discard(queue)
            self.api.metrics.event_streams.dec()
            for subscription in subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    async def _stream(
        self,
        response: web.StreamResponse,
        record: JobRecord,
        queue: asyncio.Queue[tuple[str, bytes]],
    ) -> None:
        await send_event(response, "job", _json.encode(job_detail(record, now())))
        if record.state.terminal:
            return
        seen_at = record.history[-1].at if record.history else record.submitted_at
        #: the node leading the job's run: the only one whose progress is the job's
        leader = record.placement[0].node if record.placement else None
        while True:
            try:
                kind, data = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                try:
                    current = await self.api.read_record(record.id)
                except (ProblemError, nats.errors.Error, TimeoutError):
                    current = None
                if current is not None and current.state.terminal:
                    await send_event(response, "job", _json.encode(job_detail(current, now())))
                    return
                await response.write(b": keep-alive\n\n")
                continue
            if kind == "stop":
                return
            if kind == "state":
                event = decode_event(data, JobStateEvent)
                # a transition the record already showed when the stream began
                if event is None or event.at < seen_at:
                    continue
                leader = event.placement[0].node if event.placement else None
                await send_event(response, "state", _json.encode(event))
                if event.state.terminal:
                    return
            else:
                progress = decode_event(data, JobProgressEvent)
                # its node is its sender's (_from_its_sender): another node's is dropped
                if progress is not None and progress.node == leader:
                    await send_event(response, "progress", _json.encode(progress))


def _from_its_sender(msg: Msg) -> bool:
    """Whether a progress event names the node and job its subject names: the subject
    says which node sent it, the payload only claims it."""
    event = decode_event(msg.data, JobProgressEvent)
    if event is None or not subjects.matches_sender(msg.subject, event.node, event.job_id):
        log.warning("progress event claiming another node or job dropped", subject=msg.subject)
        return False
    return True
