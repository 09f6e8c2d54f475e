"""The web dashboard at ``/`` and the data routes only it uses.

The page, its script and its style are package data (``services/admission/static``),
served without a token; every data route needs the bearer token like the rest of
``/v1`` (docs/dashboard.md):

- ``GET /v1/dashboard/scheduler``: the scheduler leader (from the lease) and what it
  says about itself (its status endpoint: policy, rounds, jobs, nodes);
- ``GET /v1/dashboard/submissions``: the tenant's submissions per minute over the last
  hour;
- ``GET /v1/dashboard/events``: a server-sent event stream of the tenant's job
  transitions and progress, a content-free hint when another tenant's job changes
  state (the GPUs it holds changed), and every scheduling round's counts.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import importlib.resources
import time
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec
import structlog
from aiohttp import ClientConnectionResetError, hdrs, web
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import DecisionSummary, JobProgressEvent, JobStateEvent
from gpusched.services.admission.http import (
    EVENT_STREAM_HEADERS,
    KEEPALIVE_S,
    MAX_BUFFERED_PROGRESS,
    PUBLIC_ROUTES,
    STOP_STREAM,
    TENANT,
    decode_event,
    json_response,
    send_event,
    unavailable,
)
from gpusched.services.admission.leader import leader_status
from gpusched.services.admission.metrics import Metrics
from gpusched.services.admission.state import JobIndex

log = structlog.get_logger("gpusched.admission")

#: the page and its assets, served to anyone (they hold no data)
ASSETS = {
    "/": ("index.html", "text/html"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard.css": ("dashboard.css", "text/css"),
}
#: the page loads nothing from elsewhere and runs no inline script
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    hdrs.CACHE_CONTROL: "no-cache",
}
#: submissions are counted in this many buckets of this many seconds, newest last
BUCKET_S = 60
BUCKETS = 60
ALL_DECISIONS = f"{subjects.PREFIX}.scheduler.*.decision"

_json = msgspec.json.Encoder()


class SchedulerView(msgspec.Struct, frozen=True, kw_only=True):
    #: the instance holding the scheduler lease (None: no leader right now)
    leader: str | None = None
    #: when the leader last renewed its lease (seconds since the epoch)
    lease_at: float | None = None
    policy: str | None = None
    #: what the leader's status endpoint answered (None: it did not answer in time)
    rounds: int | None = None
    jobs: int | None = None
    nodes: int | None = None
    last_decide_ms: float | None = None
    refused_decisions: int | None = None


class Submissions(msgspec.Struct, frozen=True, kw_only=True):
    bucket_s: int
    #: the end of the newest bucket (seconds since the epoch)
    end: float
    #: submissions per bucket, oldest first
    counts: list[int]
    total: int


class DecisionCounts(msgspec.Struct, frozen=True, kw_only=True):
    """A scheduling round as the page sees it: counts, no job ids."""

    instance: str
    policy: str
    at: float
    started: int
    preempted: int
    resized: int
    pending: int
    decide_ms: float


class _Submitted(msgspec.Struct, frozen=True):
    submitted_at: float = 0.0


_submitted_decoder = msgspec.msgpack.Decoder(_Submitted)


def count_per_bucket(
    times: Iterable[float], end: float, bucket_s: float = BUCKET_S, buckets: int = BUCKETS
) -> list[int]:
    """How many of ``times`` fall in each of ``buckets`` intervals of ``bucket_s``
    seconds ending at ``end`` (oldest first; an interval holds its start, not its end)."""
    counts = [0] * buckets
    start = end - bucket_s * buckets
    # compared with the bounds themselves, so rounding never moves a time across one
    inner = [end - bucket_s * (buckets - i) for i in range(1, buckets)]
    for at in times:
        if start <= at < end:
            counts[bisect.bisect_right(inner, at)] += 1
    return counts


def job_id_floor(at: float) -> str:
    """The lowest job id admission would create at ``at`` (ids start with ``j`` and the
    milliseconds in 12 hex digits, so they sort by time; services/admission/ids.py)."""
    return f"j{max(int(at * 1000), 0):012x}"


class AdmissionParts(Protocol):
    """What the dashboard reads of the admission API (app.py's ``AdmissionApi``): its
    connection, stores and job index, its metrics, and the open event streams, which
    the API ends when it shuts down."""

    nc: Client
    stores: Stores
    jobs: JobIndex
    metrics: Metrics
    _streams: set[asyncio.Queue[tuple[str, bytes]]]


class Dashboard:
    def __init__(self, api: AdmissionParts) -> None:
        if not set(ASSETS) <= PUBLIC_ROUTES:
            raise ValueError("the dashboard's page and assets must be public routes (http.py)")
        self.api = api
        static = importlib.resources.files("gpusched.services.admission") / "static"
        self._assets = {
            path: (static.joinpath(name).read_bytes(), content_type)
            for path, (name, content_type) in ASSETS.items()
        }

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for path in ASSETS:
            router.add_get(path, self.asset)
        router.add_get("/v1/dashboard/scheduler", self.scheduler)
        router.add_get("/v1/dashboard/submissions", self.submissions)
        router.add_get("/v1/dashboard/events", self.events, allow_head=False)

    async def asset(self, request: web.Request) -> web.Response:
        resource = request.match_info.route.resource
        body, content_type = self._assets[resource.canonical if resource else "/"]
        return web.Response(
            body=body,
            headers={hdrs.CONTENT_TYPE: f"{content_type}; charset=utf-8", **SECURITY_HEADERS},
        )

    # ------------------------------------------------------------------ data routes

    async def scheduler(self, request: web.Request) -> web.Response:
        if not self.api.nc.is_connected:
            raise unavailable()
        lease, status = await leader_status(self.api.nc, self.api.stores.lease)
        if lease is None:
            return json_response(SchedulerView())
        return json_response(
            SchedulerView(
                leader=lease.holder,
                lease_at=lease.at,
                policy=_typed(status.get("policy"), str),
                rounds=_typed(status.get("rounds"), int),
                jobs=_typed(status.get("jobs"), int),
                nodes=_typed(status.get("nodes"), int),
                last_decide_ms=_typed(status.get("last_decide_ms"), float),
                refused_decisions=_typed(status.get("refused_decisions"), int),
            )
        )

    async def submissions(self, request: web.Request) -> web.Response:
        end = time.time()
        start = end - BUCKET_S * BUCKETS
        times = (
            _submitted_decoder.decode(data).submitted_at
            for data in self.api.jobs.records_after(request[TENANT], job_id_floor(start))
        )
        counts = count_per_bucket(times, end)
        return json_response(
            Submissions(bucket_s=BUCKET_S, end=end, counts=counts, total=sum(counts))
        )

    # ------------------------------------------------------------------ event stream

    async def events(self, request: web.Request) -> web.StreamResponse:
        if not self.api.nc.is_connected:
            raise unavailable()
        tenant = request[TENANT]
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        #: job id -> is it this tenant's (a job never changes tenant)
        owned: dict[str, bool] = {}

        def own(job_id: str) -> bool:
            known = owned.get(job_id)
            if known is None:
                record = self.api.jobs.get(job_id)
                if record is None:
                    return False
                known = owned[job_id] = record.tenant == tenant
            return known

        def from_leader(msg: Msg, event: JobProgressEvent) -> bool:
            """Sent by the node leading the job's run, as its record says (the subject
            names the sender; the payload only claims it)."""
            record = self.api.jobs.get(event.job_id)
            leader = record.placement[0].node if record and record.placement else None
            return leader == event.node and subjects.matches_sender(
                msg.subject, event.node, event.job_id
            )

        async def on_state(msg: Msg) -> None:
            event = decode_event(msg.data, JobStateEvent)
            if event is None:
                return
            if own(event.job_id):
                queue.put_nowait(("state", _json.encode(event)))
            else:
                queue.put_nowait(("cluster", _json.encode({"at": event.at})))

        async def on_progress(msg: Msg) -> None:
            if queue.qsize() >= MAX_BUFFERED_PROGRESS:
                return
            event = decode_event(msg.data, JobProgressEvent)
            if event is not None and own(event.job_id) and from_leader(msg, event):
                queue.put_nowait(("progress", _json.encode(event)))

        async def on_decision(msg: Msg) -> None:
            event = decode_event(msg.data, DecisionSummary)
            if event is None:
                return
            counts = DecisionCounts(
                instance=msg.subject.split(".")[2], policy=event.policy, at=event.at,
                started=len(event.started), preempted=len(event.preempted),
                resized=len(event.resized), pending=event.pending, decide_ms=event.decide_ms,
            )
            queue.put_nowait(("decision", _json.encode(counts)))

        subscriptions = [
            await self.api.nc.subscribe(subjects.ALL_JOB_STATES, cb=on_state),
            await self.api.nc.subscribe(subjects.ALL_JOB_PROGRESS, cb=on_progress),
            await self.api.nc.subscribe(ALL_DECISIONS, cb=on_decision),
        ]
        # stopped with the others when the app shuts down
        self.api._streams.add(queue)
        self.api.metrics.event_streams.inc()
        try:
            response = web.StreamResponse(headers=EVENT_STREAM_HEADERS)
            await response.prepare(request)
            with contextlib.suppress(ConnectionResetError, ClientConnectionResetError):
                await response.write(b": connected\n\n")
                while True:
                    try:
                        kind, data = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except TimeoutError:
                        await response.write(b": keep-alive\n\n")
                        continue
                    if (kind, data) == STOP_STREAM:
                        break
                    await send_event(response, kind, data)
                await response.write_eof()
            return response
        finally:
            self.api._streams.discard(queue)
            self.api.metrics.event_streams.dec()
            for subscription in subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()


def _typed(value: Any, kind: type[Any]) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None
