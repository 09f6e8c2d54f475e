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
``checks`` (can a start run here, as what), ``simulation`` (simulated clocks),
``job_contract`` (what a process run is given), ``resize``, ``exits`` (the exit outbox)
and ``reporting`` (heartbeats, telemetry, progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro.service import Service

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.actor import Actor
from gpusched.libs.common.bus import connection
from gpusched.libs.common.embedded import free_port
from gpusched.libs.common.schemas import (
    Command,
    CommandReply,
    ComputeProfile,
    ComputeProfileRequest,
    CpuProfile,
    NodeInfo,
    Progress,
    ReallocateJob,
    ResizeJob,
    StartJob,
    StopJob,
    StopReason,
    Telemetry,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel, load_performance_model
from gpusched.services.nodeagent.checks import run_kind, start_problem
from gpusched.services.nodeagent.command_service import (
    serve_commands,
    serve_compute_profiles,
    serve_gpu_profiles,
    serve_profiles,
)
from gpusched.services.nodeagent.compute_profiling import measure_compute_profile
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.cores import machine_cores, pick_cores, real_cores
from gpusched.services.nodeagent.cpu_profiling import ProfileSettings, measure_cpu_profile
from gpusched.services.nodeagent.exits import PUBLISH_TIMEOUT_S, ExitOutbox, job_exit
from gpusched.services.nodeagent.gpu_profiling import GpuProfiling
from gpusched.services.nodeagent.gpus import GpuInventory, Nvml, discover
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.nodeagent.jobuser import JobUser, resolve_job_user, start_warning
from gpusched.services.nodeagent.metrics import JobReading, NodeView, metrics
from gpusched.services.nodeagent.reporting import Reporter
from gpusched.services.nodeagent.residents import Run, RunKind, co_runners, cores_taken
from gpusched.services.nodeagent.resize import answer_without_resizing, resize_problem, resized
from gpusched.services.nodeagent.runs import (
    STDERR_DRAIN_S,
    ProcessProgress,
    ProcessRun,
    ProcessStarted,
    ReallocateRun,
    RunEnd,
    RunEnded,
    StopRun,
)
from gpusched.services.nodeagent.simulation import SimulatedClocks, SimulatedFinish

#: (job, run) pairs remembered after they end, so that a retried start does not rerun them
REMEMBERED_RUNS = 4096


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
        self._runs: dict[str, Run] = {}
        self._ended: OrderedDict[tuple[str, int], None] = OrderedDict()
        #: set up once connected, the inventory known and the ground truth loaded
        self._clocks: SimulatedClocks | None = None
        self._reporter: Reporter | None = None
        self._outbox: ExitOutbox | None = None
        self._registered = False
        self._registering = False
        self._seen_reconnects = 0
        self._closing = False
        self._stopped_all: asyncio.Future[None] | None = None
        self._metrics = metrics()
        #: the GPU and job series this agent exports (Prometheus)
        self.view = NodeView(config.name)
        #: the machine's cores the node's (possibly emulated) cores map onto
        self._machine_cores = machine_cores()
        #: one CPU profile at a time: two would measure each other
        self._profiling = asyncio.Lock()
        #: who job processes run as (None: the agent's own user; jobuser.py)
        self._job_user: JobUser | None = None
        self._job_user_known = False
        #: the measured profile of the node's GPU type (services/nodeagent/gpu_profiling.py)
        self._gpu_profiling: GpuProfiling | None = None

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
    def _simulation(self) -> SimulatedClocks:
        assert self._clocks is not None, "the node agent has not started"
        return self._clocks

    @property
    def _reports(self) -> Reporter:
        assert self._reporter is not None, "the node agent has not started"
        return self._reporter

    @property
    def _exits(self) -> ExitOutbox:
        assert self._outbox is not None, "the node agent has not started"
        return self._outbox

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
        )
        self._clocks = SimulatedClocks(
            self._truth, self._known_models, config.time_scale, self.tell
        )
        self._reporter = Reporter(
            self._nc, config.name, config.time_scale, self._inventory, self._truth,
            self._known_models, self.log, self._metrics, nvml,
        )
        self._outbox = ExitOutbox(self._js, config.name, self.log, self._metrics)
        await super().__aenter__()
        self._stack.push_async_callback(self._stop_actor)
        self._commands = await serve_commands(
            self._nc, config.name, self._answer, self._count_command
        )
        await serve_profiles(self._commands, config.name, self._measure_cpu_profile)
        await serve_compute_profiles(self._commands, config.name, self._measure_compute)
        self._gpu_profiling = GpuProfiling(
            self._nc, self._info, self._truth,
            lambda: [i for run in self._runs.values() for i in run.start.gpus],
            self._profiling, self.log,
        )  # fmt: skip
        self._stack.push_async_callback(self._gpu_profiling.stop)
        await serve_gpu_profiles(self._commands, config.name, self._gpu_profiling.on_request)
        await self._nc.flush()
        self._seen_reconnects = self._nc.stats["reconnects"]
        self._registered = await self._register()
        self.log.info(
            "node agent started",
            gpus=len(self._inventory.gpus),
            emulated=self._inventory.emulated,
            jobs_mode=config.jobs_mode,
            time_scale=config.time_scale,
            registered=self._registered,
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
            run = self._runs.get(job.job_id)
            if run is not None and run.start.leader and run.kind != "held":
                jobs[job.job_id] = JobReading(
                    job.progress.iteration, run.start.total_iterations, sample.at
                )
        self.view.update(self._inventory.gpus, self._inventory.emulated, sample.gpus, jobs)

    async def _shutdown(self) -> None:
        if self._commands is not None:
            with contextlib.suppress(Exception):
                await self._commands.stop()
            self._commands = None
        if self.running:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.tell(_StopAll("preempt", done))
            limit = self.config.preempt_grace_s + STDERR_DRAIN_S + 5.0
            try:
                await asyncio.wait_for(done, limit)
            except TimeoutError:
                self.log.error("runs did not stop in time", jobs=sorted(self._runs))
            await self._stop_actor()
        if self._outbox is not None:
            await self._outbox.flush(self.config.exit_flush_s)
        await self._deregister()

    async def _stop_actor(self) -> None:
        if self.running:
            await Actor.__aexit__(self, None, None, None)
        # a run that outlived the shutdown limit still has an actor to wind down
        for run in list(self._runs.values()):
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
    async def _register(self) -> bool:
        assert self._js is not None and self._info is not None
        try:
            # the same write as KeyValue.put, with the codec headers every message carries
            await self._js.publish(
                f"$KV.{subjects.NODES_BUCKET}.{self.config.name}",
                codec.encode(self._info),
                headers=codec.headers(),
                timeout=PUBLISH_TIMEOUT_S,
            )
        except Exception as exc:
            self.log.warning("registration failed; will retry", error=repr(exc))
            return False
        self.log.info("node registered")
        return True

    async def _register_later(self) -> None:
        ok = False
        try:
            ok = await self._register()
        finally:
            self.tell(_Registered(ok))

    def _check_registration(self) -> None:
        """Register again after a reconnect (the server may have lost the entry, or the
        scheduler may have dropped the node) and until the first registration succeeds."""
        assert self._nc is not None
        reconnects = self._nc.stats["reconnects"]
        if self._registering or self._closing or not self._nc.is_connected:
            return
        if self._registered and reconnects == self._seen_reconnects:
            return
        self._seen_reconnects = reconnects
        self._registering = True
        self.spawn(self._register_later())

    async def _deregister(self) -> None:
        if self._js is None or self._info is None:
            return
        try:
            # KeyValue.delete's message: a delete marker on its own key
            await self._js.publish(
                f"$KV.{subjects.NODES_BUCKET}.{self.config.name}",
                headers={"KV-Operation": "DEL"}, timeout=PUBLISH_TIMEOUT_S,
            )
            self.log.info("node deregistered")
        except Exception as exc:
            self.log.warning("deregistration failed", error=repr(exc))

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
                            answer = await self._start(command)
                        case StopJob():
                            answer = await self._stop(command)
                        case ResizeJob():
                            answer = await self._resize(command)
                        case ReallocateJob():
                            answer = self._reallocate(command)
                except Exception as exc:
                    self.log.exception("command failed", job_id=command.job_id)
                    answer = CommandReply(False, f"node agent error: {exc!r}")
                if not reply.done():
                    reply.set_result(answer)
            case _HeartbeatDue():
                self._check_registration()
                await self._reports.heartbeat(self._runs.values(), self._exits.exiting)
            case _TelemetryDue():
                self._export(await self._reports.telemetry(self._runs.values()))
            case _ProgressDue():
                await self._reports.progress_events(self._runs.values())
            case SimulatedFinish(job_id, run_id, version):
                run = self._runs.get(job_id)
                if run is not None and run.run_id == run_id and run.version == version:
                    await self._end(run, RunEnd("succeeded", run.start.total_iterations, 0))
            case ProcessStarted(job_id, run_id, pid):
                run = self._runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    run.pid = pid
                    run.log.info("process started", pid=pid)
            case ProcessProgress(job_id, run_id, progress, samples):
                run = self._runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    run.progress = progress
                    run.samples.extend(samples)
            case RunEnded(job_id, run_id, end):
                run = self._runs.get(job_id)
                if run is not None and run.run_id == run_id:
                    await self._end(run, end)
            case _Registered(ok):
                self._registering = False
                self._registered = ok
            case _StopAll(reason, done):
                await self._stop_all(reason, done)
            case _Snapshot(reply) if not reply.done():
                reply.set_result(
                    AgentSnapshot(
                        node=self.config.name,
                        running={r.job_id: r.run_id for r in self._runs.values()},
                        undelivered_exits=self._exits.undelivered,
                        registered=self._registered,
                        cores={r.job_id: r.cores for r in self._runs.values() if r.cores},
                    )
                )

    async def _start(self, start: StartJob) -> CommandReply:
        current = self._runs.get(start.job_id)
        if current is not None:
            if current.run_id == start.run_id:
                # a retried command: it runs already
                return CommandReply(True, rendezvous=current.start.rendezvous)
            return CommandReply(
                False,
                f"job {start.job_id} already runs on {self.config.name} as run "
                f"{current.run_id}; stop that run first",
            )
        if (start.job_id, start.run_id) in self._ended:
            return CommandReply(True)  # it ran to its end already; its exit is reported
        if self._closing:
            return CommandReply(False, f"node agent {self.config.name} is shutting down")
        problem = self._start_problem(start)
        if problem:
            self.log.warning("start refused", job_id=start.job_id, error=problem)
            return CommandReply(False, problem)
        kind, problem = self._run_kind(start)
        if kind is None:
            self.log.warning("start refused", job_id=start.job_id, error=problem)
            return CommandReply(False, problem)
        if kind == "process" and start.leader and start.nodes > 1:
            # the other parts' ranks meet at this node; the reply tells the scheduler where
            start = msgspec.structs.replace(
                start,
                # other nodes connect: free on every interface
                rendezvous=f"tcp://{self.config.advertise_host}:{free_port('')}",
                first_rank=0,
                world_size=start.spec.gpus,
            )
        run = Run(
            start=start,
            kind=kind,
            log=self.log.bind(job_id=start.job_id, run_id=start.run_id),
            progress=Progress(iteration=start.resume_iteration if kind == "process" else 0),
        )
        if kind == "simulated":
            error = self._simulation.prepare(run)
            if error:
                return CommandReply(False, error)
        self._runs[start.job_id] = run
        if start.cpus is not None:
            run.cores = pick_cores(
                start.cpus, cores_taken(self._runs.values(), start.job_id), self.config.cpus
            )
        run.mem_gb = start.mem_gb
        self._metrics.runs_started.labels(kind).inc()
        self._metrics.running.inc()
        self._simulation.retime(self._runs.values(), start.gpus)
        run.log.info(
            "run started",
            kind=kind,
            model=start.spec.model,
            gpus=start.gpus,
            accum_steps=start.accum_steps,
            co_runners=co_runners(run, self._runs.values()),
            scheduler_co_runners=start.co_runners,
            resume_iteration=start.resume_iteration,
            total_iterations=start.total_iterations,
            leader=start.leader,
            nodes=start.nodes,
            **({"cores": run.cores} if run.cores else {}),
            **({"mem_gb": run.mem_gb} if run.mem_gb is not None else {}),
            **({"iteration_s": run.alone_s * run.slowdown} if kind == "simulated" else {}),
        )
        self._reports.warn_if_memory_overflows(self._runs.values(), start.gpus)
        if kind == "process":
            assert self._inventory is not None
            try:
                if not self._job_user_known:
                    # resolved (and a system user created) when a process first runs
                    self._job_user, _ = await asyncio.to_thread(
                        resolve_job_user, self.config.job_user
                    )
                    self._job_user_known = True
                plan = process_plan(
                    start, self.config, self._inventory, self._real_cores(run.cores),
                    self._job_user,
                )
            except Exception as exc:  # no process to start: the run fails, saying why
                why = f"cannot prepare the job's process: {exc!r}"
                await self._end(run, RunEnd("failed", start.resume_iteration, None, why))
                return CommandReply(True, rendezvous=start.rendezvous)
            run.process = ProcessRun(plan, self.tell)
            await run.process.__aenter__()
        if self.config.measure_profiles and self._gpu_profiling is not None:
            self._gpu_profiling.on_start(start, kind)  # in the background
        return CommandReply(True, rendezvous=start.rendezvous)

    def _start_problem(self, start: StartJob) -> str:
        assert self._inventory is not None
        return start_problem(start, self._inventory, self.config.name)

    def _run_kind(self, start: StartJob) -> tuple[RunKind | None, str]:
        return run_kind(start, self._known_models, self.config.jobs_mode)

    def _real_cores(self, cores: tuple[int, ...]) -> tuple[int, ...]:
        return real_cores(cores, self._machine_cores) if cores else ()

    # ---- CPU and memory -----------------------------------------------------------------
    def _reallocate(self, command: ReallocateJob) -> CommandReply:
        """Give a running run other CPU cores and host memory, without restarting it."""
        run = self._runs.get(command.job_id)
        if run is None or run.run_id != command.run_id:
            if (command.job_id, command.run_id) in self._ended:
                return CommandReply(True)  # it ended meanwhile: nothing left to change
            return CommandReply(
                False,
                f"run_id: job {command.job_id} does not run on {self.config.name} as run "
                f"{command.run_id}",
            )
        run.cores = pick_cores(
            command.cpus, cores_taken(self._runs.values(), run.job_id), self.config.cpus
        )
        run.mem_gb = command.mem_gb
        allocation = {"cpus": command.cpus, "mem_gb": command.mem_gb}
        # a later restart (a resize) keeps the allocation
        run.start = msgspec.structs.replace(run.start, **allocation)
        if run.successor is not None:
            run.successor = msgspec.structs.replace(run.successor, **allocation)
        if run.process is not None:
            run.process.tell(ReallocateRun(self._real_cores(run.cores), run.mem_gb))
        run.log.info("reallocated", cpus=command.cpus, cores=run.cores, mem_gb=run.mem_gb)
        return CommandReply(True)

    # ---- resizing -----------------------------------------------------------------------
    async def _resize(self, resize: ResizeJob) -> CommandReply:
        """Checkpoint the current run, then restart it with the new shape (in ``_end``)."""
        run = self._runs.get(resize.job_id)
        answer = answer_without_resizing(
            resize, run, self._ended, self.config.name, self._closing
        )
        if answer is not None:
            return answer
        assert run is not None  # a resize of a run not here is answered above
        problem = resize_problem(run.start, resize)
        successor = resized(run.start, resize, self._known_models)
        problem = problem or self._start_problem(successor) or (self._run_kind(successor)[1])
        if problem:
            run.log.warning("resize refused", error=problem)
            return CommandReply(False, problem)
        run.successor = successor
        run.log.info(
            "resize requested",
            new_run_id=resize.new_run_id,
            batch_size=resize.batch_size,
            gpus=resize.gpus,
            accum_steps=resize.accum_steps,
        )
        await self._stop_run(run, "preempt")
        return CommandReply(True)

    # ---- stopping and ending ------------------------------------------------------------
    async def _stop(self, stop: StopJob) -> CommandReply:
        run = self._runs.get(stop.job_id)
        if run is None or run.run_id != stop.run_id:
            return CommandReply(True)  # nothing of that run here: stopped already
        await self._stop_run(run, stop.reason)
        return CommandReply(True)

    async def _stop_run(self, run: Run, reason: StopReason) -> None:
        if run.stopping is None:
            run.log.info("stop requested", reason=reason)
        run.stopping = run.stopping or reason
        if run.process is not None:
            run.process.tell(StopRun(reason))
        elif run.clock is not None:
            # a simulated job checkpoints instantly: where it is now is where it resumes
            now = asyncio.get_running_loop().time()
            reached = int(run.clock.at(now))
            total = run.start.total_iterations
            end = RunEnd("succeeded", total, 0) if reached >= total else RunEnd(
                "stopped", reached, 0
            )
            await self._end(run, end)
        else:
            await self._end(run, RunEnd("stopped", 0))

    async def _stop_all(self, reason: StopReason, done: asyncio.Future[None]) -> None:
        self._closing = True
        self._stopped_all = done
        for run in list(self._runs.values()):
            await self._stop_run(run, reason)
        self._resolve_stopped_all()

    def _resolve_stopped_all(self) -> None:
        if self._stopped_all is not None and not self._runs and not self._stopped_all.done():
            self._stopped_all.set_result(None)

    async def _end(self, run: Run, end: RunEnd) -> None:
        if self._runs.get(run.job_id) is not run:
            return
        del self._runs[run.job_id]
        if run.finish_timer is not None:
            run.finish_timer.cancel()
        self._ended[(run.job_id, run.run_id)] = None
        while len(self._ended) > REMEMBERED_RUNS:
            self._ended.popitem(last=False)
        self._metrics.running.dec()
        self._metrics.runs_ended.labels(end.outcome).inc()
        self.view.forget_job(run.job_id)
        run.log.info(
            "run ended",
            outcome=end.outcome,
            iteration=end.iteration,
            exit_code=end.exit_code,
            **({"stderr_tail": end.stderr_tail[-300:]} if end.outcome == "failed" else {}),
        )
        self._simulation.retime(self._runs.values(), run.start.gpus)
        if run.process is not None:
            await run.process.__aexit__(None, None, None)
        successor = run.successor
        if successor is not None and end.outcome == "stopped" and not self._closing:
            await self._restart(successor, end.iteration)
        elif run.start.leader:
            # after a resize was asked for, the scheduler follows the new run's id
            run_id = run.run_id if successor is None else successor.run_id
            if successor is not None:
                self._ended[(run.job_id, run_id)] = None
            self._exits.deliver(job_exit(self.config.name, run.job_id, run_id, end))
        self._resolve_stopped_all()

    async def _restart(self, successor: StartJob, iteration: int) -> None:
        """Start the run that replaces a resized one, from where it checkpointed."""
        start = msgspec.structs.replace(successor, resume_iteration=iteration)
        answer = await self._start(start)
        if not answer.ok:
            self.log.warning("restart after resize failed", job_id=start.job_id,
                             error=answer.error)
            self._ended[(start.job_id, start.run_id)] = None
            self._exits.deliver(job_exit(self.config.name, start.job_id, start.run_id, RunEnd(
                "failed", iteration, None, f"restart after resize failed: {answer.error}")))
