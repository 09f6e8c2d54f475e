"""The live scheduler's core, ``SchedulerCore``: its picture of the cluster, its rounds,
and what it does with each input, all synchronous.

This module holds the inputs: cancels, predicted sizes, exits, progress, heartbeats,
the sweep that finds lost nodes and runs, estimates and the measured profiles the
predictor answers with. ``Rounds`` (``rounds.py``) below it holds the rounds and the
application of decisions, ``Picture`` (``picture.py``) below that the picture and the
steps of a record. No method here waits on anything: each changes the picture at once
and lists what must follow in ``effects`` (``effects.py``). What needs a read first (a
job's stored record, a node's registration, a stored exit) the actor (``actor.py``)
reads and hands over; it carries the effects out afterwards. So every rule of the live
scheduler's state can be driven, and checked, without NATS (tests/test_live_core.py).
"""

from __future__ import annotations

import math
import time

from msgspec.structs import replace

from gpusched.libs.common.compute_model import with_compute_profile
from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.schemas import (
    ComputeProfile,
    CpuProfile,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobState,
    MeasuredProfile,
    NodeInfo,
    Progress,
    SizePredicted,
)
from gpusched.libs.core.progress import MIN_EPOCHS
from gpusched.services.scheduler.live.effects import AskRemaining, StopRun
from gpusched.services.scheduler.live.rounds import Rounds
from gpusched.services.scheduler.live.state import LiveJob, LiveNode, Phase, ScaledModel


class SchedulerCore(Rounds):
    """The picture, rounds, and what the scheduler does with each input."""

    # ---- what the predictor answers ---------------------------------------------------
    def estimated(self, job_id: str, batch_size: int, gpus: int, iteration_s: float) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            spec = job.record.current_spec
            if (spec.batch_size, spec.gpus) == (batch_size, gpus):
                job.est_iteration_s = iteration_s

    def remaining_predicted(
        self, job_id: str, run_id: int, iteration: int, remaining: float
    ) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job.record.run_id == run_id:
            job.predicted_remaining, job.predicted_at = remaining, iteration
            job.predicted_run = run_id

    def cpu_measured(self, profile: CpuProfile) -> None:
        # a new model object: policies recompute what they derived from the old
        self.scaled = self.scaled.with_measured(Sensitivity(profile))
        self.estimates = self.gpu_types.over(self.scaled)
        self.log.info("using a measured CPU profile", model=profile.model)
        self._request_round()

    def compute_measured(self, profile: ComputeProfile) -> None:
        """GENIE: the model's iteration times from its profiling run and the platform
        model; its jobs are estimated again."""
        inner = with_compute_profile(self.scaled.inner, profile)
        self.scaled = ScaledModel(inner, self.scaled.time_scale, self.scaled.measured)
        self.estimates = self.gpu_types.over(self.scaled)
        for job in self.jobs.values():
            if job.record.current_spec.model == profile.model:
                self._reestimate(job)
        self.log.info("using a compute profile", model=profile.model)
        self._request_round()

    def gpu_measured(self, profile: MeasuredProfile) -> None:
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

    # ---- inputs ---------------------------------------------------------------------
    def cancel(self, job: LiveJob) -> None:
        """The user cancels the job: a waiting job ends now, a running one is stopped."""
        if job.phase == Phase.WAITING:
            self._finish(job, JobState.CANCELLED, "cancelled by the user")
            return
        if job.stop_reason == "cancel":
            return
        self._write(job, replace(job.record, cancel_requested=True))
        self._stop(job, "cancel")

    def size_predicted(self, job: LiveJob, predicted: SizePredicted) -> None:
        """Keep the predictor's figure for the job in its record (the first one stands),
        where a restarted leader finds it; a forest's figure is what the job's estimates
        believe from now on, whether it waits or runs (state.remaining_iterations)."""
        if job.record.prediction_source is not None:
            return
        self._write(job, replace(job.record, predicted_iterations=predicted.iterations,
                                 prediction_source=predicted.source))
        self.log.info("predicted size", job_id=job.id, iterations=round(predicted.iterations),
                      source=predicted.source, declared=job.record.total_iterations)
        self._request_round()

    def exit(self, exit: JobExit) -> None:
        """A run's end, as its leading node reported it."""
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
            self._finish(job, JobState.SUCCEEDED, "finished", progress=progress,
                               exit_code=exit.exit_code)
        elif job.stop_reason == "cancel" or job.record.cancel_requested:
            self._finish(job, JobState.CANCELLED, "cancelled by the user",
                         progress=progress, placement=[])
        elif exit.outcome == "stopped":
            why = "preempted" if job.stop_reason == "preempt" else f"stopped on {exit.node}"
            self._requeue(job, JobState.PREEMPTED, why, progress=progress,
                          preemptions=job.record.preemptions + 1)
        else:
            self._failed(job, exit, progress)

    def _failed(self, job: LiveJob, exit: JobExit, progress: Progress) -> None:
        attempts = job.record.attempts + 1
        tail = exit.stderr_tail.strip()
        what = f"exit code {exit.exit_code}" + (f": {tail[-300:]}" if tail else "")
        if attempts > job.record.spec.max_retries:
            self.log.warning("job failed", job_id=job.id, attempts=attempts)
            self._finish(
                job, JobState.FAILED, f"failed after {attempts} attempts; {what}",
                progress=progress, attempts=attempts, exit_code=exit.exit_code,
                error=exit.stderr_tail, placement=[],
            )
            return
        delay = min(self.config.retry_backoff_max_s,
                    self.config.retry_backoff_s * 2 ** (attempts - 1))
        job.not_before = time.time() + delay
        self._requeue(
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

    def progress(self, event: JobProgressEvent) -> None:
        """Progress a run streamed (its leading node's report)."""
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
                self.effects.append(AskRemaining(job.record, job.iteration))
        if job.iteration_at - job.last_progress_write >= self.config.progress_write_s:
            job.last_progress_write = job.iteration_at
            self._write(job, replace(job.record, progress=event.progress))

    def join(self, registrations: list[NodeInfo]) -> None:
        """Nodes whose heartbeats came before they were in the picture, with their stored
        registrations: in at once, so a thousand nodes joining lay the cluster out once,
        not once each (each layout is over every node)."""
        now = time.time()
        joined = [info for info in registrations if info.name not in self.nodes]
        for info in joined:
            self.nodes[info.name] = LiveNode(info, last_beat=now)
            self.log.info("node joined", node=info.name)
        if joined:
            self._relayout()
            self._request_round()

    def beat(self, beat: Heartbeat, registration: NodeInfo | None = None) -> None:
        """A node's heartbeat; ``registration``: the node's stored registration, which
        the actor reads where the node is not in the picture yet."""
        now = time.time()
        self.beat_lag_s.append(max(0.0, now - beat.at))
        node = self.nodes.get(beat.node)
        if node is None:
            info = registration
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
                    self._confirm_start(job)
                continue
            # the node runs something we did not start (or no longer want): truth wins,
            # and what is not ours to run is stopped
            self.effects.append(StopRun(beat.node, running.job_id, running.run_id, "lost"))

    def sweep(self, registered: set[str] | None) -> list[tuple[LiveJob, str]]:
        """Find lost nodes and runs: nodes no longer ``registered`` (None: the names
        could not be read) or whose heartbeats stopped leave the picture. Returns the
        jobs lost with them and why, for ``lost`` once the actor has looked for their
        stored exits."""
        now = time.time()
        self.liveness.forget_runs_before(now - self.config.missing_job_grace_s)
        if registered is not None:
            # deregistered nodes leave at once rather than after a heartbeat timeout
            for name in [n for n in self.nodes if n not in registered]:
                self.nodes[name].last_beat = 0.0
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
        found: list[tuple[LiveJob, str]] = []
        for job in list(self.jobs.values()):
            if not job.holds_gpus:
                if job.not_before and job.not_before <= now:
                    job.not_before = 0.0
                    self._request_round()
                continue
            nodes = {p.node for p in job.record.placement}
            if nodes & gone or any(n not in self.nodes for n in nodes):
                found.append((job, f"node {', '.join(sorted(nodes))} lost"))
            elif (
                job.phase in (Phase.RUNNING, Phase.STOPPING)
                and now - self._job_seen(job) > self.config.missing_job_grace_s
            ):
                found.append((job, "its node no longer reports it running"))
            elif (
                job.unconfirmed_start
                and now - self._job_seen(job) > self.config.missing_job_grace_s
            ):
                found.append((job, "its node never reported its start"))
        if self.wake_at is not None and now >= self.wake_at:
            self.wake_at = None
            self._request_round()
        return found

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

    def lost(self, job: LiveJob, why: str, stored_exit: JobExit | None) -> None:
        """A job ``sweep`` found lost: a run that ended has its exit stored before its
        node forgets it (``stored_exit``), and that exit, not a requeue, is the job's
        fate, or a finished job would run again."""
        if self.jobs.get(job.id) is not job:
            return  # settled or read back since the sweep found it
        if stored_exit is not None:
            self.log.info("exit found for a job its node no longer lists", job_id=job.id)
            self.exit(stored_exit)
            return
        for part in job.record.placement:
            if part.node in self.nodes:
                self.effects.append(StopRun(part.node, job.id, job.record.run_id, "lost"))
        if job.record.cancel_requested:
            self._finish(job, JobState.CANCELLED, "cancelled by the user", placement=[])
            return
        self.log.warning("requeueing job", job_id=job.id, reason=why)
        self._requeue(job, JobState.QUEUED, f"requeued: {why}")
