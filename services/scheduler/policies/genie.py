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
the fastest, and that choice is made over time (ours: the paper is silent on when). A
job's GPU count is fixed here, so its GPU-time only grows as it spans more nodes
(all-reduce over the network), and the best placement free *now* is the most
consolidated one (``place_exclusive``). When that one spans more nodes than the fewest
the job needs (``Cluster.fewest_nodes``), genie also looks at waiting for that many:
from the running jobs' predicted ends (at their progress rate) and this decision's
starts it finds, node by node, the soonest moment such a placement is idle; the run
time across ``n`` nodes is the estimate (for the fewest) scaled by
``iteration_time(n) / iteration_time(fewest)``. Of starting now and waiting, a deadline
job takes the one with the least GPU-time among those that meet its deadline (so it
waits when both do), any other job (or one that meets its deadline neither way) the one
that finishes first, starting now on a tie. Intermediate placements (fewer nodes than
now, more than the fewest) are not looked at: measured, they gained little and cost much
(docs/results.md). A job that waits holds the idle GPUs of the nodes it waits for: a
later job starts there only if it is predicted to end by then, and the job hears
"waits for 4 GPUs on one node in ~66 min: finishes sooner than starting now
across 2 nodes". Only a start that would be spread pays for this look. The plan is kept
until its moment or the job's start (``PlansKept``): at later decisions the job, when its
turn comes and it cannot start, holds its plan's idle GPUs again, so narrow jobs after
it in the order do not take the node it waits for (they would have, at a decision with
nothing spread to start).
Non-preemptive; later jobs that fit are started past one that does not (backfill).

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
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice, tee

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.placement import FreeGpus, ShapeCache, model_parallel, place_exclusive
from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot
from gpusched.services.scheduler.policies.base import (
    Capabilities,
    QueueSort,
    SkippedReasons,
    busy_reason,
    by_priority,
    greedy_exclusive,
    has_priorities,
    no_room_reason,
    ordered_pending,
)
from gpusched.services.scheduler.policies.genie_timeline import Plan, PlansKept, Timeline

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

GENIE_CAPABILITIES = Capabilities(
    without_deadlines="its deadline order and admission had nothing to act on: it ran "
    "jobs shortest predicted run time first, with backfill"
)


@dataclass(frozen=True)
class Genie:
    """Shortest waiting allowance first, fastest free placement, and under overload a
    Moore-Hodgson admission with GPUs held for the first kept job (see the module)."""

    name: str = "genie"
    preemptive: bool = False
    #: False: plain SWAF (no deferral, no held GPUs), for comparison
    admission: bool = True
    #: False: every job starts at the most consolidated placement free now, however
    #: spread (no waiting for a consolidated one), for comparison
    placement_over_time: bool = True
    _spread: SpreadCost = field(default_factory=lambda: SpreadCost(), compare=False, repr=False)
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _plans: PlansKept = field(default_factory=lambda: PlansKept(), compare=False, repr=False)

    @property
    def queue_sort(self) -> QueueSort:
        return SLACK_ORDER

    @property
    def capabilities(self) -> Capabilities:
        return GENIE_CAPABILITIES

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
        spread = self._spread if self.placement_over_time else None
        plans = self._plans if spread is not None else None
        kept = plans.live(snapshot) if plans is not None else {}
        if not snapshot.free_gpus:
            # nothing starts, but a job past hope or deferred still hears why it waits
            decision = greedy_exclusive(snapshot, (), backfill=True)
        elif deferred or kept:
            decision = placing(
                snapshot, ordered, self._shapes, hold=bool(deferred), spread=spread, plans=plans
            )
        elif spread is None:
            decision = greedy_exclusive(snapshot, ordered, backfill=True, shapes=self._shapes)
        else:
            # the plain scan first: only when one of its starts is spread over more nodes
            # than the job needs does the placement over time change anything
            ordered, again = tee(ordered)
            decision = greedy_exclusive(snapshot, ordered, backfill=True, shapes=self._shapes)
            if any(spread.is_spread(start, snapshot) for start in decision.starts):
                decision = placing(
                    snapshot, again, self._shapes, hold=False, spread=spread, plans=plans
                )
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


def running_ends(snapshot: Snapshot) -> list[tuple[float, int]]:
    """Each running job's predicted end (its remaining time from now, as estimated) and
    the GPUs it frees then."""
    now = snapshot.now
    return [(now + job.remaining_s(now), job.gpus) for job in snapshot.running]


def capacity(snapshot: Snapshot) -> tuple[list[float], list[float], list[int]]:
    """The virtual machine's capacity from ``now``: at ``times[k]`` it has given
    ``gpu_s[k]`` GPU-seconds and gives ``rate[k]`` GPUs from then on (the idle ones,
    plus each running job's at its predicted end)."""
    now = snapshot.now
    ends = sorted(running_ends(snapshot))
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


def placing(
    snapshot: Snapshot,
    ordered: Iterable[JobView],
    shapes: ShapeCache,
    *,
    hold: bool,
    spread: SpreadCost | None,
    skip_early: bool = True,
    plans: PlansKept | None = None,
) -> Decision:
    """``greedy_exclusive`` with backfill, and two ways of holding GPUs (see the module).

    With ``hold``, the first deadline job that does not fit and would still meet its
    deadline at its predicted start (when running jobs and this decision's starts free
    enough GPUs) holds them: a later job starts only if it ends by then or fits in the
    GPUs left over at that moment. With ``spread``, a job whose placement now would span
    more nodes than it needs starts there only if that is its best choice over time;
    else it waits for a less spread placement and holds the idle GPUs of its nodes.

    ``skip_early`` passes over a job that cannot start, once that is plain, writing
    only why it waits (off, every job goes through every step: the same outcome).

    ``plans``: the plans earlier decisions made (``PlansKept``, brought to ``now`` by the
    caller); a job of one that cannot start now holds its plan's GPUs again when its
    turn comes. The plans of this decision's waiting jobs are added to them."""
    now = snapshot.now
    free = FreeGpus(snapshot)
    starts: list[Start] = []
    ends: list[tuple[float, int]] = []
    reasons: dict[str, str] = {}
    held: JobView | None = None
    held_at, spare = 0.0, 0
    waits = Waits(snapshot, free, shapes)
    kept = plans.current if plans is not None else {}
    timeline: Timeline | None = None
    skipped: dict[str, tuple[JobView, int, int]] = {}
    block = -1  # the largest idle block when jobs were last skipped; -1: work it out
    for job in ordered:
        if free.total == 0 and not waits.usable_by(job):
            if not waits.pooled:
                break
            continue  # only a job that ends in time may use held GPUs: the default reason
        if (
            skip_early
            and job.gpus > free.total
            and held is None
            and not (hold and job.deadline is not None)
            and job.job_id not in kept
        ):
            # it holds no GPUs and cannot start but on held ones: what the steps below
            # would do comes down to why it waits
            if job.gpus > free.total + waits.pooled:  # not even on held ones
                if block < 0:
                    block = free.largest_block()
                skipped[job.job_id] = (job, free.total, block)  # written when asked for
                continue
            if now + job.remaining_s(now) > waits.latest:  # ends too late to use them
                bad = shapes.unschedulable(job, snapshot)
                reasons[job.job_id] = bad or waits.held_reason(job) or no_room_reason(job, free)
                continue
        block = -1  # what follows may change the idle GPUs
        bad = shapes.unschedulable(job, snapshot)
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
        start = waits.place(job, end)
        if start is not None and spread is not None and spread.is_spread(start, snapshot):
            waits.give_back(start)
            if timeline is None:
                timeline = Timeline(snapshot, free)
                for earlier, (ends_at, _) in zip(starts, ends, strict=True):
                    timeline.started(earlier, ends_at)
            plan = spread.plan(job, start, snapshot, timeline, waits.nodes)
            if plan is not None:
                reasons[job.job_id] = waits.wait(job, plan, snapshot)
                continue
            start = waits.place(job, end)
        if start is not None:
            starts.append(start)
            ends.append((end, job.gpus))
            if timeline is not None:
                timeline.started(start, end)
            if held is not None and end > held_at:
                spare -= job.gpus
            continue
        plan = kept.get(job.job_id)
        if plan is not None:  # it still waits for the placement it chose earlier
            reasons[job.job_id] = waits.wait(job, plan, snapshot)
            continue
        reasons[job.job_id] = waits.held_reason(job) or no_room_reason(job, free)
        if hold and held is None and job.deadline is not None:
            at, left = gpus_free_at(snapshot, ends, free.total, job.gpus)
            if at + job.remaining_s(now) <= job.deadline:
                held, held_at, spare = job, at, left
    default = busy_reason(snapshot)
    if waits.held:
        first = waits.held[0][0].job_id
        default = f"all GPUs are busy or held for {first}, which waits for fewer nodes"
    if plans is not None:
        plans.remember(waits.held, starts)
    explained = SkippedReasons(reasons, skipped, shapes, snapshot) if skipped else reasons
    return Decision(starts=tuple(starts), reasons=explained, default_reason=default)


class Waits:
    """The jobs of one decision that wait for a less spread placement, and the idle GPUs
    of the nodes they wait for, taken out of ``free`` until a job that ends in time
    needs them."""

    def __init__(self, snapshot: Snapshot, free: FreeGpus, shapes: ShapeCache) -> None:
        self._free = free
        self._shapes = shapes
        self._snapshot = snapshot
        self._node_of = snapshot.cluster.gpu_node
        self.now = snapshot.now
        #: (job, plan, idle GPUs held on its nodes)
        self.held: list[tuple[JobView, Plan, list[int]]] = []
        self.nodes: set[int] = set()
        #: idle GPUs held, and the latest moment a held placement is due
        self.pooled = 0
        self.latest = -math.inf
        self._held_text = ""

    def usable_by(self, job: JobView) -> bool:
        """Whether held GPUs might make room for ``job`` (a cheap first look)."""
        return job.gpus <= self.pooled and self.now + job.remaining_s(self.now) <= self.latest

    def place(self, job: JobView, end: float) -> Start | None:
        """``job`` on the GPUs not held, else, if it ends before every held placement it
        would touch is due, on held ones too."""
        free = self._free
        start = place_exclusive(job, free, self._snapshot, self._shapes)
        if start is not None or end > self.latest or job.gpus > free.total + self.pooled:
            return start
        usable = [i for i, (_, plan, gpus) in enumerate(self.held) if end <= plan.at and gpus]
        if not usable or job.gpus > free.total + sum(len(self.held[i][2]) for i in usable):
            return None
        for i in usable:
            free.give_back(self.held[i][2], self._node_of)
        start = place_exclusive(job, free, self._snapshot, self._shapes)
        for i in usable:  # take back what it left idle on those nodes
            waiting, plan, _ = self.held[i]
            self.held[i] = (waiting, plan, self._free.take_idle_on(plan.nodes))
        self.pooled = sum(len(gpus) for _, _, gpus in self.held)
        return start

    def idle_per_node(self) -> list[int]:
        """Idle GPUs per node, -1 on the nodes held for a waiting job."""
        idle = self._free.free_per_node()
        for node in self.nodes:
            idle[node] = -1
        return idle

    def give_back(self, start: Start) -> None:
        self._free.give_back(start.gpu_ids, self._node_of)


    def wait(self, job: JobView, plan: Plan, snapshot: Snapshot) -> str:
        """Hold the idle GPUs of ``plan``'s nodes for ``job``; why it waits."""
        taken = self._free.take_idle_on(plan.nodes)
        self.held.append((job, plan, taken))
        self.nodes.update(plan.nodes)
        self.pooled += len(taken)
        self.latest = max(self.latest, plan.at)
        where = "one node" if len(plan.nodes) == 1 else f"{len(plan.nodes)} nodes"
        why = (
            "meets its deadline with less GPU-time than"
            if plan.for_gpu_time
            else "finishes sooner than"
        )
        return (
            f"waits for {job.gpus} GPUs on {where} in ~{(plan.at - self.now) / 60:.0f} min: "
            f"{why} starting now across {plan.spread} nodes"
        )

    def held_reason(self, job: JobView) -> str | None:
        """Why ``job``, which did not fit, waits, where held GPUs would have made room."""
        if not self.pooled or job.gpus > self._free.total + self.pooled:
            return None
        if not self._held_text:  # the first held job stays first: one sentence for all
            waiting, plan, _ = self.held[0]
            self._held_text = (
                f"GPUs are held for {waiting.job_id}, which waits for a less spread "
                f"placement in {(plan.at - self.now) / 60:.0f} min"
            )
        return self._held_text


class SpreadCost:
    """A job's run time at ``n`` nodes over its run time at the fewest it needs, per
    job shape, for one cluster and performance model; and the choice over time."""

    def __init__(self) -> None:
        self._basis = ModelBasis()
        self._ratio: dict[tuple[str, int, int, int, int], float] = {}

    def ratio(self, job: JobView, nodes: int, accum: int, snapshot: Snapshot) -> float:
        if self._basis.moved(snapshot):
            self._ratio.clear()
        key = (job.model, job.batch_size, job.gpus, nodes, accum)
        try:
            return self._ratio[key]
        except KeyError:
            perf, fewest = snapshot.estimates, snapshot.cluster.fewest_nodes(job.gpus)
            at = perf.iteration_time(job.model, job.batch_size, job.gpus, nodes, accum)
            best = perf.iteration_time(job.model, job.batch_size, job.gpus, fewest, accum)
            ratio = self._ratio[key] = at / best if best > 0 else 1.0
            return ratio

    @staticmethod
    def is_spread(start: Start, snapshot: Snapshot) -> bool:
        """Whether ``start`` spans more nodes than the job needs (a model-parallel job is
        placed by the mapper and left to it)."""
        cluster = snapshot.cluster
        gpus = len(start.gpu_ids)
        if gpus == 1:
            return False
        job = snapshot.job(start.job_id)
        if model_parallel(job) > 1:
            return False
        return cluster.nodes_spanned(start.gpu_ids) > cluster.fewest_nodes(gpus)

    def plan(self, job: JobView, start: Start, snapshot: Snapshot, timeline: Timeline,
             held: set[int]) -> Plan | None:  # fmt: skip
        """Where ``job`` should wait instead of starting at ``start`` (spread), or None
        if starting now is its best choice (see the module)."""
        now, cluster = snapshot.now, snapshot.cluster
        run = job.remaining_s(now)
        accum = start.accum_steps
        spread = cluster.nodes_spanned(start.gpu_ids)
        cost_now = self.ratio(job, spread, accum, snapshot)
        if cost_now <= 1.0:
            return None  # as fast spread: nothing to wait for
        finish_now = now + run * cost_now
        deadline = job.deadline
        # waiting past this cannot finish sooner, nor meet the deadline
        horizon = max(finish_now, deadline if deadline is not None else -math.inf) - run
        fewest = cluster.fewest_nodes(job.gpus)
        nodes: tuple[int, ...]
        if fewest == 1:
            found = timeline.one_node(job.gpus, held)
            if found is None or found[0] > horizon:
                return None
            at, nodes = found[0], (found[1],)
        else:
            wide = timeline.nodes(job.gpus, fewest, held)
            if wide is None or wide[0] > horizon:
                return None
            at, nodes = wide
        at = max(at, now)
        finish = at + run
        meets_now = deadline is not None and finish_now <= deadline
        meets = deadline is not None and finish <= deadline
        # of those that meet the deadline the least GPU-time (consolidated), else the
        # soonest finish, starting now on a tie
        if (meets_now and not meets) or (not meets and finish >= finish_now):
            return None
        return Plan(at, nodes, finish, spread, finish_now, meets and meets_now)


def gpus_free_at(
    snapshot: Snapshot, starts: list[tuple[float, int]], idle: int, need: int
) -> tuple[float, int]:
    """When ``need`` GPUs are idle (``idle`` now, more as the running jobs and this
    decision's ``starts`` end at their predicted times), and how many beyond ``need``."""
    ends = sorted(running_ends(snapshot) + starts)
    for end, gpus in ends:
        idle += gpus
        if idle >= need:
            return end, idle - need
    return float("inf"), 0


__all__ = ["SLACK_ORDER", "Genie", "capacity", "defer", "slack_key", "swaf_key"]
