"""Discrete-event simulator: replays jobs through a policy on a virtual cluster.

The simulator is the second driver of the same ``decide(snapshot)`` the live scheduler
runs. Ground truth (``truth``) decides how fast jobs really go; the policy sees only
``estimates``. The event loop is a heap of (time, sequence, kind, job, version); a
job's completion event is invalidated by bumping its version whenever its speed
changes, so events are never searched for or removed.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import ChainMap
from collections.abc import Callable, Sequence
from dataclasses import replace

from gpusched.libs.core.cluster import Cluster, HostUse
from gpusched.libs.core.convergence import remaining_after_resize
from gpusched.libs.core.decision import (
    Decision,
    Preempt,
    Reallocate,
    Resize,
    Start,
    decision_problems,
)
from gpusched.libs.core.job_state import Run, job_view, remaining_iterations
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.parallelism import alone_iteration_time, placed_iteration_time
from gpusched.libs.core.perf import ConvergenceSource, PerformanceModel
from gpusched.libs.core.placement import unschedulable_reason
from gpusched.libs.core.progress import EpochRecord, ProgressPredictor, blended_remaining_iterations
from gpusched.libs.core.size_predictor import SubmissionSizes
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    Policy,
)
from gpusched.services.scheduler.simulation.queue_order import SortedQueue
from gpusched.services.scheduler.simulation.results import (
    SimResult,
    TimelinePoint,
)
from gpusched.services.scheduler.simulation.sim_config import SimConfig as SimConfig
from gpusched.services.scheduler.simulation.sim_job import SimJob
from gpusched.services.scheduler.simulation.sim_result import result_of
from gpusched.services.scheduler.simulation.type_use import TypeUse

ARRIVAL, FINISH, WAKE, ROUND = 0, 1, 2, 3
Queue = tuple[JobView, ...]
#: completion is declared when this few iterations remain, absorbing float rounding
ITER_EPSILON = 1e-6


class PolicyViolation(RuntimeError):
    """A decision broke a cluster invariant (``decision_problems``); the run stops rather
    than hide it."""


class Simulator:
    def __init__(
        self,
        cluster: Cluster,
        jobs: Sequence[JobSpec],
        policy: Policy,
        truth: PerformanceModel,
        estimates: PerformanceModel | None = None,
        config: SimConfig | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.truth = truth
        self.estimates = estimates or truth
        self.config = config or SimConfig()
        self.progress = progress
        self.specs = sorted(jobs, key=lambda j: (j.submit_time, j.job_id))
        if len({j.job_id for j in self.specs}) != len(self.specs):
            raise ValueError("job ids must be unique")
        self._specs_by_id = {s.job_id: s for s in self.specs}
        #: whether a job has a priority, for the snapshot (policies skip it otherwise)
        self.prioritized = any(s.priority for s in self.specs)
        #: running jobs that hold a CPU/memory allocation of their own
        self.own_allocations = 0
        self.jobs: dict[str, SimJob] = {}
        self.pending: dict[str, JobView] = {}
        capabilities = policy.capabilities
        self.queue = SortedQueue(policy.queue_sort)
        #: further orders of the queue the policy can use (see ``Snapshot.orders``)
        self.extra_queues = [SortedQueue(sort) for sort in capabilities.extra_sorts]
        self.running: dict[str, JobView] = {}
        self.unschedulable: dict[str, str] = {}
        g = cluster.total_gpus
        self.gpu_residents: list[list[SimJob]] = [[] for _ in range(g)]
        self.gpu_load = [0] * g
        self.gpu_mem_used = [0.0] * g
        self.node_free = [n.gpus for n in cluster.nodes]
        self.host = HostUse(cluster)
        self.busy_gpus = 0
        self.busy_gpu_s = 0.0
        #: speeds and busy time per GPU type, on a cluster of several types only
        self.types = TypeUse.of(cluster, truth)
        self.clock = 0.0
        self.events: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.wake_version = 0
        self.decisions = 0
        self.preemptions = 0
        self.resizes = 0
        self.reallocations = 0
        self.shared_pairs = 0
        self.done = 0
        self.last_decision: Decision | None = None
        self.timeline: list[TimelinePoint] = []
        #: the snapshot's tuples as last built, kept until what they copy changes (most
        #: decisions follow an arrival, which moves the queue only): the queue and its
        #: further orders; the running views; the per-GPU, per-node and host figures
        self._pending_tuples: tuple[tuple[JobView, ...], dict[str, Queue]] | None = None
        self._running_tuple: tuple[JobView, ...] | None = None
        self._cluster_tuples: tuple[tuple, ...] | None = None
        self._idle = Snapshot.of_idle_cluster(cluster, self.estimates)
        self._converges = truth if isinstance(truth, ConvergenceSource) else None
        #: a policy that sizes jobs by predicted progress (ONES) gets every converging
        #: job's remaining time from a progress predictor trained on the finished ones
        self._progress = (
            ProgressPredictor(seed=capabilities.progress_seed)
            if capabilities.predicts_progress
            and (
                not capabilities.sizes_only_elastic
                or any(job.elastic is not None for job in jobs)
            )
            else None
        )
        kind = self.config.predictor
        self.sizes = SubmissionSizes(kind) if kind != "truth" else None

    # ---- event plumbing -------------------------------------------------------------
    def _push(self, at: float, kind: int, job_id: str = "", version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, job_id, version))

    def run(self) -> SimResult:
        started = time.perf_counter()
        for spec in self.specs:
            self._push(spec.submit_time, ARRIVAL, spec.job_id)
        origin = self.specs[0].submit_time if self.specs else 0.0
        self.clock = origin
        total = len(self.specs)
        round_s = self.config.round_s
        if round_s is not None and self.specs:
            self._push(origin, ROUND)
        events = self.events
        while events:
            now = events[0][0]
            self._advance(now)
            # a wake-up the policy asked for is due even when nothing waits: an elastic
            # policy grows running jobs then
            changed = round_due = woken = False
            while events and events[0][0] == now:
                _, _, kind, job_id, version = heapq.heappop(events)
                if kind == ARRIVAL:
                    changed |= self._arrive(job_id)
                elif kind == FINISH:
                    changed |= self._finish(job_id, version)
                elif kind == WAKE:
                    woken |= version == self.wake_version
                else:
                    round_due = True
            if round_due and round_s is not None and self.done < total:
                self._push(now + round_s, ROUND)
            if (changed and self.pending) or (
                (round_due or woken) and (self.pending or self.running)
            ):
                self._decide(now)
            self._record(now)
            if self.progress is not None and (self.done & 1023) == 0:
                self.progress(self.done, total)
        if self.progress is not None:
            self.progress(self.done, total)
        return self._result(origin, time.perf_counter() - started)

    def _advance(self, now: float) -> None:
        self.busy_gpu_s += self.busy_gpus * (now - self.clock)
        if self.types is not None:
            self.types.advance(now - self.clock)
        self.clock = now

    def _record(self, now: float) -> None:
        point = TimelinePoint(now, self.busy_gpus, len(self.pending), len(self.running))
        if self.timeline and self.timeline[-1].time == now:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

    # ---- job lifecycle --------------------------------------------------------------
    def _arrive(self, job_id: str) -> bool:
        spec = self._specs_by_id[job_id]
        believed = self.sizes.at_submission(spec) if self.sizes is not None else None
        if spec.gpus > self.cluster.total_gpus:
            # no placement exists to time it at; decided before any per-GPU work
            job = self.jobs[job_id] = SimJob(spec, math.nan, math.nan)
            job.believed = believed
            return self._refuse(job, unschedulable_reason(self._view(job), self._idle))
        est_iter, true_iter = self._alone_iter(spec)
        job = SimJob(spec, est_iter, true_iter)
        job.believed = believed
        curve = self._converges.convergence(spec.model) if self._converges else None
        if curve is not None:
            job.convergence = (curve, spec.iterations / curve.total_iterations(spec.batch_size))
        self.jobs[job_id] = job
        view = self._view(job)
        bad = unschedulable_reason(view, self._idle)
        if bad:
            return self._refuse(job, bad)
        self._enqueue(view)
        return True

    def _alone_iter(self, spec: JobSpec) -> tuple[float, float]:
        """Estimated and true iteration time of the job alone at its most consolidated
        placement on this cluster (the reference `materialize` converts run times at)."""
        nodes = self.cluster.fewest_nodes(spec.gpus)
        est = self.estimates.iteration_time(spec.model, spec.batch_size, spec.gpus, nodes)
        true = self.truth.iteration_time(spec.model, spec.batch_size, spec.gpus, nodes)
        parallel = alone_iteration_time(self.truth, self.cluster, spec)
        if parallel is not None:  # a (d, t, p) job where the mapper puts it; estimate as off
            est, true = est * parallel / true, parallel
        return est, true

    def _refuse(self, job: SimJob, reason: str | None) -> bool:
        job.state = JobState.FAILED
        self.unschedulable[job.spec.job_id] = reason or "unschedulable"
        self.done += 1
        return False

    def _enqueue(self, view: JobView) -> None:
        self._pending_tuples = None
        self.pending[view.job_id] = view
        self.queue.add(view)
        for queue in self.extra_queues:
            queue.add(view)

    def _dequeue(self, job_id: str) -> None:
        self._pending_tuples = None
        view = self.pending.pop(job_id)
        self.queue.remove(view)
        for queue in self.extra_queues:
            queue.remove(view)

    def _view(self, job: SimJob) -> JobView:
        """The job as policies see it now: queued, or running where it runs."""
        spec = job.spec
        run = (
            Run(
                gpu_ids=job.gpu_ids,
                accum_steps=job.accum,
                progress_rate=job.est_iter / job.iter_time,
                started_at=job.started_at,
                cpus=job.cpus,
                mem_gb=job.mem_gb,
                epoch_s=self._epoch_s(job),
            )
            if job.state is JobState.RUNNING
            else None
        )
        return job_view(
            job_id=spec.job_id,
            submit_time=spec.submit_time,
            model=spec.model,
            gpus=spec.gpus,
            batch_size=spec.batch_size,
            allow_sharing=spec.allow_sharing,
            deadline=spec.deadline,
            user=spec.user,
            priority=spec.priority,
            est_remaining_s=self._predicted_remaining_iterations(job) * job.est_iter,
            attained_gpu_s=job.attained,
            as_of=self.clock,
            queued_since=job.queued_since,
            preemptions=job.preemptions,
            run=run,
            oracle_remaining_s=job.remaining * job.exclusive_iter,
            tensor_parallel=spec.tensor_parallel,
            pipeline_parallel=spec.pipeline_parallel,
            elastic=spec.elastic,
        )

    @staticmethod
    def _epoch_s(job: SimJob) -> float | None:
        if job.convergence is None or job.convergence[0].epoch_samples is None:
            return None
        return job.convergence[0].epoch_samples / job.spec.batch_size * job.iter_time

    def _predicted_remaining_iterations(self, job: SimJob) -> float:
        """Iterations the policy believes a job has left: with a size predictor, what is
        left of the size believed at submission (the rule the live scheduler shares,
        ``gpusched.libs.core.job_state.remaining_iterations``); else the estimate every
        policy uses, pulled towards the progress predictor's as it learns from finished
        jobs of the job's data set (an early predictor called long jobs nearly done, and
        such jobs then held their GPUs for hours)."""
        if job.believed is not None:
            return remaining_iterations(job.believed, job.spec.iterations - job.remaining)
        predictor = self._progress
        if predictor is None or not job.history:
            return job.remaining
        return blended_remaining_iterations(
            predictor, job.history[-1], job.samples_done, job.spec.batch_size, job.remaining
        )

    def _learn_progress(self, job: SimJob) -> None:
        """Teach the progress predictor a finished job; after a retraining, every view
        gets the new predictions."""
        predictor = self._progress
        if predictor is None or not job.history:
            return
        predictor.add_finished(job.history)
        if not predictor.retrain_due():
            return
        predictor.train()
        for other in self.jobs.values():
            if other.state is JobState.RUNNING and other.history:
                self._settle(other)
                other.view = self._view(other)
                self.running[other.spec.job_id] = other.view
                self._running_tuple = None
            elif other.spec.job_id in self.pending and other.history:
                self._dequeue(other.spec.job_id)
                self._enqueue(self._view(other))

    def _settle(self, job: SimJob) -> None:
        """Bring a running job's progress up to the clock."""
        elapsed = self.clock - job.last_settle
        if elapsed <= 0:
            return
        job.attained += elapsed * job.spec.gpus
        if job.overhead_left > 0:
            spent = min(elapsed, job.overhead_left)
            job.overhead_left -= spent
            elapsed -= spent
        done = min(job.remaining, elapsed / job.iter_time)
        if self._progress is not None and job.convergence is not None:
            self._record_epochs(job, done)
        job.samples_done += done * job.spec.batch_size
        job.remaining = max(0.0, job.remaining - done)
        job.last_settle = self.clock

    def _record_epochs(self, job: SimJob, iterations: float) -> None:
        """The epoch records a job crossed in the next ``iterations`` at its batch, with
        the validation metric its curve reaches there."""
        curve, scale = job.convergence  # type: ignore[misc]  # checked by the caller
        epoch = curve.epoch_samples
        if epoch is None:
            return
        batch = job.spec.batch_size
        before = job.samples_done
        total = scale * curve.total_iterations(batch)
        first = math.floor(before / epoch) + 1
        last = math.floor((before + iterations * batch) / epoch)
        for k in range(first, last + 1):
            left = job.remaining - (k * epoch - before) / batch
            reached = curve.progress_after(batch, max(0.0, total - left) / scale)
            metric = curve.metric_at(reached)
            opening = job.history[0].metric if job.history else metric
            job.history.append(EpochRecord(epoch, float(k), metric, opening))

    def _retime(self, job: SimJob) -> None:
        """Recompute a running job's true speed and its completion event."""
        spec = job.spec
        truth = self.truth
        nodes = self.cluster.nodes_spanned(job.gpu_ids)
        alone = None
        if spec.tensor_parallel * spec.pipeline_parallel > 1:  # (d, t, p): by its ranks' servers
            alone = placed_iteration_time(truth, self.cluster, spec, job.gpu_ids, job.accum)
        if alone is None:
            alone = truth.iteration_time(spec.model, spec.batch_size, spec.gpus, nodes, job.accum)
        if self.types is not None:  # the truth's figures are the reference type's
            sub_batch = spec.batch_size / (spec.gpus * job.accum)
            alone /= self.types.speed(spec.model, sub_batch, job.gpu_ids)
        slowdown = 1.0
        for gpu in job.gpu_ids:
            for other in self.gpu_residents[gpu]:
                if other is not job:
                    slowdown = max(slowdown, truth.colocation_slowdown(job.shape, other.shape))
        job.iter_time = alone * slowdown / job.cpu_mem_speedup
        job.version += 1
        job.view = self._view(job)
        self.running[spec.job_id] = job.view
        self._running_tuple = None
        finish = self.clock + job.overhead_left + job.remaining * job.iter_time
        self._push(finish, FINISH, spec.job_id, job.version)

    def _partners(self, job: SimJob) -> list[SimJob]:
        seen: list[SimJob] = []
        for gpu in job.gpu_ids:
            for other in self.gpu_residents[gpu]:
                if other is not job and other not in seen:
                    seen.append(other)
        return seen

    def _finish(self, job_id: str, version: int) -> bool:
        job = self.jobs[job_id]
        if job.state is not JobState.RUNNING or job.version != version:
            return False
        self._settle(job)
        if job.remaining > ITER_EPSILON * max(1.0, job.spec.iterations) and self._still_ahead(job):
            self._retime(job)  # rounding left a sliver: finish it
            return False
        job.remaining = 0.0
        partners = self._release(job)
        job.state = JobState.SUCCEEDED
        job.finish_time = self.clock
        self.done += 1
        self._learn_progress(job)
        if self.sizes is not None:
            self.sizes.completed(job.spec)
        for other in partners:
            self._settle(other)
            self._retime(other)
        return True

    def _still_ahead(self, job: SimJob) -> bool:
        """Whether the time the job has left moves the clock at all. Far from zero the
        gap between two floats exceeds a short job (at 1e20 s it is 16,384 s): such a
        job's finish rounds to now, and timing it again would put it at now forever."""
        left = job.overhead_left + job.remaining * job.iter_time
        return self.clock + left > self.clock

    def _release(self, job: SimJob) -> list[SimJob]:
        self._running_tuple = None
        self._cluster_tuples = None
        partners = self._partners(job)
        self.host.add(job.gpu_ids, job.cpus, job.mem_gb, -1)
        if job.cpus is not None or job.mem_gb is not None:
            self.own_allocations -= 1
        job.cpus = job.mem_gb = None
        job.cpu_mem_speedup = 1.0
        node_of = self.cluster.gpu_node
        for gpu in job.gpu_ids:
            self.gpu_residents[gpu].remove(job)
            self.gpu_load[gpu] -= 1
            self.gpu_mem_used[gpu] -= job.mem_mb
            if self.gpu_load[gpu] == 0:
                self.gpu_mem_used[gpu] = 0.0
                self.node_free[node_of[gpu]] += 1
                self.busy_gpus -= 1
                if self.types is not None:
                    self.types.busy(gpu, -1)
        del self.running[job.spec.job_id]
        job.gpu_ids = ()
        job.view = None
        job.version += 1
        return partners

    # ---- decisions ------------------------------------------------------------------
    def _snapshot(self, now: float) -> Snapshot:
        queued = self._pending_tuples
        if queued is None:
            queued = self._pending_tuples = (
                self.queue.views(self.pending),
                {q.order: q.views(self.pending) for q in self.extra_queues},
            )
        running = self._running_tuple
        if running is None:
            running = self._running_tuple = tuple(self.running.values())
        figures = self._cluster_tuples
        if figures is None:
            figures = self._cluster_tuples = (
                tuple(self.gpu_load),
                tuple(self.gpu_mem_used),
                tuple(self.node_free),
                self.host.all_cpus(),
                self.host.all_mem(),
            )
        gpu_load, gpu_mem_used, node_free, node_cpus_used, node_mem_used = figures
        return Snapshot(
            now=now,
            cluster=self.cluster,
            pending=queued[0],
            running=running,
            gpu_load=gpu_load,
            gpu_mem_used=gpu_mem_used,
            node_free=node_free,
            node_cpus_used=node_cpus_used,
            node_mem_used=node_mem_used,
            own_allocations=self.own_allocations > 0,
            estimates=self.estimates,
            max_jobs_per_gpu=self.config.max_jobs_per_gpu,
            queue_order=self.queue.order,
            orders=queued[1],
            prioritized=self.prioritized,
            # both dicts stay as they are until the decision is checked and applied
            index=ChainMap(self.running, self.pending),
        )

    def _decide(self, now: float) -> None:
        snapshot = self._snapshot(now)
        decision = self.policy.decide(snapshot)
        # the snapshot's memory is summed with the ground truth: check with the same
        # (a decision that changes nothing cannot break anything)
        changes = decision.changes_anything
        problems = decision_problems(snapshot, decision, self.truth) if changes else []
        if problems:
            raise PolicyViolation("; ".join(f"{self.policy.name} {p}" for p in problems))
        self.decisions += 1
        self.last_decision = decision
        decision.apply(
            start=self._start, preempt=self._preempt, resize=self._resize,
            reallocate=self._reallocate,
        )
        if decision.wake_at is not None and decision.wake_at > now:
            self.wake_version += 1
            self._push(decision.wake_at, WAKE, "", self.wake_version)

    def _preempt(self, preempt: Preempt) -> None:
        job = self.jobs[preempt.job_id]
        self._settle(job)
        partners = self._release(job)
        job.state = JobState.PREEMPTED
        job.preemptions += 1
        self.preemptions += 1
        job.overhead_left = self.config.restart_overhead_s
        job.queued_since = self.clock
        self._enqueue(self._view(job))
        for other in partners:
            self._settle(other)
            self._retime(other)

    def _resize(self, resize: Resize) -> None:
        """Restart a running job from its checkpoint with a new batch and GPUs, paying
        the restart overhead as after a preemption. A job whose model has a convergence
        curve keeps the progress it made, so the iterations it has left follow the new
        batch's statistical efficiency; any other job keeps its remaining iterations."""
        job = self.jobs[resize.job_id]
        self._settle(job)
        partners = self._release(job)
        self._reshape(job, resize.batch_size, len(resize.gpu_ids))
        job.state = JobState.PREEMPTED
        job.overhead_left = self.config.restart_overhead_s
        job.queued_since = self.clock
        self.resizes += 1
        self._enqueue(self._view(job))
        for other in partners:
            self._settle(other)
            self._retime(other)
        self._start(Start(resize.job_id, resize.gpu_ids, resize.accum_steps))

    def _reshape(self, job: SimJob, batch_size: int, gpus: int) -> None:
        """Give a job that holds no GPUs a new global batch and GPU count."""
        if job.convergence is not None and batch_size != job.spec.batch_size:
            curve, scale = job.convergence
            job.remaining = remaining_after_resize(
                curve, job.spec.batch_size, job.remaining, batch_size, scale
            )
        if gpus % (job.spec.tensor_parallel * job.spec.pipeline_parallel):
            # tensor x pipeline must divide the GPUs; on others the job runs data-parallel
            job.spec = replace(job.spec, tensor_parallel=1, pipeline_parallel=1)
        job.spec = replace(job.spec, batch_size=batch_size, gpus=gpus)
        job.est_iter, job.exclusive_iter = self._alone_iter(job.spec)

    def _start(self, start: Start) -> None:
        job = self.jobs[start.job_id]
        if start.batch_size is not None and (
            start.batch_size != job.spec.batch_size or len(start.gpu_ids) != job.spec.gpus
        ):
            self._reshape(job, start.batch_size, len(start.gpu_ids))
        spec = job.spec
        mem = self.truth.gpu_memory_mb(
            spec.model, spec.batch_size / (spec.gpus * start.accum_steps)
        )
        self._dequeue(spec.job_id)
        job.state = JobState.RUNNING
        job.gpu_ids = start.gpu_ids
        job.accum = start.accum_steps
        job.shape = spec.shape(start.accum_steps)
        job.mem_mb = mem
        self._cluster_tuples = None
        self.host.add(start.gpu_ids, None, None, +1)
        self._allocate(job, start.cpus, start.mem_gb)
        job.last_settle = self.clock
        job.started_at = self.clock
        job.queue_total += self.clock - job.queued_since
        if job.first_start is None:
            job.first_start = self.clock
        node_of = self.cluster.gpu_node
        partners: list[SimJob] = []
        for gpu in start.gpu_ids:
            residents = self.gpu_residents[gpu]
            for other in residents:
                if other not in partners:
                    partners.append(other)
            if not residents:
                self.node_free[node_of[gpu]] -= 1
                self.busy_gpus += 1
                if self.types is not None:
                    self.types.busy(gpu, +1)
            residents.append(job)
            self.gpu_load[gpu] += 1
            self.gpu_mem_used[gpu] += mem
        if partners:
            job.shared = True
            self.shared_pairs += len(partners)
        for other in partners:
            other.shared = True
            self._settle(other)
            self._retime(other)
        self._retime(job)

    def _allocate(self, job: SimJob, cpus: float | None, mem_gb: float | None) -> None:
        """Give a job that holds its GPUs a CPU/memory allocation, and the speed it
        brings: the ground truth's speed-up at it over the one at the proportional share
        of its GPUs (exactly 1 for jobs given that share, whatever the cluster)."""
        if cpus is None and mem_gb is None and job.cpus is None and job.mem_gb is None:
            return
        self._cluster_tuples = None
        self.host.add(job.gpu_ids, job.cpus, job.mem_gb, -1)
        self.host.add(job.gpu_ids, cpus, mem_gb, +1)
        self.own_allocations += (cpus is not None or mem_gb is not None) - (
            job.cpus is not None or job.mem_gb is not None
        )
        job.cpus, job.mem_gb = cpus, mem_gb
        job.cpu_mem_speedup = 1.0
        if cpus is None and mem_gb is None:
            return
        gpus = len(job.gpu_ids)
        fair_cpus, fair_mem = self.cluster.proportional_share(job.gpu_ids)
        model = job.spec.model
        at_allocation = self.truth.cpu_mem_speedup(
            model,
            gpus,
            (fair_cpus if cpus is None else cpus) / gpus,
            (fair_mem if mem_gb is None else mem_gb) / gpus,
        )
        at_fair = self.truth.cpu_mem_speedup(model, gpus, fair_cpus / gpus, fair_mem / gpus)
        job.cpu_mem_speedup = at_allocation / at_fair

    def _reallocate(self, reallocate: Reallocate) -> None:
        """A running job's new CPU/memory: its speed changes from now, nothing else."""
        job = self.jobs[reallocate.job_id]
        self._settle(job)
        self._allocate(job, reallocate.cpus, reallocate.mem_gb)
        self.reallocations += 1
        self._retime(job)

    # ---- results --------------------------------------------------------------------
    def _result(self, origin: float, wall_s: float) -> SimResult:
        return result_of(self, origin, wall_s)

def simulate(
    cluster: Cluster,
    jobs: Sequence[JobSpec],
    policy: Policy,
    truth: PerformanceModel,
    estimates: PerformanceModel | None = None,
    config: SimConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    return Simulator(cluster, jobs, policy, truth, estimates, config, progress).run()
