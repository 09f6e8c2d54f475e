"""SJF-BSBF: shortest job first, best sharing benefit first (and SJF-FFS, its greedy twin).

Non-preemptive. Jobs go in order of predicted remaining time. A job that finds enough
idle GPUs runs alone. Otherwise it may share GPUs that hold exactly one resident job B,
if both allow it and memory fits, with A choosing k gradient-accumulation steps
(sub-batch = batch / k) to fit and to minimise the mean completion time of the pair:

    t_seq = E_b + E_a / 2                                  (A waits for B)
    t_con = E_a/2 + (1 - 1/(2 x_a)) x_b E_b   if x_a E_a >= x_b E_b   (B finishes first)
          = E_b/2 + (1 - 1/(2 x_b)) x_a E_a   otherwise

A shares only when t_con < t_seq. For fixed slowdowns, t_con grows with E_b and the set
of E_b for which sharing pays is at most two intervals, so the best slot in a group of
alike residents is found by bisection instead of a scan. When sharing does not pay yet
but will once a resident's remaining time shrinks below ``x_a E_a / x_b``, the decision
asks to be woken at that moment instead of being polled.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from libs.core.decision import Decision, Start
from libs.core.placement import FreeGpus
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import (
    QueueSort,
    accum_choices,
    busy_reason,
    ordered_pending,
    place_exclusive,
    unschedulable_reason,
)
from services.scheduler.policies.simple import SJF_ORDER

#: a wake-up lands this much after the benefit test flips, so the test passes then
WAKE_MARGIN_S = 1e-3


def t_sequential(e_a: float, e_b: float) -> float:
    """Mean completion time of A and B when A waits for B."""
    return e_b + e_a / 2


def t_concurrent(e_a: float, e_b: float, x_a: float, x_b: float) -> float:
    """Mean completion time of A and B when they share from now on."""
    if x_a * e_a >= x_b * e_b:
        return e_a / 2 + (1 - 1 / (2 * x_a)) * x_b * e_b
    return e_b / 2 + (1 - 1 / (2 * x_b)) * x_a * e_a


@dataclass(frozen=True, slots=True)
class BenefitWindow:
    """Values of E_b for which sharing pays: (low1, high1] and (low2, inf)."""

    low1: float
    high1: float
    low2: float

    @classmethod
    def of(cls, e_a_alone: float, e_a_shared: float, x_a: float, x_b: float) -> BenefitWindow:
        """``e_a_shared`` is A's exclusive time at its sharing sub-batch (>= ``e_a_alone``)."""
        split = x_a * e_a_shared / x_b  # at or below it, B finishes first
        c1 = (1 - 1 / (2 * x_a)) * x_b
        # at c1 >= 1 sharing never pays in the branch where B finishes first
        low1 = (e_a_shared - e_a_alone) / (2 * (1 - c1)) if c1 < 1 else math.inf
        low2 = max(split, 2 * (1 - 1 / (2 * x_b)) * x_a * e_a_shared - e_a_alone)
        return cls(low1=low1, high1=split, low2=low2)


@dataclass(slots=True)
class SlotGroup:
    """GPUs holding one resident each, whose residents are alike (model, batch, memory)."""

    key: tuple
    resident: JobView
    mem_used_mb: float
    gpu_mem_mb: int
    remaining: list[float] = field(default_factory=list)
    slots: list[tuple[float, int, JobView]] = field(default_factory=list)

    def indices(self, window: BenefitWindow | None) -> Iterator[int]:
        """Slot indices in ascending E_b, only those where sharing pays (all if no window)."""
        n = len(self.remaining)
        if window is None:
            yield from range(n)
            return
        i = bisect_right(self.remaining, window.low1)
        while i < n and self.remaining[i] <= window.high1:
            yield i
            i += 1
        yield from range(max(i, bisect_right(self.remaining, window.low2)), n)

    def remove(self, index: int) -> None:
        del self.remaining[index]
        del self.slots[index]


def build_groups(snapshot: Snapshot) -> list[SlotGroup]:
    groups: dict[tuple, SlotGroup] = {}
    now = snapshot.now
    load = snapshot.gpu_load
    gpu_mem = snapshot.cluster.gpu_mem_mb
    for job in snapshot.running:
        if not job.allow_sharing:
            continue
        e_b = job.remaining_s(now)
        for gpu in job.gpu_ids:
            if load[gpu] != 1:
                continue
            key = (job.model, job.batch_size, job.gpus, job.accum_steps, gpu_mem[gpu])
            group = groups.get(key)
            if group is None:
                group = groups[key] = SlotGroup(key, job, snapshot.gpu_mem_used[gpu], gpu_mem[gpu])
            group.slots.append((e_b, gpu, job))
    ordered = [groups[k] for k in sorted(groups, key=repr)]
    for group in ordered:
        group.slots.sort(key=lambda s: (s[0], s[1]))
        group.remaining = [s[0] for s in group.slots]
    return ordered


@dataclass(frozen=True, slots=True)
class Terms:
    fits: bool
    x_a: float
    x_b: float
    stretch: float


def _dominates(a: Terms, b: Terms) -> bool:
    return a.x_a <= b.x_a and a.x_b <= b.x_b and a.stretch <= b.stretch and a != b


@dataclass(frozen=True, slots=True)
class Pairing:
    """A job shape paired with a kind of resident at one accumulation, its window
    coefficients precomputed: the window for a job with E_a is ``E_a`` times these."""

    accum: int
    x_a: float
    x_b: float
    stretch: float
    c_low1: float
    c_high1: float
    c_low2: float
    #: the window has a gap that a shrinking E_b can cross into (see BenefitWindow)
    gap: bool

    @classmethod
    def of(cls, accum: int, terms: Terms) -> Pairing:
        unit = BenefitWindow.of(1.0, terms.stretch, terms.x_a, terms.x_b)
        return cls(
            accum,
            terms.x_a,
            terms.x_b,
            terms.stretch,
            unit.low1,
            unit.high1,
            unit.low2,
            unit.low1 < unit.high1 < unit.low2,
        )

    def window(self, e_alone: float) -> BenefitWindow:
        return BenefitWindow(e_alone * self.c_low1, e_alone * self.c_high1, e_alone * self.c_low2)


#: a pairing placed against one slot group of this decision (by index)
Entry = tuple[int, Pairing]


@dataclass(frozen=True, slots=True)
class Choice:
    score: float
    accum: int
    picks: tuple[tuple[float, int, int], ...]  # (t_con, group index, slot index)


@dataclass(frozen=True)
class SjfBsbf:
    """SJF-BSBF; with ``benefit_test=False`` it is SJF-FFS (share whenever memory fits)."""

    benefit_test: bool = True
    name: str = "sjf-bsbf"
    preemptive: bool = False
    queue_sort: QueueSort | None = SJF_ORDER
    #: most queued jobs examined for sharing in one decision (the rest wait a round), so
    #: a decision over a long queue stays bounded, as Slurm's bf_max_job_test does
    share_lookahead: int = 256
    _memo: dict[tuple, Terms] = field(default_factory=dict, compare=False, repr=False)
    _pairings: dict[tuple, tuple[Pairing, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def decide(self, snapshot: Snapshot) -> Decision:
        pending = snapshot.pending
        if not pending:
            return Decision(default_reason=busy_reason(snapshot))
        free = FreeGpus(snapshot)
        groups: list[SlotGroup] | None = None
        entry_cache: dict[tuple[str, int, int], list[Entry]] = {}
        open_slots = 0
        examined = 0
        starts: list[Start] = []
        reasons: dict[str, str] = {}
        wake = math.inf
        lookahead_hit = False
        for job in ordered_pending(snapshot, SJF_ORDER):
            if free.total >= job.gpus:
                bad = unschedulable_reason(job, snapshot)
                start = None if bad else place_exclusive(job, free, snapshot)
                if start is not None:
                    starts.append(start)
                else:
                    reasons[job.job_id] = bad or f"needs {job.gpus} GPUs"
                continue
            if groups is None:
                groups = build_groups(snapshot)
                open_slots = sum(len(g.slots) for g in groups)
            if free.total == 0 and open_slots == 0:
                break
            if examined >= self.share_lookahead:
                lookahead_hit = True
                break
            bad = unschedulable_reason(job, snapshot)
            if bad:
                reasons[job.job_id] = bad
                continue
            if not job.allow_sharing:
                reasons[job.job_id] = (
                    f"needs {job.gpus} idle GPUs, {free.total} idle; it does not allow sharing"
                )
                continue
            shape = (job.model, job.batch_size, job.gpus)
            entries = entry_cache.get(shape)
            if entries is None:
                entries = entry_cache[shape] = self._entries(job, groups, snapshot)
            examined += 1
            choice, job_wake, why = self._best_share(job, groups, entries, snapshot.now)
            if choice is None:
                wake = min(wake, job_wake)
                reasons[job.job_id] = f"needs {job.gpus} GPUs, {free.total} idle; {why}"
                continue
            starts.append(self._apply(job, choice, groups))
            open_slots -= job.gpus
        default = busy_reason(snapshot)
        if groups is not None and open_slots == 0:
            default = "all GPUs are busy and every shareable GPU already holds two jobs"
        elif lookahead_hit:
            default = (
                f"all GPUs are busy; this round looked for sharing partners for the "
                f"{self.share_lookahead} shortest queued jobs only"
            )
        return Decision(
            starts=tuple(starts),
            reasons=reasons,
            default_reason=default,
            wake_at=wake if wake < math.inf else None,
        )

    def _terms(self, job: JobView, group: SlotGroup, accum: int, snapshot: Snapshot) -> Terms:
        b = group.resident
        key = (
            job.model,
            job.batch_size,
            job.gpus,
            accum,
            b.model,
            b.batch_size,
            b.gpus,
            b.accum_steps,
            group.mem_used_mb,
            group.gpu_mem_mb,
        )
        terms = self._memo.get(key)
        if terms is None:
            terms = self._memo[key] = compute_terms(job, b, accum, group, snapshot)
        return terms

    def _entries(self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot) -> list[Entry]:
        """Every (group, accumulation) pairing worth trying for jobs shaped like ``job``."""
        shape = (job.model, job.batch_size, job.gpus)
        entries: list[Entry] = []
        for gi, group in enumerate(groups):
            pairings = self._pairings.get((shape, group.key))
            if pairings is None:
                pairings = self._pair(job, group, snapshot)
                self._pairings[(shape, group.key)] = pairings
            entries.extend((gi, pairing) for pairing in pairings)
        return entries

    def _pair(self, job: JobView, group: SlotGroup, snapshot: Snapshot) -> tuple[Pairing, ...]:
        options = [(self._terms(job, group, k, snapshot), k) for k in accum_choices(job)]
        fitting = [(t, k) for t, k in options if t.fits]
        return tuple(
            Pairing.of(k, terms)
            for terms, k in fitting
            # a sub-batch that another beats on every count is never the best choice
            if not any(_dominates(other, terms) for other, _ in fitting if other is not terms)
        )

    def _best_share(
        self, job: JobView, groups: list[SlotGroup], entries: list[Entry], now: float
    ) -> tuple[Choice | None, float, str]:
        if not entries:
            return None, math.inf, "no GPU holding a single job has memory for it"
        e_alone = max(job.remaining_s(now), 1e-9)
        if job.gpus == 1:
            best = self._best_single(e_alone, groups, entries)
        else:
            best = self._best_gang(job.gpus, e_alone, groups, entries)
        if best is not None:
            return best, math.inf, ""
        wake = math.inf
        for gi, pairing in entries:
            if pairing.gap:
                wake = min(wake, _wake_time(groups[gi], pairing.window(e_alone), now))
        return None, wake, "sharing with the running jobs would not lower mean completion time yet"

    def _first_slot(self, e_alone: float, rem: list[float], entry: Pairing, start: int) -> int:
        """Index of the first slot at or after ``start`` where sharing pays (len if none)."""
        n = len(rem)
        if not self.benefit_test:
            return start
        i = max(start, bisect_right(rem, e_alone * entry.c_low1))
        if i < n and rem[i] <= e_alone * entry.c_high1:
            return i
        return max(i, bisect_right(rem, e_alone * entry.c_low2))

    def _best_single(
        self, e_alone: float, groups: list[SlotGroup], entries: list[Entry]
    ) -> Choice | None:
        """One GPU wanted: per pairing only the smallest E_b that pays can be best."""
        best_t = math.inf
        best: tuple[float, int, int] | None = None
        best_accum = 1
        half = e_alone / 2
        for gi, entry in entries:
            rem = groups[gi].remaining
            i = self._first_slot(e_alone, rem, entry, 0)
            if i >= len(rem):
                continue
            e_b = rem[i]
            t_con = t_concurrent(e_alone * entry.stretch, e_b, entry.x_a, entry.x_b)
            if self.benefit_test and not t_con < e_b + half:
                continue
            if t_con < best_t:
                best_t, best, best_accum = t_con, (t_con, gi, i), entry.accum
        if best is None:
            return None
        return Choice(score=best_t, accum=best_accum, picks=(best,))

    def _best_gang(
        self, gpus: int, e_alone: float, groups: list[SlotGroup], entries: list[Entry]
    ) -> Choice | None:
        """Several GPUs wanted: the sub-batch whose ``gpus``-th best slot finishes soonest.

        Slots come off one heap in ascending t_con across all pairings; the first
        sub-batch to collect ``gpus`` slots has the smallest worst slot, so the search
        stops there instead of listing every candidate.
        """
        heap = [
            pick
            for ei in range(len(entries))
            if (pick := self._next_pick(e_alone, groups, entries, ei, 0)) is not None
        ]
        heapq.heapify(heap)
        picks: dict[int, list[tuple[float, int, int]]] = {}
        while heap:
            t_con, ei, si = heapq.heappop(heap)
            gi, entry = entries[ei]
            chosen = picks.setdefault(entry.accum, [])
            chosen.append((t_con, gi, si))
            if len(chosen) == gpus:
                return Choice(score=t_con, accum=entry.accum, picks=tuple(chosen))
            following = self._next_pick(e_alone, groups, entries, ei, si + 1)
            if following is not None:
                heapq.heappush(heap, following)
        return None

    def _next_pick(
        self, e_alone: float, groups: list[SlotGroup], entries: list[Entry], ei: int, start: int
    ) -> tuple[float, int, int] | None:
        """(t_con, entry index, slot index) of the next slot that pays, from ``start``."""
        gi, entry = entries[ei]
        rem = groups[gi].remaining
        i = self._first_slot(e_alone, rem, entry, start)
        while i < len(rem):
            e_b = rem[i]
            t_con = t_concurrent(e_alone * entry.stretch, e_b, entry.x_a, entry.x_b)
            if not self.benefit_test or t_con < t_sequential(e_alone, e_b):
                return (t_con, ei, i)
            i = self._first_slot(e_alone, rem, entry, i + 1)  # rounding at a window edge
        return None

    @staticmethod
    def _apply(job: JobView, choice: Choice, groups: list[SlotGroup]) -> Start:
        gpus: list[int] = []
        partners: list[str] = []
        for _, gi, si in sorted(choice.picks, key=lambda p: (p[1], -p[2])):
            _, gpu, resident = groups[gi].slots[si]
            groups[gi].remove(si)  # descending slot index per group keeps the rest valid
            gpus.append(gpu)
            if resident.job_id not in partners:
                partners.append(resident.job_id)
        return Start(job.job_id, tuple(sorted(gpus)), choice.accum, tuple(sorted(partners)))


def compute_terms(
    job: JobView, resident: JobView, accum: int, group: SlotGroup, snapshot: Snapshot
) -> Terms:
    est = snapshot.estimates
    mem_a = est.gpu_memory_mb(job.model, job.batch_size / (job.gpus * accum))
    fits = mem_a + group.mem_used_mb <= group.gpu_mem_mb
    x_a = est.colocation_slowdown(
        job.model,
        job.batch_size,
        job.gpus,
        accum,
        resident.model,
        resident.batch_size,
        resident.gpus,
        resident.accum_steps,
    )
    x_b = est.colocation_slowdown(
        resident.model,
        resident.batch_size,
        resident.gpus,
        resident.accum_steps,
        job.model,
        job.batch_size,
        job.gpus,
        accum,
    )
    nodes = -(-job.gpus // snapshot.cluster.max_gpus_per_node)
    alone = est.iteration_time(job.model, job.batch_size, job.gpus, nodes, 1)
    stretch = est.iteration_time(job.model, job.batch_size, job.gpus, nodes, accum) / alone
    return Terms(fits=fits, x_a=x_a, x_b=x_b, stretch=stretch)


def _wake_time(group: SlotGroup, window: BenefitWindow, now: float) -> float:
    """When the least-loaded resident not yet worth sharing with becomes worth it."""
    if window.low1 >= window.high1:
        return math.inf
    i = bisect_right(group.remaining, window.high1)
    if i >= len(group.remaining) or group.remaining[i] > window.low2:
        return math.inf  # nothing waiting to enter the window, or it already pays
    e_b, _, resident = group.slots[i]
    if resident.progress_rate <= 0:
        return math.inf
    return now + (e_b - window.high1) / resident.progress_rate + WAKE_MARGIN_S
