"""A whole cluster in one process: nats-server, admission, scheduler, predictor, agents."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsCluster, NatsServer, watching_stores
from gpusched.libs.common.natsauth import Credentials, nodeagent_user, write_private
from gpusched.libs.common.schemas import JobRecord
from gpusched.services.admission.app import API
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.quota import QUOTA_BUCKET
from gpusched.services.admission.service import AdmissionService
from gpusched.services.cli.client import up_file
from gpusched.services.cli.join import Joins
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.config import (
    NodeAgentConfig,
    default_node_name,
    node_name_problem,
)
from gpusched.services.nodeagent.gpus import NvmlGpu, nvml_absence, read_nvml
from gpusched.services.nodeagent.jobuser import (
    job_user_problem,
    reachable_by_others,
    start_warning,
)
from gpusched.services.nodeagent.metrics import NodeCollector
from gpusched.services.nodeagent.metrics import metrics as nodeagent_metrics
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import SchedulerService
from gpusched.services.scheduler.live.metrics import MetricsServer, combined
from gpusched.services.scheduler.policies.sjf_bsbf import resident_cap_problem

#: what ``up`` writes in its state directory for the CLI (client.up_file says where the
#: CLI looks)
UP_FILE = "up.json"
#: where job directories go when jobs run as a user who cannot reach the state directory
SHARED_WORK_ROOT = Path("/var/lib/gpusched")
#: emulated cluster of ``gpusched up`` on a machine without NVML GPUs
DEFAULT_EMULATED_NODES = 2
DEFAULT_EMULATED_GPUS_PER_NODE = 4


@dataclass(frozen=True)
class UpConfig:
    #: emulated node agents (None: 2 when emulating, none beside a real GPU node; 0: no
    #: local node agent at all, only nodes that join)
    nodes: int | None = None
    #: emulated GPUs per node: a number emulates even where real GPUs exist; None
    #: uses the GPUs NVML finds (one node agent over them), else emulates 4 per node
    gpus_per_node: int | None = None
    gpu_model: str = "V100-32GB"
    policy: str = "auto"
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
    #: where the embedded NATS server listens ("0.0.0.0": nodes on other machines may
    #: join) and its port (0: any free port)
    nats_host: str = "127.0.0.1"
    nats_port: int = 0
    #: node names admitted to join from other machines: each gets a NATS user of its own
    #: (``gpusched node add NAME`` adds more while the cluster runs)
    join: tuple[str, ...] = ()
    #: JetStream storage, checkpoints and job logs
    state_dir: Path = field(default_factory=lambda: up_file().parent)
    #: forget the jobs and the store of an earlier run in ``state_dir`` first
    fresh: bool = False
    #: who job processes run as (services/nodeagent/jobuser.py): "auto" is what the
    #: command line gives; "self" (the default here) runs them as this process's user
    job_user: str = "self"
    #: None: real torch processes on real GPUs, simulated jobs on emulated ones
    jobs_mode: Literal["simulated", "process"] | None = None
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
        if self.nodes is not None and self.nodes < 0:
            raise ValueError(f"nodes: must be >= 0, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(
                f"--emulate-gpus: emulated GPUs per node must be >= 1, got {self.gpus_per_node}"
            )
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
        if not 0 <= self.nats_port <= 65535:
            raise ValueError(f"nats_port: must be in [0, 65535], got {self.nats_port}")
        problem = job_user_problem(self.job_user)
        if problem:
            raise ValueError(problem)
        for name in self.join:
            problem = node_name_problem(name)
            if problem:
                raise ValueError(f"join: {problem}")
        if len(set(self.join)) != len(self.join):
            raise ValueError(f"join: a node name is given twice in {list(self.join)}")
        if self.join and (self.nats_url or not self.nats_auth):
            raise ValueError(
                "join: joining needs the embedded NATS server with its users "
                "(no --nats-url, auth on)"
            )

    @property
    def emulating(self) -> bool:
        """Emulation asked for in so many words (a GPU count or a node count)."""
        return self.gpus_per_node is not None or self.nodes is not None


@dataclass(frozen=True)
class NodePlan:
    """Which node agents ``up`` starts on this machine, and why, in words."""

    #: the GPUs NVML found, for one node agent over them (empty: emulated or none)
    real_gpus: tuple[NvmlGpu, ...]
    real_node: str
    emulated_nodes: int
    emulated_gpus_per_node: int
    jobs_mode: Literal["simulated", "process"]
    why: str

    @property
    def node_names(self) -> list[str]:
        if self.real_gpus:
            return [self.real_node]
        return node_names(self.emulated_nodes)

    def banner(self, policy: str) -> str:
        jobs = "real torch processes" if self.jobs_mode == "process" else "simulated jobs"
        if self.real_gpus:
            kinds = sorted({g.name for g in self.real_gpus})
            count = len(self.real_gpus)
            return (f"gpusched is up: node {self.real_node} with {count} real "
                    f"GPU{'s' if count != 1 else ''} ({', '.join(kinds)}), {jobs}, "
                    f"policy {policy}")
        if not self.emulated_nodes:
            return f"gpusched is up: no local node agent, policy {policy}"
        nodes = self.emulated_nodes
        return (f"gpusched is up: {nodes} emulated node{'s' if nodes != 1 else ''} x "
                f"{self.emulated_gpus_per_node} GPUs, {jobs}, policy {policy}")


def plan_nodes(config: UpConfig, nvml: list[NvmlGpu] | None, absence: str) -> NodePlan:
    """Real GPUs where NVML found some and emulation was not asked for; else emulated
    ones, saying why. ``absence`` says why NVML found none."""
    real = () if config.emulating or config.nats_url else tuple(nvml or ())
    if real:
        return NodePlan(
            real_gpus=real, real_node=default_node_name(), emulated_nodes=0,
            emulated_gpus_per_node=0, jobs_mode=config.jobs_mode or "process",
            why="NVML found the GPUs; --emulate-gpus N emulates instead",
        )
    nodes = DEFAULT_EMULATED_NODES if config.nodes is None else config.nodes
    per_node = config.gpus_per_node or DEFAULT_EMULATED_GPUS_PER_NODE
    if config.emulating:
        why = "emulated GPUs, as asked"
    else:
        why = (f"emulated GPUs: {absence}; --emulate-gpus N and --nodes N choose "
               "their number")
    return NodePlan(
        real_gpus=(), real_node="", emulated_nodes=nodes, emulated_gpus_per_node=per_node,
        jobs_mode=config.jobs_mode or "simulated", why=why,
    )


def detect_nodes(config: UpConfig) -> NodePlan:
    """:func:`plan_nodes` on this machine's NVML (blocking)."""
    if config.emulating:
        return plan_nodes(config, None, "")
    nvml = read_nvml()
    return plan_nodes(config, nvml, "" if nvml else nvml_absence())


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
        #: the node agent over this machine's real GPUs
        self.gpu_agent: NodeAgent | None = None
        self.plan: NodePlan | None = None
        #: jobs of an earlier run in state_dir that were not finished when this one began
        self.resumed_jobs = 0
        #: node name -> the command a machine runs to join (``join`` and earlier ones)
        self.join_commands: dict[str, str] = {}
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
        if config.fresh:
            forget_state(config.state_dir, self.work_dir)
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.plan = plan = await asyncio.to_thread(detect_nodes, config)
        if not self.nats_url:
            await self._start_nats(plan)
        url = self.connect_url
        self.resumed_jobs = await unfinished_jobs(url("scheduler"))
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
        await self._start_nodes(plan)
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
        state_dir = config.state_dir.resolve()
        path = state_dir / UP_FILE
        # the token and the tap user's password: readable by this user only
        write_private(
            path,
            json.dumps({"url": self.url, "token": self.token, "nats_url": url("tap"),
                        "state_dir": str(state_dir)}),
        )
        self._stack.callback(_forget, path, self.url)
        pointer = up_file()
        if pointer.resolve() != path:
            # where the CLI looks: which state directory holds this cluster's up.json
            write_private(pointer, json.dumps({"state_dir": str(state_dir)}))
            self._stack.callback(_forget_pointer, pointer, str(state_dir))

    async def _start_nats(self, plan: NodePlan) -> None:
        config = self.config
        store = config.state_dir / "nats"
        joins = Joins(config.state_dir)
        if config.nats_auth:
            joined = joins.admit(config.join, taken=plan.node_names)
            self.credentials = Credentials.generate(plan.node_names).with_nodes(joined)
        users = list(self.credentials.users.values()) if self.credentials else None
        if config.nats_cluster > 1:
            self.nats_cluster = NatsCluster(
                store, config.nats_cluster, host=config.nats_host, users=users
            ).start()
            self._stack.callback(self.nats_cluster.close)
            servers = self.nats_cluster.servers
            self.nats_url = self.nats_cluster.url
            await self._replicate(min(3, config.nats_cluster))
        else:
            self.nats = NatsServer(
                store_dir=store, users=users, host=config.nats_host, port=config.nats_port
            ).start()
            self._stack.callback(self.nats.close)
            servers = [self.nats]
        # a server whose store write failed (a full disk) restarts once there is room
        await self._stack.enter_async_context(watching_stores(servers))
        self.nats_url = ",".join(s.url for s in servers)
        if self.credentials is not None:
            joins.publish(self.credentials, servers, self.public_nats_url)
            self._stack.callback(joins.withdraw)
            self.join_commands = {
                node: joins.join_command(node, self.credentials, self.public_nats_url)
                for node in sorted(joins.nodes())
            }

    @property
    def public_nats_url(self) -> str:
        """The NATS URL as another machine would write it: a wildcard listen address
        becomes this host's name."""
        if self.config.nats_host not in ("0.0.0.0", "::", ""):
            return self.nats_url
        host = socket.getfqdn()
        return ",".join(
            u.replace(f"//{self.config.nats_host}:", f"//{host}:") for u in
            self.nats_url.split(",")
        )

    async def _start_nodes(self, plan: NodePlan) -> None:
        config = self.config
        if self.switches_users:
            make_passable(self.work_dir, config.state_dir)
        common: dict[str, Any] = dict(
            work_dir=self.work_dir, jobs_mode=plan.jobs_mode,
            time_scale=config.time_scale, data_dir=config.data_dir,
            heartbeat_s=config.heartbeat_s, job_user=config.job_user,
        )
        if plan.real_gpus:
            node = plan.real_node
            agent_config = NodeAgentConfig(
                nats_url=self.connect_url(nodeagent_user(node)), name=node, gpus=None,
                advertise_host="127.0.0.1", **common,
            )
            self.gpu_agent = await self._stack.enter_async_context(NodeAgent(agent_config))
            return
        if not plan.emulated_nodes:
            return
        agents = EmulatedCluster.of(
            self.nats_url, plan.emulated_nodes, plan.emulated_gpus_per_node,
            gpu_model=config.gpu_model,
            # each agent is its own NATS user, allowed only its own node's subjects
            share_connection=self.credentials is None, **common,
        )
        agents.configs = [
            dataclasses.replace(c, nats_url=self.connect_url(nodeagent_user(c.name)))
            for c in agents.configs
        ]
        self.agents = await self._stack.enter_async_context(agents)

    @property
    def switches_users(self) -> bool:
        """Whether job processes run as a user of their own (jobuser.py)."""
        return not start_warning(self.config.job_user)

    @property
    def work_dir(self) -> Path:
        """Where jobs get their directories: in the state directory, unless jobs run as
        a user of their own who cannot reach it (a state directory under root's home),
        then under /var/lib/gpusched, one folder per state directory."""
        inside = self.config.state_dir / "work"
        if not self.switches_users or reachable_by_others(self.config.state_dir):
            return inside
        tag = hashlib.sha256(str(self.config.state_dir.resolve()).encode()).hexdigest()[:12]
        return SHARED_WORK_ROOT / tag / "work"

    @property
    def node_agents(self) -> list[NodeAgent]:
        """Every node agent this process runs."""
        if self.gpu_agent is not None:
            return [self.gpu_agent]
        return list(self.agents.agents) if self.agents else []

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
        registry = combined([
            admission.app[API].metrics.registry,
            self.scheduler.metrics.registry,
            predictor.metrics.registry,
            nodeagent_metrics(),
            NodeCollector(lambda: [a.view for a in self.node_agents]),
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


def make_passable(work_dir: Path, state_dir: Path) -> None:
    """Let job users pass through to their directories under ``work_dir`` (others may
    enter, not list): ``work_dir`` and the folders between it and the state directory
    or the shared root."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for folder in [work_dir, *work_dir.parents]:
        folder.chmod(folder.stat().st_mode | 0o111)
        if folder in (state_dir, SHARED_WORK_ROOT) or folder == folder.parent:
            break


def forget_state(state_dir: Path, work_dir: Path | None = None) -> None:
    """Remove what an earlier ``up`` left in ``state_dir``: its JetStream store (every
    job and record), checkpoints and job logs (in ``work_dir`` when elsewhere). Nothing
    else there is touched."""
    for part in ("nats", "work"):
        shutil.rmtree(state_dir / part, ignore_errors=True)
    if work_dir is not None:
        shutil.rmtree(work_dir, ignore_errors=True)


async def unfinished_jobs(nats_url: str) -> int:
    """How many stored jobs are not finished: an earlier run's, which this one resumes."""
    async with connection(nats_url, "gpusched-up") as nc:
        stores = await Stores.open(nc)
        count = 0
        for job_id in await stores.live_job_ids():
            with contextlib.suppress(KeyNotFoundError):
                entry = await stores.jobs.get(job_id)
                if entry.value and not codec.decode(entry.value, JobRecord).state.terminal:
                    count += 1
        return count


def _forget(path: Path, url: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(path.read_text()).get("url") == url:
            path.unlink()


def _forget_pointer(path: Path, state_dir: str) -> None:
    """Remove the pointer to ``state_dir``, unless another ``up`` wrote its own since."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        saved = json.loads(path.read_text())
        if "url" not in saved and saved.get("state_dir") == state_dir:
            path.unlink()
