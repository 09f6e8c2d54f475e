"""GENIE: jobs with deadlines, shortest waiting allowance first (SWAF), with an admission
that defers the jobs crowding out several others when the cluster is overloaded.

A job's waiting allowance is how long it may still wait and meet its deadline:
``deadline - now - predicted run time`` at its fastest placement (``JobView``'s estimate
is for the most consolidated one). Pending jobs go in this order:

1. jobs that can still meet their deadline, smallest allowance first, except those the
   admission defers;
2. jobs without a deadline, shortest predicted run time first;
3. the deferred jobs, smallest allowance first;
4. jobs that can no longer meet their deadline, shortest first (GENIE puts them last).

Each job takes the placement with the least GPU-time that still meets its deadline, else
the fastest. A job's GPU count is fixed here, so its GPU-time only grows as it spans more
nodes (all-reduce over the network), and both rules pick the most consolidated placement
free now: that is what ``place_exclusive`` gives. Non-preemptive; later jobs that fit
are started past one that does not (backfill).

The admission (ours, not the paper's): GENIE's goal is the share of jobs that meet their
deadlines, and under overload serving in allowance order lets one big job make several
small ones miss. So the jobs that can still meet their deadline are planned on a virtual
machine of the cluster's G GPUs: capacity is the GPUs idle now plus those each running
job frees at its predicted end (GPU-seconds over time), and a queued job must *start*
by ``deadline - run time``, that is, the capacity up to that moment must cover the
GPU-seconds of the jobs kept before it. With ``D = capacity(deadline - run time) + its
GPU-seconds`` this is one machine with due dates ``D``, where Moore-Hodgson keeps the
most jobs on time: walk them by ``D``, add each one's GPU-seconds, and when the sum
passes its ``D`` defer the kept job with the most GPU-seconds (O(n log n) with a heap).
A deferred job hears "deferred: running it now would make N jobs ... miss": N is how
many kept jobs' virtual slack its GPU-seconds exceed. While the virtual machine shows
such a miss, the first kept deadline job that does not fit also holds GPUs (EASY-style
backfill, ours too): a later job starts past it only if it ends before the held job's
predicted start, from the running jobs' predicted ends, or fits in GPUs left over then.
When the virtual machine shows no miss the decision is plain SWAF; with no deadline job
queued the admission costs one look at the queue's head. Measured on synthetic
workloads (docs/results.md, Deadlines): walking the virtual machine in SWAF order with
completions (``now + work / G``) instead deferred too much and lost to plain SWAF;
putting the deferred jobs among the hopeless ones measured the same as before them;
holding GPUs at every decision, not only under overload, lost at load 0.8.

Our design, not the paper's (its text is not available): from its abstract, its DATE'19
predecessor, and DESIGN.md section 5. Priorities (ours too): within this order a tenant's
places go to its own jobs highest ``priority`` first (``base.by_priority``), so a tenant
may put a job without a deadline before its own deadline job, never before another
tenant's. The profiling run and platform model that predict
run times belong to the predictor; this policy reads the estimates it is given.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, islice

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.placement import FreeGpus
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    QueueSort,
    busy_reason,
    by_priority,
    greedy_exclusive,
    has_priorities,
    no_room_reason,
    ordered_pending,
    place_exclusive,
    unschedulable_reason,
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
    """Shortest waiting allowance first, fastest free placement, and under overload a
    Moore-Hodgson admission with GPUs held for the first kept job (see the module)."""

    name: str = "genie"
    preemptive: bool = False
    #: False: plain SWAF (no deferral, no held GPUs), for comparison
    admission: bool = True

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
        deferred = defer(fixed, len(late), snapshot) if self.admission else {}
        late.sort(key=lambda job: swaf_key(job, now))
        ordered: Iterable[JobView] = chain(islice(fixed, len(late), None), late)
        if deferred:
            rest = list(islice(fixed, len(late), None))
            ordered = chain(
                (job for job in rest if job.job_id not in deferred),
                (job for job in rest if job.job_id in deferred),
                late,
            )
        if has_priorities(snapshot):
            ordered = list(by_priority(list(ordered)))
        if not snapshot.free_gpus:
            # nothing starts, but a job past hope or deferred still hears why it waits
            decision = greedy_exclusive(snapshot, (), backfill=True)
        elif deferred:
            decision = holding_gpus(snapshot, ordered)
        else:
            decision = greedy_exclusive(snapshot, ordered, backfill=True)
        started = {start.job_id for start in decision.starts}
        reasons = {
            job.job_id: "can no longer meet its deadline: it waits behind every job that can"
            for job in late
            if job.job_id not in started and job.job_id not in decision.reasons
        }
        for job_id, crowded in deferred.items():
            if job_id not in started and job_id not in decision.reasons:
                reasons[job_id] = deferred_reason(crowded)
        if not reasons:
            return decision
        return Decision(
            starts=decision.starts,
            reasons={**decision.reasons, **reasons},
            default_reason=decision.default_reason,
        )


def deferred_reason(crowded: int) -> str:
    if crowded == 0:
        return "deferred: its GPU-time is planned after jobs that can still meet deadlines"
    jobs = "job that can meet its deadline" if crowded == 1 else "jobs that can meet theirs"
    return f"deferred: running it now would make {crowded} {jobs} miss"


def capacity(snapshot: Snapshot) -> tuple[list[float], list[float], list[int]]:
    """The virtual machine's capacity from ``now``: at ``times[k]`` it has given
    ``gpu_s[k]`` GPU-seconds and gives ``rate[k]`` GPUs from then on (the idle ones,
    plus each running job's at its predicted end)."""
    now = snapshot.now
    ends = sorted((now + job.remaining_s(now), job.gpus) for job in snapshot.running)
    times, gpu_s, rate = [now], [0.0], [snapshot.free_gpus]
    for end, gpus in ends:
        gpu_s.append(gpu_s[-1] + rate[-1] * (end - times[-1]))
        times.append(end)
        rate.append(rate[-1] + gpus)
    return times, gpu_s, rate


def defer(fixed: Sequence[JobView], skip: int, snapshot: Snapshot) -> dict[str, int]:
    """The deadline jobs of ``fixed[skip:]`` GENIE defers (Moore-Hodgson on the virtual
    machine, see the module), each with how many kept jobs it would make miss if it ran
    first. Empty when ``fixed[skip]`` has no deadline (deadline jobs come first in the
    fixed order) or the virtual machine shows no miss."""
    if skip >= len(fixed) or fixed[skip].deadline is None:
        return {}
    now = snapshot.now
    times, gpu_s, rate = capacity(snapshot)
    due: list[tuple[float, int, float]] = []  # (D, position, GPU-seconds)
    for i, job in enumerate(islice(fixed, skip, None)):
        if job.deadline is None:
            break
        run = job.remaining_s(now)
        latest = job.deadline - run
        k = bisect.bisect_right(times, latest) - 1
        work = job.gpus * run
        due.append((gpu_s[k] + rate[k] * (latest - times[k]) + work, i, work))
    due.sort()
    kept: list[tuple[float, int]] = []  # heap of (-GPU-seconds, position)
    total = 0.0
    dropped: list[tuple[float, int]] = []
    for end, i, work in due:
        heapq.heappush(kept, (-work, i))
        total += work
        if total > end:
            neg, j = heapq.heappop(kept)
            total += neg
            dropped.append((-neg, j))
    if not dropped:
        return {}
    gone = {j for _, j in dropped}
    total, slacks = 0.0, []
    for end, i, work in due:
        if i not in gone:
            total += work
            slacks.append(end - total)
    slacks.sort()
    return {fixed[skip + j].job_id: bisect.bisect_left(slacks, work) for work, j in dropped}


def holding_gpus(snapshot: Snapshot, ordered: Iterable[JobView]) -> Decision:
    """``greedy_exclusive`` with backfill, except that the first deadline job that does
    not fit and would still meet its deadline at its predicted start (when running jobs
    and this decision's starts free enough GPUs) holds them: a later job starts only if
    it ends by then or fits in the GPUs left over at that moment."""
    now = snapshot.now
    free = FreeGpus(snapshot)
    starts: list[Start] = []
    ends: list[tuple[float, int]] = []
    reasons: dict[str, str] = {}
    held: JobView | None = None
    held_at, spare = 0.0, 0
    for job in ordered:
        if free.total == 0:
            break
        bad = unschedulable_reason(job, snapshot)
        if bad:
            reasons[job.job_id] = bad
            continue
        end = now + job.remaining_s(now)
        if held is not None and end > held_at and job.gpus > spare:
            reasons[job.job_id] = (
                f"GPUs are held for {held.job_id}, which needs {held.gpus} to meet its "
                f"deadline and should have them in {(held_at - now) / 60:.0f} min"
            )
            continue
        start = place_exclusive(job, free, snapshot)
        if start is not None:
            starts.append(start)
            ends.append((end, job.gpus))
            if held is not None and end > held_at:
                spare -= job.gpus
            continue
        reasons[job.job_id] = no_room_reason(job, free)
        if held is None and job.deadline is not None:
            at, left = gpus_free_at(snapshot, ends, free.total, job.gpus)
            if at + job.remaining_s(now) <= job.deadline:
                held, held_at, spare = job, at, left
    return Decision(starts=tuple(starts), reasons=reasons, default_reason=busy_reason(snapshot))


def gpus_free_at(
    snapshot: Snapshot, starts: list[tuple[float, int]], idle: int, need: int
) -> tuple[float, int]:
    """When ``need`` GPUs are idle (``idle`` now, more as the running jobs and this
    decision's ``starts`` end at their predicted times), and how many beyond ``need``."""
    now = snapshot.now
    ends = sorted([(now + job.remaining_s(now), job.gpus) for job in snapshot.running] + starts)
    for end, gpus in ends:
        idle += gpus
        if idle >= need:
            return end, idle - need
    return float("inf"), 0


__all__ = ["SLACK_ORDER", "Genie", "capacity", "defer", "slack_key", "swaf_key"]
