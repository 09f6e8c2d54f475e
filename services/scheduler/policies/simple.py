"""Non-preemptive baselines: FIFO, SJF on predicted sizes, and EDF on deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.placement import ShapeCache
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    PLAIN,
    Capabilities,
    QueueSort,
    greedy_exclusive,
    ordered_pending,
)


def fifo_key(job: JobView) -> tuple[float, str]:
    return (job.submit_time, job.job_id)


def sjf_key(job: JobView) -> tuple[float, float, str]:
    return (job.est_remaining_s, job.submit_time, job.job_id)


def edf_key(job: JobView) -> tuple[float, float, str]:
    # a job without a deadline can wait behind every job with one
    deadline = job.deadline if job.deadline is not None else float("inf")
    return (deadline, job.submit_time, job.job_id)


FIFO_ORDER = QueueSort("submit-time", fifo_key)
SJF_ORDER = QueueSort("predicted-size", sjf_key)
EDF_ORDER = QueueSort("deadline", edf_key)


@dataclass(frozen=True)
class Fifo:
    """First come, first served; by default the head of the queue blocks the rest."""

    backfill: bool = False
    name: str = "fifo"
    preemptive: bool = False
    queue_sort: QueueSort | None = FIFO_ORDER
    capabilities: ClassVar[Capabilities] = PLAIN
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)

    def decide(self, snapshot: Snapshot) -> Decision:
        return greedy_exclusive(
            snapshot, ordered_pending(snapshot, FIFO_ORDER), backfill=self.backfill,
            shapes=self._shapes,
        )


@dataclass(frozen=True)
class FifoBackfill(Fifo):
    """First come, first served with backfilling: a later job that fits the idle GPUs now starts."""

    backfill: bool = True
    name: str = "fifo-backfill"


@dataclass(frozen=True)
class Sjf:
    """Shortest (predicted) job first, non-preemptive, skipping jobs that do not fit."""

    name: str = "sjf"
    preemptive: bool = False
    queue_sort: QueueSort | None = SJF_ORDER
    capabilities: ClassVar[Capabilities] = PLAIN
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)

    def decide(self, snapshot: Snapshot) -> Decision:
        return _skipping(snapshot, SJF_ORDER, self._shapes)


@dataclass(frozen=True)
class Edf:
    """Earliest deadline first, non-preemptive, skipping jobs that do not fit; jobs
    without a deadline go after every job with one, in submission order."""

    name: str = "edf"
    preemptive: bool = False
    queue_sort: QueueSort | None = EDF_ORDER
    capabilities: ClassVar[Capabilities] = Capabilities(
        without_deadlines="it ran them in submission order, skipping those that do not "
        "fit: the order of fifo-backfill"
    )
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)

    def decide(self, snapshot: Snapshot) -> Decision:
        return _skipping(snapshot, EDF_ORDER, self._shapes)


def _skipping(snapshot: Snapshot, order: QueueSort, shapes: ShapeCache) -> Decision:
    """Start queued jobs in ``order``, skipping those that do not fit."""
    if snapshot.free_gpus == 0:
        return greedy_exclusive(snapshot, (), backfill=True)
    return greedy_exclusive(
        snapshot, ordered_pending(snapshot, order), backfill=True, shapes=shapes
    )
