"""The frozen view of a cluster that a policy decides on.

A snapshot is everything a policy may read: the cluster, the jobs with what the
scheduler *believes* about them (estimates, never the ground truth, except the
``oracle_remaining_s`` a simulator may fill for oracle baselines), and per-GPU load.

Views of running jobs are linear in time: a view taken at ``as_of`` stays valid until
the job's speed changes, so a driver can reuse one view across many decisions and a
policy asks ``remaining_s(now)`` for the value at decision time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpusched.libs.core.cluster import Cluster, HostUse
from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.perf import PerformanceModel


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    submit_time: float
    model: str
    gpus: int
    batch_size: int
    #: predicted exclusive run time still to go, at a consolidated placement, as of ``as_of``
    est_remaining_s: float
    #: GPU-seconds of service received, as of ``as_of``
    attained_gpu_s: float = 0.0
    as_of: float = 0.0
    allow_sharing: bool = True
    deadline: float | None = None
    #: true remaining exclusive run time; filled only by simulators, for oracle baselines
    oracle_remaining_s: float | None = None
    #: RUNNING while the job holds GPUs (being started or stopped too), else QUEUED
    state: JobState = JobState.QUEUED
    #: running only: GPUs held and the accumulation steps in use
    gpu_ids: tuple[int, ...] = ()
    accum_steps: int = 1
    #: running only: exclusive seconds of work done per wall second (1/slowdown; 0 while
    #: restoring a checkpoint)
    progress_rate: float = 0.0
    #: when the job last entered the queue (submission or preemption); for a running job,
    #: the wait that ended with its current run
    queued_since: float = 0.0
    #: running only: when its current run began
    started_at: float = 0.0
    preemptions: int = 0
    #: running only: CPU cores and host memory GB the whole job holds; None: the
    #: GPU-proportional share of its nodes
    cpus: float | None = None
    mem_gb: float | None = None
    #: running only: seconds one epoch of its data set takes at its current shape, where
    #: the driver knows the data set's size; None: unknown
    epoch_s: float | None = None
    #: the tenant (user) that submitted the job, and the priority it gave it (-1000..1000):
    #: a tenant's higher-priority jobs take the places of its own lower-priority ones in
    #: a policy's order (``gpusched.services.scheduler.policies.base.by_priority``)
    user: str = ""
    priority: int = 0
    #: tensor and pipeline parallel degrees (``gpusched.libs.core.parallelism``); data
    #: parallel = gpus / (tensor x pipeline); a policy places such a job with
    #: ``FreeGpus.take_parallel``
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    #: the elastic bounds the job declares (``gpusched.libs.core.elastic``); None: none,
    #: or a driver that passes none. A policy that sizes jobs keeps a job within them
    elastic: Elastic | None = None

    @property
    def running(self) -> bool:
        return self.state is JobState.RUNNING

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.est_remaining_s - (now - self.as_of) * self.progress_rate)

    def oracle_remaining_at(self, now: float) -> float:
        """True remaining time where a simulator knows it, else the estimate."""
        if self.oracle_remaining_s is None or self.est_remaining_s <= 0:
            return self.remaining_s(now)
        # both count the same remaining iterations, so they shrink in proportion
        done = (now - self.as_of) * self.progress_rate / self.est_remaining_s
        return max(0.0, self.oracle_remaining_s * (1 - done))

    def attained_at(self, now: float) -> float:
        if not self.running:
            return self.attained_gpu_s
        return self.attained_gpu_s + (now - self.as_of) * self.gpus


@dataclass(frozen=True)
class Snapshot:
    now: float
    cluster: Cluster
    #: queued jobs, in the order ``queue_order`` names
    pending: tuple[JobView, ...]
    running: tuple[JobView, ...]
    #: number of jobs resident on every global GPU index
    gpu_load: tuple[int, ...]
    #: GPU memory held on every global GPU index, MiB
    gpu_mem_used: tuple[float, ...]
    #: GPUs with no resident job, per node
    node_free: tuple[int, ...]
    estimates: PerformanceModel
    #: most jobs one GPU may hold
    max_jobs_per_gpu: int = 2
    #: the queue sort ``pending`` follows; "arrival" is the order jobs (re)joined the queue
    queue_order: str = "arrival"
    #: CPU cores and host memory GB in use on every node (running jobs' allocations, the
    #: GPU-proportional share for jobs without one); empty: the driver does not track them
    node_cpus_used: tuple[float, ...] = ()
    node_mem_used: tuple[float, ...] = ()
    #: whether some running job holds a CPU/memory allocation of its own rather than the
    #: GPU-proportional share (None: a check looks). Shares alone never overcommit a
    #: node, so with False a decision that gives no allocation is checked on GPUs only
    own_allocations: bool | None = None
    #: whether some queued or running job has a priority other than 0 (None: a policy
    #: looks); with False a policy skips the priority pass, with True it runs it
    prioritized: bool | None = None
    #: the same queued jobs in further orders the driver keeps, by ``QueueSort`` name (a
    #: policy names the ones it can use in ``extra_sorts``); a driver may give none
    orders: Mapping[str, tuple[JobView, ...]] = field(default_factory=dict, compare=False)
    #: every job above by id, where the driver keeps such an index (it must not change
    #: until the decision on this snapshot is checked); None: built on the first lookup,
    #: which costs the length of the queue
    index: Mapping[str, JobView] | None = field(default=None, repr=False, compare=False)
    _by_id: dict[str, JobView] = field(default_factory=dict, repr=False, compare=False)

    @property
    def free_gpus(self) -> int:
        return sum(self.node_free)

    def job(self, job_id: str) -> JobView:
        if self.index is not None:
            return self.index[job_id]
        if not self._by_id:
            self._by_id.update((j.job_id, j) for j in self.running)
            self._by_id.update((j.job_id, j) for j in self.pending)
        return self._by_id[job_id]

    @classmethod
    def of_jobs(
        cls,
        now: float,
        cluster: Cluster,
        pending: tuple[JobView, ...],
        running: tuple[JobView, ...],
        estimates: PerformanceModel,
        *,
        memory: PerformanceModel | None = None,
        max_jobs_per_gpu: int = 2,
        queue_order: str = "arrival",
        prioritized: bool | None = None,
        orders: Mapping[str, tuple[JobView, ...]] | None = None,
        index: Mapping[str, JobView] | None = None,
    ) -> Snapshot:
        """The snapshot of these jobs, with every field that follows from them derived
        from the running ones: ``gpu_load`` (jobs resident on each GPU), ``gpu_mem_used``
        (each resident's memory at its per-GPU sub-batch, as ``memory`` sizes jobs:
        default ``estimates``, and the model ``decision_problems`` must then be given),
        ``node_free`` (GPUs without a resident), ``node_cpus_used`` and ``node_mem_used``
        (their allocations, or the GPU-proportional share; see ``HostUse``) and
        ``own_allocations``. ``prioritized``: whether some job has a priority other than
        0, where the driver knows of more jobs than these (None: these jobs say).

        A driver may keep these fields up to date job by job instead (the simulator
        does, for speed); they must equal what this derives."""
        total = cluster.total_gpus
        load = [0] * total
        used = [0.0] * total
        sizes = memory if memory is not None else estimates
        own = False
        for view in running:
            mem = sizes.gpu_memory_mb(
                view.model, view.batch_size / (view.gpus * max(1, view.accum_steps))
            )
            for gpu in view.gpu_ids:
                load[gpu] += 1
                used[gpu] += mem
            own = own or view.cpus is not None or view.mem_gb is not None
        node_free = [0] * len(cluster.nodes)
        gpu_node = cluster.gpu_node
        for gpu, residents in enumerate(load):
            if residents == 0:
                node_free[gpu_node[gpu]] += 1
        host = HostUse.of_jobs(cluster, ((v.gpu_ids, v.cpus, v.mem_gb) for v in running))
        if prioritized is None:
            prioritized = any(v.priority for v in pending) or any(v.priority for v in running)
        return cls(
            now=now,
            cluster=cluster,
            pending=pending,
            running=running,
            gpu_load=tuple(load),
            gpu_mem_used=tuple(used),
            node_free=tuple(node_free),
            estimates=estimates,
            max_jobs_per_gpu=max_jobs_per_gpu,
            queue_order=queue_order,
            node_cpus_used=host.all_cpus(),
            node_mem_used=host.all_mem(),
            own_allocations=own,
            prioritized=prioritized,
            orders=orders if orders is not None else {},
            index=index,
        )

    @classmethod
    def of_idle_cluster(
        cls,
        cluster: Cluster,
        estimates: PerformanceModel,
        pending: tuple[JobView, ...] = (),
        now: float = 0.0,
    ) -> Snapshot:
        return cls.of_jobs(now, cluster, pending, (), estimates)


class ModelBasis:
    """The cluster and performance model that a policy's cached work was computed for:
    what depends on them is forgotten when a snapshot brings others."""

    __slots__ = ("_cluster", "_estimates")

    def __init__(self) -> None:
        self._cluster: object = None
        self._estimates: object = None

    def moved(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot`` brings another cluster or model than the last one asked
        about (which it then remembers)."""
        if snapshot.cluster is self._cluster and snapshot.estimates is self._estimates:
            return False
        self._cluster, self._estimates = snapshot.cluster, snapshot.estimates
        return True
