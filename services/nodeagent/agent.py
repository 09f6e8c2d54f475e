"""The node agent: registers its node, runs what the scheduler starts there, reports.

One actor owns the node's state (the runs and what sits on each GPU). NATS callbacks,
timers and process runs only send it messages. Commands arrive by request/reply on
``gpusched.node.<name>.command``, the endpoint of the node's NATS micro service
(``command_service``); the agent publishes heartbeats, telemetry and progress
events, and every run of a leader part ends with exactly one JobExit stored in JetStream
(retried until the server takes it, deduplicated by its Nats-Msg-Id). It publishes under
its own node's subjects only, and creates, inspects and reads no stream: its NATS user may
not (libs/common/natsauth.py).

The agent keeps the lifecycle and dispatches what arrives; the rest lives beside it:
``node_runs`` (the runs and the commands that start, stop, resize and reallocate them,
with ``checks``, ``job_contract`` and ``resize``), ``registration`` (the node's entry in
the nodes bucket), ``simulation`` (simulated clocks), ``exits`` (the exit outbox) and
``reporting`` (heartbeats, telemetry, progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro.service import Service

from gpusched.libs.common.actor import Actor
from gpusched.libs.common.bus import connection
from gpusched.libs.common.schemas import (
    Command,
    CommandReply,
    ComputeProfile,
    ComputeProfileRequest,
    CpuProfile,
    NodeInfo,
    ReallocateJob,
    ResizeJob,
    StartJob,
    StopJob,
    StopReason,
    Telemetry,
)
from gpusched.libs.common.tasks import close_within
from gpusched.libs.core.groundtruth import ProfilePerformanceModel, load_performance_model
from gpusched.services.nodeagent.command_service import (
    serve_commands,
    serve_compute_profiles,
    serve_gpu_profiles,
    serve_profiles,
)
from gpusched.services.nodeagent.compute_profiling import measure_compute_profile
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.cores import machine_cores
from gpusched.services.nodeagent.cpu_profiling import ProfileSettings, measure_cpu_profile
from gpusched.services.nodeagent.exits import PUBLISH_TIMEOUT_S, ExitOutbox
from gpusched.services.nodeagent.gpu_profiling import GpuProfiling
from gpusched.services.nodeagent.gpus import GpuInventory, Nvml, discover
from gpusched.services.nodeagent.jobuser import start_warning
from gpusched.services.nodeagent.metrics import JobReading, NodeView, metrics
from gpusched.services.nodeagent.node_runs import NodeRuns
from gpusched.services.nodeagent.registration import Registration
from gpusched.services.nodeagent.reporting import Reporter
from gpusched.services.nodeagent.runs import (
    STDERR_DRAIN_S,
    ProcessProgress,
    ProcessStarted,
    RunEnd,
    RunEnded,
)
from gpusched.services.nodeagent.simulation import SimulatedClocks, SimulatedFinish

# ---- messages to the agent's actor --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Command:
    command: Command
    reply: asyncio.Future[CommandReply]


@dataclass(frozen=True, slots=True)
class _HeartbeatDue:
    pass


@dataclass(frozen=True, slots=True)
class _TelemetryDue:
    pass


@dataclass(frozen=True, slots=True)
class _ProgressDue:
    pass


@dataclass(frozen=True, slots=True)
class _Registered:
    ok: bool


@dataclass(frozen=True, slots=True)
class _StopAll:
    reason: StopReason
    done: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    reply: asyncio.Future[AgentSnapshot]


AgentMessage = (
    _Command | _HeartbeatDue | _TelemetryDue | _ProgressDue | SimulatedFinish | _Registered
    | _StopAll | _Snapshot | ProcessStarted | ProcessProgress | RunEnded
)


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    """What an agent holds at one moment (for status displays and tests)."""

    node: str
    #: job id -> run id of every run holding GPUs here
    running: dict[str, int]
    #: job ids whose JobExit JetStream has not stored yet
    undelivered_exits: tuple[str, ...]
    registered: bool
    #: job id -> the node's CPU cores allocated to its run (runs with an allocation only)
    cores: dict[str, tuple[int, ...]] = field(default_factory=dict)


class NodeAgent(Actor[AgentMessage]):
    """One node's agent. ``async with NodeAgent(config) as agent:`` connects, registers
    and serves until the block ends; then it preempts what runs (so the jobs checkpoint),
    delivers their exits, deregisters and drains.

    ``nc`` shares a connection (the caller then owns it) and ``truth`` shares the
    ground-truth model, for many agents in one process.
    """

    name = "nodeagent"

    def __init__(
        self,
        config: NodeAgentConfig,
        *,
        nc: Client | None = None,
        truth: ProfilePerformanceModel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.log = structlog.get_logger("gpusched.nodeagent").bind(node=config.name)
        self._nc = nc
        #: publishes into streams (exits, the registration); asks the server nothing else
        self._js: JetStreamContext | None = None
        self._truth = truth
        self._known_models: frozenset[str] = frozenset()
        self._inventory: GpuInventory | None = None
        self._info: NodeInfo | None = None
        self._stack = contextlib.AsyncExitStack()
        self._commands: Service | None = None
        #: set up once connected, the inventory known and the ground truth loaded
        self._clocks: SimulatedClocks | None = None
        self._reporter: Reporter | None = None
        self._outbox: ExitOutbox | None = None
        self._keeper: NodeRuns | None = None
        self._registration: Registration | None = None
        self._metrics = metrics()
        #: the GPU and job series this agent exports (Prometheus)
        self.view = NodeView(config.name)
        #: the machine's cores the node's (possibly emulated) cores map onto
        self._machine_cores = machine_cores()
        #: one CPU profile at a time: two would measure each other
        self._profiling = asyncio.Lock()

    # ---- public ---------------------------------------------------------------------
    @property
    def info(self) -> NodeInfo:
        """The registration (available once the agent is entered)."""
        if self._info is None:
            raise RuntimeError("the node agent has not started")
        return self._info

    async def snapshot(self) -> AgentSnapshot:
        reply: asyncio.Future[AgentSnapshot] = asyncio.get_running_loop().create_future()
        self.tell(_Snapshot(reply))
        return await reply

    @property
    def _reports(self) -> Reporter:
        assert self._reporter is not None, "the node agent has not started"
        return self._reporter

    @property
    def _exits(self) -> ExitOutbox:
        assert self._outbox is not None, "the node agent has not started"
        return self._outbox

    @property
    def _node_runs(self) -> NodeRuns:
        assert self._keeper is not None, "the node agent has not started"
        return self._keeper

    @property
    def _entry(self) -> Registration:
        assert self._registration is not None, "the node agent has not started"
        return self._registration

    # ---- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> NodeAgent:
        try:
            await self._open()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _open(self) -> None:
        config = self.config
        if self._nc is None:
            self._nc = await self._stack.enter_async_context(
                connection(config.nats_url, f"nodeagent-{config.name}")
            )
        self._js = self._nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        warning = start_warning(config.job_user)
        if warning:
            self.log.warning("jobs run as the agent's user", detail=warning)
        if self._truth is None:
            self._truth = await asyncio.to_thread(load_performance_model, config.data_dir)
        self._known_models = frozenset(self._truth.models())
        # NVML is initialised once for the agent's life and shut down with it
        nvml = await asyncio.to_thread(Nvml.open) if config.gpus is None else None
        if nvml is not None:
            self._stack.callback(nvml.close)
        readings = await asyncio.to_thread(nvml.read) if nvml is not None else None
        self._inventory = discover(
            config.name, config.gpus, config.gpu_model, config.emulated_gpu_mem_mb, readings
        )
        if self._inventory.emulated and nvml is not None:
            nvml.close()
            nvml = None
        self._info = NodeInfo(
            name=config.name,
            gpus=list(self._inventory.gpus),
            cpus=config.cpus,
            host_mem_gb=config.host_mem_gb,
            net_gbps=config.net_gbps,
            emulated=self._inventory.emulated,
            started_at=time.time(),
            time_scale=config.time_scale if config.jobs_mode == "simulated" else 1.0,
        )
        self._registration = Registration(self._js, config.name, self._info, self.log)
        self._clocks = SimulatedClocks(
            self._truth, self._known_models, config.time_scale, self.tell
        )
        self._reporter = Reporter(
            self._nc, config.name, config.time_scale, self._inventory, self._truth,
            self._known_models, self.log, self._metrics, nvml,
        )
        self._outbox = ExitOutbox(self._js, config.name, self.log, self._metrics)
        self._keeper = NodeRuns(
            config, self.log, self._metrics, self.view, self._inventory, self._known_models,
            self._machine_cores, self._clocks, self._reporter, self._outbox, self.tell,
        )  # fmt: skip
        await super().__aenter__()
        self._stack.push_async_callback(self._stop_actor)
        self._commands = await serve_commands(
            self._nc, config.name, self._answer, self._count_command
        )
        await serve_profiles(self._commands, config.name, self._measure_cpu_profile)
        await serve_compute_profiles(self._commands, config.name, self._measure_compute)
        gpu_profiling = GpuProfiling(
            self._nc, self._info, self._truth,
            lambda: [i for run in self._node_runs.runs.values() for i in run.start.gpus],
            self._profiling, self.log,
        )  # fmt: skip
        self._node_runs.gpu_profiling = gpu_profiling
        self._stack.push_async_callback(gpu_profiling.stop)
        await serve_gpu_profiles(self._commands, config.name, gpu_profiling.on_request)
        await self._nc.flush()
        self._entry.seen_reconnects = self._nc.stats["reconnects"]
        self._entry.registered = await self._entry.register()
        self.log.info(
            "node agent started",
            gpus=len(self._inventory.gpus),
            emulated=self._inventory.emulated,
            jobs_mode=config.jobs_mode,
            time_scale=config.time_scale,
            registered=self._entry.registered,
        )
        self.tell(_HeartbeatDue())
        self._tick(config.heartbeat_s, _HeartbeatDue)
        self._tick(config.telemetry_s, _TelemetryDue)
        self._tick(config.progress_s, _ProgressDue)

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._shutdown()
        finally:
            self.view.clear()
            await self._stack.aclose()

    def _export(self, sample: Telemetry) -> None:
        """The telemetry tick's GPU readings and the progress of the jobs led here, for
        Prometheus (services/nodeagent/metrics.py)."""
        assert self._inventory is not None
        jobs: dict[str, JobReading] = {}
        for job in sample.jobs:
            run = self._node_runs.runs.get(job.job_id)
            if run is not None and run.start.leader and run.kind != "held":
                jobs[job.job_id] = JobReading(
                    job.progress.iteration, run.start.total_iterations, sample.at
                )
        self.view.update(self._inventory.gpus, self._inventory.emulated, sample.gpus, jobs)

    async def _shutdown(self) -> None:
        if self._commands is not None:
            commands, self._commands = self._commands, None
            await close_within(commands.stop(), f"node {self.config.name}: command service stop")
        if self.running:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.tell(_StopAll("preempt", done))
            limit = self.config.preempt_grace_s + STDERR_DRAIN_S + 5.0
            try:
                await asyncio.wait_for(done, limit)
            except TimeoutError:
                self.log.error("runs did not stop in time", jobs=sorted(self._node_runs.runs))
            await self._stop_actor()
        if self._outbox is not None:
            await self._outbox.flush(self.config.exit_flush_s)
        if self._registration is not None:
            await self._registration.deregister()

    async def _stop_actor(self) -> None:
        if self.running:
            await Actor.__aexit__(self, None, None, None)
        # a run that outlived the shutdown limit still has an actor to wind down
        for run in list(self._node_runs.runs.values()):
            if run.process is not None:
                await run.process.__aexit__(None, None, None)

    def _tick(self, period_s: float, message: Callable[[], AgentMessage]) -> None:
        """Send ``message()`` every ``period_s`` at a fixed rate. Each node starts at its
        own phase, so that hundreds of agents in one process do not all fire at once."""
        phase = (zlib.crc32(self.config.name.encode()) % 1000) / 1000.0 * period_s

        async def ticks() -> None:
            loop = asyncio.get_running_loop()
            next_at = loop.time() + phase
            while True:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                self.tell(message())
                next_at += period_s
                if next_at < loop.time():  # fell behind: skip, do not burst
                    next_at = loop.time() + period_s

        self.spawn(ticks())

    # ---- registration ---------------------------------------------------------------
    async def _register_later(self) -> None:
        ok = False
        try:
            ok = await self._entry.register()
        finally:
            self.tell(_Registered(ok))

    def _check_registration(self) -> None:
        """Register again after a reconnect and until the first registration succeeds
        (``Registration.due``)."""
        assert self._nc is not None
        if self._entry.due(self._nc, self._node_runs.closing):
            self.spawn(self._register_later())

    # ---- commands -------------------------------------------------------------------
    async def _answer(self, command: Command) -> CommandReply:
        if not self.running:
            return CommandReply(False, f"node agent {self.config.name} is shutting down")
        future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self.tell(_Command(command, future))
        return await future

    async def _measure_cpu_profile(self, model: str) -> CpuProfile:
        """Synergy's optimistic profile of ``model`` on this node, with the real worker
        (beside the actor: it takes seconds, and runs go on meanwhile)."""
        settings = ProfileSettings(rounds=self.config.cpu_profile_rounds)
        async with self._profiling:
            self.log.info("measuring a CPU profile", model=model)
            profile = await measure_cpu_profile(
                model, self.info, self._machine_cores, settings
            )
        self.log.info(
            "measured a CPU profile", model=model,
            points=[(p.cpus, round(p.uncached_sample_s * 1e6)) for p in profile.points],
        )  # fmt: skip
        return profile

    async def _measure_compute(self, request: ComputeProfileRequest) -> ComputeProfile:
        """GENIE's profiling run of a model on this node (one measurement at a time, CPU
        profiles included), at the request's batch or the model's default."""
        assert self._truth is not None
        batch = request.batch_size
        if batch is None:
            batch = self._truth.default_batch_size(request.model)
        async with self._profiling:
            self.log.info("measuring a compute profile", model=request.model, batch=batch)
            profile = await measure_compute_profile(
                request, batch, self.info, self.config.advertise_host
            )
        self.log.info(
            "measured a compute profile", model=request.model, model_bytes=profile.model_bytes,
            points=[(p.batch_size, p.iteration_s) for p in profile.points],
        )  # fmt: skip
        return profile

    def _count_command(self, kind: str, reply: CommandReply) -> None:
        self._metrics.commands.labels(kind, "ok" if reply.ok else "refused").inc()

    async def handle(self, message: AgentMessage) -> None:
        match message:
            case _Command(command, reply):
                try:
                    match command:
                        case StartJob():
                            answer = await self._node_runs.start(command)
                        case StopJob():
                            answer = await self._node_runs.stop(command)
                        case ResizeJob():
                            answer = await self._node_runs.resize(command)
                        case ReallocateJob():
                            answer = self._node_runs.reallocate(command)
                except Exception as exc:
                    self.log.exception("command failed", job_id=command.job_id)
                    answer = CommandReply(False, f"node agent error: {exc!r}")
                if not reply.done():
                    reply.set_result(answer)
            case _HeartbeatDue():
                self._check_registration()
                await self._reports.heartbeat(self._node_runs.runs.values(), self._exits.exiting)
            case _TelemetryDue():
                self._export(await self._reports.telemetry(self._node_runs.runs.values()))
            case _ProgressDue():
                await self._reports.progress_events(self._node_runs.runs.values())
            case SimulatedFinish(job_id, run_id, version):
                run = self._node_runs.runs.get(job_id)
                if run is not None and run.run_id == run_id and run.version == version:
                    await self._node_runs.end(
                        run, RunEnd("succeeded", run.start.total_iterations, 0)
                    )
            case ProcessStarted(job_id, run_id, pid):
                run = self._node_runs.runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    run.pid = pid
                    run.log.info("process started", pid=pid)
            case ProcessProgress(job_id, run_id, progress, samples):
                run = self._node_runs.runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    run.progress = progress
                    run.samples.extend(samples)
            case RunEnded(job_id, run_id, end):
                run = self._node_runs.runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    await self._node_runs.end(run, end)
            case _Registered(ok):
                self._entry.written(ok)
            case _StopAll(reason, done):
                await self._node_runs.stop_all(reason, done)
            case _Snapshot(reply) if not reply.done():
                reply.set_result(
                    AgentSnapshot(
                        node=self.config.name,
                        running={r.job_id: r.run_id for r in self._node_runs.runs.values()},
                        undelivered_exits=self._exits.undelivered,
                        registered=self._entry.registered,
                        cores={
                            r.job_id: r.cores for r in self._node_runs.runs.values() if r.cores
                        },
                    )
                )
