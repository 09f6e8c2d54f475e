"""Preemptive priority scheduling: SRTF (oracle sizes) and Tiresias 2D-LAS.

Both rank every job, running or queued, and hand GPUs out in rank order. A running job
outside the winning set is preempted only when a higher-ranked queued job needs its
GPUs, so lower-ranked jobs keep running while nobody is waiting for their GPUs.

Speed: a decision walks the running jobs and the queue merged in rank order and stops
as soon as the GPU budget is spent, because from there on every queued job loses and
every running job not yet reached is a candidate victim. The queue arrives in rank order
when the driver keeps it so (``QueueSort``): a queued job's SRTF rank never changes
while it waits, and its Tiresias rank changes only when it is promoted. Reasons for the
jobs the walk never reached are written only when asked for (``LazyReasons``).

Priorities (our rule, see ``base.by_priority_ranked``): where some job has a priority
other than 0, the ranks a tenant's jobs hold, running and queued together, go to its own
jobs highest priority first; other tenants' ranks do not move.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter, itemgetter
from typing import ClassVar

from gpusched.libs.core.decision import Decision, Preempt, Start
from gpusched.libs.core.placement import (
    FreeGpus,
    ShapeCache,
    place_exclusive,
    unschedulable_reason,
)
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    PLAIN,
    Capabilities,
    LazyReasons,
    QueueSort,
    busy_reason,
    by_priority_ranked,
    has_priorities,
    no_room_reason,
)

RankKey = Callable[[JobView], tuple]


_gpus_of = attrgetter("gpus")
_rank, _view = itemgetter(0), itemgetter(1)
_job_id = attrgetter("job_id")


Ranked = tuple[tuple, JobView]


@dataclass
class Moved:
    """The jobs a decision starts and preempts, as the policy saw them."""

    started: list[JobView] = field(default_factory=list)
    preempted: list[JobView] = field(default_factory=list)


def decide_by_rank(
    snapshot: Snapshot,
    running: list[Ranked],
    pending: Iterable[Ranked],
    describe: Callable[[JobView], str],
    shapes: ShapeCache | None = None,
    budget_cell: list[int] | None = None,
    run_keys: list[tuple] | None = None,
    run_gpus: list[int] | None = None,
    moved: Moved | None = None,
) -> Decision:
    """Hand GPUs out in rank order; ``running`` and ``pending`` each come in ascending rank.

    Ranks must be unique across both (they end in the job id). ``pending`` may be lazy:
    it is read only until the budget of GPUs is spent, and a lazy ``pending`` may leave
    out jobs larger than the budget it reads from ``budget_cell[0]`` (kept up to date
    here before each job is asked for). ``run_keys`` and ``run_gpus``, if given, are the
    keys and GPU counts of ``running`` (a caller that keeps them need not list them).
    ``moved``, when given, receives the views of the jobs started and of those preempted.
    """
    cell = budget_cell if budget_cell is not None else [0]
    shapes = shapes or ShapeCache()
    explicit: dict[str, str] = {}
    budget = snapshot.cluster.total_gpus
    winners: list[JobView] = []
    losers_running: list[JobView] = []
    if run_keys is None or run_gpus is None:
        run_keys = list(map(_rank, running))
        run_gpus = list(map(_gpus_of, map(_view, running)))
    # until a queued job wins, every running job fits when together they hold at most
    # the cluster (no GPU shared), so a stretch of them costs a sum rather than a walk
    contested = sum(run_gpus) > budget
    ri = 0
    for key, job in pending:
        hi = bisect_left(run_keys, key, ri)
        if not contested:
            budget -= sum(run_gpus[ri:hi])
            ri = hi
        while ri < hi:
            held = running[ri][1]
            ri += 1
            if held.gpus <= budget:
                budget -= held.gpus
            else:
                losers_running.append(held)
        if budget <= 0:
            break  # every job from here on loses: its reason is written when asked for
        if job.gpus > budget:
            cell[0] = budget
            continue  # a rank loser (or unschedulable): reason written when asked for
        bad = shapes.unschedulable(job, snapshot)
        if bad:
            explicit[job.job_id] = bad
            continue
        budget -= job.gpus
        cell[0] = budget
        winners.append(job)
        contested = True
    rest = sum(run_gpus[ri:])
    if rest <= budget:
        budget -= rest
    else:
        for _, held in running[ri:]:
            if held.gpus <= budget:
                budget -= held.gpus
            else:
                losers_running.append(held)
    starts: list[Start] = []
    preemptions: list[Preempt] = []
    if winners:
        _place_winners(
            snapshot, winners, losers_running, describe, shapes, starts, preemptions, explicit,
            moved,
        )
    won = {job.job_id for job in winners}
    bad_by_shape: dict[tuple[str, int, int], str | None] = {}

    def reason_of(job: JobView) -> str | None:
        if job.job_id in won:
            return None
        shape = (job.model, job.batch_size, job.gpus)
        if shape not in bad_by_shape:
            bad_by_shape[shape] = unschedulable_reason(job, snapshot)
        bad = bad_by_shape[shape]
        if bad:
            return bad
        return f"{describe(job)}; higher-ranked jobs hold the GPUs it needs ({job.gpus})"

    return Decision(
        starts=tuple(starts),
        preemptions=tuple(preemptions),
        reasons=LazyReasons(explicit, snapshot.pending, reason_of),
        default_reason=busy_reason(snapshot),
    )


def _place_winners(
    snapshot: Snapshot,
    winners: list[JobView],
    losers_running: list[JobView],
    describe: Callable[[JobView], str],
    shapes: ShapeCache,
    starts: list[Start],
    preemptions: list[Preempt],
    explicit: dict[str, str],
    moved: Moved | None = None,
) -> None:
    """Place the queued winners in rank order, evicting the lowest-ranked losers as needed."""
    free = FreeGpus(snapshot)
    node_of = snapshot.cluster.gpu_node
    for job in winners:
        start = place_exclusive(job, free, snapshot, shapes)
        while start is None and losers_running:
            victim = losers_running.pop()  # lowest rank goes first
            preemptions.append(Preempt(victim.job_id, f"preempted for {job.job_id}"))
            free.give_back(victim.gpu_ids, node_of)
            if moved is not None:
                moved.preempted.append(victim)
            start = place_exclusive(job, free, snapshot, shapes)
        if start is None:
            explicit[job.job_id] = f"{describe(job)}; {no_room_reason(job, free)}"
        else:
            starts.append(start)
            if moved is not None:
                moved.started.append(job)


def pending_remaining(job: JobView) -> float:
    """A queued job's oracle remaining time: it does not change while the job waits."""
    return job.oracle_remaining_at(job.as_of)


def srtf_running_remaining(job: JobView, now: float) -> float:
    """``job.oracle_remaining_at(now)``, inlined: it is computed for every running job at
    every decision."""
    oracle, est = job.oracle_remaining_s, job.est_remaining_s
    elapsed = now - job.as_of
    if oracle is None or est <= 0:
        left = est - elapsed * job.progress_rate
    else:
        left = oracle * (1 - elapsed * job.progress_rate / est)
    return left if left > 0.0 else 0.0


def srtf_key(job: JobView) -> tuple[float, float, str]:
    return (pending_remaining(job), job.submit_time, job.job_id)


SRTF_ORDER = QueueSort("oracle-remaining", srtf_key)

#: within a Tiresias queue, running jobs rank before queued ones
RUNNING_FIRST, QUEUED_AFTER = 0, 1
#: a run that began this close to its promotion time began as a promotion (float slack)
PROMOTION_SLACK_S = 1e-6


@dataclass(frozen=True)
class Srtf:
    """Shortest remaining time first with oracle sizes (a simulator-only baseline)."""

    name: str = "srtf"
    preemptive: bool = True
    queue_sort: QueueSort | None = SRTF_ORDER
    capabilities: ClassVar[Capabilities] = PLAIN
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now
        running = [
            ((srtf_running_remaining(j, now), j.submit_time, j.job_id), j) for j in snapshot.running
        ]
        running.sort()
        pending: Iterable[Ranked] = ((srtf_key(j), j) for j in snapshot.pending)
        if snapshot.queue_order != SRTF_ORDER.name:
            pending = sorted(pending)
        # else already in rank order: keys are made only for the jobs the walk reaches
        if has_priorities(snapshot):
            running, pending = by_priority_ranked(running, list(pending))

        def describe(job: JobView) -> str:
            return f"{job.oracle_remaining_at(now):.0f} s of work left"

        return decide_by_rank(snapshot, running, pending, describe, self._shapes)


#: a service-threshold crossing time worked out at one decision may differ from the
#: value the plain formula gives at another by float rounding; this much slack covers it
_CROSS_SLACK_S = 1e-3


class RunningRanks:
    """Running jobs in Tiresias rank order, kept across decisions.

    A running job's rank is (queue, running first, submit time, id), and its queue
    changes only when the service that places it (``base_of``: that service as of the
    view, growing by its GPUs each second) crosses a threshold, at a time known from its
    view. So instead
    of ranking every running job at every decision, this keeps the ranked list of the
    last decision, drops the views that are gone, ranks the new ones, and re-ranks only
    the jobs whose next crossing is due (a heap by crossing time). The ranks, and the
    earliest crossing as a wake-up, come out exactly as the plain formula gives them at
    ``now``: every value that can matter is recomputed at ``now`` with that formula.
    A driver that makes new views every round simply gets every job ranked anew.
    """

    def __init__(
        self, thresholds: tuple[float, ...], base_of: Callable[[JobView], float]
    ) -> None:
        self.thresholds = thresholds
        self._base_of = base_of
        self._reset()

    def _reset(self) -> None:
        self._views: dict[str, JobView] = {}
        self._keys: dict[str, tuple] = {}
        #: the running jobs in rank order, with their keys and GPU counts alongside
        self.ranked: list[Ranked] = []
        self.keys: list[tuple] = []
        self.gpus: list[int] = []
        #: (approximate time of the next threshold crossing, job id, tie-breaker, view)
        self._crossings: list[tuple[float, str, int, JobView]] = []
        self._seq = 0
        self._now = -math.inf
        #: the running tuple the ranking was last brought to: a driver that hands the
        #: same tuple again (nothing started, ended or changed speed) skips the scan
        self._last_running: tuple[JobView, ...] | None = None

    def _rank(self, j: JobView, now: float) -> tuple:
        base = self._base_of(j)
        service = base + (now - j.as_of) * j.gpus
        q = bisect_right(self.thresholds, service)
        if q < len(self.thresholds):
            at = j.as_of + (self.thresholds[q] - base) / j.gpus
            self._seq += 1
            heapq.heappush(self._crossings, (at, j.job_id, self._seq, j))
        return (q, RUNNING_FIRST, j.submit_time, j.job_id)

    def _insert(self, key: tuple, j: JobView) -> None:
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.gpus.insert(i, j.gpus)
        self.ranked.insert(i, (key, j))

    def _delete(self, key: tuple) -> None:
        i = bisect_left(self.keys, key)
        del self.keys[i]
        del self.gpus[i]
        del self.ranked[i]

    def update(self, running: tuple[JobView, ...], now: float) -> float:
        """Bring the ranking to ``running`` at ``now``; return the earliest time a running
        job drops a queue (inf if none will), as ``now + (threshold - attained) / gpus``."""
        if now < self._now:  # time went back (another run): rank everything anew
            self._reset()
        self._now = now
        views, keys = self._views, self._keys
        fresh: list[JobView] = []
        if running is not self._last_running:
            get = views.get
            fresh = [j for j in running if get(j.job_id) is not j]
            if len(running) - len(fresh) != len(views):  # some are gone
                for job_id in views.keys() - set(map(_job_id, running)):
                    del views[job_id]
                    self._delete(keys.pop(job_id))
            self._last_running = running
        for j in fresh:
            old = keys.pop(j.job_id, None)
            if old is not None:
                self._delete(old)
            views[j.job_id] = j
            key = keys[j.job_id] = self._rank(j, now)
            self._insert(key, j)
        crossings = self._crossings
        # re-rank every job whose crossing may be due; drop entries of views now gone
        due: list[tuple[float, str, int, JobView]] = []
        while crossings and crossings[0][0] <= now + _CROSS_SLACK_S:
            due.append(heapq.heappop(crossings))
        for _, job_id, _, j in due:
            if views.get(job_id) is not j:
                continue
            old = keys[job_id]
            key = self._rank(j, now)  # pushes its next crossing, or this one again
            if key != old:
                self._delete(old)
                keys[job_id] = key
                self._insert(key, j)
        # the wake-up: the exact formula for every job whose crossing is near the first
        wake = math.inf
        while crossings and views.get(crossings[0][1]) is not crossings[0][3]:
            heapq.heappop(crossings)  # stale
        if crossings:
            limit = crossings[0][0] + 2 * _CROSS_SLACK_S
            near: list[tuple[float, str, int, JobView]] = []
            while crossings and crossings[0][0] <= limit:
                item = heapq.heappop(crossings)
                j = item[3]
                if views.get(item[1]) is not j:
                    continue
                near.append(item)
                service = self._base_of(j) + (now - j.as_of) * j.gpus
                q = bisect_right(self.thresholds, service)
                if q < len(self.thresholds):
                    drop = now + (self.thresholds[q] - service) / j.gpus
                    if drop < wake:
                        wake = drop
            for item in near:
                heapq.heappush(crossings, item)
        if len(crossings) > 4 * len(views) + 64:
            self._crossings = [c for c in crossings if views.get(c[1]) is c[3]]
            heapq.heapify(self._crossings)
        return wake


@dataclass(frozen=True)
class Tiresias:
    """Discretised two-dimensional least-attained-service (Tiresias 2D-LAS).

    Queue ``i`` holds jobs whose attained GPU-seconds lie between thresholds ``i-1`` and
    ``i``; lower queues win. Within a queue running jobs come first, then queued jobs in
    submission order, so a job is never preempted by one of its own queue (as in the
    Tiresias simulator, which moves a queue's pending jobs behind its running ones).

    A queued job that has waited more than ``promote_knob`` times its executed time (and
    at least ``min_wait_s``) is promoted to the top queue so that nothing starves. As in
    the Tiresias simulator, promotion restarts the count of service that decides the
    queue: a run that began as a promotion is placed by the service of that run alone,
    so it sinks again only after earning another threshold's worth. (The simulator also
    keeps that count after a later preemption; here a queued job is placed by all the
    service it ever had, so a promoted job preempted again waits in its old queue.)
    """

    thresholds_gpu_s: tuple[float, ...] = (3_600.0, 36_000.0)
    promote_knob: float = 8.0
    min_wait_s: float = 3_600.0
    name: str = "tiresias"
    preemptive: bool = True
    #: keep the running jobs ranked across decisions instead of ranking them anew each
    #: time (the same outcome, faster; off, it is the plain rule to compare against)
    keep_running_ranks: bool = True
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _base_sort: QueueSort = field(init=False, compare=False, repr=False)
    _promote_sort: QueueSort = field(init=False, compare=False, repr=False)
    _size_sort: QueueSort = field(init=False, compare=False, repr=False)
    _ranks: RunningRanks = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.thresholds_gpu_s) != sorted(self.thresholds_gpu_s):
            raise ValueError("tiresias thresholds must be ascending")
        if self.promote_knob <= 0:
            raise ValueError("tiresias promote_knob must be > 0")
        thresholds = self.thresholds_gpu_s
        object.__setattr__(self, "_ranks", RunningRanks(thresholds, self._service_as_of))

        def base_key(job: JobView) -> tuple[int, float, str]:
            return (bisect_right(thresholds, job.attained_gpu_s), job.submit_time, job.job_id)

        def promote_key(job: JobView) -> tuple[float, float, str]:
            return (self._promote_value(job), job.submit_time, job.job_id)

        def size_key(job: JobView) -> tuple[int, int, float, str]:
            return (job.gpus, *base_key(job))

        object.__setattr__(self, "_base_sort", QueueSort(f"tiresias-base{thresholds}", base_key))
        object.__setattr__(self, "_size_sort", QueueSort(f"tiresias-size{thresholds}", size_key))
        object.__setattr__(
            self,
            "_promote_sort",
            QueueSort(f"tiresias-promote{(self.min_wait_s, self.promote_knob)}", promote_key),
        )

    def scaled(self, time_scale: float) -> Tiresias:
        """This policy on a cluster whose jobs run ``1/time_scale`` times faster: the
        service thresholds and the starvation wait shrink alike, so jobs change queue at
        the same points of their work."""
        return replace(
            self,
            thresholds_gpu_s=tuple(t * time_scale for t in self.thresholds_gpu_s),
            min_wait_s=self.min_wait_s * time_scale,
        )

    @property
    def queue_sort(self) -> QueueSort:
        """Queued jobs by their queue before promotion, then FIFO: a fixed order, since
        a waiting job's attained service does not grow; promotions are merged in."""
        return self._base_sort

    @property
    def capabilities(self) -> Capabilities:
        """Further orders (``extra_sorts``): queued jobs by when they are promoted
        (never, for jobs not yet run), and by size then base queue: with them a decision
        finds the promoted jobs and its next wake-up without a scan, and reads only
        queued jobs that still fit the GPUs left."""
        return Capabilities(extra_sorts=(self._promote_sort, self._size_sort))

    def _promoted_run(self, job: JobView) -> bool:
        """Whether a running job's current run began because its wait promoted it."""
        before = job.attained_gpu_s - (job.as_of - job.started_at) * job.gpus
        if before <= PROMOTION_SLACK_S * job.gpus:
            return False
        wait = max(self.min_wait_s, self.promote_knob * before / job.gpus)
        return job.started_at >= job.queued_since + wait - PROMOTION_SLACK_S

    def _service_as_of(self, job: JobView) -> float:
        """The service that places a running job in a queue, as of its view."""
        if self._promoted_run(job):
            return (job.as_of - job.started_at) * job.gpus
        return job.attained_gpu_s

    def _running_service(self, job: JobView, now: float) -> float:
        return self._service_as_of(job) + (now - job.as_of) * job.gpus

    def _promote_value(self, job: JobView) -> float:
        return self._promote_at(job) if job.attained_gpu_s > 0 else math.inf

    def queue_of(self, job: JobView, now: float) -> int:
        if job.running:
            return bisect_right(self.thresholds_gpu_s, self._running_service(job, now))
        if self._starving(job, now):
            return 0
        return bisect_right(self.thresholds_gpu_s, job.attained_gpu_s)

    def _promote_at(self, job: JobView) -> float:
        executed = job.attained_gpu_s / job.gpus
        return job.queued_since + max(self.min_wait_s, self.promote_knob * executed)

    def _starving(self, job: JobView, now: float) -> bool:
        return job.attained_gpu_s > 0 and now >= self._promote_at(job)

    def decide(self, snapshot: Snapshot) -> Decision:
        now = snapshot.now
        thresholds = self.thresholds_gpu_s
        min_wait, knob = self.min_wait_s, self.promote_knob
        running, wake = self._rank_running(snapshot)
        by_promotion = snapshot.orders.get(self._promote_sort.name)
        prioritized = has_priorities(snapshot)
        if (
            snapshot.queue_order == self._base_sort.name
            and by_promotion is not None
            and not prioritized
        ):
            return self._decide_in_order(snapshot, running, by_promotion, wake)
        pending: list[Ranked] = []
        for j in snapshot.pending:
            attained = j.attained_gpu_s
            q = bisect_right(thresholds, attained)
            if attained > 0:
                promote_at = j.queued_since + max(min_wait, knob * attained / j.gpus)
                if now >= promote_at:
                    q = 0
                else:
                    wake = min(wake, promote_at)
            pending.append(((q, QUEUED_AFTER, j.submit_time, j.job_id), j))
        pending.sort()  # nearly sorted when the driver keeps the queue_sort order
        if prioritized:
            running, pending = by_priority_ranked(running, pending)

        def describe(job: JobView) -> str:
            return f"priority queue {self.queue_of(job, now)}"

        moved = Moved()
        decision = decide_by_rank(
            snapshot, running, pending, describe, self._shapes, None, *self._kept(running),
            moved=moved,
        )
        return self._with_wake(decision, snapshot, wake, moved)

    def _with_wake(
        self, decision: Decision, snapshot: Snapshot, wake: float, moved: Moved
    ) -> Decision:
        """Add the times at which the decision's own moves change a queue: a started job
        sinking, a preempted one being promoted. Queue changes matter only while someone
        waits."""
        now = snapshot.now
        thresholds = self.thresholds_gpu_s
        for job in moved.started:
            service = 0.0 if self._starving(job, now) else job.attained_gpu_s
            q = bisect_right(thresholds, service)
            if q < len(thresholds):
                wake = min(wake, now + (thresholds[q] - service) / job.gpus)
        for job in moved.preempted:
            attained = job.attained_at(now)
            if attained > 0:
                executed = attained / job.gpus
                wake = min(wake, now + max(self.min_wait_s, self.promote_knob * executed))
        waiting = len(snapshot.pending) - len(moved.started) + len(moved.preempted)
        if waiting <= 0 or wake == math.inf:
            return decision
        return replace(decision, wake_at=wake)

    def _rank_running(self, snapshot: Snapshot) -> tuple[list[Ranked], float]:
        """Running jobs in rank order, and the earliest time one of them drops a queue."""
        if self.keep_running_ranks:
            wake = self._ranks.update(snapshot.running, snapshot.now)
            return self._ranks.ranked, wake
        now = snapshot.now
        thresholds = self.thresholds_gpu_s
        wake = math.inf
        running: list[Ranked] = []
        levels = len(thresholds)
        for j in snapshot.running:
            service = self._running_service(j, now)
            q = bisect_right(thresholds, service)
            running.append(((q, RUNNING_FIRST, j.submit_time, j.job_id), j))
            if q < levels:  # when it next drops a queue
                drop = now + (thresholds[q] - service) / j.gpus
                if drop < wake:
                    wake = drop
        running.sort()
        return running, wake

    def _kept(self, running: list[Ranked]) -> tuple[list[tuple] | None, list[int] | None]:
        """The keys and GPU counts of ``running`` where the kept ranking is it."""
        if running is self._ranks.ranked:
            return self._ranks.keys, self._ranks.gpus
        return None, None

    def _decide_in_order(
        self,
        snapshot: Snapshot,
        running: list[Ranked],
        by_promotion: tuple[JobView, ...],
        wake: float,
    ) -> Decision:
        """The queue comes in base-queue order and in promotion order: the promoted jobs
        are a prefix of the second, the next promotion is the job after it, and the walk
        reads the first only as far as the GPUs last."""
        now = snapshot.now
        thresholds = self.thresholds_gpu_s
        cut = bisect_right(by_promotion, now, key=self._promote_value)
        if cut < len(by_promotion):
            wake = min(wake, self._promote_value(by_promotion[cut]))
        # promoted from a lower queue (jobs of queue 0 are there already)
        first = thresholds[0] if thresholds else math.inf
        promoted = sorted(
            ((0, QUEUED_AFTER, j.submit_time, j.job_id), j)
            for j in by_promotion[:cut]
            if j.attained_gpu_s >= first
        )
        lifted = {j.job_id for _, j in promoted}

        budget = [snapshot.cluster.total_gpus]
        by_size = snapshot.orders.get(self._size_sort.name)

        def in_rank_order() -> Iterator[Ranked]:
            pi = 0
            for j in snapshot.pending:
                q = bisect_right(thresholds, j.attained_gpu_s)
                if q and j.job_id in lifted:
                    continue
                key = (q, QUEUED_AFTER, j.submit_time, j.job_id)
                while pi < len(promoted) and promoted[pi][0] < key:
                    yield promoted[pi]
                    pi += 1
                yield key, j
            yield from promoted[pi:]

        def fitting_in_rank_order(queue: tuple[JobView, ...]) -> Iterator[Ranked]:
            """The queue in rank order, leaving out jobs larger than the GPUs left: one
            stream per job size (``queue`` is by size, then rank), merged, and a size is
            dropped for good once the budget falls below it."""
            heads: list[tuple[tuple, int, int, int]] = []  # (key, size, position, end)
            start = 0
            while start < len(queue):
                size = queue[start].gpus
                end = bisect_right(queue, size, lo=start, key=_gpus_of)
                _push_head(heads, queue, start, end, size)
                start = end
            heapq.heapify(heads)
            merged = list(promoted)
            merged.reverse()  # pop() gives the next promoted job
            while heads or merged:
                if heads and (not merged or heads[0][0] < merged[-1][0]):
                    key, size, pos, end = heapq.heappop(heads)
                    if size > budget[0]:
                        continue  # nothing of this size can win any more
                    yield key, queue[pos]
                    _push_head(heads, queue, pos + 1, end, size, heap=True)
                else:
                    yield merged.pop()

        def _push_head(
            heads: list[tuple[tuple, int, int, int]],
            queue: tuple[JobView, ...],
            pos: int,
            end: int,
            size: int,
            heap: bool = False,
        ) -> None:
            while pos < end:
                j = queue[pos]
                q = bisect_right(thresholds, j.attained_gpu_s)
                if not (q and j.job_id in lifted):
                    item = ((q, QUEUED_AFTER, j.submit_time, j.job_id), size, pos, end)
                    if heap:
                        heapq.heappush(heads, item)
                    else:
                        heads.append(item)
                    return
                pos += 1

        def describe(job: JobView) -> str:
            return f"priority queue {self.queue_of(job, now)}"

        stream = in_rank_order() if by_size is None else fitting_in_rank_order(by_size)
        moved = Moved()
        decision = decide_by_rank(
            snapshot, running, stream, describe, self._shapes, budget, *self._kept(running),
            moved=moved,
        )
        return self._with_wake(decision, snapshot, wake, moved)
