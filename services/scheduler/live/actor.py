"""The live scheduler: the simulator's policies driven by NATS instead of a virtual clock.

One instance leads (it holds the KV lease); the others wait as hot standbys. The leader
keeps its picture of the cluster in one actor (``LiveScheduler``): job records from KV,
nodes from their registrations and heartbeats. Each round it builds a frozen snapshot,
asks the policy, and applies the decision by request/reply commands to node agents.
Durable inputs (submissions, cancels, exits) come from a JetStream pull consumer and are
acknowledged only once handled, so a crash of the leader loses none of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
import structlog
from msgspec.structs import replace
from nats import micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.actor import Actor
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.compute_model import with_compute_profile
from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.schemas import (
    CancelRequest,
    ComputeProfile,
    CpuProfile,
    DecisionSummary,
    Heartbeat,
    IdStr,
    JobExit,
    JobProgressEvent,
    JobRecord,
    JobState,
    MeasuredProfile,
    Progress,
    SizePredicted,
    StateChange,
    split_problem,
)
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.decision import Decision, Reallocate, Resize, Start, decision_problems
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.perf import PerformanceModel, UnknownModelError
from gpusched.libs.core.progress import MIN_EPOCHS
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.gpu_types import GpuMeasured, GpuTypes
from gpusched.services.scheduler.lease import LeaderLease
from gpusched.services.scheduler.live import timing
from gpusched.services.scheduler.live.commands import NodeCommands
from gpusched.services.scheduler.live.liveness import Liveness
from gpusched.services.scheduler.live.messages import (
    Beat,
    ComputeMeasured,
    Durable,
    Estimated,
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
)
from gpusched.services.scheduler.live.predictor import PredictorAsks
from gpusched.services.scheduler.live.publisher import Publisher
from gpusched.services.scheduler.live.registry import NodeRegistry
from gpusched.services.scheduler.live.store import JobStore, RecordConflict
from gpusched.services.scheduler.metrics import SchedulerMetrics
from gpusched.services.scheduler.policies import honours_priority, make_policy
from gpusched.services.scheduler.policies.base import Policy
from gpusched.services.scheduler.state import (
    Layout,
    LiveJob,
    LiveNode,
    Phase,
    ScaledModel,
    build_snapshot,
    consolidated_nodes,
    finish_estimates,
)

log = structlog.get_logger("gpusched.scheduler")

SCHEDULER_VERSION = "0.1.0"

class LiveScheduler(Actor[Message]):
    name = "scheduler"

    def __init__(
        self, config: SchedulerConfig, nc: Client, stores: Stores,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.metrics = metrics or SchedulerMetrics()
        self.policy = make_policy(config.policy, config.time_scale, config.max_resident_slowdown)
        truth: PerformanceModel = load_performance_model(config.data_dir)
        self.scaled = ScaledModel(truth, config.time_scale)
        self.estimates: PerformanceModel = self.scaled
        #: measured profiles per GPU type, and the type jobs are timed on (gpu_types.py)
        self.gpu_types = GpuTypes()
        #: ONES: running jobs' remaining iterations come from the progress predictor
        self.predicts_progress = self.policy.capabilities.predicts_progress
        self.jobs: dict[str, LiveJob] = {}
        #: ids of jobs known to be finished, so a late message does not read them again
        self.settled: set[str] = set()
        self.nodes: dict[str, LiveNode] = {}
        self.liveness = Liveness()
        #: when the first round after taking the lead started a job (None: not yet)
        self.first_start_at: float | None = None  # see bench/takeover.py
        self.layout: Layout | None = None
        self.round_queued = False
        self.rounds = 0
        #: decisions not applied because ``decision_problems`` found them broken
        self.refused_decisions = 0
        self.last_decide_ms = 0.0
        self.wake_at: float | None = None
        self.leading_since = time.time()
        #: how long heartbeats waited before this actor saw them (its input lag)
        self.beat_lag_s: collections.deque[float] = collections.deque(maxlen=10_000)
        self.decide_ms: collections.deque[float] = collections.deque(maxlen=10_000)
        #: the lease is lost: what waits in the inbox is no longer handled (``depose``)
        self.deposed = False
        # the adapters: every NATS and KV call of the actor goes through one of them
        self.store = JobStore(stores, self.log)
        self.registry = NodeRegistry(stores)
        self.commands = NodeCommands(nc, config, self.log, self.spawn, self.tell)
        self.predictor = PredictorAsks(
            nc, config, self.gpu_types, lambda: self.layout.cluster if self.layout else None,
            self.log, self.spawn, self.tell,
        )
        self.publisher = Publisher(nc, config.instance)

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
            "leading", policy=self.policy.name, jobs=len(self.jobs), nodes=len(self.nodes)
        )
        self._request_round()

    async def _load_nodes(self) -> None:
        now = time.time()
        for key in await self.registry.names():
            info = await self.registry.registration(key)
            if info is not None:
                # a node gets a whole timeout to show it is alive after a takeover
                self.nodes[info.name] = LiveNode(info, last_beat=now)
        self._relayout()

    async def _load_jobs(self) -> None:
        """Read the unfinished jobs only: the live index, not every job ever stored."""
        for key, record, revision in await self.store.unfinished():
            await self._take(key, record, revision)

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
            if key in self.jobs:
                continue
            try:
                await self._rescan_one(key)
            except RecordConflict as conflict:
                self.tell(Resync(conflict.job_id))
            except Exception as exc:
                self.log.warning("rescan could not read a job; the next one tries again",
                                 job_id=key, error=repr(exc))

    async def _rescan_one(self, key: str) -> None:
        if key in self.settled:
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
        if await self._take(key, *stored) is not None:
            self.log.info("adopted a job without a submission message", job_id=key)
            self._request_round()

    async def _adopt(self, job_id: str) -> LiveJob | None:
        """Take a stored record into the picture (a submission, a cancel)."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        stored = await self.store.read(job_id)
        if stored is None:
            return None
        job = await self._take(job_id, *stored)
        if job is not None:
            await self.store.mark_live(job_id)
        return job

    async def _take(self, job_id: str, record: JobRecord, revision: int) -> LiveJob | None:
        if job_id in self.jobs:
            return self.jobs[job_id]
        if record.state.terminal:
            self.settled.add(job_id)
            await self.store.unmark_live(job_id)
            return None
        try:
            est = self._profiled_iteration_s(record)
        except UnknownModelError as exc:
            job = LiveJob(record, revision, est_iteration_s=0.0)
            self.jobs[job_id] = job
            await self._finish(job, JobState.FAILED, str(exc))
            return None
        now = time.time()
        job = LiveJob(
            record,
            revision,
            est_iteration_s=est,
            queued_since=record.history[-1].at if record.history else record.submitted_at,
            iteration=record.progress.iteration,
            iteration_at=record.progress.at or now,
            last_seen=now,
        )
        if record.state is JobState.RUNNING:
            job.phase = Phase.STOPPING if record.cancel_requested else Phase.RUNNING
            job.stop_reason = "cancel" if record.cancel_requested else ""
        elif record.placement:
            # a waiting record keeps a placement only while its start is in flight: the
            # leader that sent it is gone, and its run may be alive (or already ended)
            job.phase = Phase.STARTING
            job.unconfirmed_start = True
        self.jobs[job_id] = job
        # the profile answers now; the predictor's (learned) figure replaces it when it comes
        self.predictor.ask_estimate(record)
        self.predictor.ask_compute_profile(record.current_spec.model)
        return job

    def _profiled_iteration_s(self, record: JobRecord) -> float:
        spec = record.current_spec
        nodes = consolidated_nodes(spec.gpus, self.layout.cluster if self.layout else None)
        return self.estimates.iteration_time(spec.model, spec.batch_size, spec.gpus, nodes)

    # ---- dispatch -------------------------------------------------------------------
    async def handle(self, message: Message) -> None:
        if self.deposed:
            await redeliver(message, first_s=0.0)
            return
        try:
            await self._handle(message)
        except RecordConflict as conflict:
            # handled against a record that was not the latest, or one whose write
            # failed: a stored input is handled again later, from the stored record
            await redeliver(message)
            await self._resync(conflict.job_id, str(conflict))
        except Exception:
            # a NATS call failed (a timeout, a store that cannot write): a stored input
            # is handled again later, never dropped
            await redeliver(message)
            raise

    async def _handle(self, message: Message) -> None:
        match message:
            case Durable(msg):
                self.metrics.durable_seen(msg)
                await self._durable(msg)
            case Beat(heartbeat):
                self.metrics.input_seen("heartbeat", heartbeat.at)
                await self._beat(heartbeat)
            case ProgressSeen(event):
                self.metrics.input_seen("progress", event.progress.at)
                await self._progress(event)
            case Round():
                self.round_queued = False
                await self._round()
                self.metrics.observe(self.jobs, self.nodes)
            case Sweep():
                await self._sweep()
            case Rescan():
                await self._rescan()
            case Resync(job_id):
                await self._resync(job_id, "reading it back again")
            case StartResult():
                await self._start_result(message)
            case Estimated(job_id, batch_size, gpus, iteration_s):
                job = self.jobs.get(job_id)
                if job is not None:
                    spec = job.record.current_spec
                    if (spec.batch_size, spec.gpus) == (batch_size, gpus):
                        job.est_iteration_s = iteration_s
            case RemainingPredicted(job_id, run_id, iteration, remaining):
                job = self.jobs.get(job_id)
                if job is not None and job.record.run_id == run_id:
                    job.predicted_remaining, job.predicted_at = remaining, iteration
                    job.predicted_run = run_id
            case Measured(profile):
                # a new model object: policies recompute what they derived from the old
                self.scaled = self.scaled.with_measured(Sensitivity(profile))
                self.estimates = self.gpu_types.over(self.scaled)
                self.log.info("using a measured CPU profile", model=profile.model)
                self._request_round()
            case ComputeMeasured(profile):
                # GENIE: the model's iteration times from its profiling run and the
                # platform model; its jobs are estimated again
                inner = with_compute_profile(self.scaled.inner, profile)
                self.scaled = ScaledModel(inner, self.scaled.time_scale, self.scaled.measured)
                self.estimates = self.gpu_types.over(self.scaled)
                for job in self.jobs.values():
                    if job.record.current_spec.model == profile.model:
                        self._reestimate(job)
                self.log.info("using a compute profile", model=profile.model)
                self._request_round()
            case GpuMeasured(profile):
                self._gpu_measured(profile)
            case StopFailed():
                self.log.warning("stop not confirmed", job_id=message.job_id, error=message.error)

    def _gpu_measured(self, profile: MeasuredProfile) -> None:
        """A GPU type's measured profile: where it is the cluster's type, the changed
        models' jobs are timed from it and asked of the predictor again."""
        try:
            changed = self.gpu_types.take(profile)
        except ValueError as exc:
            self.log.warning("unreadable measured profile", error=str(exc))
            return
        if not changed:
            return
        self.estimates = self.gpu_types.over(self.scaled)
        for job in self.jobs.values():
            if job.record.current_spec.model in changed:
                self._reestimate(job)  # and asks the predictor again
        self.log.info("using measured figures", gpu_type=profile.gpu_type, models=sorted(changed))
        self._request_round()

    def _request_round(self) -> None:
        if not self.round_queued:
            self.round_queued = True
            self.tell(Round())

    async def _durable(self, msg: Msg) -> None:
        event = msg.subject.rsplit(".", 1)[-1]
        try:
            if subjects.node_of(msg.subject) is not None:
                # the exits stream: gpusched.node.<node>.job.<id>.exit
                exit = _from_sender(msg, codec.decode(msg.data, JobExit), self.metrics, "exit")
                if exit is not None:
                    await self._exit(exit)
            elif event == "submitted":
                job_id = msg.subject.split(".")[2]
                if await self._adopt(job_id) is not None:
                    self._request_round()
            elif event == "cancel":
                await self._cancel(codec.decode(msg.data, CancelRequest))
            elif event == "exit":
                # stored in the jobs stream before exits had a stream of their own
                await self._exit(codec.decode(msg.data, JobExit))
            elif event == "predicted_size":
                await self._size_predicted(codec.decode(msg.data, SizePredicted))
        except msgspec.DecodeError as exc:
            self.log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))
        await msg.ack()

    # ---- records --------------------------------------------------------------------
    async def _write(self, job: LiveJob, record: JobRecord) -> None:
        """Compare-and-set the job's record (``JobStore.write``). The actor's own steps
        call the store; this stays for callers of the one-module scheduler
        (tests/test_scheduler_hardening.py writes through it)."""
        await self.store.write(job, record)

    async def _write_partner(self, partner: LiveJob, record: JobRecord) -> None:
        """A write of another job's record on the way: its failure is that job's, read
        back after this message, and does not stop the step under way."""
        try:
            await self.store.write(partner, record)
        except RecordConflict as failed:
            self.log.warning("partner record not written", job_id=partner.id, error=str(failed))
            self.tell(Resync(partner.id))

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
        self.jobs.pop(job_id, None)
        self.settled.discard(job_id)
        if stored is not None:
            await self._take(job_id, *stored)
        self._request_round()

    def _later(self, delay_s: float, message: Message) -> None:
        async def tell() -> None:
            await asyncio.sleep(delay_s)
            self.tell(message)

        self.spawn(tell())

    async def _transition(
        self, job: LiveJob, state: JobState, reason: str, **changes: Any
    ) -> None:
        now = time.time()
        record = replace(
            job.record,
            state=state,
            history=[*job.record.history, StateChange(state, now, reason)],
            pending_reason=reason if state.waiting else "",
            **changes,
        )
        await self.store.write(job, record)
        self.metrics.transitioned(state.value, reason)
        await self.publisher.job_state(job, reason)

    async def _share_with(self, job: LiveJob, partners: Sequence[str]) -> None:
        """A job that joins residents' GPUs is named in each resident's ``shares_with``
        too, so both records of a shared GPU name each other."""
        for partner_id in partners:
            partner = self.jobs.get(partner_id)
            if partner is not None and job.id not in partner.record.shares_with:
                shares = [*partner.record.shares_with, job.id]
                await self._write_partner(partner, replace(partner.record, shares_with=shares))

    async def _unshare(self, job: LiveJob) -> None:
        """A job leaving its GPUs leaves its partners' ``shares_with``."""
        for partner_id in job.record.shares_with:
            partner = self.jobs.get(partner_id)
            if partner is not None and job.id in partner.record.shares_with:
                shares = [p for p in partner.record.shares_with if p != job.id]
                await self._write_partner(partner, replace(partner.record, shares_with=shares))

    async def _finish(self, job: LiveJob, state: JobState, reason: str, **changes: Any) -> None:
        job.settle_service(time.time())
        await self._unshare(job)
        await self._transition(job, state, reason, **changes)
        self.jobs.pop(job.id, None)
        self.settled.add(job.id)
        await self.store.unmark_live(job.id)
        self._request_round()

    async def _requeue(self, job: LiveJob, state: JobState, reason: str, **changes: Any) -> None:
        job.phase = Phase.WAITING
        job.stop_reason = ""
        job.resizing_from = None
        job.unconfirmed_start = False
        job.queued_since = time.time()
        job.settle_service(job.queued_since)
        await self._unshare(job)
        await self._transition(job, state, reason, placement=[], shares_with=[], **changes)
        self._request_round()

    # ---- inputs ---------------------------------------------------------------------
    async def _cancel(self, request: CancelRequest) -> None:
        job = self.jobs.get(request.job_id) or await self._adopt(request.job_id)
        if job is None:
            return
        if job.phase == Phase.WAITING:
            await self._finish(job, JobState.CANCELLED, "cancelled by the user")
            return
        if job.stop_reason == "cancel":
            return
        await self.store.write(job, replace(job.record, cancel_requested=True))
        self._stop(job, "cancel")

    async def _size_predicted(self, predicted: SizePredicted) -> None:
        """Keep the predictor's figure for the job in its record (the first one stands),
        where a restarted leader finds it; a forest's figure is what the job's estimates
        believe from now on, whether it waits or runs (state.remaining_iterations)."""
        if predicted.job_id in self.settled:
            return
        job = self.jobs.get(predicted.job_id) or await self._adopt(predicted.job_id)
        if job is None or job.record.prediction_source is not None:
            return
        await self.store.write(job, replace(job.record, predicted_iterations=predicted.iterations,
                                            prediction_source=predicted.source))
        self.log.info("predicted size", job_id=job.id, iterations=round(predicted.iterations),
                      source=predicted.source, declared=job.record.total_iterations)
        self._request_round()

    async def _exit(self, exit: JobExit) -> None:
        job = self.jobs.get(exit.job_id)
        if job is None or exit.run_id != job.record.run_id or job.phase == Phase.WAITING:
            return  # a report from an earlier run, or of a job already settled
        if not self._from_leader(job, "exit", exit.node):
            return
        log = self.log.bind(job_id=job.id, node=exit.node)
        self._stop_followers(job, exit.node)
        # the run's own last word (its final loss too), else the last progress it streamed
        final = exit.progress or job.progress or job.record.progress
        progress = replace(final, iteration=exit.iteration, at=exit.at)
        job.iteration, job.iteration_at = exit.iteration, time.time()
        if exit.outcome == "succeeded":
            log.info("job succeeded")
            await self._finish(job, JobState.SUCCEEDED, "finished", progress=progress,
                               exit_code=exit.exit_code)
        elif job.stop_reason == "cancel" or job.record.cancel_requested:
            await self._finish(job, JobState.CANCELLED, "cancelled by the user",
                               progress=progress, placement=[])
        elif exit.outcome == "stopped":
            why = "preempted" if job.stop_reason == "preempt" else f"stopped on {exit.node}"
            await self._requeue(job, JobState.PREEMPTED, why, progress=progress,
                                preemptions=job.record.preemptions + 1)
        else:
            await self._failed(job, exit, progress)

    async def _failed(self, job: LiveJob, exit: JobExit, progress: Progress) -> None:
        attempts = job.record.attempts + 1
        tail = exit.stderr_tail.strip()
        what = f"exit code {exit.exit_code}" + (f": {tail[-300:]}" if tail else "")
        if attempts > job.record.spec.max_retries:
            self.log.warning("job failed", job_id=job.id, attempts=attempts)
            await self._finish(
                job, JobState.FAILED, f"failed after {attempts} attempts; {what}",
                progress=progress, attempts=attempts, exit_code=exit.exit_code,
                error=exit.stderr_tail, placement=[],
            )
            return
        delay = min(self.config.retry_backoff_max_s,
                    self.config.retry_backoff_s * 2 ** (attempts - 1))
        job.not_before = time.time() + delay
        await self._requeue(
            job, JobState.QUEUED,
            f"retry {attempts}/{job.record.spec.max_retries} in {delay:.0f} s after {what}",
            progress=progress, attempts=attempts, exit_code=exit.exit_code,
            error=exit.stderr_tail,
        )

    def _from_leader(self, job: LiveJob, kind: str, node: str) -> bool:
        """Whether ``node`` (the sender, from the subject) leads the job's current run:
        only that node may report its progress or end it. Another node's report is
        dropped, with a warning and a count."""
        placement = job.record.placement
        if placement and placement[0].node == node:
            return True
        self.metrics.report_refused(kind)
        self.log.warning("report from a node not running the job dropped", kind=kind,
                         job_id=job.id, node=node,
                         leader=placement[0].node if placement else None)
        return False

    async def _progress(self, event: JobProgressEvent) -> None:
        job = self.jobs.get(event.job_id)
        if job is None or event.run_id != job.record.run_id:
            return
        if not self._from_leader(job, "progress", event.node):
            return
        job.iteration = event.progress.iteration
        job.progress = event.progress
        job.iteration_at = time.time()
        job.last_seen = job.iteration_at
        epoch = event.progress.epoch
        if self.predicts_progress and epoch is not None and epoch >= MIN_EPOCHS:
            whole = math.floor(epoch + 1e-9)
            if whole > job.asked_epoch:  # once per epoch: the prediction changes no faster
                job.asked_epoch = whole
                self.predictor.ask_remaining(job.record, job.iteration)
        if job.iteration_at - job.last_progress_write >= self.config.progress_write_s:
            job.last_progress_write = job.iteration_at
            await self.store.write(job, replace(job.record, progress=event.progress))

    async def _beat(self, beat: Heartbeat) -> None:
        now = time.time()
        self.beat_lag_s.append(max(0.0, now - beat.at))
        node = self.nodes.get(beat.node)
        if node is None:
            info = await self.registry.registration(beat.node)
            if info is not None:
                node = LiveNode(info, last_beat=now)
                self.nodes[beat.node] = node
                self._relayout()
                self.log.info("node joined", node=beat.node)
                self._request_round()
            if node is None:
                return
        node.last_beat = now
        node.reported = {r.job_id: r.run_id for r in beat.running}
        for running in beat.running:
            job = self.jobs.get(running.job_id)
            if job is not None and job.holds_gpus and running.run_id in (
                job.record.run_id, job.resizing_from
            ) and any(part.node == beat.node for part in job.record.placement):
                job.last_seen = now
                if job.unconfirmed_start and running.run_id == job.record.run_id:
                    await self._confirm_start(job)
                continue
            # the node runs something we did not start (or no longer want): truth wins,
            # and what is not ours to run is stopped
            self.commands.stop(beat.node, running.job_id, running.run_id, "lost")

    async def _sweep(self) -> None:
        now = time.time()
        self.liveness.forget_runs_before(now - self.config.missing_job_grace_s)
        await self._refresh_nodes()
        lost = [
            n for n in self.nodes.values()
            if now - self._node_seen(n) > self.config.node_timeout_s
        ]
        for node in lost:
            self.log.warning("node lost: heartbeats stopped", node=node.name)
            del self.nodes[node.name]
        if lost:
            self._relayout()
        gone = {n.name for n in lost}
        for job in list(self.jobs.values()):
            if not job.holds_gpus:
                if job.not_before and job.not_before <= now:
                    job.not_before = 0.0
                    self._request_round()
                continue
            nodes = {p.node for p in job.record.placement}
            if nodes & gone or any(n not in self.nodes for n in nodes):
                await self._lost(job, f"node {', '.join(sorted(nodes))} lost")
            elif (
                job.phase in (Phase.RUNNING, Phase.STOPPING)
                and now - self._job_seen(job) > self.config.missing_job_grace_s
            ):
                await self._lost(job, "its node no longer reports it running")
            elif (
                job.unconfirmed_start
                and now - self._job_seen(job) > self.config.missing_job_grace_s
            ):
                await self._lost(job, "its node never reported its start")
        if self.wake_at is not None and now >= self.wake_at:
            self.wake_at = None
            self._request_round()

    def _node_seen(self, node: LiveNode) -> float:
        """When the node's last heartbeat arrived: deregistration (``last_beat`` set to
        0) overrides what arrived before it."""
        if node.last_beat == 0.0:
            return 0.0
        return max(node.last_beat, self.liveness.node_seen(node.name))

    def _job_seen(self, job: LiveJob) -> float:
        nodes = {part.node for part in job.record.placement}
        return max(
            job.last_seen,
            self.liveness.run_seen(job.id, job.record.run_id, nodes),
            self.liveness.run_seen(job.id, job.resizing_from, nodes),
        )

    async def _refresh_nodes(self) -> None:
        """Deregistered nodes leave at once rather than after a heartbeat timeout."""
        try:
            keys = set(await self.registry.names())
        except Exception:
            return
        for name in [n for n in self.nodes if n not in keys]:
            self.nodes[name].last_beat = 0.0

    async def _lost(self, job: LiveJob, why: str) -> None:
        # a run that ended has its exit stored before its node forgets it: that exit, not
        # a requeue, is the job's fate, or a finished job would run again
        try:
            exit = await self.store.stored_exit(job)
        except Exception as exc:
            # not knowing whether it ended is no reason to run it twice: ask again later
            self.log.warning("cannot look for a stored exit; job left as it is",
                             job_id=job.id, error=repr(exc))
            return
        if exit is not None:
            self.log.info("exit found for a job its node no longer lists", job_id=job.id)
            await self._exit(exit)
            return
        for part in job.record.placement:
            if part.node in self.nodes:
                self.commands.stop(part.node, job.id, job.record.run_id, "lost")
        if job.record.cancel_requested:
            await self._finish(job, JobState.CANCELLED, "cancelled by the user", placement=[])
            return
        self.log.warning("requeueing job", job_id=job.id, reason=why)
        await self._requeue(job, JobState.QUEUED, f"requeued: {why}")

    def _relayout(self) -> None:
        self.layout = Layout.of([n.info for n in self.nodes.values()])
        if self.gpu_types.follow(n.info for n in self.nodes.values()):
            self.estimates = self.gpu_types.over(self.scaled)
        wanted = self.gpu_types.to_ask()
        if wanted is not None:
            self.predictor.ask_gpu_profile(wanted)

    # ---- rounds ---------------------------------------------------------------------
    async def _round(self) -> None:
        if self.layout is None:
            await self._explain_all("no nodes with GPUs have registered")
            return
        now = time.time()
        started = time.perf_counter()
        snapshot = build_snapshot(now, self.layout, self.jobs, self.estimates, self.policy)
        if not snapshot.pending and not self.policy.preemptive:
            return
        decision = self.policy.decide(snapshot)
        self.last_decide_ms = (time.perf_counter() - started) * 1000
        self.decide_ms.append(self.last_decide_ms)
        self.rounds += 1
        refused = self._refused(snapshot, decision)
        self.metrics.decided(self.policy.name, self.last_decide_ms / 1000, decision, refused)
        if refused:
            return
        for preempt in decision.preemptions:
            job = self.jobs.get(preempt.job_id)
            if job is not None and job.phase == Phase.RUNNING:
                self._stop(job, "preempt")
        for resize in decision.resizes:
            await self._resize(resize)
        # the order the decision was checked in: a reallocation may free what a start uses
        for reallocation in decision.reallocations:
            await self._reallocate(reallocation)
        for start in decision.starts:
            await self._start(start, snapshot.now)
        if decision.starts and self.first_start_at is None:
            self.first_start_at = time.time()
        started_ids = {s.job_id for s in decision.starts}
        for view in snapshot.pending:
            if view.job_id not in started_ids:
                await self._explain(self.jobs[view.job_id], decision.why(view.job_id))
        for job_id, (end, run_s) in finish_estimates(snapshot, started_ids).items():
            estimated = self.jobs.get(job_id)
            if estimated is not None:
                await self._estimate(estimated, end, run_s)
        self.wake_at = decision.wake_at
        if decision.starts or decision.preemptions or decision.resizes:
            summary = DecisionSummary(
                at=now,
                policy=self.policy.name,
                started=sorted(started_ids),
                preempted=[p.job_id for p in decision.preemptions],
                resized=[r.job_id for r in decision.resizes],
                pending=len(snapshot.pending) - len(started_ids),
                decide_ms=self.last_decide_ms,
            )
            await self.publisher.decision(summary)

    def _refused(self, snapshot: Snapshot, decision: Decision) -> bool:
        """Whether the decision breaks the cluster's limits (a GPU booked twice, memory
        exceeded, a job in the wrong state): then none of it is applied, since its parts
        were meant together, and the next round decides afresh."""
        problems = decision_problems(snapshot, decision)
        for problem in problems:
            self.log.error("decision refused", policy=self.policy.name, problem=problem)
        if problems:
            self.refused_decisions += 1
        return bool(problems)

    async def _explain(self, job: LiveJob, reason: str) -> None:
        if job.record.pending_reason != reason and not job.record.state.terminal:
            await self.store.write(job, replace(job.record, pending_reason=reason))

    async def _estimate(self, job: LiveJob, end: float, run_s: float) -> None:
        """Store when a job with a deadline is expected to finish, when that moved by more
        than 5 % of the time left to it (a record write per job and round otherwise)."""
        record = job.record
        old = record.est_end_at
        if record.state.terminal or (
            old is not None and abs(end - old) <= 0.05 * max(end - time.time(), 0.0)
        ):
            return
        await self.store.write(job, replace(record, est_end_at=end, est_run_s=run_s))

    async def _explain_all(self, reason: str) -> None:
        for job in self.jobs.values():
            if job.phase == Phase.WAITING:
                await self._explain(job, reason)

    async def _start(self, start: Start, now: float) -> None:
        job = self.jobs.get(start.job_id)
        if job is None or job.phase != Phase.WAITING or self.layout is None:
            return
        shape: dict[str, int] = {}
        if start.batch_size is not None:
            elastic = Resize(start.job_id, start.gpu_ids, start.batch_size, start.accum_steps)
            problem = _resize_problem(job.record, elastic)
            if problem:
                self.log.warning("elastic start ignored", job_id=job.id, error=problem)
                return
            shape = {"batch_size": start.batch_size, "gpus": len(start.gpu_ids)}
        placement = self.layout.placement(start.gpu_ids)
        run_id = job.record.run_id + 1
        job.phase = Phase.STARTING
        job.last_seen = time.time()
        await self.store.write(
            job,
            replace(
                job.record,
                run_id=run_id,
                placement=placement,
                accum_steps=start.accum_steps,
                shares_with=list(start.shares_with),
                pending_reason="starting",
                cpus=start.cpus,
                mem_gb=start.mem_gb,
                **shape,
            ),
        )
        await self._share_with(job, start.shares_with)
        if shape:
            self._reestimate(job)
        self.log.info(
            "starting job", job_id=job.id, placement=[(p.node, p.gpus) for p in placement],
            accum_steps=start.accum_steps, shares_with=list(start.shares_with), **shape,
            **({"cpus": start.cpus} if start.cpus is not None else {}),
            **({"mem_gb": start.mem_gb} if start.mem_gb is not None else {}),
        )
        self.commands.start(job.record, placement)

    async def _confirm_start(self, job: LiveJob) -> None:
        """A run an earlier leader started is alive on its node: it runs from now on."""
        job.unconfirmed_start = False
        job.phase = Phase.RUNNING
        job.iteration_at = job.running_since = time.time()
        await self._transition(job, JobState.RUNNING, "started")

    async def _start_result(self, result: StartResult) -> None:
        job = self.jobs.get(result.job_id)
        if job is None or job.record.run_id != result.run_id or job.phase != Phase.STARTING:
            return
        if result.error and job.resizing_from is not None:
            self.log.warning("resize failed", job_id=job.id, error=result.error)
            # whichever run the node has, it checkpoints and goes; the job starts anew
            for run_id in (job.resizing_from, job.record.run_id):
                for part in job.record.placement:
                    self.commands.stop(part.node, job.id, run_id, "preempt")
            await self._requeue(job, JobState.PREEMPTED, f"resize failed ({result.error})",
                                preemptions=job.record.preemptions + 1)
            return
        if result.error and result.unanswered:
            # requeueing now could start the job twice (and a short one run to its end
            # twice): its node's heartbeats or its exit tell whether it started
            self.log.warning("start unanswered; waiting for its node", job_id=job.id,
                             error=result.error)
            job.unconfirmed_start = True
            job.last_seen = time.time()
            return
        if result.error:
            self.log.warning("start failed", job_id=job.id, error=result.error)
            await self._requeue(job, JobState.QUEUED, f"start failed ({result.error}); retrying")
            return
        job.phase = Phase.RUNNING
        job.iteration_at = job.running_since = time.time()
        if job.resizing_from is not None:
            job.resizing_from = None
            spec = job.record.current_spec
            await self._transition(
                job, JobState.RUNNING,
                f"resized to batch {spec.batch_size} on {spec.gpus} GPUs",
            )
            return
        await self._transition(job, JobState.RUNNING, "started")

    async def _resize(self, resize: Resize) -> None:
        """In place on the job's node: one resize command. Elsewhere: a preemption, and
        the job starts again with its new shape where the next round puts it."""
        job = self.jobs.get(resize.job_id)
        if job is None or job.phase != Phase.RUNNING or self.layout is None:
            return
        problem = _resize_problem(job.record, resize)
        if problem:
            self.log.warning("resize ignored", job_id=job.id, error=problem)
            return
        now = time.time()
        placement = self.layout.placement(resize.gpu_ids)
        before = job.record.placement
        shape = {"batch_size": resize.batch_size, "gpus": len(resize.gpu_ids)}
        self.log.info(
            "resizing job", job_id=job.id, placement=[(p.node, p.gpus) for p in placement],
            accum_steps=resize.accum_steps, reason=resize.reason, **shape,
        )
        if len(before) != 1 or len(placement) != 1 or before[0].node != placement[0].node:
            await self.store.write(job, replace(job.record, **shape))
            self._reestimate(job)
            self._stop(job, "preempt")
            return
        job.settle_service(now)
        job.resizing_from = job.record.run_id
        job.phase = Phase.STARTING
        job.last_seen = now
        await self._unshare(job)
        await self.store.write(
            job,
            replace(
                job.record,
                run_id=job.record.run_id + 1,
                placement=placement,
                accum_steps=resize.accum_steps,
                shares_with=[],
                **shape,
            ),
        )
        self._reestimate(job)
        self.commands.resize(job.id, job.resizing_from, job.record.run_id, placement[0],
                             resize.batch_size, resize.accum_steps)

    async def _reallocate(self, reallocation: Reallocate) -> None:
        """A running job's CPU cores and host memory change in place: each of its nodes
        re-pins the run to its share, in proportion to the job's GPUs there."""
        job = self.jobs.get(reallocation.job_id)
        if job is None or job.phase != Phase.RUNNING:
            return
        record = replace(job.record, cpus=reallocation.cpus, mem_gb=reallocation.mem_gb)
        await self.store.write(job, record)
        self.log.info(
            "reallocating job", job_id=job.id, cpus=reallocation.cpus,
            mem_gb=reallocation.mem_gb, reason=reallocation.reason,
        )
        self.commands.reallocate(record)

    def _reestimate(self, job: LiveJob) -> None:
        with contextlib.suppress(UnknownModelError):
            job.est_iteration_s = self._profiled_iteration_s(job.record)
        self.predictor.ask_estimate(job.record)

    def _stop(self, job: LiveJob, reason: str) -> None:
        job.phase = Phase.STOPPING
        job.stop_reason = reason
        for part in job.record.placement:
            self.commands.stop(part.node, job.id, job.record.run_id, reason)

    def _stop_followers(self, job: LiveJob, leader: str) -> None:
        for part in job.record.placement:
            if part.node != leader:
                self.commands.stop(part.node, job.id, job.record.run_id, "lost")


def _resize_problem(record: JobRecord, resize: Resize) -> str:
    """Why a policy's resize cannot apply to this job, or ''."""
    spec = record.spec
    if not resize.gpu_ids or len(set(resize.gpu_ids)) != len(resize.gpu_ids):
        return f"gpu_ids: {resize.gpu_ids} must be distinct GPUs"
    if spec.min_batch_size is not None and resize.batch_size < spec.min_batch_size:
        return f"batch_size: {resize.batch_size} is below min_batch_size {spec.min_batch_size}"
    if spec.max_batch_size is not None and resize.batch_size > spec.max_batch_size:
        return f"batch_size: {resize.batch_size} is above max_batch_size {spec.max_batch_size}"
    return split_problem(resize.batch_size, len(resize.gpu_ids), resize.accum_steps)


class SchedulerService:
    """One scheduler instance: leads while it holds the lease, else waits as a standby."""

    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self.config = config
        #: a policy object of the embedder's own, used instead of ``config.policy`` by
        #: every leadership of this instance (see ``use_policy``)
        self.policy = policy
        self.nc: Client | None = None
        self.stores: Stores | None = None
        self.scheduler: LiveScheduler | None = None
        self._stack = contextlib.AsyncExitStack()
        self._task: asyncio.Task[None] | None = None
        self._lease: LeaderLease | None = None
        self.log = log.bind(instance=config.instance)
        self.metrics = SchedulerMetrics()

    def use_policy(self, policy: Policy) -> None:
        """Decide with ``policy`` from now on: in the leadership under way, if any, and
        in every later one (a lease lost and taken back starts a new scheduler)."""
        self.policy = policy
        if self.scheduler is not None:
            self.scheduler.policy = policy

    @property
    def is_leader(self) -> bool:
        """Holds the lease and its scheduler runs (one whose start failed does not)."""
        live = self.scheduler
        return live is not None and live.running and not live.deposed

    async def __aenter__(self) -> SchedulerService:
        self.nc = await self._stack.enter_async_context(
            connection(self.config.nats_url, f"gpusched-scheduler-{self.config.instance}")
        )
        self.stores = await Stores.open(self.nc, lease_ttl_s=self.config.lease_ttl_s)
        self._lease = LeaderLease(self.stores.lease, self.config.instance, self.config.lease_ttl_s)
        service = await micro.add_service(
            self.nc,
            name="gpusched-scheduler",
            version=SCHEDULER_VERSION,
            description="gpusched scheduler: leader or hot standby",
            metadata={"instance": self.config.instance, "policy": self.config.policy},
        )
        self._stack.push_async_callback(service.stop)
        await service.add_endpoint(
            name="status",
            subject=subjects.scheduler_status(self.config.instance),
            handler=self._status,
        )
        self._task = asyncio.create_task(self._run(), name="scheduler-lease")
        return self

    def status(self) -> dict[str, Any]:
        live = self.scheduler
        return {
            "instance": self.config.instance,
            "policy": self.config.policy,
            "leader": self.is_leader,
            "jobs": len(live.jobs) if live else None,
            "nodes": len(live.nodes) if live else None,
            "rounds": live.rounds if live else None,
            "last_decide_ms": live.last_decide_ms if live else None,
            "refused_decisions": live.refused_decisions if live else None,
            "honours_priority": honours_priority(live.policy) if live else None,
        }

    async def _status(self, request: micro.Request) -> None:
        await request.respond(msgspec.json.encode(self.status()))

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self._stack.aclose()

    async def _run(self) -> None:
        """Campaign for the lease for as long as the service runs: lead while it is
        held, and after it is lost, or leading failed, try again."""
        assert self._lease is not None
        try:
            while True:
                try:
                    if await self._lease.try_acquire():
                        await self._lead()
                        continue
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.log.exception("leading failed; campaigning again")
                    await self._lease.release()
                await asyncio.sleep(self.config.lease_renew_s / 2)
        finally:
            await self._lease.release()

    async def _lead(self) -> None:
        assert self._lease is not None
        async with self._leading() as scheduler:
            while True:
                await asyncio.sleep(self.config.lease_renew_s)
                if not scheduler.running:
                    # its start failed (a NATS timeout reading the jobs): holding the
                    # lease would leave the cluster with a leader that never decides
                    self.log.error("the scheduler stopped; giving up the lease")
                    break
                if not await self._lease.renew():
                    scheduler.depose()
                    break
        # given up while held (not lost): a standby, or this instance, takes over now
        await self._lease.release()

    @contextlib.asynccontextmanager
    async def _leading(self) -> AsyncIterator[LiveScheduler]:
        assert self.nc is not None and self.stores is not None
        scheduler = LiveScheduler(self.config, self.nc, self.stores, self.metrics)
        if self.policy is not None:
            scheduler.policy = self.policy
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(scheduler)
            beats = await self.nc.subscribe(
                subjects.ALL_HEARTBEATS, cb=functools.partial(_heartbeat_arrived, scheduler)
            )
            stack.push_async_callback(_unsubscribe, beats)
            progress = await self.nc.subscribe(
                subjects.ALL_JOB_PROGRESS, cb=functools.partial(_progress_arrived, scheduler)
            )
            stack.push_async_callback(_unsubscribe, progress)
            profiles = await self.nc.subscribe(
                subjects.ALL_CPU_PROFILES,
                cb=functools.partial(_tell, scheduler, CpuProfile, Measured),
            )
            stack.push_async_callback(_unsubscribe, profiles)
            computed = await self.nc.subscribe(
                subjects.ALL_COMPUTE_PROFILES,
                cb=functools.partial(_tell, scheduler, ComputeProfile, ComputeMeasured),
            )
            stack.push_async_callback(_unsubscribe, computed)
            measured = await self.nc.subscribe(
                subjects.ALL_GPU_PROFILES,
                cb=functools.partial(_tell, scheduler, MeasuredProfile, GpuMeasured),
            )
            stack.push_async_callback(_unsubscribe, measured)
            consumers = [
                asyncio.create_task(self._consume(scheduler, stream), name=f"consume-{stream}")
                for stream in (subjects.JOBS_STREAM, subjects.EXITS_STREAM)
            ]

            async def stop_consumer() -> None:
                for consumer in consumers:
                    await cancel_and_wait(consumer)

            stack.push_async_callback(stop_consumer)
            self.scheduler = scheduler
            self.metrics.leading(True)
            try:
                yield scheduler
            finally:
                self.scheduler = None
                self.metrics.leading(False)
                self.log.info("leadership ended")

    async def _consume(self, scheduler: LiveScheduler, stream: str) -> None:
        """Hand the messages of ``stream`` (the jobs stream, or the exits stream) to the
        scheduler through the durable consumer of that stream."""
        assert self.stores is not None
        js = self.stores.js
        config = ConsumerConfig(
            durable_name=subjects.SCHEDULER_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30,
            max_ack_pending=10_000,
        )
        while True:
            try:
                await js.add_consumer(stream, config)
                sub = await js.pull_subscribe_bind(
                    durable=subjects.SCHEDULER_CONSUMER, stream=stream
                )
                break
            except Exception as exc:
                self.log.warning("cannot bind the consumer yet", stream=stream, error=str(exc))
                await asyncio.sleep(0.5)
        try:
            while True:
                try:
                    messages = await sub.fetch(256, timeout=1.0)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # a fetch timeout when idle, or NATS reconnecting: try again
                    await asyncio.sleep(0.01)
                    continue
                for msg in messages:
                    scheduler.tell(Durable(msg))
        finally:
            # an open pull request would hold up draining the connection
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _tell(scheduler: LiveScheduler, kind: type, wrap: type, msg: Msg) -> None:
    try:
        scheduler.tell(wrap(codec.decode(msg.data, kind)))
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))


async def _heartbeat_arrived(scheduler: LiveScheduler, msg: Msg) -> None:
    try:
        beat = _valid_runs(codec.decode(msg.data, Heartbeat))
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))
        return
    if _from_sender(msg, beat, scheduler.metrics, "heartbeat") is None:
        return
    scheduler.liveness.saw(beat, arrived=time.time())
    scheduler.tell(Beat(beat))


async def _progress_arrived(scheduler: LiveScheduler, msg: Msg) -> None:
    try:
        event = codec.decode(msg.data, JobProgressEvent)
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))
        return
    if _from_sender(msg, event, scheduler.metrics, "progress") is not None:
        scheduler.tell(ProgressSeen(event))


_Report = TypeVar("_Report", Heartbeat, JobProgressEvent, JobExit)


def _from_sender(
    msg: Msg, report: _Report, metrics: SchedulerMetrics, kind: str
) -> _Report | None:
    """``report`` when it speaks of the node and job its subject names: the subject says
    who sent it (only that node's user may publish there), the payload only claims it.
    A report claiming another node or job is dropped, with a warning and a count."""
    job_id = None if isinstance(report, Heartbeat) else report.job_id
    if subjects.matches_sender(msg.subject, report.node, job_id):
        return report
    metrics.report_refused(kind)
    log.warning("report claiming another sender dropped", kind=kind, subject=msg.subject,
                claimed_node=report.node[:64])
    return None


def _valid_runs(beat: Heartbeat) -> Heartbeat:
    """The beat without the runs whose job id no job can have (not an ``IdStr``): no
    command can name them, and one such entry must not cost the node its other runs."""
    running = [r for r in beat.running if _is_id(r.job_id)]
    exiting = [r for r in beat.exiting if _is_id(r.job_id)]
    skipped = len(beat.running) - len(running) + len(beat.exiting) - len(exiting)
    if not skipped:
        return beat
    log.warning("heartbeat runs with invalid job ids skipped", node=beat.node[:64],
                skipped=skipped)
    return replace(beat, running=running, exiting=exiting)


def _is_id(text: str) -> bool:
    try:
        msgspec.convert(text, IdStr)
    except msgspec.ValidationError:
        return False
    return True


async def _unsubscribe(sub: Any) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
