"""A whole cluster in one process: nats-server, admission, scheduler, predictor, agents."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nats.js.api import KeyValueConfig, StorageType

from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsCluster, NatsServer
from gpusched.libs.common.natsauth import Credentials, nodeagent_user, write_private
from gpusched.services.admission.app import API
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.quota import QUOTA_BUCKET
from gpusched.services.admission.service import AdmissionService
from gpusched.services.cli.client import up_file
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.metrics import NodeCollector
from gpusched.services.nodeagent.metrics import metrics as nodeagent_metrics
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import SchedulerService
from gpusched.services.scheduler.metrics import MetricsServer, combined
from gpusched.services.scheduler.policies.sjf_bsbf import resident_cap_problem


@dataclass(frozen=True)
class UpConfig:
    nodes: int = 2
    gpus_per_node: int = 4
    gpu_model: str = "V100-32GB"
    policy: str = "sjf-bsbf"
    host: str = "127.0.0.1"
    port: int = 8080
    #: an existing NATS server; None starts an embedded one
    nats_url: str | None = None
    #: the embedded server admits only the services, each with its own user and
    #: permissions (docs/security.md); False: anyone reaching its port may do anything
    nats_auth: bool = True
    #: embedded NATS servers: 1, or a JetStream cluster of 3 (or more) where every
    #: stream and bucket has 3 replicas and losing one server loses nothing
    nats_cluster: int = 1
    #: JetStream storage, checkpoints and job logs
    state_dir: Path = field(default_factory=lambda: up_file().parent)
    jobs_mode: Literal["simulated", "process"] = "simulated"
    #: wall seconds per ground-truth second for simulated jobs
    time_scale: float = 1.0
    data_dir: Path | None = None
    token: str | None = None
    heartbeat_s: float = 1.0
    #: see SchedulerConfig.max_resident_slowdown
    max_resident_slowdown: float | None = None
    #: serve every service's Prometheus metrics at http://host:metrics_port/metrics
    #: (0: any free port; None: not at all); docs/metrics.md
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise ValueError(f"nodes: must be >= 0, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: must be >= 1, got {self.gpus_per_node}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale: must be > 0, got {self.time_scale}")
        if self.nats_cluster != 1 and self.nats_cluster < 3:
            raise ValueError(
                f"nats_cluster: 1 server, or a cluster of 3 or more, got {self.nats_cluster}"
            )
        problem = resident_cap_problem(self.max_resident_slowdown)
        if problem:
            raise ValueError(f"max_resident_slowdown: {problem}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535], got {self.metrics_port}")


class LocalCluster:
    """``async with LocalCluster(config) as cluster``: everything up; ``cluster.url``,
    ``cluster.token`` and ``cluster.nats_url`` say how to reach it. With an embedded,
    authenticated NATS, ``cluster.credentials`` holds every service's user and
    ``cluster.nats_url`` carries no password (``connect_url(user)`` does).
    ``cluster.metrics_url`` is where every service's metrics are served ('' when off)."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.token = config.token or secrets.token_urlsafe(24)
        self.nats_url = config.nats_url or ""
        self.url = ""
        self.metrics_url = ""
        self.nats: NatsServer | None = None
        self.nats_cluster: NatsCluster | None = None
        self.credentials: Credentials | None = None
        self.scheduler: SchedulerService | None = None
        self.agents: EmulatedCluster | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> LocalCluster:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            if config.nats_auth:
                self.credentials = Credentials.generate(node_names(config.nodes))
            users = list(self.credentials.users.values()) if self.credentials else None
            store = config.state_dir / "nats"
            if config.nats_cluster > 1:
                self.nats_cluster = NatsCluster(store, config.nats_cluster, users=users).start()
                self._stack.callback(self.nats_cluster.close)
                self.nats_url = self.nats_cluster.url
                await self._replicate(min(3, config.nats_cluster))
            else:
                self.nats = NatsServer(store_dir=store, users=users).start()
                self._stack.callback(self.nats.close)
                self.nats_url = self.nats.url
        url = self.connect_url
        predictor = await self._stack.enter_async_context(
            PredictorService(
                PredictorConfig(nats_url=url("predictor"), data_dir=config.data_dir)
            )
        )
        self.scheduler = await self._stack.enter_async_context(
            SchedulerService(
                SchedulerConfig(
                    nats_url=url("scheduler"), policy=config.policy, time_scale=config.time_scale,
                    data_dir=config.data_dir, max_resident_slowdown=config.max_resident_slowdown,
                    node_timeout_s=max(5.0, 5 * config.heartbeat_s),
                )
            )
        )
        if config.nodes:
            agents = EmulatedCluster.of(
                self.nats_url, config.nodes, config.gpus_per_node,
                gpu_model=config.gpu_model, work_dir=config.state_dir / "work",
                jobs_mode=config.jobs_mode, time_scale=config.time_scale,
                data_dir=config.data_dir, heartbeat_s=config.heartbeat_s,
                # each agent is its own NATS user, allowed only its own node's subjects
                share_connection=self.credentials is None,
            )
            agents.configs = [
                dataclasses.replace(c, nats_url=self.connect_url(nodeagent_user(c.name)))
                for c in agents.configs
            ]
            self.agents = await self._stack.enter_async_context(agents)
        admission = await self._stack.enter_async_context(
            AdmissionService(
                AdmissionConfig(
                    nats_url=url("admission"), host=config.host, port=config.port,
                    tokens={self.token: "default"}, data_dir=config.data_dir,
                )
            )
        )
        self.url = admission.url
        if config.metrics_port is not None:
            await self._serve_metrics(predictor, admission, config.host, config.metrics_port)
        path = up_file()
        # the token and the tap user's password: readable by this user only
        write_private(
            path,
            json.dumps({"url": self.url, "token": self.token, "nats_url": url("tap")}),
        )
        self._stack.callback(_forget, path, self.url)

    async def _replicate(self, replicas: int) -> None:
        """Create every stream and bucket with ``replicas`` copies before any service
        starts: the services open them as they find them."""
        async with connection(self.connect_url("scheduler"), "gpusched-up") as nc:
            stores = await Stores.open(nc, replicas=replicas)
            await stores.predictor_bucket()
        async with connection(self.connect_url("admission"), "gpusched-up") as nc:
            with contextlib.suppress(Exception):  # already there
                await nc.jetstream(timeout=5).key_value(QUOTA_BUCKET)
                return
            await nc.jetstream(timeout=5).create_key_value(
                KeyValueConfig(bucket=QUOTA_BUCKET, history=1, storage=StorageType.FILE,
                               replicas=replicas)
            )

    async def _serve_metrics(
        self, predictor: PredictorService, admission: AdmissionService, host: str, port: int
    ) -> None:
        """One exposition of every service's own registry (docs/metrics.md)."""
        assert self.scheduler is not None and admission.app is not None
        agents = self.agents
        registry = combined([
            admission.app[API].metrics.registry,
            self.scheduler.metrics.registry,
            predictor.metrics.registry,
            nodeagent_metrics(),
            NodeCollector(lambda: [a.view for a in agents.agents] if agents else []),
        ])
        server = await self._stack.enter_async_context(MetricsServer(registry, host, port))
        self.metrics_url = server.url

    def connect_url(self, user: str) -> str:
        """The NATS URL ``user`` connects with: its name and password in it when the
        embedded server authenticates, else the plain URL."""
        if self.credentials is None:
            return self.nats_url
        return self.credentials.url(user, self.nats_url)

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


def node_names(nodes: int) -> list[str]:
    """The names EmulatedCluster gives ``nodes`` agents."""
    return [f"node-{i}" for i in range(nodes)]


def _forget(path: Path, url: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("url") == url:
            path.unlink()
