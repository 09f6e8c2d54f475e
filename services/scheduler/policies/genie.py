"""GENIE: jobs with deadlines, shortest waiting allowance first (SWAF).

A job's waiting allowance is how long it may still wait and meet its deadline:
``deadline - now - predicted run time`` at its fastest placement (``JobView``'s estimate
is for the most consolidated one). Pending jobs go in this order:

1. jobs that can still meet their deadline, smallest allowance first;
2. jobs without a deadline, shortest predicted run time first;
3. jobs that can no longer meet their deadline, shortest first (GENIE puts them last).

Each job takes the placement with the least GPU-time that still meets its deadline, else
the fastest. A job's GPU count is fixed here, so its GPU-time only grows as it spans more
nodes (all-reduce over the network), and both rules pick the most consolidated placement
free now: that is what ``place_exclusive`` gives. Non-preemptive; later jobs that fit
are started past one that does not (backfill).

Our design, not the paper's (its text is not available): from its abstract, its DATE'19
predecessor, and DESIGN.md section 5. Priorities (ours too): within this order a tenant's
places go to its own jobs highest ``priority`` first (``base.by_priority``), so a tenant
may put a job without a deadline before its own deadline job, never before another
tenant's. The profiling run and platform model that predict
run times belong to the predictor; this policy reads the estimates it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, islice

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    QueueSort,
    by_priority,
    greedy_exclusive,
    has_priorities,
    ordered_pending,
)

CAN_MEET, NO_DEADLINE, TOO_LATE = 0, 1, 2


def swaf_key(job: JobView, now: float) -> tuple[int, float, float, str]:
    """The job's place in GENIE's order at ``now`` (ties: submission, then id)."""
    remaining = job.remaining_s(now)
    if job.deadline is None:
        return (NO_DEADLINE, remaining, job.submit_time, job.job_id)
    allowance = job.deadline - now - remaining
    if allowance < 0:
        return (TOO_LATE, remaining, job.submit_time, job.job_id)
    return (CAN_MEET, allowance, job.submit_time, job.job_id)


def slack_key(job: JobView) -> tuple[int, float, float, str]:
    """A queued job's fixed place: deadline jobs by ``deadline - run time`` (their
    allowance plus ``now``, so the same order at every decision), then the rest by run
    time. A queued job's estimate does not change while it waits."""
    remaining = max(0.0, job.est_remaining_s)
    if job.deadline is None:
        return (NO_DEADLINE, remaining, job.submit_time, job.job_id)
    return (CAN_MEET, job.deadline - remaining, job.submit_time, job.job_id)


#: the fixed order a driver may keep GENIE's queue in; the jobs past hope are the
#: deadline jobs at its head whose allowance has gone below zero
SLACK_ORDER = QueueSort("deadline-slack", slack_key)


@dataclass(frozen=True)
class Genie:
    """Shortest waiting allowance first, fastest free placement (see the module)."""

    name: str = "genie"
    preemptive: bool = False

    @property
    def queue_sort(self) -> QueueSort:
        return SLACK_ORDER

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now
        fixed = ordered_pending(snapshot, SLACK_ORDER)
        # SWAF without sorting the queue at every decision: in the fixed order the jobs
        # past hope are a prefix of the deadline jobs (allowance = slack - now < 0)
        late: list[JobView] = []
        for job in fixed:
            if job.deadline is None or swaf_key(job, now)[0] != TOO_LATE:
                break
            late.append(job)
        late.sort(key=lambda job: swaf_key(job, now))
        ordered: Iterable[JobView] = chain(islice(fixed, len(late), None), late)
        if has_priorities(snapshot):
            ordered = list(by_priority(list(ordered)))
        # with no idle GPU nothing starts, but a job past hope still hears why it waits
        decision = greedy_exclusive(snapshot, ordered if snapshot.free_gpus else (), backfill=True)
        started = {start.job_id for start in decision.starts}
        reasons = {
            job.job_id: "can no longer meet its deadline: it waits behind every job that can"
            for job in late
            if job.job_id not in started and job.job_id not in decision.reasons
        }
        if not reasons:
            return decision
        return Decision(
            starts=decision.starts,
            reasons={**decision.reasons, **reasons},
            default_reason=decision.default_reason,
        )


__all__ = ["SLACK_ORDER", "Genie", "slack_key", "swaf_key"]
