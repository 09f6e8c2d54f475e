"""The live scheduler's rounds: each builds a frozen snapshot of the picture, asks the
policy, checks the decision and applies it (preemptions, resizes, reallocations,
starts, in the order the decision was checked in), then writes why each job still waits
and when jobs with deadlines should end. The results of the starts and resizes the
node agents report (``StartResult``) are applied here too.

``Rounds`` adds these to ``Picture`` (the jobs, nodes and record steps they change) and
``SchedulerCore`` (``core.py``) adds the inputs. Like them it waits on nothing: the
writes and commands a round gives are effects (``effects.py``), carried out by the
actor after it.
"""

from __future__ import annotations

import time

from msgspec.structs import replace

from gpusched.libs.common.schemas import DecisionSummary, JobRecord, JobState, split_problem
from gpusched.libs.core.decision import (
    Decision,
    Preempt,
    Reallocate,
    Resize,
    Start,
    decision_problems,
)
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.live.effects import (
    PublishDecision,
    ReallocateRun,
    ResizeRun,
    StartRun,
    StopRun,
)
from gpusched.services.scheduler.live.messages import StartResult
from gpusched.services.scheduler.live.picture import Picture
from gpusched.services.scheduler.live.state import LiveJob, Phase, build_snapshot, finish_estimates


class Rounds(Picture):
    """Rounds, and the application of their decisions (see the module's docstring)."""

    # ---- rounds ---------------------------------------------------------------------
    def round(self) -> None:
        """One round: a decision over a snapshot of the picture as it is now, applied."""
        self.round_queued = False  # what changes from now on asks for a round of its own
        if self.layout is None:
            self._explain_all("no nodes with GPUs have registered")
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
        decision.apply(
            start=self._start, preempt=self._preempt, resize=self._resize,
            reallocate=self._reallocate,
        )
        if decision.starts and self.first_start_at is None:
            self.first_start_at = time.time()
        started_ids = {s.job_id for s in decision.starts}
        for view in snapshot.pending:
            if view.job_id not in started_ids:
                self._explain(self.jobs[view.job_id], decision.why(view.job_id))
        for job_id, (end, run_s) in finish_estimates(snapshot, started_ids).items():
            estimated = self.jobs.get(job_id)
            if estimated is not None:
                self._estimate(estimated, end, run_s)
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
            self.effects.append(PublishDecision(summary))

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

    def _explain(self, job: LiveJob, reason: str) -> None:
        if job.record.pending_reason != reason and not job.record.state.terminal:
            self._write(job, replace(job.record, pending_reason=reason))

    def _estimate(self, job: LiveJob, end: float, run_s: float) -> None:
        """Store when a job with a deadline is expected to finish, when that moved by more
        than 5 % of the time left to it (a record write per job and round otherwise)."""
        record = job.record
        old = record.est_end_at
        if record.state.terminal or (
            old is not None and abs(end - old) <= 0.05 * max(end - time.time(), 0.0)
        ):
            return
        self._write(job, replace(record, est_end_at=end, est_run_s=run_s))

    def _explain_all(self, reason: str) -> None:
        for job in self.jobs.values():
            if job.phase == Phase.WAITING:
                self._explain(job, reason)

    def _preempt(self, preempt: Preempt) -> None:
        job = self.jobs.get(preempt.job_id)
        if job is not None and job.phase == Phase.RUNNING:
            self._stop(job, "preempt")

    def _start(self, start: Start) -> None:
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
        self._write(
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
        self._share_with(job, start.shares_with)
        if shape:
            self._reestimate(job)
        self.log.info(
            "starting job", job_id=job.id, placement=[(p.node, p.gpus) for p in placement],
            accum_steps=start.accum_steps, shares_with=list(start.shares_with), **shape,
            **({"cpus": start.cpus} if start.cpus is not None else {}),
            **({"mem_gb": start.mem_gb} if start.mem_gb is not None else {}),
        )
        self.effects.append(StartRun(job.record, placement))

    def _confirm_start(self, job: LiveJob) -> None:
        """A run an earlier leader started is alive on its node: it runs from now on."""
        job.unconfirmed_start = False
        job.phase = Phase.RUNNING
        job.iteration_at = job.running_since = time.time()
        self._transition(job, JobState.RUNNING, "started")

    def start_result(self, result: StartResult) -> None:
        """A node's answer to a start or a resize command."""
        job = self.jobs.get(result.job_id)
        if job is None or job.record.run_id != result.run_id or job.phase != Phase.STARTING:
            return
        if result.error and job.resizing_from is not None:
            self.log.warning("resize failed", job_id=job.id, error=result.error)
            # whichever run the node has, it checkpoints and goes; the job starts anew
            for run_id in (job.resizing_from, job.record.run_id):
                for part in job.record.placement:
                    self.effects.append(StopRun(part.node, job.id, run_id, "preempt"))
            self._requeue(job, JobState.PREEMPTED, f"resize failed ({result.error})",
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
            self._requeue(job, JobState.QUEUED, f"start failed ({result.error}); retrying")
            return
        job.phase = Phase.RUNNING
        job.iteration_at = job.running_since = time.time()
        if job.resizing_from is not None:
            job.resizing_from = None
            spec = job.record.current_spec
            self._transition(
                job, JobState.RUNNING,
                f"resized to batch {spec.batch_size} on {spec.gpus} GPUs",
            )
            return
        self._transition(job, JobState.RUNNING, "started")

    def _resize(self, resize: Resize) -> None:
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
            self._write(job, replace(job.record, **shape))
            self._reestimate(job)
            self._stop(job, "preempt")
            return
        job.settle_service(now)
        job.resizing_from = job.record.run_id
        job.phase = Phase.STARTING
        job.last_seen = now
        self._unshare(job)
        self._write(
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
        self.effects.append(ResizeRun(job.id, job.resizing_from, job.record.run_id,
                                      placement[0], resize.batch_size, resize.accum_steps))

    def _reallocate(self, reallocation: Reallocate) -> None:
        """A running job's CPU cores and host memory change in place: each of its nodes
        re-pins the run to its share, in proportion to the job's GPUs there."""
        job = self.jobs.get(reallocation.job_id)
        if job is None or job.phase != Phase.RUNNING:
            return
        record = replace(job.record, cpus=reallocation.cpus, mem_gb=reallocation.mem_gb)
        self._write(job, record)
        self.log.info(
            "reallocating job", job_id=job.id, cpus=reallocation.cpus,
            mem_gb=reallocation.mem_gb, reason=reallocation.reason,
        )
        self.effects.append(ReallocateRun(record))


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
