"""The node agent: registers its node, runs what the scheduler starts there, reports.

One actor owns the node's state (the runs and what sits on each GPU). NATS callbacks,
timers and process runs only send it messages. Commands arrive by request/reply on
``gpusched.node.<name>.command``; the agent publishes heartbeats, telemetry and progress
events, and every run of a leader part ends with exactly one JobExit stored in JetStream
(retried until the server takes it, deduplicated by its Nats-Msg-Id).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.common import codec, subjects
from libs.common.actor import Actor
from libs.common.bus import Stores, connection
from libs.common.embedded import free_port
from libs.common.schemas import (
    SCHEMA_VERSION,
    CommandReply,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    NodeInfo,
    Progress,
    ResizeJob,
    RunningJob,
    RunRef,
    StartJob,
    StopJob,
    Telemetry,
    split_problem,
)
from libs.core.groundtruth import ProfilePerformanceModel, load_performance_model
from libs.sdk import context as job_env
from services.nodeagent.config import NAME_PATTERN, NodeAgentConfig
from services.nodeagent.gpus import (
    GpuInventory,
    discover,
    emulated_telemetry,
    read_nvml,
)
from services.nodeagent.metrics import metrics
from services.nodeagent.runs import (
    STDERR_DRAIN_S,
    ProcessPlan,
    ProcessProgress,
    ProcessRun,
    ProcessStarted,
    RunEnd,
    RunEnded,
    SimulatedProgress,
    StopReason,
    StopRun,
    run_environment,
)

RunKind = Literal["simulated", "process", "held"]

#: (job, run) pairs remembered after they end, so that a retried start does not rerun them
REMEMBERED_RUNS = 4096
#: one attempt to store a JobExit or the registration
PUBLISH_TIMEOUT_S = 2.0
EXIT_RETRY_FIRST_S = 0.1
EXIT_RETRY_MAX_S = 2.0
#: the command type as msgspec decodes it: a tagged union
Command = StartJob | StopJob | ResizeJob
_COMMAND = cast("type[Command]", Command)


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
class _SimulatedFinish:
    job_id: str
    run_id: int
    version: int


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
    _Command | _HeartbeatDue | _TelemetryDue | _ProgressDue | _SimulatedFinish | _Registered
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


# ---- one run, as the actor keeps it --------------------------------------------------


@dataclass(eq=False)
class _Run:
    start: StartJob
    kind: RunKind
    log: Any
    #: ground-truth seconds per iteration running alone (simulated runs)
    alone_s: float = 0.0
    slowdown: float = 1.0
    clock: SimulatedProgress | None = None
    version: int = 0
    finish_timer: asyncio.TimerHandle | None = None
    process: ProcessRun | None = None
    pid: int | None = None
    #: latest progress of a process run (simulated runs compute theirs)
    progress: Progress = field(default_factory=Progress)
    #: (iteration, seconds) where the last progress event's measurement ended
    measured_from: tuple[float, float] | None = None
    #: (iteration, seconds) of progress lines read since the last progress event
    samples: list[tuple[int, float]] = field(default_factory=list)
    stopping: StopReason | None = None
    #: the run that replaces this one once it has checkpointed (a resize)
    successor: StartJob | None = None

    @property
    def job_id(self) -> str:
        return self.start.job_id

    @property
    def run_id(self) -> int:
        return self.start.run_id


class NodeAgent(Actor[AgentMessage]):
    """One node's agent. ``async with NodeAgent(config) as agent:`` connects, registers
    and serves until the block ends; then it preempts what runs (so the jobs checkpoint),
    delivers their exits, deregisters and drains.

    ``nc``/``stores`` share a connection (the caller then owns it) and ``truth`` shares
    the ground-truth model, for many agents in one process.
    """

    name = "nodeagent"

    def __init__(
        self,
        config: NodeAgentConfig,
        *,
        nc: Client | None = None,
        stores: Stores | None = None,
        truth: ProfilePerformanceModel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.log = structlog.get_logger("gpusched.nodeagent").bind(node=config.name)
        self._nc = nc
        self._stores = stores
        self._truth = truth
        self._known_models: frozenset[str] = frozenset()
        self._inventory: GpuInventory | None = None
        self._info: NodeInfo | None = None
        self._stack = contextlib.AsyncExitStack()
        self._command_sub: Subscription | None = None
        self._runs: dict[str, _Run] = {}
        self._ended: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._deliveries: dict[asyncio.Task[None], str] = {}
        #: the run of each exit being delivered, listed in heartbeats until it is stored
        self._exiting: dict[asyncio.Task[None], RunRef] = {}
        self._registered = False
        self._registering = False
        self._seen_reconnects = 0
        self._closing = False
        self._stopped_all: asyncio.Future[None] | None = None
        self._metrics = metrics()

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
        if self._stores is None:
            self._stores = await Stores.open(self._nc)
        if self._truth is None:
            self._truth = await asyncio.to_thread(load_performance_model, config.data_dir)
        self._known_models = frozenset(self._truth.models())
        nvml = await asyncio.to_thread(read_nvml) if config.gpus is None else None
        self._inventory = discover(
            config.name, config.gpus, config.gpu_model, config.emulated_gpu_mem_mb, nvml
        )
        self._info = NodeInfo(
            name=config.name,
            gpus=list(self._inventory.gpus),
            cpus=config.cpus,
            host_mem_gb=config.host_mem_gb,
            net_gbps=config.net_gbps,
            emulated=self._inventory.emulated,
            started_at=time.time(),
        )
        await super().__aenter__()
        self._stack.push_async_callback(self._stop_actor)
        self._command_sub = await self._nc.subscribe(
            subjects.node_command(config.name), cb=self._on_command
        )
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
            await self._stack.aclose()

    async def _shutdown(self) -> None:
        if self._command_sub is not None:
            with contextlib.suppress(Exception):
                await self._command_sub.unsubscribe()
            self._command_sub = None
        if self.running:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.tell(_StopAll("preempt", done))
            limit = self.config.preempt_grace_s + STDERR_DRAIN_S + 5.0
            try:
                await asyncio.wait_for(done, limit)
            except TimeoutError:
                self.log.error("runs did not stop in time", jobs=sorted(self._runs))
            await self._stop_actor()
        await self._flush_exits()
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
        assert self._stores is not None and self._info is not None
        try:
            # the same write as KeyValue.put, with the codec headers every message carries
            await self._stores.js.publish(
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
        if self._stores is None or self._info is None:
            return
        try:
            await asyncio.wait_for(self._stores.nodes.delete(self.config.name), PUBLISH_TIMEOUT_S)
            self.log.info("node deregistered")
        except Exception as exc:
            self.log.warning("deregistration failed", error=repr(exc))

    # ---- commands -------------------------------------------------------------------
    async def _on_command(self, msg: Msg) -> None:
        kind = "unknown"
        schema = (msg.headers or {}).get(codec.SCHEMA_HEADER)
        try:
            if schema is not None and schema != str(SCHEMA_VERSION):
                raise msgspec.DecodeError(
                    f"schema version {schema} (header {codec.SCHEMA_HEADER}); this node "
                    f"agent reads version {SCHEMA_VERSION}"
                )
            command = codec.decode(msg.data, _COMMAND)
        except msgspec.DecodeError as exc:
            reply = CommandReply(ok=False, error=f"undecodable command: {exc}")
        else:
            kind = str(command.__struct_config__.tag)
            if self.running:
                future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
                self.tell(_Command(command, future))
                reply = await future
            else:
                reply = CommandReply(False, f"node agent {self.config.name} is shutting down")
        self._metrics.commands.labels(kind, "ok" if reply.ok else "refused").inc()
        if msg.reply and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.publish(msg.reply, codec.encode(reply), headers=codec.headers())

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
                except Exception as exc:
                    self.log.exception("command failed", job_id=command.job_id)
                    answer = CommandReply(False, f"node agent error: {exc!r}")
                if not reply.done():
                    reply.set_result(answer)
            case _HeartbeatDue():
                await self._heartbeat()
            case _TelemetryDue():
                await self._telemetry()
            case _ProgressDue():
                await self._progress_events()
            case _SimulatedFinish(job_id, run_id, version):
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
                        undelivered_exits=tuple(sorted(self._deliveries.values())),
                        registered=self._registered,
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
        problem = self._check(start)
        if problem:
            self.log.warning("start refused", job_id=start.job_id, error=problem)
            return CommandReply(False, problem)
        kind, problem = self._kind_of(start)
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
        run = _Run(
            start=start,
            kind=kind,
            log=self.log.bind(job_id=start.job_id, run_id=start.run_id),
            progress=Progress(iteration=start.resume_iteration if kind == "process" else 0),
        )
        if kind == "simulated":
            error = self._prepare_simulated(run)
            if error:
                return CommandReply(False, error)
        self._runs[start.job_id] = run
        self._metrics.runs_started.labels(kind).inc()
        self._metrics.running.inc()
        self._retime_sharing(start.gpus)
        co_runners = self._co_runners(run)
        run.log.info(
            "run started",
            kind=kind,
            model=start.spec.model,
            gpus=start.gpus,
            accum_steps=start.accum_steps,
            co_runners=co_runners,
            scheduler_co_runners=start.co_runners,
            resume_iteration=start.resume_iteration,
            total_iterations=start.total_iterations,
            leader=start.leader,
            nodes=start.nodes,
            **({"iteration_s": run.alone_s * run.slowdown} if kind == "simulated" else {}),
        )
        self._warn_if_memory_overflows(start.gpus)
        if kind == "process":
            run.process = ProcessRun(self._plan(start), self.tell)
            await run.process.__aenter__()
        return CommandReply(True, rendezvous=start.rendezvous)

    def _check(self, start: StartJob) -> str:
        """Why this start cannot run here, or ''."""
        assert self._inventory is not None
        if not NAME_PATTERN.match(start.job_id):
            return f"job_id: {start.job_id!r} must be 1-64 letters, digits, '-' or '_'"
        if not start.gpus:
            return "gpus: no GPU given"
        indices = self._inventory.indices
        seen: set[int] = set()
        for index in start.gpus:
            if index in seen:
                return f"gpus: GPU {index} is given twice"
            seen.add(index)
            if index not in indices:
                return (
                    f"gpus: GPU {index} does not exist on {self.config.name} "
                    f"(it has GPUs {_ranges(sorted(indices))})"
                )
        if start.total_iterations < 1:
            return f"total_iterations: must be >= 1, got {start.total_iterations}"
        if start.resume_iteration < 0:
            return f"resume_iteration: must be >= 0, got {start.resume_iteration}"
        if start.accum_steps < 1:
            return f"accum_steps: must be >= 1, got {start.accum_steps}"
        if start.nodes < 1:
            return f"nodes: must be >= 1, got {start.nodes}"
        if start.emulated_iteration_s is not None and not start.emulated_iteration_s > 0:
            return f"emulated_iteration_s: must be > 0, got {start.emulated_iteration_s}"
        if start.rendezvous and (
            start.first_rank < 0 or start.world_size < start.first_rank + len(start.gpus)
        ):
            return (
                f"world_size: {start.world_size} ranks cannot hold ranks {start.first_rank}.."
                f"{start.first_rank + len(start.gpus) - 1} of this part"
            )
        return ""

    def _kind_of(self, start: StartJob) -> tuple[RunKind | None, str]:
        """The kind of run this start makes, or None and why it cannot run."""
        if not start.leader:
            # a part of a process job across nodes runs its ranks; any other holds its GPUs
            kind, _ = self._leader_kind(start)
            return ("process" if kind == "process" and start.rendezvous else "held"), ""
        return self._leader_kind(start)

    def _leader_kind(self, start: StartJob) -> tuple[RunKind | None, str]:
        if start.spec.command:
            return "process", ""
        model = start.spec.model
        known = model in self._known_models
        if self.config.jobs_mode == "simulated":
            if known or start.emulated_iteration_s is not None:
                return "simulated", ""
            return None, (
                f"spec.model: {model!r} has no ground-truth profile, so a simulated run "
                "needs emulated_iteration_s (or the job a command)"
            )
        if known:
            return "process", ""
        return None, (
            f"spec.model: {model!r} is not a built-in model and the job gives no command"
        )

    # ---- simulated runs -----------------------------------------------------------------
    def _prepare_simulated(self, run: _Run) -> str:
        assert self._truth is not None
        start, spec = run.start, run.start.spec
        if start.emulated_iteration_s is not None:
            run.alone_s = start.emulated_iteration_s
        else:
            try:
                run.alone_s = self._truth.iteration_time(
                    spec.model, spec.batch_size, spec.gpus, start.nodes, start.accum_steps
                )
            except ValueError as exc:
                return f"nodes: {exc}"
        now = asyncio.get_running_loop().time()
        wall_s = run.alone_s * self.config.time_scale
        run.clock = SimulatedProgress(start.resume_iteration, start.total_iterations, wall_s, now)
        run.measured_from = (run.clock.iteration, now / self.config.time_scale)
        return ""

    def _slowdown(self, run: _Run) -> float:
        """The ground-truth slowdown from the worst co-runner on any of its GPUs."""
        assert self._truth is not None
        spec = run.start.spec
        worst = 1.0
        for other in self._sharing(run):
            o = other.start.spec
            if spec.model not in self._known_models or o.model not in self._known_models:
                continue
            worst = max(
                worst,
                self._truth.colocation_slowdown(
                    spec.model, spec.batch_size, spec.gpus, run.start.accum_steps,
                    o.model, o.batch_size, o.gpus, other.start.accum_steps,
                ),
            )
        return worst

    def _retime_sharing(self, gpus: list[int]) -> None:
        """Recompute the speed of every simulated run on these GPUs (someone came or
        went), and when each finishes."""
        loop = asyncio.get_running_loop()
        touched = set(gpus)
        for run in self._runs.values():
            if run.clock is None or not touched.intersection(run.start.gpus):
                continue
            slowdown = self._slowdown(run)
            if slowdown == run.slowdown and run.finish_timer is not None:
                continue
            now = loop.time()
            run.slowdown = slowdown
            run.clock.change_speed(run.alone_s * slowdown * self.config.time_scale, now)
            run.version += 1
            if run.finish_timer is not None:
                run.finish_timer.cancel()
            run.finish_timer = loop.call_at(
                run.clock.finishes_at(),
                self.tell,
                _SimulatedFinish(run.job_id, run.run_id, run.version),
            )

    # ---- process runs -------------------------------------------------------------------
    def _plan(self, start: StartJob) -> ProcessPlan:
        assert self._inventory is not None
        config, spec = self.config, start.spec
        job_dir = config.work_dir / start.job_id
        checkpoint_dir = job_dir / "ckpt"
        # the parts of a job across nodes may share a work directory: one name per part
        part = "" if start.leader else f"-{config.name}"
        progress_file = job_dir / f"progress-{start.run_id}{part}.jsonl"
        contract: dict[str, Any] = {
            job_env.JOB_ID: start.job_id,
            job_env.RUN_ID: start.run_id,
            job_env.MODEL: spec.model,
            job_env.BATCH_SIZE: spec.batch_size,
            job_env.ACCUM_STEPS: start.accum_steps,
            job_env.GPUS: ",".join(str(i) for i in start.gpus),
            job_env.DEVICE: "cpu" if self._inventory.emulated else "cuda",
            job_env.TOTAL_ITERATIONS: start.total_iterations,
            job_env.START_ITERATION: start.resume_iteration,
            job_env.CHECKPOINT_DIR: checkpoint_dir,
            job_env.CHECKPOINT_EVERY: spec.checkpoint_every,
            job_env.PROGRESS_FILE: progress_file,
            job_env.NODE: config.name,
            "PYTHONUNBUFFERED": "1",
        }
        if start.rendezvous:
            contract[job_env.RENDEZVOUS] = start.rendezvous
            contract[job_env.FIRST_RANK] = start.first_rank
            contract[job_env.WORLD_SIZE] = start.world_size
        if not self._inventory.emulated:
            by_index = {g.index: g.uuid for g in self._inventory.gpus}
            contract["CUDA_VISIBLE_DEVICES"] = ",".join(by_index[i] for i in start.gpus)
        argv = (
            tuple(spec.command)
            if spec.command
            else (sys.executable, "-m", "services.nodeagent.worker")
        )
        return ProcessPlan(
            node=config.name,
            job_id=start.job_id,
            run_id=start.run_id,
            argv=argv,
            env=run_environment(contract),
            progress_file=progress_file,
            log_file=job_dir / f"run-{start.run_id}{part}.log",
            checkpoint_dir=checkpoint_dir,
            total_iterations=start.total_iterations,
            start_iteration=start.resume_iteration,
            kill_grace_s=config.kill_grace_s,
            preempt_grace_s=config.preempt_grace_s,
            poll_s=config.progress_poll_s,
        )

    # ---- resizing -----------------------------------------------------------------------
    async def _resize(self, resize: ResizeJob) -> CommandReply:
        """Checkpoint the current run, then restart it with the new shape (in ``_end``)."""
        job_id = resize.job_id
        if resize.new_run_id <= resize.run_id:
            return CommandReply(
                False, f"new_run_id: must be above run_id {resize.run_id}, got {resize.new_run_id}"
            )
        run = self._runs.get(job_id)
        if run is not None and run.run_id == resize.new_run_id:
            return CommandReply(True)  # a retried command: the new run runs already
        if (job_id, resize.new_run_id) in self._ended:
            return CommandReply(True)  # it ran to its end already; its exit is reported
        if run is None or run.run_id != resize.run_id:
            where = f"as run {run.run_id}" if run is not None else "at all"
            return CommandReply(
                False, f"run_id: job {job_id} does not run on {self.config.name} {where}"
            )
        if run.successor is not None:
            if run.successor.run_id == resize.new_run_id:
                return CommandReply(True)  # a retry while the old run checkpoints
            return CommandReply(
                False, f"new_run_id: job {job_id} is being resized to run {run.successor.run_id}"
            )
        if self._closing:
            return CommandReply(False, f"node agent {self.config.name} is shutting down")
        problem = self._check_resize(run, resize)
        successor = self._resized(run.start, resize)
        problem = problem or self._check(successor) or (self._kind_of(successor)[1])
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

    @staticmethod
    def _check_resize(run: _Run, resize: ResizeJob) -> str:
        if run.start.nodes > 1 or not run.start.leader:
            return (
                f"job_id: job {resize.job_id} spans {run.start.nodes} nodes; move it with "
                "a stop and a start"
            )
        if resize.batch_size < 1:
            return f"batch_size: must be >= 1, got {resize.batch_size}"
        if resize.accum_steps >= 1 and resize.gpus:
            return split_problem(resize.batch_size, len(resize.gpus), resize.accum_steps)
        return ""

    def _resized(self, start: StartJob, resize: ResizeJob) -> StartJob:
        spec = msgspec.structs.replace(
            start.spec, batch_size=resize.batch_size, gpus=len(resize.gpus)
        )
        return msgspec.structs.replace(
            start,
            run_id=resize.new_run_id,
            spec=spec,
            gpus=list(resize.gpus),
            accum_steps=resize.accum_steps,
            co_runners=list(resize.co_runners),
            # a speed given for the old shape says nothing about the new one
            emulated_iteration_s=None
            if spec.model in self._known_models
            else start.emulated_iteration_s,
        )

    # ---- stopping and ending ------------------------------------------------------------
    async def _stop(self, stop: StopJob) -> CommandReply:
        run = self._runs.get(stop.job_id)
        if run is None or run.run_id != stop.run_id:
            return CommandReply(True)  # nothing of that run here: stopped already
        await self._stop_run(run, stop.reason)
        return CommandReply(True)

    async def _stop_run(self, run: _Run, reason: StopReason) -> None:
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

    async def _end(self, run: _Run, end: RunEnd) -> None:
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
        run.log.info(
            "run ended",
            outcome=end.outcome,
            iteration=end.iteration,
            exit_code=end.exit_code,
            **({"stderr_tail": end.stderr_tail[-300:]} if end.outcome == "failed" else {}),
        )
        self._retime_sharing(run.start.gpus)
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
            self._deliver(self._exit(run.job_id, run_id, end))
        self._resolve_stopped_all()

    async def _restart(self, successor: StartJob, iteration: int) -> None:
        """Start the run that replaces a resized one, from where it checkpointed."""
        start = msgspec.structs.replace(successor, resume_iteration=iteration)
        answer = await self._start(start)
        if not answer.ok:
            self.log.warning("restart after resize failed", job_id=start.job_id,
                             error=answer.error)
            self._ended[(start.job_id, start.run_id)] = None
            self._deliver(self._exit(start.job_id, start.run_id, RunEnd(
                "failed", iteration, None, f"restart after resize failed: {answer.error}")))

    def _exit(self, job_id: str, run_id: int, end: RunEnd) -> JobExit:
        return JobExit(
            job_id=job_id,
            run_id=run_id,
            node=self.config.name,
            outcome=end.outcome,
            exit_code=end.exit_code,
            iteration=end.iteration,
            stderr_tail=end.stderr_tail,
            at=time.time(),
        )

    def _deliver(self, exit: JobExit) -> None:
        task = asyncio.create_task(self._publish_exit(exit), name=f"exit-{exit.job_id}")
        self._deliveries[task] = exit.job_id
        self._exiting[task] = RunRef(exit.job_id, exit.run_id)
        task.add_done_callback(self._deliveries.pop)
        task.add_done_callback(self._exiting.pop)

    async def _publish_exit(self, exit: JobExit) -> None:
        """Store the exit in JetStream, retrying until it is taken: the server may be
        restarting. A retry after a lost acknowledgement is deduplicated by its id."""
        assert self._stores is not None
        data = codec.encode(exit)
        headers = codec.headers({"Nats-Msg-Id": f"{exit.job_id}-{exit.run_id}-exit"})
        log = self.log.bind(job_id=exit.job_id, run_id=exit.run_id)
        began = time.monotonic()
        delay = EXIT_RETRY_FIRST_S
        attempts = 0
        while True:
            try:
                await self._stores.js.publish(
                    subjects.job_exit(exit.job_id), data, headers=headers,
                    timeout=PUBLISH_TIMEOUT_S,
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempts += 1
                self._metrics.exit_retries.inc()
                log.warning("exit not stored yet; retrying", attempt=attempts, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, EXIT_RETRY_MAX_S)
        self._metrics.exit_delivery_seconds.observe(time.monotonic() - began)
        log.info("exit delivered", outcome=exit.outcome, iteration=exit.iteration,
                 attempts=attempts + 1)

    async def _flush_exits(self) -> None:
        pending = set(self._deliveries)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=self.config.exit_flush_s)
        for task in late:
            self.log.error("exit never delivered", job_id=self._deliveries.get(task))
            task.cancel()
        for task in late:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- reporting ------------------------------------------------------------------
    def _sharing(self, run: _Run) -> list[_Run]:
        gpus = set(run.start.gpus)
        return [
            other for other in self._runs.values()
            if other is not run and gpus.intersection(other.start.gpus)
        ]

    def _co_runners(self, run: _Run) -> list[str]:
        return sorted(other.job_id for other in self._sharing(run))

    def _gpu_memory_mb(self, run: _Run) -> float:
        """What one GPU of this run holds: the ground truth where the model is known."""
        assert self._truth is not None
        spec = run.start.spec
        if spec.model in self._known_models:
            return self._truth.gpu_memory_mb(
                spec.model, spec.batch_size / (spec.gpus * run.start.accum_steps)
            )
        return run.progress.gpu_mem_mb

    def _progress_of(self, run: _Run, now: float) -> Progress:
        if run.clock is None:
            return run.progress
        batch = run.start.spec.batch_size
        return Progress(
            iteration=int(run.clock.at(now)),
            samples_per_s=batch / (run.alone_s * run.slowdown),
            gpu_mem_mb=self._gpu_memory_mb(run),
            at=time.time(),
        )

    def _running(self) -> list[RunningJob]:
        now = asyncio.get_running_loop().time()
        return [
            RunningJob(run.job_id, run.run_id, self._progress_of(run, now))
            for run in self._runs.values()
        ]

    async def _publish(self, subject: str, value: Any, kind: str) -> None:
        assert self._nc is not None
        if not self._nc.is_connected:
            return  # a late heartbeat is worse than none: the scheduler would trust it
        try:
            await self._nc.publish(subject, codec.encode(value), headers=codec.headers())
        except Exception as exc:
            self.log.debug("publish failed", subject=subject, error=repr(exc))
            return
        self._metrics.published.labels(kind).inc()

    async def _heartbeat(self) -> None:
        self._check_registration()
        beat = Heartbeat(
            node=self.config.name, at=time.time(), running=self._running(),
            exiting=list(self._exiting.values()),
        )
        await self._publish(subjects.node_heartbeat(self.config.name), beat, "heartbeat")

    async def _telemetry(self) -> None:
        assert self._inventory is not None
        if self._inventory.emulated:
            used: dict[int, float] = {}
            for run in self._runs.values():
                per_gpu = self._gpu_memory_mb(run)
                for index in run.start.gpus:
                    used[index] = used.get(index, 0.0) + per_gpu
            busy = {i for run in self._runs.values() for i in run.start.gpus}
            gpus = emulated_telemetry(self._inventory.gpus, used, busy)
        else:
            readings = await asyncio.to_thread(read_nvml)
            gpus = [g.telemetry() for g in readings or ()]
        sample = Telemetry(
            node=self.config.name, at=time.time(), gpus=gpus, jobs=self._running()
        )
        await self._publish(subjects.node_telemetry(self.config.name), sample, "telemetry")

    async def _progress_events(self) -> None:
        now = asyncio.get_running_loop().time()
        for run in list(self._runs.values()):
            if run.kind == "held" or not run.start.leader:
                continue
            progress = self._progress_of(run, now)
            event = JobProgressEvent(
                job_id=run.job_id,
                run_id=run.run_id,
                node=self.config.name,
                model=run.start.spec.model,
                batch_size=run.start.spec.batch_size,
                gpus=run.start.spec.gpus,
                nodes=run.start.nodes,
                accum_steps=run.start.accum_steps,
                co_runners=self._co_runners(run),
                iteration_s=self._measure(run, now),
                progress=progress,
            )
            await self._publish(subjects.job_progress(run.job_id), event, "progress")

    def _measure(self, run: _Run, now: float) -> float | None:
        """Seconds per iteration over the interval since the last progress event, in
        the job's own seconds: a simulated run's wall time divided by the time scale,
        so that measurements compare with the ground truth at any speed-up."""
        if run.clock is not None:
            point = (run.clock.at(now), now / self.config.time_scale)
        elif run.samples:
            last = run.samples[-1]
            point = (float(last[0]), last[1])
            if run.measured_from is None:
                first = run.samples[0]
                run.measured_from = (float(first[0]), first[1])
            run.samples.clear()
        else:
            return None
        base, run.measured_from = run.measured_from, point
        if base is None or point[0] <= base[0]:
            return None
        return (point[1] - base[1]) / (point[0] - base[0])

    def _warn_if_memory_overflows(self, gpus: list[int]) -> None:
        assert self._inventory is not None
        if not self._inventory.emulated:
            return
        capacity = {g.index: g.memory_mb for g in self._inventory.gpus}
        for index in gpus:
            residents = [r for r in self._runs.values() if index in r.start.gpus]
            used = sum(self._gpu_memory_mb(r) for r in residents)
            if used > capacity[index]:
                self.log.warning(
                    "GPU memory oversubscribed", gpu=index, used_mb=round(used),
                    capacity_mb=capacity[index], jobs=sorted(r.job_id for r in residents),
                )


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    start = previous = None
    for index in indices:
        if start is None or previous is None:
            start = previous = index
        elif index == previous + 1:
            previous = index
        else:
            parts.append(f"{start}-{previous}" if previous != start else str(start))
            start = previous = index
    if start is not None and previous is not None:
        parts.append(f"{start}-{previous}" if previous != start else str(start))
    return ", ".join(parts) or "none"
