"""The API's routes beside the jobs: the cluster's nodes, GPUs and load
(``GET /v1/cluster``), the history export (``GET /v1/history/export``, built by
history.py), the predictor's size error (``GET /v1/predictor/size-error``), health
(``GET /healthz``), the Prometheus metrics (``GET /metrics``) and the OpenAPI document
(``GET /openapi.json``)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import msgspec
import nats.errors
import structlog
from aiohttp import hdrs, web
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobRecord, SizeErrorReport
from gpusched.services.admission import history
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.http import (
    STORE_RETRY_AFTER,
    TENANT,
    json_response,
    unavailable,
)
from gpusched.services.admission.leader import leader_status
from gpusched.services.admission.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gpusched.services.admission.metrics import Metrics
from gpusched.services.admission.openapi import build_openapi
from gpusched.services.admission.probe import StoreProbe, leader_problem
from gpusched.services.admission.problems import ProblemError
from gpusched.services.admission.quota import Quotas
from gpusched.services.admission.state import JobIndex, NodeIndex, TelemetryCache
from gpusched.services.admission.views import (
    ClusterTotals,
    ClusterView,
    GpuView,
    Health,
    NodeView,
)

log = structlog.get_logger("gpusched.admission")

#: how long GET /v1/predictor/size-error waits for the predictor
PREDICTOR_TIMEOUT_S = 2.0

_json = msgspec.json.Encoder()


class OpsParts(Protocol):
    """What these routes read of the admission API (app.py's ``AdmissionApi``): its
    config (the operators), the model names, the connection and stores, the job and
    node indexes, the telemetry, the metrics and the quota ledgers (whose bucket the
    health check's store probe writes to)."""

    config: AdmissionConfig
    models: frozenset[str]
    nc: Client
    stores: Stores
    jobs: JobIndex
    nodes: NodeIndex
    telemetry: TelemetryCache
    metrics: Metrics

    @property
    def quotas(self) -> Quotas: ...


class OpsRoutes:
    def __init__(self, api: OpsParts) -> None:
        self.api = api
        #: whether the store takes writes (GET /healthz), on the quota bucket
        self._probe: StoreProbe | None = None
        self._openapi = _json.encode(build_openapi(api.models))

    async def cluster(self, request: web.Request) -> web.Response:
        jobs_on: dict[tuple[str, int], list[str]] = {}
        for job_id, placements in self.api.jobs.placed():
            for placement in placements:
                for index in placement.gpus:
                    jobs_on.setdefault((placement.node, index), []).append(job_id)
        views: list[NodeView] = []
        total = busy = 0
        utils: list[float] = []
        for node in self.api.nodes.nodes():
            sample = self.api.telemetry.latest(node.name)
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
            window_gpu_util=self.api.telemetry.window_util(time.time()),
            util_window_s=self.api.telemetry.window_s,
        )
        return json_response(ClusterView(nodes=views, totals=totals))

    async def history_export(self, request: web.Request) -> web.Response:
        """The finished jobs of a window of submission times as a native trace, and the
        cluster's shape (history.py): the tenant's jobs, or every tenant's for an
        operator's token."""
        tenant = request[TENANT]
        since, until = history.window(request.query)
        everyone = tenant in self.api.config.operators
        # decoded and chosen in one go: no other request changes the mirror meanwhile
        records = [
            codec.decode(data, JobRecord)
            for data in self.api.jobs.records(None if everyone else [tenant])
        ]
        # the policy the leader runs now, named in the export (whatif's live row); none
        # where no leader answers
        _, status = await leader_status(self.api.nc, self.api.stores.lease)
        policy = status.get("policy")
        export = history.export(records, self.api.nodes.nodes(), since, until,
                                all_tenants=everyone, tenant=tenant,
                                policy=policy if isinstance(policy, str) else None)
        return json_response(export)

    async def size_error(self, request: web.Request) -> web.Response:
        """The predictor's size error figures (every tenant's finished jobs together)."""
        try:
            reply = await self.api.nc.request(
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
        return json_response(report)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the cluster can take and schedule jobs; 503 with what stops it:
        NATS unreachable (a problem), or the store takes no writes or no scheduler leads
        (``status`` degraded, the reasons in ``problems``)."""
        if not self.api.nc.is_connected:
            raise unavailable()
        if self._probe is None:
            self._probe = StoreProbe(self.api.quotas.kv)
        found = await asyncio.gather(
            self._probe.problem(), leader_problem(self.api.stores.lease)
        )
        reasons = [problem for problem in found if problem]
        if reasons:
            return json_response(Health(status="degraded", problems=reasons), 503,
                                 {hdrs.RETRY_AFTER: STORE_RETRY_AFTER})
        return json_response(Health(status="ok"))

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.api.metrics.render(), headers={hdrs.CONTENT_TYPE: METRICS_CONTENT_TYPE}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")
