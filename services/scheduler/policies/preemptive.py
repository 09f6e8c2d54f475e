"""Preemptive priority scheduling: SRTF (oracle sizes) and Tiresias 2D-LAS.

Both rank every job, running or queued, and hand GPUs out in rank order. A running job
outside the winning set is preempted only when a higher-ranked queued job needs its
GPUs, so lower-ranked jobs keep running while nobody is waiting for their GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from libs.core.decision import Decision, Preempt, Start
from libs.core.placement import FreeGpus
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import (
    QueueSort,
    busy_reason,
    no_room_reason,
    place_exclusive,
    unschedulable_reason,
)

RankKey = Callable[[JobView], tuple]


def decide_by_rank(
    snapshot: Snapshot, rank: RankKey, describe: Callable[[JobView], str]
) -> Decision:
    reasons: dict[str, str] = {}
    candidates = [j for j in snapshot.running]
    for job in snapshot.pending:
        bad = unschedulable_reason(job, snapshot)
        if bad:
            reasons[job.job_id] = bad
        else:
            candidates.append(job)
    candidates.sort(key=rank)
    budget = snapshot.cluster.total_gpus
    winners: list[JobView] = []
    losers_running: list[JobView] = []
    for job in candidates:
        if job.gpus <= budget:
            budget -= job.gpus
            winners.append(job)
        elif job.running:
            losers_running.append(job)
        else:
            reasons[job.job_id] = (
                f"{describe(job)}; higher-ranked jobs hold the GPUs it needs ({job.gpus})"
            )
    free = FreeGpus(snapshot)
    node_of = snapshot.cluster.gpu_node
    starts: list[Start] = []
    preemptions: list[Preempt] = []
    for job in winners:
        if job.running:
            continue
        start = place_exclusive(job, free, snapshot)
        while start is None and losers_running:
            victim = losers_running.pop()  # lowest rank goes first
            preemptions.append(Preempt(victim.job_id, f"preempted for {job.job_id}"))
            free.give_back(victim.gpu_ids, node_of)
            start = place_exclusive(job, free, snapshot)
        if start is None:
            reasons[job.job_id] = f"{describe(job)}; {no_room_reason(job, free)}"
        else:
            starts.append(start)
    return Decision(
        starts=tuple(starts),
        preemptions=tuple(preemptions),
        reasons=reasons,
        default_reason=busy_reason(snapshot),
    )


@dataclass(frozen=True)
class Srtf:
    """Shortest remaining time first with oracle sizes (a simulator-only baseline)."""

    name: str = "srtf"
    preemptive: bool = True
    queue_sort: QueueSort | None = None

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now

        def rank(job: JobView) -> tuple:
            return (job.oracle_remaining_at(now), job.submit_time, job.job_id)

        def describe(job: JobView) -> str:
            return f"{job.oracle_remaining_at(now):.0f} s of work left"

        return decide_by_rank(snapshot, rank, describe)


@dataclass(frozen=True)
class Tiresias:
    """Discretised two-dimensional least-attained-service (Tiresias 2D-LAS).

    Queue ``i`` holds jobs whose attained GPU-seconds lie between thresholds ``i-1`` and
    ``i``; lower queues win, FIFO within a queue. A queued job that has waited more than
    ``promote_knob`` times its executed time (and at least ``min_wait_s``) is promoted
    to the top queue so that nothing starves.
    """

    thresholds_gpu_s: tuple[float, ...] = (3_600.0, 36_000.0)
    promote_knob: float = 8.0
    min_wait_s: float = 3_600.0
    name: str = "tiresias"
    preemptive: bool = True
    queue_sort: QueueSort | None = None

    def __post_init__(self) -> None:
        if list(self.thresholds_gpu_s) != sorted(self.thresholds_gpu_s):
            raise ValueError("tiresias thresholds must be ascending")
        if self.promote_knob <= 0:
            raise ValueError("tiresias promote_knob must be > 0")

    def queue_of(self, job: JobView, now: float) -> int:
        if not job.running and self._starving(job, now):
            return 0
        attained = job.attained_at(now)
        for index, limit in enumerate(self.thresholds_gpu_s):
            if attained < limit:
                return index
        return len(self.thresholds_gpu_s)

    def _promote_at(self, job: JobView) -> float:
        executed = job.attained_gpu_s / job.gpus
        return job.queued_since + max(self.min_wait_s, self.promote_knob * executed)

    def _starving(self, job: JobView, now: float) -> bool:
        return job.attained_gpu_s > 0 and now >= self._promote_at(job)

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now

        def rank(job: JobView) -> tuple:
            return (self.queue_of(job, now), job.submit_time, job.job_id)

        def describe(job: JobView) -> str:
            return f"priority queue {self.queue_of(job, now)}"

        decision = decide_by_rank(snapshot, rank, describe)
        wake = self._next_change(snapshot)
        return decision if wake is None else replace(decision, wake_at=wake)

    def _next_change(self, snapshot: Snapshot) -> float | None:
        """When some job next changes queue: a runner crossing a threshold, a waiter promoted."""
        if not snapshot.pending:
            return None  # queue changes matter only when someone is waiting
        now = snapshot.now
        wake = math.inf
        for job in snapshot.running:
            attained = job.attained_at(now)
            for limit in self.thresholds_gpu_s:
                if attained < limit:
                    wake = min(wake, now + (limit - attained) / job.gpus)
                    break
        for job in snapshot.pending:
            if job.attained_gpu_s > 0 and not self._starving(job, now):
                wake = min(wake, self._promote_at(job))
        return wake if wake < math.inf else None
