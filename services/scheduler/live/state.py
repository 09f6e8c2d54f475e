"""The live scheduler's picture of the cluster, and the snapshot it gives a policy.

Placements are kept per node with node-local GPU indices; global indices exist only
inside one snapshot, because the set of live nodes can change between rounds.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.schemas import SOURCE_FOREST, JobRecord, NodeInfo, Placement, Progress
from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.job_state import Run, job_view
from gpusched.libs.core.job_state import remaining_iterations as core_remaining_iterations
from gpusched.libs.core.perf import CpuMemDemand, DelegatingModel, PerformanceModel
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import Policy


class ScaledModel(DelegatingModel):
    """A performance model whose times are in wall seconds of a sped-up cluster, and
    whose CPU/memory sensitivity of a model comes from the profile a node measured where
    there is one (``measured``, by model; see libs/common/cpu_sensitivity.py)."""

    def __init__(
        self,
        inner: PerformanceModel,
        time_scale: float,
        measured: Mapping[str, Sensitivity] | None = None,
    ) -> None:
        super().__init__(inner)
        self.time_scale = time_scale
        self.measured: Mapping[str, Sensitivity] = dict(measured or {})

    def with_measured(self, sensitivity: Sensitivity) -> ScaledModel:
        """A new model (policies forget what they derived from the old one) that takes
        ``sensitivity.model``'s CPU/memory sensitivity from this measurement."""
        return ScaledModel(
            self.inner, self.time_scale, {**self.measured, sensitivity.model: sensitivity}
        )

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        return self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps) * (
            self.time_scale
        )

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        measured = self.measured.get(model)
        if measured is not None:
            return measured.speedup(cpus_per_gpu, mem_gb_per_gpu)
        return self.inner.cpu_mem_speedup(model, gpus, cpus_per_gpu, mem_gb_per_gpu)

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        measured = self.measured.get(model)
        if measured is not None:
            return measured.demand()
        return self.inner.cpu_mem_demand(model)


class Phase(enum.StrEnum):
    """Where the live scheduler is with a job it drives: finer than the job's stored
    ``JobState``, because starting and stopping take request/reply round trips during
    which the job's GPUs are booked although its record does not say RUNNING (or still
    says it)."""

    #: queued or preempted (``JobState.waiting``): holds no GPUs, offered to the policy
    WAITING = "waiting"
    #: start (or resize) commands sent, not yet confirmed; the record still waits
    STARTING = "starting"
    #: the record says RUNNING and the job's nodes run it
    RUNNING = "running"
    #: a stop was sent; the record says RUNNING until the job's exit arrives
    STOPPING = "stopping"


def believed_iterations(record: JobRecord) -> float:
    """The iterations the scheduler believes the job runs in all: the size forest's
    prediction where the predictor gave one (``prediction_source`` ``forest``), never
    more than the job's own total (its run stops there), else that total."""
    total = float(record.total_iterations)
    predicted = record.predicted_iterations
    if record.prediction_source == SOURCE_FOREST and predicted is not None:
        return min(predicted, total)
    return total


def remaining_iterations(record: JobRecord, done: int) -> float:
    """The iterations a job is believed to have left after ``done``: the rule both
    drivers share (``gpusched.libs.core.job_state.remaining_iterations``) over the
    believed total, within the run, which stops at the job's declared total."""
    return core_remaining_iterations(believed_iterations(record), done, record.total_iterations)


@dataclass
class LiveJob:
    record: JobRecord
    revision: int
    #: predicted wall seconds per iteration, exclusive, at a consolidated placement
    est_iteration_s: float
    phase: Phase = Phase.WAITING
    #: what a stop is for: "preempt", "cancel" or "lost"
    stop_reason: str = ""
    queued_since: float = 0.0
    #: a failed job is not offered to the policy before this time (retry backoff)
    not_before: float = 0.0
    #: GPU-seconds of service of the runs that ended (the current run counts on top)
    attained_gpu_s: float = 0.0
    #: when the current run went RUNNING (0: none runs)
    running_since: float = 0.0
    #: the run a resize replaces: its node may list it until it has checkpointed
    resizing_from: int | None = None
    #: when the job's node last listed it as running
    last_seen: float = 0.0
    #: a start sent by an earlier leader that never saw its result: the run is taken as
    #: started once its node lists it, or as never started after the missing-job grace
    unconfirmed_start: bool = False
    last_progress_write: float = 0.0
    #: the latest progress the current run streamed (its record keeps one every
    #: ``progress_write_s``); None before the first
    progress: Progress | None = None
    iteration: int = 0
    iteration_at: float = 0.0
    #: remaining iterations the predictor's progress predictor gave at iteration
    #: ``predicted_at`` of run ``predicted_run`` (policies that predict progress; None,
    #: or another run, with another batch maybe: the plain estimate)
    predicted_remaining: float | None = None
    predicted_at: int = 0
    predicted_run: int = 0
    #: the last whole epoch a prediction was asked at
    asked_epoch: int = 0
    #: the view last offered to the policy, and what it was built from (see _kept)
    _kept_view: tuple[JobRecord, tuple, JobView] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def holds_gpus(self) -> bool:
        return self.phase != Phase.WAITING

    def remaining_s(self) -> float:
        if self.predicted_remaining is not None and self.predicted_run == self.record.run_id:
            since = max(0, self.iteration - self.predicted_at)
            return max(0.0, self.predicted_remaining - since) * self.est_iteration_s
        return remaining_iterations(self.record, self.iteration) * self.est_iteration_s

    @property
    def gpus(self) -> int:
        return self.record.current_spec.gpus

    def attained_at(self, now: float) -> float:
        """GPU-seconds of service so far, the current run included."""
        running = max(0.0, now - self.running_since) if self.running_since else 0.0
        return self.attained_gpu_s + running * self.gpus

    def settle_service(self, now: float) -> None:
        """Add the current run's service to the total (its run ends or changes shape)."""
        self.attained_gpu_s = self.attained_at(now)
        self.running_since = 0.0


@dataclass
class LiveNode:
    info: NodeInfo
    last_beat: float
    #: job id -> run id, as the node last reported
    reported: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.name


def node_of(info: NodeInfo) -> Node:
    memory = min((g.memory_mb for g in info.gpus), default=1)
    model = info.gpus[0].model if info.gpus else "none"
    return Node(
        name=info.name,
        gpus=len(info.gpus),
        gpu_mem_mb=max(1, memory),
        cpus=info.cpus,
        host_mem_gb=info.host_mem_gb,
        net_gbps=info.net_gbps,
        gpu_model=model,
    )


@dataclass(frozen=True)
class Layout:
    """The cluster of the live nodes, with the map between global and node-local GPUs."""

    cluster: Cluster
    node_index: dict[str, int]

    @classmethod
    def of(cls, nodes: list[NodeInfo]) -> Layout | None:
        usable = sorted((n for n in nodes if n.gpus), key=lambda n: n.name)
        if not usable:
            return None
        cluster = Cluster(tuple(node_of(n) for n in usable))
        return cls(cluster, {n.name: i for i, n in enumerate(usable)})

    def global_ids(self, placement: list[Placement]) -> tuple[int, ...] | None:
        ids: list[int] = []
        for part in placement:
            index = self.node_index.get(part.node)
            if index is None:
                return None
            offset = self.cluster.offsets[index]
            ids.extend(offset + g for g in part.gpus)
        return tuple(ids)

    def placement(self, gpu_ids: tuple[int, ...]) -> list[Placement]:
        by_node: dict[int, list[int]] = {}
        for gpu in gpu_ids:
            node = self.cluster.gpu_node[gpu]
            by_node.setdefault(node, []).append(gpu - self.cluster.offsets[node])
        return [
            Placement(node=self.cluster.nodes[n].name, gpus=sorted(local))
            for n, local in sorted(by_node.items())
        ]


def consolidated_nodes(gpus: int, cluster: Cluster | None) -> int:
    per_node = cluster.max_gpus_per_node if cluster else 8
    return max(1, math.ceil(gpus / max(1, per_node)))


def job_memory_mb(job: LiveJob, estimates: PerformanceModel) -> float:
    spec = job.record.current_spec
    return estimates.gpu_memory_mb(
        spec.model, spec.batch_size / (spec.gpus * max(1, job.record.accum_steps))
    )


def _view(job: LiveJob, as_of: float, run: Run | None = None) -> JobView:
    """The job's view as of ``as_of``, built by the rule both drivers share
    (``gpusched.libs.core.job_state.job_view``): running where ``run`` is given. The
    live views carry no parallel degrees (the core builder's default, 1 x 1) and no
    oracle figure; a job's batch bounds are its elastic bounds (a live job declares no
    GPU bounds), so a policy that resizes never picks a batch the job refuses."""
    record = job.record
    spec = record.current_spec
    asked = record.spec
    return job_view(
        job_id=job.id,
        submit_time=record.submitted_at,
        model=spec.model,
        gpus=spec.gpus,
        batch_size=spec.batch_size,
        allow_sharing=spec.allow_sharing,
        deadline=spec.deadline,
        user=record.tenant,
        priority=spec.priority,
        est_remaining_s=job.remaining_s(),
        attained_gpu_s=job.attained_at(as_of),
        as_of=as_of,
        queued_since=job.queued_since,
        preemptions=record.preemptions,
        run=run,
        elastic=Elastic.of(None, None, asked.min_batch_size, asked.max_batch_size),
    )


def _epoch_s(job: LiveJob) -> float | None:
    """Seconds one epoch takes at the job's current shape, where its spec gives a data
    set size (what ONES waits between changes of a job)."""
    spec = job.record.current_spec
    if spec.dataset_size is None or job.est_iteration_s <= 0:
        return None
    return spec.dataset_size / spec.batch_size * job.est_iteration_s


def _kept(job: LiveJob, inputs: tuple, make: Callable[[], JobView]) -> JobView:
    """The job's view from the last round while its record (replaced, never changed in
    place, when the job changes) and ``inputs`` are the same, else ``make()``, kept."""
    record = job.record
    cached = job._kept_view
    if cached is not None and cached[0] is record and cached[1] == inputs:
        return cached[2]
    view = make()
    job._kept_view = (record, inputs, view)
    return view


def waiting_view(job: LiveJob, now: float) -> JobView:
    """The view of a waiting job, the same object as last round's while nothing it is
    built from has changed. A waiting view does not age (it makes no progress and earns
    no service), so reusing it is exact, and a policy that remembers jobs by their view
    (SJF-BSBF's queued jobs without a partner) keeps what it learnt across rounds; it
    also spares a round most of the cost of a long queue."""

    def make() -> JobView:
        return _view(job, now)

    if job.running_since:  # its service grows until it is settled: new every round
        return make()
    inputs = (
        job.phase, job.est_iteration_s, job.iteration, job.attained_gpu_s, job.queued_since,
        job.predicted_remaining,
    )  # fmt: skip
    return _kept(job, inputs, make)


def running_view(job: LiveJob, now: float, gpu_ids: tuple[int, ...]) -> JobView:
    """The view of a job holding GPUs, as of its last progress report, and the same
    object as last round's while nothing it is built from has changed (a running view is
    linear in time, see ``gpusched.libs.core.snapshot``). Before its first report it is as of now,
    so new every round."""

    def make() -> JobView:
        run = Run(
            gpu_ids=gpu_ids,
            accum_steps=job.record.accum_steps,
            # a stopping job finishes nothing more; one being started not yet
            progress_rate=1.0 if job.phase == Phase.RUNNING else 0.0,
            started_at=job.running_since,
            cpus=job.record.cpus,
            mem_gb=job.record.mem_gb,
            epoch_s=_epoch_s(job),
        )
        return _view(job, job.iteration_at or now, run)

    if not job.iteration_at:
        return make()
    inputs = (
        job.phase, gpu_ids, job.est_iteration_s, job.iteration, job.iteration_at,
        job.attained_gpu_s, job.running_since, job.queued_since, job.predicted_remaining,
    )  # fmt: skip
    return _kept(job, inputs, make)


def build_snapshot(
    now: float,
    layout: Layout,
    jobs: dict[str, LiveJob],
    estimates: PerformanceModel,
    policy: Policy,
) -> Snapshot:
    """The snapshot of the jobs offered to the policy: those holding GPUs on live nodes,
    and those waiting (past any retry backoff) in the policy's queue order. Its per-GPU
    and per-node fields are derived by ``Snapshot.of_jobs``; ``prioritized`` looks at
    every job kept, offered or not."""
    running: list[JobView] = []
    pending: list[JobView] = []
    prioritized = False
    for job in jobs.values():
        record = job.record
        prioritized = prioritized or record.spec.priority != 0
        if job.holds_gpus:
            gpu_ids = layout.global_ids(record.placement)
            if gpu_ids is None:
                continue  # its node is gone; the node sweep requeues it
            running.append(running_view(job, now, gpu_ids))
        elif job.not_before <= now and not record.state.terminal:
            pending.append(waiting_view(job, now))
    sort = policy.queue_sort
    if sort is not None:
        pending.sort(key=sort.key)
    else:
        pending.sort(key=lambda v: (v.queued_since, v.job_id))
    return Snapshot.of_jobs(
        now,
        layout.cluster,
        tuple(pending),
        tuple(running),
        estimates,
        queue_order=sort.name if sort is not None else "arrival",
        prioritized=prioritized,
    )


def finish_estimates(
    snapshot: Snapshot, started: Collection[str]
) -> dict[str, tuple[float, float]]:
    """Per job with a deadline, running or queued: when it is expected to finish and the
    run time alone it still needs (seconds, on the snapshot's clock).

    Our estimate: a running job (or one ``started`` now) finishes after its predicted
    remaining time. A queued job first waits until enough GPUs are free for it, counting
    the GPUs idle after this decision and those the running jobs free at their predicted
    ends (jobs queued ahead of it are not counted, so the wait is a lower bound), then
    runs for its predicted time. A job that no such wait makes room for is left out.
    """
    now = snapshot.now
    with_deadline = [v for v in (*snapshot.running, *snapshot.pending) if v.deadline is not None]
    if not with_deadline:
        return {}
    estimates: dict[str, tuple[float, float]] = {}
    holders = list(snapshot.running)
    free = snapshot.free_gpus
    for view in snapshot.pending:
        if view.job_id in started:
            holders.append(view)
            free -= view.gpus
    ends = sorted((now + v.remaining_s(now), v.gpus) for v in holders)
    free = max(0, free)
    for view in with_deadline:
        run_s = view.remaining_s(now)
        if view.running or view.job_id in started:
            estimates[view.job_id] = (now + run_s, run_s)
            continue
        room, ready = free, now
        for end, gpus in ends:
            if room >= view.gpus:
                break
            room, ready = room + gpus, end
        if room >= view.gpus:
            estimates[view.job_id] = (ready + run_s, run_s)
    return estimates
