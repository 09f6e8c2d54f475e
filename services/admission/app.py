"""The admission app: ``make_app`` builds the aiohttp application, and ``AdmissionApi``
holds what its parts share (config, connection, stores, the job and node mirrors,
telemetry, metrics, quota ledgers, open event streams), runs the background work, reads
a job's record from the store, and maps every route onto its handler. The handlers
live by concept: middleware.py (authentication, errors as problems, request metrics),
submission.py (``POST /v1/jobs``), jobs.py (reading, cancelling and following jobs),
ops.py (cluster, history export, size error, health, metrics, OpenAPI) and
dashboard.py (the dashboard)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import nats.errors
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobRecord
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.admission import quota
from gpusched.services.admission.auth import Authenticator
from gpusched.services.admission.capacity import MemoryOf
from gpusched.services.admission.config import OPEN_TENANT, AdmissionConfig
from gpusched.services.admission.dashboard import Dashboard
from gpusched.services.admission.http import STOP_STREAM, unavailable
from gpusched.services.admission.jobs import JobRoutes
from gpusched.services.admission.leader import LeaderPolicy
from gpusched.services.admission.metrics import Metrics
from gpusched.services.admission.middleware import ErrorMiddleware
from gpusched.services.admission.ops import OpsRoutes
from gpusched.services.admission.publisher import JetStreamWriter
from gpusched.services.admission.quota import Quotas
from gpusched.services.admission.quota import open_bucket as open_quota_bucket
from gpusched.services.admission.state import JobIndex, KvMirror, NodeIndex, TelemetryCache
from gpusched.services.admission.submission import Submissions

log = structlog.get_logger("gpusched.admission")

#: how long startup waits for the job mirror to hold every stored record
SYNC_TIMEOUT_S = 10.0


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
    app = web.Application(
        middlewares=[api.errors.middleware], client_max_size=config.max_body_bytes
    )
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
        #: the submission path's writes to the streams and buckets, started with the app
        self.writer = JetStreamWriter(nc)
        #: whether the leader honours priorities, asked once per leader term
        self.leader_policy = LeaderPolicy(nc, stores.lease)
        #: the shared quota ledgers, opened when the app starts
        self._quotas: Quotas | None = None
        self._streams: set[asyncio.Queue[tuple[str, bytes]]] = set()
        #: the handlers, by concept; each reads this API through a protocol of its own
        self.errors = ErrorMiddleware(self)
        self.submissions = Submissions(self)
        self.job_routes = JobRoutes(self)
        self.ops = OpsRoutes(self)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/jobs", self.submissions.submit)
        router.add_get("/v1/jobs", self.job_routes.list_jobs)
        router.add_get("/v1/jobs/{id}", self.job_routes.get_job)
        router.add_delete("/v1/jobs/{id}", self.job_routes.cancel_job)
        # a HEAD would hold the stream open with nothing to send
        router.add_get("/v1/jobs/{id}/events", self.job_routes.job_events, allow_head=False)
        router.add_get("/v1/cluster", self.ops.cluster)
        router.add_get("/v1/history/export", self.ops.history_export)
        router.add_get("/v1/predictor/size-error", self.ops.size_error)
        router.add_get("/healthz", self.ops.health)
        router.add_get("/metrics", self.ops.prometheus)
        router.add_get("/openapi.json", self.ops.openapi)

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
        await self.writer.__aenter__()
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
            await self.writer.__aexit__()
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
                        self.jobs.status, self.jobs.unfinished, self.is_stored
                    )
                except (nats.errors.Error, TimeoutError) as exc:
                    log.debug("quota reconciliation failed", error=repr(exc))
            await asyncio.sleep(quota.RECONCILE_S)

    async def is_stored(self, job_id: str) -> bool:
        """Whether the store holds a record of ``job_id`` (not deleted)."""
        try:
            entry = await self.stores.jobs.get(job_id)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        return entry.value is not None

    async def read_record(self, job_id: str) -> JobRecord | None:
        """The record of ``job_id`` as the store holds it now (None: no such job), also
        applied to the job mirror."""
        # a request made while disconnected would wait out the whole JetStream timeout
        if not self.nc.is_connected:
            raise unavailable()
        try:
            entry = await self.stores.jobs.get(job_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        record = codec.decode(entry.value, JobRecord)
        self.jobs.apply(entry.revision or 0, job_id, entry.value)
        return record

    async def end_streams(self, app: web.Application) -> None:
        for queue in list(self._streams):
            queue.put_nowait(STOP_STREAM)


API = web.AppKey("api", AdmissionApi)
