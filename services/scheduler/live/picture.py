"""The live scheduler's picture of the cluster, and the steps that change a job's record.

``Picture`` is the part of the actor (``LiveScheduler`` builds on it, through
``Rounds``) that holds what the leader knows: its jobs (from their records), its nodes
(from registrations and heartbeats), the cluster they make and the performance model
jobs are timed with; and the adapters every NATS and KV call goes through. Its methods
are the steps every input and every decision share: take a stored record into the
picture, write a record (``_transition``, ``_finish``, ``_requeue``, the partners of a
shared GPU), read one back after a conflict or a failed write (``_resync``), stop a
run. It is a module of its own so the actor's inputs (``actor.py``) and the rounds
that apply decisions (``rounds.py``) each stay one module of readable size; only the
actor's task calls any of these methods.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from msgspec.structs import replace
from nats.aio.client import Client

from gpusched.libs.common.actor import Actor
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobRecord, JobState, StateChange
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.perf import PerformanceModel, UnknownModelError
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import timing
from gpusched.services.scheduler.live.commands import NodeCommands
from gpusched.services.scheduler.live.gpu_types import GpuTypes
from gpusched.services.scheduler.live.liveness import Liveness
from gpusched.services.scheduler.live.messages import Message, Resync, Round
from gpusched.services.scheduler.live.metrics import SchedulerMetrics
from gpusched.services.scheduler.live.predictor import PredictorAsks
from gpusched.services.scheduler.live.publisher import Publisher
from gpusched.services.scheduler.live.registry import NodeRegistry
from gpusched.services.scheduler.live.state import (
    Layout,
    LiveJob,
    LiveNode,
    Phase,
    ScaledModel,
    consolidated_nodes,
)
from gpusched.services.scheduler.live.store import JobStore, RecordConflict
from gpusched.services.scheduler.policies import make_policy


class Picture(Actor[Message]):
    """What the leader knows of jobs and nodes, and the steps that change a job's record
    (see the module's docstring); ``LiveScheduler`` is the actor built on it."""

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

    # ---- taking jobs in --------------------------------------------------------------
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

    def _request_round(self) -> None:
        if not self.round_queued:
            self.round_queued = True
            self.tell(Round())

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

    # ---- nodes, estimates, stops -----------------------------------------------------
    def _relayout(self) -> None:
        self.layout = Layout.of([n.info for n in self.nodes.values()])
        if self.gpu_types.follow(n.info for n in self.nodes.values()):
            self.estimates = self.gpu_types.over(self.scaled)
        wanted = self.gpu_types.to_ask()
        if wanted is not None:
            self.predictor.ask_gpu_profile(wanted)

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
