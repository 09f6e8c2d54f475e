"""The live scheduler's actor, ``LiveScheduler``: one task owns the scheduler's core
(``core.py``) and reads one inbox (``messages.py``).

The actor is the core's only way to the world. It reads what an input needs read first
(a job's stored record, a node's registration, a stored exit), hands the input to the
core, and carries out the effects the core lists (``effects.py``) through the adapters
(``store.py``, ``registry.py``, ``commands.py``, ``predictor.py``, ``publisher.py``),
in order. It also holds the takeover (nodes and the unfinished jobs read from the
store), the rescans of the index of unfinished jobs, and the handling of a stored input
that fails (it goes back to its stream).
"""

from __future__ import annotations

import asyncio
import collections
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.actor import Actor
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import (
    CancelRequest,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobRecord,
    NodeInfo,
    SizePredicted,
)
from gpusched.libs.core.perf import PerformanceModel
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import timing
from gpusched.services.scheduler.live.commands import NodeCommands
from gpusched.services.scheduler.live.core import SchedulerCore
from gpusched.services.scheduler.live.effects import (
    AskComputeProfile,
    AskEstimate,
    AskGpuProfile,
    AskRemaining,
    Effect,
    MarkLive,
    PublishDecision,
    PublishState,
    ReallocateRun,
    RequestRound,
    ResizeRun,
    StartRun,
    StopRun,
    UnmarkLive,
    WriteRecord,
    job_of,
)
from gpusched.services.scheduler.live.gpu_types import GpuMeasured, GpuTypes
from gpusched.services.scheduler.live.liveness import Liveness
from gpusched.services.scheduler.live.messages import (
    Beat,
    ComputeMeasured,
    Durable,
    Estimated,
    InputsDue,
    Measured,
    Message,
    ProgressSeen,
    RemainingPredicted,
    Rescan,
    Resync,
    Round,
    StartResult,
    StopFailed,
    Sweep,
    redeliver,
    redeliver_msg,
)
from gpusched.services.scheduler.live.metrics import SchedulerMetrics
from gpusched.services.scheduler.live.predictor import PredictorAsks
from gpusched.services.scheduler.live.publisher import Publisher
from gpusched.services.scheduler.live.registry import NodeRegistry
from gpusched.services.scheduler.live.reports import from_sender
from gpusched.services.scheduler.live.state import Layout, LiveJob, LiveNode, ScaledModel
from gpusched.services.scheduler.live.store import JobStore, RecordConflict
from gpusched.services.scheduler.policies.base import Policy


class LiveScheduler(Actor[Message]):
    """The actor: inputs in, the core's effects out (see the module's docstring)."""

    name = "scheduler"

    def __init__(
        self, config: SchedulerConfig, nc: Client, stores: Stores,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.core = SchedulerCore(config, metrics, self.log)
        #: the lease is lost: what waits in the inbox is no longer handled (``depose``)
        self.deposed = False
        # the adapters: every NATS and KV call of the actor goes through one of them
        self.store = JobStore(stores, self.log)
        self.registry = NodeRegistry(stores)
        self.commands = NodeCommands(nc, config, self.log, self.spawn, self.tell)
        self.predictor = PredictorAsks(
            nc, config, self.core.gpu_types,
            lambda: self.core.layout.cluster if self.core.layout else None,
            self.log, self.spawn, self.tell,
        )
        self.publisher = Publisher(nc, config.instance)
        #: inputs waiting for the next ``InputsDue`` (messages.py): stream messages and
        #: start results in order; reports the latest per sender, since a node's newer
        #: heartbeat says all an older one did and a run's newer progress likewise (a
        #: heartbeat's entry keeps when the oldest one it replaced was sent: input lag)
        self._stream: list[Msg] = []
        self._results: list[StartResult] = []
        self._beats: dict[str, tuple[Heartbeat, float]] = {}
        self._progress: dict[tuple[str, str], JobProgressEvent] = {}
        #: records read for a batch of stream messages before its first is handled
        #: (``_durables``); used only for a job neither in the picture nor settled
        self._prefetched: dict[str, tuple[JobRecord, int] | None] = {}

    # ---- what the service, benches and tests read of the core --------------------------
    @property
    def jobs(self) -> dict[str, LiveJob]:
        return self.core.jobs

    @property
    def nodes(self) -> dict[str, LiveNode]:
        return self.core.nodes

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.core.policy = policy

    # the core's figures and models, read through the actor (the service's status, benches)
    @property
    def layout(self) -> Layout | None:
        return self.core.layout

    @property
    def estimates(self) -> PerformanceModel:
        return self.core.estimates

    @property
    def scaled(self) -> ScaledModel:
        return self.core.scaled

    @property
    def gpu_types(self) -> GpuTypes:
        return self.core.gpu_types

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.core.metrics

    @property
    def liveness(self) -> Liveness:
        return self.core.liveness

    @property
    def settled(self) -> set[str]:
        return self.core.settled

    @property
    def rounds(self) -> int:
        return self.core.rounds

    @property
    def refused_decisions(self) -> int:
        return self.core.refused_decisions

    @property
    def last_decide_ms(self) -> float:
        return self.core.last_decide_ms

    @property
    def decide_ms(self) -> collections.deque[float]:
        return self.core.decide_ms

    @property
    def beat_lag_s(self) -> collections.deque[float]:
        return self.core.beat_lag_s

    @property
    def first_start_at(self) -> float | None:
        return self.core.first_start_at

    # ---- inputs handled together (``InputsDue``) ---------------------------------------
    def durables_arrived(self, msgs: list[Msg]) -> None:
        """Messages of the jobs or exits stream, acknowledged once handled."""
        if msgs:
            self._inputs_due()
            self._stream += msgs

    def beat_arrived(self, beat: Heartbeat) -> None:
        """A heartbeat: it replaces the node's one still waiting."""
        waiting = self._beats.get(beat.node)
        oldest = min(beat.at, waiting[1]) if waiting is not None else beat.at
        self._inputs_due()
        self._beats[beat.node] = (beat, oldest)

    def progress_arrived(self, event: JobProgressEvent) -> None:
        self._inputs_due()
        self._progress[(event.job_id, event.node)] = event

    def tell(self, message: Message) -> None:
        if isinstance(message, StartResult):  # from the node commands under way
            self._inputs_due()
            self._results.append(message)
        else:
            super().tell(message)

    def _inputs_due(self) -> None:
        if not (self._stream or self._results or self._beats or self._progress):
            super().tell(InputsDue())

    def depose(self) -> None:
        """No longer the leader: queued messages are not handled from now on (stored
        inputs go back to their stream for the next leader), so leaving does not wait on
        a backlog of writes, each of which may take a whole NATS timeout to fail."""
        self.deposed = True

    # ---- lifecycle ------------------------------------------------------------------
    async def on_start(self) -> None:
        await self._load_nodes()
        await self._load_jobs()
        self.every(self.config.decide_every_s, Round)
        self.every(min(1.0, self.config.node_timeout_s / 3), Sweep)
        self.every(timing.RESCAN_S, Rescan)
        self.log.info(
            "leading", policy=self.core.policy.name, jobs=len(self.core.jobs),
            nodes=len(self.core.nodes),
        )
        self.core._request_round()
        await self._carry_out()

    async def _load_nodes(self) -> None:
        now = time.time()
        # read at once: a thousand registrations one after another hold the takeover
        names = await self.registry.names()
        found = await asyncio.gather(*(self.registry.registration(key) for key in names))
        for info in found:
            if info is not None:
                # a node gets a whole timeout to show it is alive after a takeover
                self.core.nodes[info.name] = LiveNode(info, last_beat=now)
        self.core._relayout()

    async def _load_jobs(self) -> None:
        """Read the unfinished jobs only: the live index, not every job ever stored."""
        for key, record, revision in await self.store.unfinished():
            self.core.take(key, record, revision)

    async def _adopt(self, job_id: str) -> LiveJob | None:
        """Take a stored record into the picture (a submission, a cancel)."""
        if job_id in self.core.jobs:
            return self.core.jobs[job_id]
        if job_id in self._prefetched and job_id not in self.core.settled:
            stored = self._prefetched.pop(job_id)
        else:
            stored = await self.store.read(job_id)
        if stored is None:
            return None
        job = self.core.take(job_id, *stored)
        if job is not None:
            # carried out with the step's other effects, before the input is acknowledged
            self.core.effects.append(MarkLive(job_id))
        return job

    async def _rescan(self) -> None:
        """Adopt indexed jobs whose submission message never came (a crash between the
        writes of a submit), and drop index entries of finished jobs or of records never
        written. A job that cannot be read now is left to the next rescan."""
        try:
            keys = await self.store.live_job_ids()
        except Exception as exc:
            self.log.debug("rescan failed", error=str(exc))
            return
        for key in keys:
            if key in self.core.jobs:
                continue
            try:
                await self._rescan_one(key)
                await self._carry_out()
            except RecordConflict as conflict:
                self.tell(Resync(conflict.job_id))
            except Exception as exc:
                self.log.warning("rescan could not read a job; the next one tries again",
                                 job_id=key, error=repr(exc))

    async def _rescan_one(self, key: str) -> None:
        if key in self.core.settled:
            await self.store.unmark_live(key)
            return
        # the entry before the record: a submission retried after this read enters
        # the job again (a later revision) before it writes the record
        mark = await self.store.live_mark(key)
        stored = await self.store.read(key)
        if stored is None:
            if mark is not None and time.time() - mark[0] > timing.ORPHAN_INDEX_S:
                # only the entry read: one made since by a retried submission stays
                await self.store.unmark_live(key, mark[1])
            return
        if self.core.take(key, *stored) is not None:
            self.log.info("adopted a job without a submission message", job_id=key)
            self.core._request_round()

    async def _resync(self, job_id: str, why: str) -> None:
        """Forget our picture of a job whose record another writer changed, or whose
        write failed, and take the stored one instead: it is newer than anything we
        know. Until the record can be read the picture stays (forgetting the job would
        free GPUs it may hold) and a ``Resync`` asks again."""
        self.log.warning("reading a job's record back", job_id=job_id, why=why)
        try:
            stored = await self.store.read(job_id)
        except Exception as exc:
            self.log.warning("record not read back; trying again", job_id=job_id,
                             error=repr(exc))
            self._later(timing.RESYNC_RETRY_S, Resync(job_id))
            return
        self.core.jobs.pop(job_id, None)
        self.core.settled.discard(job_id)
        if stored is not None:
            self.core.take(job_id, *stored)
        self.core._request_round()

    def _later(self, delay_s: float, message: Message) -> None:
        async def tell() -> None:
            await asyncio.sleep(delay_s)
            self.tell(message)

        self.spawn(tell())

    async def _write(self, job: LiveJob, record: JobRecord) -> None:
        """Compare-and-set the job's record now (``JobStore.write``), outside any step of
        the core (tests/test_scheduler_hardening.py writes through it)."""
        await self.store.write(job, record)

    # ---- the core's effects -----------------------------------------------------------
    async def _carry_out(self) -> None:
        """Carry out the effects the core listed. Each job's effects go in their order,
        each after the one before it (a start command after the write of its run's
        record; a record written at the revision its previous write gave); the effects
        of different jobs are under way together, since no job's record depends on
        another's, and the step waits for all of them. Effects of no job (a round, a
        question about a model) go at their place. A record write that fails
        (``RecordConflict``) stops its job's later effects; every other job stopped is
        read back from the store, and the first conflict is raised for the caller to
        read that job back (and hand a stored input back) too."""
        effects = self.core.take_effects()
        chains: dict[str, asyncio.Future[None]] = {}
        room = asyncio.Semaphore(timing.EFFECTS_IN_FLIGHT)
        error: BaseException | None = None
        try:
            for effect in effects:
                job_id = job_of(effect)
                if job_id is None:
                    await self._do(effect)
                else:
                    chains[job_id] = asyncio.ensure_future(
                        self._after(chains.get(job_id), effect, room)
                    )
        except BaseException as exc:
            error = exc
        ends = await asyncio.gather(*chains.values(), return_exceptions=True)
        failed = {
            job_id: end for job_id, end in zip(chains, ends, strict=True)
            if isinstance(end, BaseException)
        }
        conflicts = [end for end in failed.values() if isinstance(end, RecordConflict)]
        if error is None:
            error = next((e for e in failed.values() if not isinstance(e, RecordConflict)),
                         conflicts[0] if conflicts else None)
        for job_id in failed:
            if error is not failed[job_id] or not isinstance(error, RecordConflict):
                self.tell(Resync(job_id))
        if error is not None:
            raise error

    async def _after(self, previous: asyncio.Future[None] | None, effect: Effect,
                     room: asyncio.Semaphore) -> None:
        """One of a job's effects, after its previous one; not carried out when that one
        failed (its error is raised again)."""
        if previous is not None:
            await previous
        async with room:
            await self._do(effect)

    async def _do(self, effect: Effect) -> None:
        match effect:
            case WriteRecord(job, record, partner=False):
                await self.store.write(job, record)
            case WriteRecord(job, record, partner=True):
                try:
                    await self.store.write(job, record)
                except RecordConflict as failed:
                    self.log.warning("partner record not written", job_id=job.id,
                                     error=str(failed))
                    self.tell(Resync(job.id))
            case MarkLive(job_id):
                await self.store.mark_live(job_id)
            case UnmarkLive(job_id):
                await self.store.unmark_live(job_id)
            case StartRun(record, placement):
                self.commands.start(record, placement)
            case StopRun(node, job_id, run_id, reason):
                self.commands.stop(node, job_id, run_id, reason)
            case ResizeRun(job_id, run_id, new_run_id, part, batch_size, accum_steps):
                self.commands.resize(job_id, run_id, new_run_id, part, batch_size, accum_steps)
            case ReallocateRun(record):
                self.commands.reallocate(record)
            case AskEstimate(record):
                self.predictor.ask_estimate(record)
            case AskComputeProfile(model):
                self.predictor.ask_compute_profile(model)
            case AskRemaining(record, iteration):
                self.predictor.ask_remaining(record, iteration)
            case AskGpuProfile(gpu_type):
                self.predictor.ask_gpu_profile(gpu_type)
            case PublishState(job_id, state, reason, placement):
                await self.publisher.job_state(job_id, state, reason, placement)
            case PublishDecision(summary):
                await self.publisher.decision(summary)
            case RequestRound():
                self.tell(Round())

    # ---- dispatch -------------------------------------------------------------------
    async def handle(self, message: Message) -> None:
        if self.deposed:
            await redeliver(message, first_s=0.0)
            if isinstance(message, InputsDue):
                for msg in self._stream:
                    await redeliver_msg(msg, first_s=0.0)
                self._stream = []
            return
        try:
            await self._handle(message)
            await self._carry_out()
        except RecordConflict as conflict:
            # handled against a record that was not the latest, or one whose write
            # failed: a stored input is handled again later, from the stored record
            await redeliver(message)
            await self._resync(conflict.job_id, str(conflict))
            await self._carry_out_after_resync()
        except Exception:
            # a NATS call failed (a timeout, a store that cannot write): a stored input
            # is handled again later, never dropped
            await redeliver(message)
            raise

    async def _carry_out_after_resync(self) -> None:
        try:
            await self._carry_out()
        except RecordConflict as conflict:
            self.tell(Resync(conflict.job_id))

    async def _handle(self, message: Message) -> None:
        core = self.core
        match message:
            case Durable(msg):
                core.metrics.durable_seen(msg)
                await self._durable(msg)

            case Beat(heartbeat):
                core.metrics.input_seen("heartbeat", heartbeat.at)
                await self._beat(heartbeat)
            case InputsDue():
                await self._inputs()
            case ProgressSeen(event):
                core.metrics.input_seen("progress", event.progress.at)
                core.progress(event)
            case Round():
                core.round()
                core.metrics.observe(core.jobs, core.nodes)
            case Sweep():
                await self._sweep()
            case Rescan():
                await self._rescan()
            case Resync(job_id):
                await self._resync(job_id, "reading it back again")
            case StartResult():
                core.start_result(message)
            case Estimated(job_id, batch_size, gpus, iteration_s):
                core.estimated(job_id, batch_size, gpus, iteration_s)
            case RemainingPredicted(job_id, run_id, iteration, remaining):
                core.remaining_predicted(job_id, run_id, iteration, remaining)
            case Measured(profile):
                core.cpu_measured(profile)
            case ComputeMeasured(profile):
                core.compute_measured(profile)
            case GpuMeasured(profile):
                core.gpu_measured(profile)
            case StopFailed():
                self.log.warning("stop not confirmed", job_id=message.job_id, error=message.error)

    async def _durable(self, msg: Msg) -> None:
        await self._durable_step(msg)
        # what the input changed is written before it is acknowledged
        await self._carry_out()
        await msg.ack()

    async def _inputs(self) -> None:
        """Every input waiting (``InputsDue``), one step: the records of the jobs the
        stream messages submit are read at once, the inputs handed to the core (stream
        messages and start results in order, then each node's latest heartbeat and each
        run's latest progress), their effects carried out together, and only then each
        stream message acknowledged. A stream message whose handling failed, or every
        one where carrying the effects out failed, goes back to its stream; handling
        one again changes nothing already done."""
        msgs, self._stream = self._stream, []
        results, self._results = self._results, []
        beats, self._beats = self._beats, {}
        progress, self._progress = self._progress, {}
        failed: set[int] = set()  # ids of the messages whose handling failed
        try:
            await self._prefetch(msgs)
            for msg in msgs:
                self.core.metrics.durable_seen(msg)
                try:
                    await self._durable_step(msg)
                except Exception as exc:
                    self.log.warning("stream message not handled; handed back",
                                     subject=msg.subject, error=repr(exc))
                    failed.add(id(msg))
        except BaseException:
            for msg in msgs:
                await redeliver_msg(msg)
            raise
        finally:
            self._prefetched = {}
        for result in results:
            self.core.start_result(result)
        await self._join([node for node in beats if node not in self.core.nodes])
        now = time.time()
        for beat, oldest in beats.values():
            self.core.metrics.input_seen("heartbeat", oldest)
            if oldest < beat.at:  # the heartbeat it replaced waited longer
                self.core.beat_lag_s.append(max(0.0, now - oldest))
            self.core.beat(beat)
        for event in progress.values():
            self.core.metrics.input_seen("progress", event.progress.at)
            self.core.progress(event)
        try:
            await self._carry_out()
        except BaseException:
            for msg in msgs:
                await redeliver_msg(msg)
            raise
        for msg in msgs:
            if id(msg) in failed:
                await redeliver_msg(msg)
            else:
                await msg.ack()

    async def _prefetch(self, msgs: list[Msg]) -> None:
        """Read at once the records of the jobs ``msgs`` submit that the picture does
        not hold (``_adopt`` takes them instead of reading each in turn)."""
        wanted = [
            job_id for job_id in dict.fromkeys(
                msg.subject.split(".")[2] for msg in msgs
                if subjects.node_of(msg.subject) is None
                and msg.subject.rsplit(".", 1)[-1] == "submitted"
            )
            if job_id not in self.core.jobs and job_id not in self.core.settled
        ]
        records = await asyncio.gather(*(self.store.read(job_id) for job_id in wanted))
        self._prefetched = dict(zip(wanted, records, strict=True))

    async def _durable_step(self, msg: Msg) -> None:
        event = msg.subject.rsplit(".", 1)[-1]
        try:
            if subjects.node_of(msg.subject) is not None:
                # the exits stream: gpusched.node.<node>.job.<id>.exit
                exit = from_sender(msg, codec.decode(msg.data, JobExit), self.core.metrics,
                                   "exit")
                if exit is not None:
                    self.core.exit(exit)
            elif event == "submitted":
                job_id = msg.subject.split(".")[2]
                if await self._adopt(job_id) is not None:
                    self.core._request_round()
            elif event == "cancel":
                await self._cancel(codec.decode(msg.data, CancelRequest))
            elif event == "exit":
                # stored in the jobs stream before exits had a stream of their own
                self.core.exit(codec.decode(msg.data, JobExit))
            elif event == "predicted_size":
                await self._size_predicted(codec.decode(msg.data, SizePredicted))
        except msgspec.DecodeError as exc:
            self.log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))

    async def _cancel(self, request: CancelRequest) -> None:
        job = self.core.jobs.get(request.job_id) or await self._adopt(request.job_id)
        if job is not None:
            self.core.cancel(job)

    async def _size_predicted(self, predicted: SizePredicted) -> None:
        if predicted.job_id in self.core.settled:
            return
        job = self.core.jobs.get(predicted.job_id) or await self._adopt(predicted.job_id)
        if job is not None:
            self.core.size_predicted(job, predicted)

    async def _join(self, names: list[str]) -> None:
        """Read the registrations of nodes new to the picture at once and take them in
        (``SchedulerCore.join``); one not read is tried again with its next heartbeat."""
        found = await asyncio.gather(
            *(self.registry.registration(name) for name in names), return_exceptions=True
        )
        for name, info in zip(names, found, strict=True):
            if isinstance(info, BaseException):
                self.log.warning("registration not read", node=name, error=repr(info))
        self.core.join([info for info in found if isinstance(info, NodeInfo)])

    async def _beat(self, beat: Heartbeat) -> None:
        registration = None
        if beat.node not in self.core.nodes:
            registration = await self.registry.registration(beat.node)
        self.core.beat(beat, registration)

    async def _sweep(self) -> None:
        try:
            registered: set[str] | None = set(await self.registry.names())
        except Exception:
            registered = None
        found = self.core.sweep(registered)
        # looked for at once: a sweep after a stall finds many, each a round trip
        exits = await asyncio.gather(
            *(self.store.stored_exit(job) for job, _ in found), return_exceptions=True
        )
        for (job, why), exit in zip(found, exits, strict=True):
            if isinstance(exit, BaseException):
                # not knowing whether it ended is no reason to run it twice: ask again later
                self.log.warning("cannot look for a stored exit; job left as it is",
                                 job_id=job.id, error=repr(exit))
                continue
            self.core.lost(job, why, exit)
