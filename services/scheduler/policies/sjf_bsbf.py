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

import math
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from libs.core.decision import Decision, Start
from libs.core.placement import FreeGpus
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import (
    accum_choices,
    busy_reason,
    place_exclusive,
    unschedulable_reason,
)
from services.scheduler.policies.simple import sjf_key

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
        if c1 < 1:
            low1 = (e_a_shared - e_a_alone) / (2 * (1 - c1))
        else:
            low1 = math.inf  # B-finishes-first never pays
        low2 = max(split, 2 * (1 - 1 / (2 * x_b)) * x_a * e_a_shared - e_a_alone)
        return cls(low1=low1, high1=split, low2=low2)


@dataclass(slots=True)
class SlotGroup:
    """GPUs holding one resident each, whose residents are alike (model, batch, memory)."""

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
                group = groups[key] = SlotGroup(job, snapshot.gpu_mem_used[gpu], gpu_mem[gpu])
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
    _memo: dict[tuple, Terms] = field(default_factory=dict, compare=False, repr=False)

    def decide(self, snapshot: Snapshot) -> Decision:
        pending = snapshot.pending
        if not pending:
            return Decision(default_reason=busy_reason(snapshot))
        free = FreeGpus(snapshot)
        groups: list[SlotGroup] | None = None
        open_slots = 0
        starts: list[Start] = []
        reasons: dict[str, str] = {}
        wake = math.inf
        for job in sorted(pending, key=sjf_key):
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
            bad = unschedulable_reason(job, snapshot)
            if bad:
                reasons[job.job_id] = bad
                continue
            if not job.allow_sharing:
                reasons[job.job_id] = (
                    f"needs {job.gpus} idle GPUs, {free.total} idle; it does not allow sharing"
                )
                continue
            choice, job_wake, why = self._best_share(job, groups, snapshot)
            if choice is None:
                wake = min(wake, job_wake)
                reasons[job.job_id] = f"needs {job.gpus} GPUs, {free.total} idle; {why}"
                continue
            starts.append(self._apply(job, choice, groups))
            open_slots -= job.gpus
        default = busy_reason(snapshot)
        if groups is not None and open_slots == 0:
            default = "all GPUs are busy and every shareable GPU already holds two jobs"
        return Decision(
            starts=tuple(starts),
            reasons=reasons,
            default_reason=default,
            wake_at=wake if wake < math.inf else None,
        )

    def _terms(self, job: JobView, group: SlotGroup, accum: int, snapshot: Snapshot) -> Terms:
        b = group.resident
        key = (job.model, job.batch_size, job.gpus, accum, b.model, b.batch_size, b.gpus,
               b.accum_steps, group.mem_used_mb, group.gpu_mem_mb)
        terms = self._memo.get(key)
        if terms is None:
            terms = self._memo[key] = compute_terms(job, b, accum, group, snapshot)
        return terms

    def _best_share(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot
    ) -> tuple[Choice | None, float, str]:
        e_alone = job.remaining_s(snapshot.now)
        best: Choice | None = None
        wake = math.inf
        memory_fits = False
        for accum in accum_choices(job):
            picks: list[tuple[float, int, int]] = []
            for gi, group in enumerate(groups):
                if not group.slots:
                    continue
                terms = self._terms(job, group, accum, snapshot)
                if not terms.fits:
                    continue
                memory_fits = True
                e_shared = e_alone * terms.stretch
                window = None
                if self.benefit_test:
                    window = BenefitWindow.of(e_alone, e_shared, terms.x_a, terms.x_b)
                    wake = min(wake, _wake_time(group, window, snapshot.now))
                taken = 0
                for si in group.indices(window):
                    e_b = group.remaining[si]
                    t_con = t_concurrent(e_shared, e_b, terms.x_a, terms.x_b)
                    if self.benefit_test and not t_con < t_sequential(e_alone, e_b):
                        continue  # rounding at a window edge
                    picks.append((t_con, gi, si))
                    taken += 1
                    if taken == job.gpus:
                        break
            if len(picks) < job.gpus:
                continue
            picks.sort()
            chosen = tuple(picks[: job.gpus])
            if best is None or chosen[-1][0] < best.score:
                best = Choice(score=chosen[-1][0], accum=accum, picks=chosen)
        if best is not None:
            return best, wake, ""
        if not memory_fits:
            return None, wake, "no GPU holding a single job has memory for it"
        return None, wake, "sharing with the running jobs would not lower mean completion time yet"

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


def compute_terms(job: JobView, resident: JobView, accum: int, group: SlotGroup,
                  snapshot: Snapshot) -> Terms:
    est = snapshot.estimates
    mem_a = est.gpu_memory_mb(job.model, job.batch_size / (job.gpus * accum))
    fits = mem_a + group.mem_used_mb <= group.gpu_mem_mb
    x_a = est.colocation_slowdown(job.model, job.batch_size, job.gpus, accum, resident.model,
                                  resident.batch_size, resident.gpus, resident.accum_steps)
    x_b = est.colocation_slowdown(resident.model, resident.batch_size, resident.gpus,
                                  resident.accum_steps, job.model, job.batch_size, job.gpus, accum)
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
