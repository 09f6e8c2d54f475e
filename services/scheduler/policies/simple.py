"""Non-preemptive baselines: FIFO and SJF on predicted sizes."""

from __future__ import annotations

from dataclasses import dataclass

from libs.core.decision import Decision
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import greedy_exclusive


def fifo_key(job: JobView) -> tuple[float, str]:
    return (job.submit_time, job.job_id)


def sjf_key(job: JobView) -> tuple[float, float, str]:
    return (job.est_remaining_s, job.submit_time, job.job_id)


@dataclass(frozen=True)
class Fifo:
    """First come, first served; by default the head of the queue blocks the rest."""

    backfill: bool = False
    name: str = "fifo"
    preemptive: bool = False

    def decide(self, snapshot: Snapshot) -> Decision:
        # the snapshot lists pending jobs in submission order already
        return greedy_exclusive(snapshot, snapshot.pending, backfill=self.backfill)


@dataclass(frozen=True)
class Sjf:
    """Shortest (predicted) job first, non-preemptive, skipping jobs that do not fit."""

    name: str = "sjf"
    preemptive: bool = False

    def decide(self, snapshot: Snapshot) -> Decision:
        if snapshot.free_gpus == 0:
            return greedy_exclusive(snapshot, (), backfill=True)
        return greedy_exclusive(snapshot, sorted(snapshot.pending, key=sjf_key), backfill=True)
