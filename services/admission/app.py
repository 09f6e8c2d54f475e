"""The HTTP API: routes, the error middleware and the job submission path."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import msgspec
import nats.errors
import structlog
from aiohttp import ClientConnectionResetError, hdrs, web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import (
    CancelRequest,
    JobProgressEvent,
    JobRecord,
    JobSpec,
    JobState,
    JobStateEvent,
    JobSubmitted,
    SizeErrorReport,
    StateChange,
    now,
)
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.admission import history, params, problems, quota
from gpusched.services.admission.auth import Authenticator
from gpusched.services.admission.capacity import MemoryOf, capacity_warnings
from gpusched.services.admission.config import OPEN_TENANT, AdmissionConfig
from gpusched.services.admission.dashboard import Dashboard
from gpusched.services.admission.http import (
    EVENT_STREAM_HEADERS,
    KEEPALIVE_S,
    MAX_BUFFERED_PROGRESS,
    PUBLIC_ROUTES,
    TENANT,
)
from gpusched.services.admission.http import STOP_STREAM as _STOP_STREAM
from gpusched.services.admission.http import decode_event as _decode
from gpusched.services.admission.http import json_response as _json_response
from gpusched.services.admission.http import send_event as _send
from gpusched.services.admission.http import unavailable as _unavailable
from gpusched.services.admission.ids import idempotent_job_id, is_job_id, new_job_id
from gpusched.services.admission.leader import leader_status
from gpusched.services.admission.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gpusched.services.admission.metrics import UNMATCHED_ROUTE, Metrics
from gpusched.services.admission.openapi import build_openapi
from gpusched.services.admission.probe import StoreProbe, leader_problem, store_error
from gpusched.services.admission.problems import ProblemError
from gpusched.services.admission.quota import QuotaExceeded, Quotas
from gpusched.services.admission.quota import open_bucket as open_quota_bucket
from gpusched.services.admission.specs import ACCEPTED_TYPES, accepts, decode_spec, total_iterations
from gpusched.services.admission.state import JobIndex, KvMirror, NodeIndex, TelemetryCache
from gpusched.services.admission.views import (
    ClusterTotals,
    ClusterView,
    GpuView,
    Health,
    JobList,
    NodeView,
    job_detail,
    submitted_job,
)

log = structlog.get_logger("gpusched.admission")

PENDING_REASON = "waiting for the scheduler"
#: how long startup waits for the job mirror to hold every stored record
SYNC_TIMEOUT_S = 10.0
#: how long GET /v1/predictor/size-error waits for the predictor
PREDICTOR_TIMEOUT_S = 2.0
LIST_PARAMETERS = frozenset({"state", "limit", "after"})
#: JetStream's error codes for a store out of room (its limit, or its disk) and for a
#: compare-and-set that found a later revision
INSUFFICIENT_RESOURCES = 10023
WRONG_LAST_SEQUENCE = 10071
#: when to try again after the store refused a write: a full disk takes a while to free
STORE_RETRY_AFTER = "5"
#: the status (nginx's) of a request whose client closed its connection before the
#: answer; it never reaches the client, which is gone
CLIENT_CLOSED_REQUEST = 499

_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(
    config: AdmissionConfig,
    nc: Client,
    stores: Stores,
    *,
    models: Iterable[str] | None = None,
) -> web.Application:
    """The aiohttp application. ``models`` are the model names jobs may use (default:
    the performance model of ``config.data_dir``, whose GPU memory figures then say
    whether a GPU can hold a job). Its background work (the KV mirrors and the telemetry
    subscription) starts and stops with the app's runner."""
    memory_mb: MemoryOf | None = None
    if models is None:
        performance = load_performance_model(config.data_dir)
        models, memory_mb = performance.models(), performance.gpu_memory_mb
    api = AdmissionApi(config, nc, stores, models, memory_mb=memory_mb)
    app = web.Application(middlewares=[api.middleware], client_max_size=config.max_body_bytes)
    app[API] = api
    api.add_routes(app.router)
    Dashboard(api).add_routes(app.router)
    app.cleanup_ctx.append(api.background)
    app.on_shutdown.append(api.end_streams)
    return app


class AdmissionApi:
    def __init__(
        self, config: AdmissionConfig, nc: Client, stores: Stores, models: Iterable[str],
        *, memory_mb: MemoryOf | None = None,
    ) -> None:
        self.config = config
        #: a job's GPU memory (model, per-GPU batch) -> MiB, for the capacity warnings
        self.memory_mb = memory_mb
        self.nc = nc
        self.stores = stores
        self.models = frozenset(models)
        if not self.models:
            raise ValueError("models: at least one model name is needed")
        self.auth = Authenticator(config.tokens)
        self.metrics = Metrics()
        self.jobs = JobIndex(on_finished=self._job_finished)
        self.metrics.watch_tenants(
            [OPEN_TENANT] if config.open else config.tokens.values(), config.quotas,
            self.jobs.held_gpus,
        )
        self.nodes = NodeIndex()
        self.telemetry = TelemetryCache()
        self.job_mirror = KvMirror(nc, stores.jobs, self.jobs.apply, "jobs")
        self.node_mirror = KvMirror(nc, stores.nodes, self.nodes.apply, "nodes")
        #: the shared quota ledgers, opened when the app starts
        self._quotas: Quotas | None = None
        #: whether the store takes writes (GET /healthz), on the quota bucket
        self._probe: StoreProbe | None = None
        self._streams: set[asyncio.Queue[tuple[str, bytes]]] = set()
        self._openapi = _json.encode(build_openapi(self.models))

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/jobs", self.submit)
        router.add_get("/v1/jobs", self.list_jobs)
        router.add_get("/v1/jobs/{id}", self.get_job)
        router.add_delete("/v1/jobs/{id}", self.cancel_job)
        # a HEAD would hold the stream open with nothing to send
        router.add_get("/v1/jobs/{id}/events", self.job_events, allow_head=False)
        router.add_get("/v1/cluster", self.cluster)
        router.add_get("/v1/history/export", self.history_export)
        router.add_get("/v1/predictor/size-error", self.size_error)
        router.add_get("/healthz", self.health)
        router.add_get("/metrics", self.prometheus)
        router.add_get("/openapi.json", self.openapi)

    # ------------------------------------------------------------------ lifecycle

    @property
    def quotas(self) -> Quotas:
        if self._quotas is None:
            raise RuntimeError("the admission app has not started")
        return self._quotas

    async def background(self, app: web.Application) -> AsyncIterator[None]:
        if self.config.open:
            log.warning("no tokens configured: the API is open, every caller is 'default'")
        self._quotas = Quotas(await open_quota_bucket(self.stores.js), self.config.quotas)
        await self.telemetry.start(self.nc)
        tasks = [
            asyncio.create_task(self.quotas.run(), name="admission-quotas"),
            asyncio.create_task(self.job_mirror.run(), name="admission-jobs-mirror"),
            asyncio.create_task(self.node_mirror.run(), name="admission-nodes-mirror"),
            asyncio.create_task(self._reconcile_quotas(), name="admission-quota-reconcile"),
        ]
        try:
            try:
                await asyncio.wait_for(self.job_mirror.synced.wait(), SYNC_TIMEOUT_S)
            except TimeoutError:
                log.warning("job records not all loaded yet; listings may be incomplete")
            yield
        finally:
            await cancel_and_wait(*tasks)
            await self.telemetry.stop()

    def _job_finished(self, tenant: str, job_id: str) -> None:
        if self._quotas is not None:
            self._quotas.release(tenant, job_id)

    async def _reconcile_quotas(self) -> None:
        """Frees reservations of finished and abandoned submissions, now and then."""
        await self.job_mirror.synced.wait()
        while True:
            if self.nc.is_connected:
                try:
                    await self.quotas.reconcile(
                        self.jobs.status, self.jobs.unfinished, self._stored
                    )
                except (nats.errors.Error, TimeoutError) as exc:
                    log.debug("quota reconciliation failed", error=repr(exc))
            await asyncio.sleep(quota.RECONCILE_S)

    async def _stored(self, job_id: str) -> bool:
        try:
            entry = await self.stores.jobs.get(job_id)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        return entry.value is not None

    async def end_streams(self, app: web.Application) -> None:
        for queue in list(self._streams):
            queue.put_nowait(_STOP_STREAM)

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = UNMATCHED_ROUTE
        try:
            match = request.match_info
            if match.http_exception is not None:
                raise match.http_exception
            resource = match.route.resource
            route = resource.canonical if resource is not None else UNMATCHED_ROUTE
            if route not in PUBLIC_ROUTES:
                request[TENANT] = self.auth.tenant(request.headers.get(hdrs.AUTHORIZATION))
            response = await handler(request)
        except ProblemError as exc:
            response = problems.response(exc.problem(request.path), exc.headers)
        except web.HTTPException as exc:
            response = self._http_problem(request, exc)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("nats unavailable", path=request.path, error=repr(exc))
            unavailable = (
                _store_failed(exc, "nothing was changed, try again")
                if self.nc.is_connected else _unavailable()
            )
            response = problems.response(unavailable.problem(request.path), unavailable.headers)
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                # the client closed its connection (e.g. mid-body): nobody to answer, and
                # no fault of the service; not counted as a request answered
                log.info("client went away", method=request.method, path=request.path,
                         error=str(exc))
                return web.Response(status=CLIENT_CLOSED_REQUEST)
            log.exception("request failed", method=request.method, path=request.path)
            response = problems.response(
                ProblemError(500, "internal", "the server failed; see its log").problem(
                    request.path
                )
            )
        self.metrics.observe(
            request.method, route, response.status, time.perf_counter() - started
        )
        return response

    def _http_problem(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        headers = {
            name: value
            for name, value in exc.headers.items()
            if name not in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH)
        }
        if exc.status == 404:
            detail = f"no such resource: {request.path}"
            kind = "not-found"
        elif exc.status == 405:
            detail = f"{request.method} is not allowed here; allowed: {headers.get('Allow', '')}"
            kind = "method-not-allowed"
        elif exc.status == 413:
            detail = f"the body is larger than {self.config.max_body_bytes} bytes"
            kind = "payload-too-large"
        else:
            detail = exc.text or exc.reason
            kind = exc.reason.lower().replace(" ", "-")
        problem = ProblemError(exc.status, kind, detail).problem(request.path)
        return problems.response(problem, headers)

    # ------------------------------------------------------------------ submit

    async def submit(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        if not accepts(request.content_type):
            raise ProblemError(
                415,
                "unsupported-media-type",
                f"send the job spec as {' or '.join(ACCEPTED_TYPES)}, "
                f"not {request.content_type}",
                field="Content-Type",
                headers={"Accept-Post": ", ".join(ACCEPTED_TYPES)},
            )
        key = request.headers.get("Idempotency-Key")
        if key is not None and not params.valid_idempotency_key(key):
            raise ProblemError(
                400,
                "invalid-header",
                "Idempotency-Key: must be 1-255 printable ASCII characters, not starting or "
                "ending with a space",
                field="Idempotency-Key",
            )
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.config.max_body_bytes, actual_size=length
            )
        spec = decode_spec(await request.read(), request.content_type)
        iterations = total_iterations(spec, self.models)
        if not self.nc.is_connected:
            raise _unavailable()
        return await self._admit(tenant, spec, iterations, key)

    async def _check_priority_honoured(self) -> None:
        """A priority the leading scheduler's policy cannot honour is refused, not
        stored to be ignored; without a leader's answer the job is taken (a policy that
        honours it may lead by the time it runs)."""
        _, status = await leader_status(self.nc, self.stores.lease)
        if status.get("honours_priority") is False:
            raise _priority_refused(str(status.get("policy")))

    async def _admit(
        self, tenant: str, spec: JobSpec, iterations: int, key: str | None
    ) -> web.Response:
        job_id = idempotent_job_id(tenant, key) if key is not None else new_job_id()
        if key is not None and self.jobs.knows(job_id):
            stored = await self._read(job_id)
            if stored is not None:
                return await self._replay(stored, tenant, spec)
        _check_deadline(spec, now())
        if spec.priority:
            await self._check_priority_honoured()
        for attempt in range(3):
            if attempt and key is None:
                job_id = new_job_id()
            # True while this request may hold a reservation it has to give back
            owned = True
            try:
                try:
                    owned = await self.quotas.reserve(tenant, job_id, spec.gpus)
                except QuotaExceeded as exc:
                    owned = False
                    # the mirror may not have seen a job this key created a moment ago
                    stored = await self._read(job_id) if key is not None else None
                    if stored is None:
                        raise self._over_quota(tenant, exc.used, spec.gpus) from None
                    return await self._replay(stored, tenant, spec)
                at = now()
                record = JobRecord(
                    id=job_id,
                    tenant=tenant,
                    spec=spec,
                    total_iterations=iterations,
                    state=JobState.QUEUED,
                    submitted_at=at,
                    history=[StateChange(JobState.QUEUED, at, "submitted")],
                    pending_reason=PENDING_REASON,
                )
                data = codec.encode(record)
                try:
                    # indexed first: a record whose submission event the scheduler never
                    # takes (this instance dies before publishing, or the event of an
                    # attempt whose record was withdrawn is consumed before the retry's
                    # duplicate is dropped) is adopted by its periodic rescan
                    await self.stores.mark_live(job_id)
                    # ids are built subject-safe here; skip the client's regex check on
                    # the hot path
                    revision = await self.stores.jobs.create(job_id, data, validate_keys=False)
                except KeyWrongLastSequenceError:
                    if key is None:
                        continue
                    stored = await self._read(job_id)
                    if stored is None:
                        continue
                    # the job this key created holds the reservation while it runs
                    owned = owned and stored.state.terminal
                    return await self._replay(stored, tenant, spec)
                except (nats.errors.Error, TimeoutError) as exc:
                    # refused (a full store, a timeout): nothing of it may stay, its
                    # index entry, or a record a create that got no answer stored
                    owned = await self._withdraw(job_id, None, data)
                    raise self._refused(job_id, "record not stored", exc, owned) from None
                self.jobs.apply(revision, job_id, data)
                try:
                    await self._publish_submitted(record)
                except (nats.errors.Error, TimeoutError) as exc:
                    # a record that could not be withdrawn keeps its reservation: the
                    # scheduler adopts it, or reconciliation frees it once it is gone
                    owned = await self._withdraw(job_id, revision, data)
                    raise self._refused(job_id, "submission not published", exc, owned) from None
                owned = False
                break
            finally:
                if owned:
                    await self._give_back(tenant, job_id)
        else:
            raise ProblemError(503, "conflict-retry", "could not store the job; try again")
        self.metrics.submitted(tenant)
        log.info("job submitted", job_id=job_id, tenant=tenant, model=spec.model,
                 gpus=spec.gpus, iterations=iterations)
        return _json_response(
            submitted_job(job_detail(record, now()), self._warnings(spec)), 201,
            {hdrs.LOCATION: f"/v1/jobs/{job_id}"},
        )

    def _warnings(self, spec: JobSpec) -> list[str]:
        """What the submitter should know at once: that no node registered today can
        hold the job (it waits all the same; nodes may join later). Nothing before the
        node registry has been read."""
        if not self.node_mirror.synced.is_set():
            return []
        return capacity_warnings(spec, self.nodes.nodes(), self.memory_mb)

    def _over_quota(self, tenant: str, used: int, gpus: int) -> ProblemError:
        quota = self.quotas.limit(tenant)
        return ProblemError(
            403,
            "quota-exceeded",
            f"gpus: tenant {tenant!r} holds {used} GPUs in unfinished jobs; {gpus} more "
            f"would exceed its quota of {quota}",
            field="gpus",
            quota=quota,
        )

    async def _give_back(self, tenant: str, job_id: str) -> None:
        """Releases a failed submission's reservation. The release is queued even when
        this request is cancelled; it is awaited only while NATS is reachable, so a
        failure answer is not held up by it."""
        released = self.quotas.release(tenant, job_id)
        if released is None or not self.nc.is_connected:
            return
        try:
            await asyncio.shield(released)
        except Exception as exc:
            log.warning("quota reservation not released; reconciliation will",
                        job_id=job_id, error=repr(exc))

    async def _replay(self, stored: JobRecord, tenant: str, spec: JobSpec) -> web.Response:
        if stored.tenant != tenant:
            raise ProblemError(
                409, "conflict", "Idempotency-Key: names another job", field="Idempotency-Key"
            )
        if stored.spec != spec:
            raise ProblemError(
                422,
                "idempotency-key-reused",
                "Idempotency-Key: was used before for a different job spec",
                field="Idempotency-Key",
            )
        if stored.state is JobState.QUEUED:
            # covers a crash between storing the record and publishing the submission;
            # the stream drops the duplicate by its Nats-Msg-Id otherwise
            await self._publish_submitted(stored)
        self.metrics.idempotent_replays.inc()
        return _json_response(
            submitted_job(job_detail(stored, now()), self._warnings(stored.spec)),
            200,
            {hdrs.LOCATION: f"/v1/jobs/{stored.id}", "Idempotent-Replayed": "true"},
        )

    async def _publish_submitted(self, record: JobRecord) -> None:
        await self.stores.js.publish(
            subjects.job_submitted(record.id),
            codec.encode(JobSubmitted(record.id, record.submitted_at)),
            headers=codec.headers({"Nats-Msg-Id": record.id}),
        )

    async def _withdraw(self, job_id: str, revision: int | None, data: bytes) -> bool:
        """Removes what a refused submission stored, so a failed request leaves nothing
        behind: its record (of ``revision``; after a create that got no answer, the one
        holding exactly ``data``, if any) and its entry in the index of unfinished
        jobs. True when no record of it is left; the entry of a record that stays
        stays too, so the scheduler adopts it."""
        try:
            if revision is None:
                try:
                    entry = await self.stores.jobs.get(job_id)
                except (KeyNotFoundError, KeyDeletedError):
                    entry = None
                if entry is not None and entry.value != data:
                    return False  # another request's record under this Idempotency-Key
                revision = entry.revision if entry is not None else None
            if revision is not None and not await self._remove_record(job_id, revision):
                return False
        except Exception as exc:
            log.error("could not withdraw a refused job", job_id=job_id, error=repr(exc))
            return False
        try:
            await self.stores.unmark_live(job_id)
        except Exception as exc:  # the scheduler drops an entry without a record later
            log.warning("refused job left in the index of unfinished jobs", job_id=job_id,
                        error=repr(exc))
        return True

    async def _remove_record(self, job_id: str, revision: int) -> bool:
        """Deletes the record of ``revision``; where the store takes no delete marker (it
        is full), purges it, which needs no room. False when a later revision (the
        scheduler's) stays."""
        try:
            await self.stores.jobs.delete(job_id, last=revision)
        except (nats.errors.Error, TimeoutError) as exc:
            if getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE:
                return False
            log.warning("record not deleted; purging it", job_id=job_id, error=repr(exc))
            await self.stores.purge_job(job_id, revision)
            if await self._stored(job_id):
                return False
        self.jobs.apply(revision + 1, job_id, None)
        return True

    def _refused(
        self, job_id: str, what: str, exc: Exception, withdrawn: bool
    ) -> ProblemError:
        log.warning(what, job_id=job_id, record_withdrawn=withdrawn, error=repr(exc))
        if not self.nc.is_connected:
            return _unavailable()
        return _store_failed(exc, "nothing was stored, try again" if withdrawn else
                             "the job may be stored: retry with the same Idempotency-Key")

    # ------------------------------------------------------------------ read and cancel

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
        jobs, next_id = self.jobs.page(tenant, states=states, after=after, limit=limit)
        at = now()
        return _json_response(JobList(jobs=[job_detail(j, at) for j in jobs], next=next_id))

    async def get_job(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        return _json_response(job_detail(record, now()), 200)

    async def cancel_job(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        if record.state.terminal:
            raise ProblemError(
                409,
                "job-finished",
                f"job {record.id} has already finished ({record.state.value})",
            )
        await self.stores.js.publish(
            subjects.job_cancel(record.id),
            codec.encode(CancelRequest(record.id, record.tenant, now())),
            headers=codec.headers({"Nats-Msg-Id": f"{record.id}-cancel"}),
        )
        self.metrics.cancels_requested.inc()
        log.info("cancel requested", job_id=record.id, tenant=record.tenant)
        return _json_response(job_detail(record, now()), 202)

    async def _owned(self, request: web.Request) -> JobRecord:
        job_id = request.match_info["id"]
        record = await self._read(job_id) if is_job_id(job_id) else None
        if record is None or record.tenant != request[TENANT]:
            raise ProblemError(404, "job-not-found", f"no job {job_id!r}")
        return record

    async def _read(self, job_id: str) -> JobRecord | None:
        # a request made while disconnected would wait out the whole JetStream timeout
        if not self.nc.is_connected:
            raise _unavailable()
        try:
            entry = await self.stores.jobs.get(job_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        record = codec.decode(entry.value, JobRecord)
        self.jobs.apply(entry.revision or 0, job_id, entry.value)
        return record

    # ------------------------------------------------------------------ event stream

    async def job_events(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        if not is_job_id(job_id):
            raise ProblemError(404, "job-not-found", f"no job {job_id!r}")
        if not self.nc.is_connected:
            raise _unavailable()
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

        async def on_state(msg: Msg) -> None:
            queue.put_nowait(("state", msg.data))

        async def on_progress(msg: Msg) -> None:
            if queue.qsize() < MAX_BUFFERED_PROGRESS and _from_its_sender(msg):
                queue.put_nowait(("progress", msg.data))

        # subscribe before reading the record, so no transition falls between the two
        subscriptions = [
            await self.nc.subscribe(subjects.job_state(job_id), cb=on_state),
            await self.nc.subscribe(
                subjects.job_progress_from_any_node(job_id), cb=on_progress
            ),
        ]
        self._streams.add(queue)
        self.metrics.event_streams.inc()
        try:
            record = await self._owned(request)
            response = web.StreamResponse(headers=EVENT_STREAM_HEADERS)
            await response.prepare(request)
            with contextlib.suppress(ConnectionResetError, ClientConnectionResetError):
                await self._stream(response, record, queue)
                await response.write_eof()
            return response
        finally:
            self._streams.discard(queue)
            self.metrics.event_streams.dec()
            for subscription in subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    async def _stream(
        self,
        response: web.StreamResponse,
        record: JobRecord,
        queue: asyncio.Queue[tuple[str, bytes]],
    ) -> None:
        await _send(response, "job", _json.encode(job_detail(record, now())))
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
                    current = await self._read(record.id)
                except (ProblemError, nats.errors.Error, TimeoutError):
                    current = None
                if current is not None and current.state.terminal:
                    await _send(response, "job", _json.encode(job_detail(current, now())))
                    return
                await response.write(b": keep-alive\n\n")
                continue
            if kind == "stop":
                return
            if kind == "state":
                event = _decode(data, JobStateEvent)
                # a transition the record already showed when the stream began
                if event is None or event.at < seen_at:
                    continue
                leader = event.placement[0].node if event.placement else None
                await _send(response, "state", _json.encode(event))
                if event.state.terminal:
                    return
            else:
                progress = _decode(data, JobProgressEvent)
                # its node is its sender's (_from_its_sender): another node's is dropped
                if progress is not None and progress.node == leader:
                    await _send(response, "progress", _json.encode(progress))

    # ------------------------------------------------------------------ cluster, ops

    async def cluster(self, request: web.Request) -> web.Response:
        jobs_on: dict[tuple[str, int], list[str]] = {}
        for job_id, placements in self.jobs.placed():
            for placement in placements:
                for index in placement.gpus:
                    jobs_on.setdefault((placement.node, index), []).append(job_id)
        views: list[NodeView] = []
        total = busy = 0
        utils: list[float] = []
        for node in self.nodes.nodes():
            sample = self.telemetry.latest(node.name)
            by_index = {gpu.index: gpu for gpu in sample.gpus} if sample is not None else {}
            gpus = []
            for gpu in node.gpus:
                on_gpu = sorted(jobs_on.get((node.name, gpu.index), []))
                telemetry = by_index.get(gpu.index)
                total += 1
                busy += bool(on_gpu)
                if telemetry is not None:
                    utils.append(telemetry.util)
                gpus.append(
                    GpuView(
                        index=gpu.index,
                        uuid=gpu.uuid,
                        model=gpu.model,
                        memory_mb=gpu.memory_mb,
                        jobs=on_gpu,
                        telemetry=telemetry,
                    )
                )
            views.append(
                NodeView(
                    name=node.name,
                    cpus=node.cpus,
                    host_mem_gb=node.host_mem_gb,
                    net_gbps=node.net_gbps,
                    emulated=node.emulated,
                    started_at=node.started_at,
                    gpus=gpus,
                    telemetry_at=sample.at if sample is not None else None,
                )
            )
        totals = ClusterTotals(
            nodes=len(views),
            gpus=total,
            busy_gpus=busy,
            utilisation=busy / total if total else 0.0,
            mean_gpu_util=sum(utils) / len(utils) if utils else None,
            window_gpu_util=self.telemetry.window_util(time.time()),
            util_window_s=self.telemetry.window_s,
        )
        return _json_response(ClusterView(nodes=views, totals=totals))

    async def history_export(self, request: web.Request) -> web.Response:
        """The finished jobs of a window of submission times as a native trace, and the
        cluster's shape (history.py): the tenant's jobs, or every tenant's for an
        operator's token."""
        tenant = request[TENANT]
        since, until = history.window(request.query)
        everyone = tenant in self.config.operators
        # decoded and chosen in one go: no other request changes the mirror meanwhile
        records = [
            codec.decode(data, JobRecord)
            for data in self.jobs.records(None if everyone else [tenant])
        ]
        export = history.export(records, self.nodes.nodes(), since, until,
                                all_tenants=everyone, tenant=tenant)
        return _json_response(export)

    async def size_error(self, request: web.Request) -> web.Response:
        """The predictor's size error figures (every tenant's finished jobs together)."""
        try:
            reply = await self.nc.request(
                subjects.PREDICT_SIZE_ERROR, b"", timeout=PREDICTOR_TIMEOUT_S,
                headers=codec.headers(),
            )  # fmt: skip
            report = codec.decode(reply.data, SizeErrorReport)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
            log.debug("no size error from the predictor", error=repr(exc))
            raise ProblemError(
                503, "predictor-unavailable", "no predictor answered; try again",
                headers={hdrs.RETRY_AFTER: "1"},
            ) from None  # fmt: skip
        return _json_response(report)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the cluster can take and schedule jobs; 503 with what stops it:
        NATS unreachable (a problem), or the store takes no writes or no scheduler leads
        (``status`` degraded, the reasons in ``problems``)."""
        if not self.nc.is_connected:
            raise _unavailable()
        if self._probe is None:
            self._probe = StoreProbe(self.quotas.kv)
        found = await asyncio.gather(self._probe.problem(), leader_problem(self.stores.lease))
        reasons = [problem for problem in found if problem]
        if reasons:
            return _json_response(Health(status="degraded", problems=reasons), 503,
                                  {hdrs.RETRY_AFTER: STORE_RETRY_AFTER})
        return _json_response(Health(status="ok"))

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={hdrs.CONTENT_TYPE: METRICS_CONTENT_TYPE}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


API = web.AppKey("api", AdmissionApi)


def _priority_refused(policy: str) -> ProblemError:
    return ProblemError(
        422,
        "invalid-field",
        f"priority: the scheduler's policy {policy} does not honour priorities (it re-plans "
        "every job's size); submit with priority 0 or run a policy that orders by it",
        field="priority",
    )


def _store_failed(exc: Exception, outcome: str) -> ProblemError:
    """The 503 of a NATS call that failed while connected: the store is full, did not
    answer, or refused the write; ``outcome`` says what became of the request."""
    if getattr(exc, "err_code", None) == INSUFFICIENT_RESOURCES:
        kind, why = "store-full", "the job store is full (JetStream: insufficient resources)"
    elif isinstance(exc, TimeoutError):
        kind, why = "store-unavailable", (
            "the job store did not answer in time (its disk may be full, or a NATS server "
            "down)"
        )
    else:
        kind, why = "store-unwritable", f"the job store refused the write ({store_error(exc)})"
    return ProblemError(503, kind, f"{why}; {outcome}",
                        headers={hdrs.RETRY_AFTER: STORE_RETRY_AFTER})


def _check_deadline(spec: JobSpec, at: float) -> None:
    """A deadline already past cannot be met: refused, naming the field."""
    if spec.deadline is not None and spec.deadline <= at:
        raise ProblemError(
            422,
            "invalid-field",
            f"deadline: {spec.deadline:.0f} is in the past (now {at:.0f}, seconds since the "
            "epoch)",
            field="deadline",
        )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _from_its_sender(msg: Msg) -> bool:
    """Whether a progress event names the node and job its subject names: the subject
    says which node sent it, the payload only claims it."""
    event = _decode(msg.data, JobProgressEvent)
    if event is None or not subjects.matches_sender(msg.subject, event.node, event.job_id):
        log.warning("progress event claiming another node or job dropped", subject=msg.subject)
        return False
    return True
