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

from dataclasses import dataclass

from libs.core.decision import Decision
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import by_priority, greedy_exclusive, has_priorities

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


@dataclass(frozen=True)
class Genie:
    """Shortest waiting allowance first, fastest free placement (see the module)."""

    name: str = "genie"
    preemptive: bool = False
    # the order depends on the time of the decision, so there is no fixed queue order
    queue_sort: None = None

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now
        keys = {job.job_id: swaf_key(job, now) for job in snapshot.pending}
        ordered = sorted(snapshot.pending, key=lambda job: keys[job.job_id])
        if has_priorities(snapshot):
            ordered = list(by_priority(ordered))
        # with no idle GPU nothing starts, but a job past hope still hears why it waits
        decision = greedy_exclusive(snapshot, ordered if snapshot.free_gpus else (), backfill=True)
        started = {start.job_id for start in decision.starts}
        late = {
            job.job_id: "can no longer meet its deadline: it waits behind every job that can"
            for job in ordered
            if keys[job.job_id][0] == TOO_LATE
            and job.job_id not in started
            and job.job_id not in decision.reasons
        }
        if not late:
            return decision
        return Decision(
            starts=decision.starts,
            reasons={**decision.reasons, **late},
            default_reason=decision.default_reason,
        )


__all__ = ["Genie", "swaf_key"]
