"""The live scheduler's actor, ``LiveScheduler``: one task owns the picture of the
cluster and reads one inbox (``messages.py``).

This module holds what the actor does with its inputs: the takeover (nodes and the
unfinished jobs read from the store), the rescans of the index of unfinished jobs, the
dispatch of each message (a stored input that fails goes back to its stream), and the
inputs themselves: submissions, cancels, predicted sizes and exits from the jobs and
exits streams, progress, heartbeats, the sweep that finds lost nodes and runs, and the
measured profiles the predictor publishes. Rounds and the application of decisions are
``Rounds`` (``rounds.py``), which it builds on; the picture and the steps of a record
are ``Picture`` (``picture.py``) below that. Every NATS and KV call goes through the
adapters (``store.py``, ``registry.py``, ``commands.py``, ``predictor.py``,
``publisher.py``): none of these three modules makes a NATS or KV call itself, but
for acknowledging a stored input once handled (or handing it back: ``redeliver``).
"""

from __future__ import annotations

import math
import time

import msgspec
from msgspec.structs import replace
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.compute_model import with_compute_profile
from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.schemas import (
    CancelRequest,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobState,
    MeasuredProfile,
    Progress,
    SizePredicted,
)
from gpusched.libs.core.progress import MIN_EPOCHS
from gpusched.services.scheduler.live import timing
from gpusched.services.scheduler.live.gpu_types import GpuMeasured
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
from gpusched.services.scheduler.live.reports import from_sender
from gpusched.services.scheduler.live.rounds import Rounds
from gpusched.services.scheduler.live.state import LiveJob, LiveNode, Phase, ScaledModel
from gpusched.services.scheduler.live.store import RecordConflict


class LiveScheduler(Rounds):
    """The actor: the picture, rounds, and what it does with each input."""

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

    async def _durable(self, msg: Msg) -> None:
        event = msg.subject.rsplit(".", 1)[-1]
        try:
            if subjects.node_of(msg.subject) is not None:
                # the exits stream: gpusched.node.<node>.job.<id>.exit
                exit = from_sender(msg, codec.decode(msg.data, JobExit), self.metrics, "exit")
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

