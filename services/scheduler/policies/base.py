"""What every policy shares: the protocol, feasibility checks and greedy exclusive placement."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from libs.core.decision import Decision, Start
from libs.core.placement import FreeGpus
from libs.core.snapshot import JobView, Snapshot

#: accumulation steps a policy may choose from (sub-batch = batch / (gpus * k))
ACCUM_CHOICES = (1, 2, 4, 8, 16)

SortKey = Callable[[JobView], tuple]


@dataclass(frozen=True)
class QueueSort:
    """A fixed order of queued jobs (a key that does not change while a job waits).

    A driver that knows a policy's queue sort keeps its queue in that order and says so
    in ``Snapshot.queue_order``, so the policy need not sort a long queue every round.
    """

    name: str
    key: SortKey


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def preemptive(self) -> bool: ...

    @property
    def queue_sort(self) -> QueueSort | None:
        """The order the policy reads the queue in, if it is fixed."""
        ...

    def decide(self, snapshot: Snapshot) -> Decision: ...


def ordered_pending(snapshot: Snapshot, sort: QueueSort) -> Sequence[JobView]:
    """The queue in ``sort`` order, sorting only if the driver has not already."""
    if snapshot.queue_order == sort.name:
        return snapshot.pending
    return sorted(snapshot.pending, key=sort.key)


def accum_choices(job: JobView) -> tuple[int, ...]:
    """Accumulation steps that leave every sub-batch at least one sample."""
    per_gpu = job.batch_size // job.gpus
    return tuple(k for k in ACCUM_CHOICES if per_gpu // k >= 1)


def exclusive_accum(job: JobView, snapshot: Snapshot, gpu_mem_mb: float) -> int | None:
    """Fewest accumulation steps whose per-GPU memory fits an idle GPU, None if none does."""
    est = snapshot.estimates
    for k in accum_choices(job):
        if est.gpu_memory_mb(job.model, job.batch_size / (job.gpus * k)) <= gpu_mem_mb:
            return k
    return None


def unschedulable_reason(job: JobView, snapshot: Snapshot) -> str | None:
    """Why the job can never run on this cluster, or None if it can."""
    total = snapshot.cluster.total_gpus
    if job.gpus > total:
        return f"unschedulable: needs {job.gpus} GPUs; the cluster has {total}"
    biggest = snapshot.cluster.max_gpu_mem_mb
    if exclusive_accum(job, snapshot, biggest) is None:
        smallest = job.batch_size / (job.gpus * max(accum_choices(job) or (1,)))
        need = snapshot.estimates.gpu_memory_mb(job.model, smallest)
        return (
            f"unschedulable: needs {need:.0f} MiB per GPU even at a sub-batch of "
            f"{smallest:g}; the largest GPU has {biggest} MiB"
        )
    return None


def no_room_reason(job: JobView, free: FreeGpus) -> str:
    return (
        f"needs {job.gpus} GPU{'s' if job.gpus > 1 else ''}; {free.total} idle, "
        f"largest idle block on one node {free.largest_block()}"
    )


def busy_reason(snapshot: Snapshot) -> str:
    return f"all {snapshot.cluster.total_gpus} GPUs are busy; waiting for a job to finish"


def place_exclusive(job: JobView, free: FreeGpus, snapshot: Snapshot) -> Start | None:
    if job.gpus > free.total:
        return None
    gpu_mem = snapshot.cluster.min_gpu_mem_mb
    accum = exclusive_accum(job, snapshot, gpu_mem) or 1
    gpus = free.take(job.gpus)
    if gpus is None:
        return None
    return Start(job.job_id, tuple(gpus), accum)


def greedy_exclusive(snapshot: Snapshot, ordered: Iterable[JobView], *, backfill: bool) -> Decision:
    """Start jobs in order on idle GPUs; with ``backfill`` skip those that do not fit.

    The scan stops once no GPU is idle: every job after that point shares one reason,
    so a decision over a long queue costs what it places, not the queue's length.
    """
    free = FreeGpus(snapshot)
    starts: list[Start] = []
    reasons: dict[str, str] = {}
    blocker: JobView | None = None
    for job in ordered:
        if free.total == 0:
            break
        bad = unschedulable_reason(job, snapshot)
        if bad:
            reasons[job.job_id] = bad
            continue
        start = place_exclusive(job, free, snapshot)
        if start is not None:
            starts.append(start)
            continue
        reasons[job.job_id] = no_room_reason(job, free)
        if not backfill:
            blocker = job
            break
    default = busy_reason(snapshot)
    if blocker is not None:
        default = f"behind {blocker.job_id} in queue order, which needs {blocker.gpus} GPUs"
    return Decision(starts=tuple(starts), reasons=reasons, default_reason=default)
