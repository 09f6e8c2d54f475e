"""The live scheduler's picture of the cluster, and the steps that change a job's record.

``Picture`` is the bottom of the scheduler's synchronous core (``Rounds`` in
``rounds.py`` and ``SchedulerCore`` in ``core.py`` build on it): what the leader knows
of its jobs (from their records), its nodes (from registrations and heartbeats), the
cluster they make and the performance model jobs are timed with. Its methods are the
steps every input and every decision share: take a stored record into the picture,
change a record (``_transition``, ``_finish``, ``_requeue``, the partners of a shared
GPU), stop a run. None of them waits on anything: each changes the picture at once and
lists what must follow outside it in ``effects`` (``effects.py``), which the actor
(``actor.py``) carries out through its adapters, in order.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import structlog
from msgspec.structs import replace

from gpusched.libs.common.schemas import JobRecord, JobState, StateChange
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.perf import PerformanceModel, UnknownModelError
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.effects import (
    AskComputeProfile,
    AskEstimate,
    AskGpuProfile,
    Effect,
    PublishState,
    RequestRound,
    StopRun,
    UnmarkLive,
    WriteRecord,
)
from gpusched.services.scheduler.live.gpu_types import GpuTypes
from gpusched.services.scheduler.live.liveness import Liveness
from gpusched.services.scheduler.live.metrics import SchedulerMetrics
from gpusched.services.scheduler.live.state import (
    Layout,
    LiveJob,
    LiveNode,
    Phase,
    ScaledModel,
    consolidated_nodes,
)
from gpusched.services.scheduler.policies import make_policy


class Picture:
    """What the leader knows of jobs and nodes, and the steps that change a job's record
    (see the module's docstring)."""

    def __init__(
        self, config: SchedulerConfig, metrics: SchedulerMetrics | None = None,
        log: Any = None,
    ) -> None:
        self.config = config
        self.log = log if log is not None else structlog.get_logger("gpusched.scheduler")
        #: what must follow outside the picture, in order (``effects.py``); the actor
        #: takes them after each step (``take_effects``)
        self.effects: list[Effect] = []
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

    def take_effects(self) -> list[Effect]:
        """What the steps since the last call asked for, in order; the list is emptied."""
        effects, self.effects = self.effects, []
        return effects

    # ---- taking jobs in --------------------------------------------------------------
    def take(self, job_id: str, record: JobRecord, revision: int) -> LiveJob | None:
        """Take a stored record into the picture: the job it describes, or None where it
        has ended (or cannot run: its model is unknown, and it fails)."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        if record.state.terminal:
            self.settled.add(job_id)
            self.effects.append(UnmarkLive(job_id))
            return None
        try:
            est = self._profiled_iteration_s(record)
        except UnknownModelError as exc:
            job = LiveJob(record, revision, est_iteration_s=0.0)
            self.jobs[job_id] = job
            self._finish(job, JobState.FAILED, str(exc))
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
        self.effects += [AskEstimate(record), AskComputeProfile(record.current_spec.model)]
        return job

    def _profiled_iteration_s(self, record: JobRecord) -> float:
        spec = record.current_spec
        nodes = consolidated_nodes(spec.gpus, self.layout.cluster if self.layout else None)
        return self.estimates.iteration_time(spec.model, spec.batch_size, spec.gpus, nodes)

    def _request_round(self) -> None:
        if not self.round_queued:
            self.round_queued = True
            self.effects.append(RequestRound())

    # ---- records --------------------------------------------------------------------
    def _write(self, job: LiveJob, record: JobRecord) -> None:
        """The job's record is ``record`` from now on; the actor compare-and-sets it in
        the store (a failed write reads the stored one back: ``RecordConflict``)."""
        job.record = record
        self.effects.append(WriteRecord(job, record))

    def _write_partner(self, partner: LiveJob, record: JobRecord) -> None:
        """A write of another job's record on the way: its failure is that job's, read
        back after this step, and does not stop the step under way."""
        partner.record = record
        self.effects.append(WriteRecord(partner, record, partner=True))

    def _transition(self, job: LiveJob, state: JobState, reason: str, **changes: Any) -> None:
        now = time.time()
        record = replace(
            job.record,
            state=state,
            history=[*job.record.history, StateChange(state, now, reason)],
            pending_reason=reason if state.waiting else "",
            **changes,
        )
        self._write(job, record)
        self.metrics.transitioned(state.value, reason)
        self.effects.append(PublishState(job.id, state, reason, record.placement))

    def _share_with(self, job: LiveJob, partners: Sequence[str]) -> None:
        """A job that joins residents' GPUs is named in each resident's ``shares_with``
        too, so both records of a shared GPU name each other."""
        for partner_id in partners:
            partner = self.jobs.get(partner_id)
            if partner is not None and job.id not in partner.record.shares_with:
                shares = [*partner.record.shares_with, job.id]
                self._write_partner(partner, replace(partner.record, shares_with=shares))

    def _unshare(self, job: LiveJob) -> None:
        """A job leaving its GPUs leaves its partners' ``shares_with``."""
        for partner_id in job.record.shares_with:
            partner = self.jobs.get(partner_id)
            if partner is not None and job.id in partner.record.shares_with:
                shares = [p for p in partner.record.shares_with if p != job.id]
                self._write_partner(partner, replace(partner.record, shares_with=shares))

    def _finish(self, job: LiveJob, state: JobState, reason: str, **changes: Any) -> None:
        job.settle_service(time.time())
        self._unshare(job)
        self._transition(job, state, reason, **changes)
        self.jobs.pop(job.id, None)
        self.settled.add(job.id)
        self.effects.append(UnmarkLive(job.id))
        self._request_round()

    def _requeue(self, job: LiveJob, state: JobState, reason: str, **changes: Any) -> None:
        job.phase = Phase.WAITING
        job.stop_reason = ""
        job.resizing_from = None
        job.unconfirmed_start = False
        job.queued_since = time.time()
        job.settle_service(job.queued_since)
        self._unshare(job)
        self._transition(job, state, reason, placement=[], shares_with=[], **changes)
        self._request_round()

    # ---- nodes, estimates, stops -----------------------------------------------------
    def _relayout(self) -> None:
        self.layout = Layout.of([n.info for n in self.nodes.values()])
        if self.gpu_types.follow(n.info for n in self.nodes.values()):
            self.estimates = self.gpu_types.over(self.scaled)
        wanted = self.gpu_types.to_ask()
        if wanted is not None:
            self.effects.append(AskGpuProfile(wanted))

    def _reestimate(self, job: LiveJob) -> None:
        with contextlib.suppress(UnknownModelError):
            job.est_iteration_s = self._profiled_iteration_s(job.record)
        self.effects.append(AskEstimate(job.record))

    def _stop(self, job: LiveJob, reason: str) -> None:
        job.phase = Phase.STOPPING
        job.stop_reason = reason
        for part in job.record.placement:
            self.effects.append(StopRun(part.node, job.id, job.record.run_id, reason))

    def _stop_followers(self, job: LiveJob, leader: str) -> None:
        for part in job.record.placement:
            if part.node != leader:
                self.effects.append(StopRun(part.node, job.id, job.record.run_id, "lost"))
