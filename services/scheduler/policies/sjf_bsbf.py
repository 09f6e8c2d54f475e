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

Speed: a job is paired only with the groups of residents whose lower bound on t_con can
still beat the best slot found (see ``SjfBsbf._search_heap``); a one-GPU job needs no heap,
and a job of several GPUs is not searched at all when no sub-batch has that many slots
inside its benefit windows (``SjfBsbf._window_counts``). A queued job that found no
partner is not searched again while no shareable slot is new (``SlotIndex``), and once
slots are new it is tried only against those (each slot's epoch of birth is known),
unless one of the old slots may have entered a benefit window since. A job shape's
sub-batch terms are worked out once and shared by every group it is paired with, and
the slowdowns beside a kind of resident once per model and per-GPU batch, shared by the
model's shapes of every GPU count.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import ClassVar

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.placement import FreeGpus, ShapeCache, place_exclusive
from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot
from gpusched.services.scheduler.policies.base import (
    Capabilities,
    QueueSort,
    busy_reason,
    ordered_pending,
)
from gpusched.services.scheduler.policies.sharing import (
    BenefitWindow,
    Pairing,
    ShapeTerms,
    SlowdownRow,
    bound_coefficients,
    pair,
    shape_terms,
    slowdown_row,
    t_concurrent,
    t_sequential,
)
from gpusched.services.scheduler.policies.simple import SJF_ORDER
from gpusched.services.scheduler.policies.slots import SlotGroup, SlotIndex

#: a wake-up lands this much after the benefit test flips, so the test passes then
WAKE_MARGIN_S = 1e-3
#: a group's lower bound on t_con, (E_a + E_b) / 2, a hair lower so rounding never puts
#: it above a t_con computed by the other formula
_BOUND_SCALE = 0.5 * (1 - 1e-12)
_TIGHT_SCALE = 1 - 1e-12
#: kinds of entry on ``SjfBsbf._search_heap``'s heap: at one value a bound comes off
#: before the slots it stands for
_GROUP, _PAIRING, _SLOT = 0, 1, 2


def resident_cap_problem(cap: object) -> str | None:
    """What is wrong with ``cap`` as a ``max_resident_slowdown`` (None: nothing)."""
    if cap is None or (isinstance(cap, int | float) and not isinstance(cap, bool) and cap >= 1):
        return None
    return f"must be a slowdown of at least 1.0, got {cap!r}"


Alike = tuple[tuple[Pairing, ...], tuple[Pairing, ...], tuple[float, float, float] | None, bool]


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
    capabilities: ClassVar[Capabilities] = Capabilities(shares_gpus=True)
    #: most queued jobs examined for sharing in one decision (the rest wait a round), so
    #: a decision over a long queue stays bounded, as Slurm's bf_max_job_test does
    share_lookahead: int = 256
    #: also refuse a partner that sharing would slow by more than this factor (None: no
    #: cap, the rule as specified). The pairwise benefit test does not see the jobs queued
    #: behind a long resident, which a slowed resident keeps waiting; docs/results.md
    #: measures caps on the Philly trace.
    max_resident_slowdown: float | None = None
    #: take the shorter roads of ``_search`` (the same outcome, faster; off, every job
    #: goes through the heap search, the reference to compare against)
    fast_paths: bool = True
    _pairings: dict[tuple, tuple[Pairing, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _terms: dict[tuple, ShapeTerms] = field(default_factory=dict, compare=False, repr=False)
    #: per kind of pairing (see ``_group_pairings``), the slowdown row
    _rows: dict[tuple, SlowdownRow] = field(default_factory=dict, compare=False, repr=False)
    #: per (job shape, kind of pairing), the pairings, those with a gap, the bound's
    #: coefficients (None: no pairing) and whether the cap took every pairing away,
    #: shared by every group of that kind
    _alike: dict[tuple, Alike] = field(default_factory=dict, compare=False, repr=False)
    #: the pairings of ``_pairings`` whose benefit window has a gap
    _gaps: dict[tuple, tuple[Pairing, ...]] = field(default_factory=dict, compare=False, repr=False)
    _made: dict[tuple[int, float, float, float], Pairing] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: per key of ``_pairings`` with some pairing, the coefficients of its bound (see
    #: ``bound_coefficients``)
    _coefs: dict[tuple, tuple[float, float, float]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _slots: SlotIndex = field(default_factory=SlotIndex, compare=False, repr=False)
    #: job id -> (its view, slot epoch, wake-up, why, recheck, counts) for queued jobs
    #: that found no partner; until ``recheck`` none of the slots it was searched against
    #: can start to pay; ``counts`` (jobs of several GPUs): per sub-batch, at most how
    #: many of those slots lay in its benefit windows (None: not counted)
    _no_share: dict[str, tuple[JobView, int, float, str, float, dict[int, int] | None]] = field(
        default_factory=dict, compare=False, repr=False
    )
    #: within one decision, while no slot is taken: per job shape, why it finds no partner
    #: when none of its pairings has a gap (then that does not depend on the job's E_a)
    _per_shape: dict[tuple, str] = field(default_factory=dict, compare=False, repr=False)
    #: the cluster and performance model the pairing caches were worked out for
    _basis: ModelBasis = field(default_factory=ModelBasis, compare=False, repr=False)

    #: keys of ``_pairings`` with a sub-batch that fits but slows the resident past the cap
    _capped: set[tuple] = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        problem = resident_cap_problem(self.max_resident_slowdown)
        if problem:
            raise ValueError(f"max_resident_slowdown: {problem}")

    def with_max_resident_slowdown(self, cap: float) -> SjfBsbf:
        """This policy, also refusing partners it would slow by more than ``cap``."""
        return replace(self, max_resident_slowdown=cap)

    def _sync(self, snapshot: Snapshot) -> None:
        """Forget the pairing caches when a snapshot brings another cluster or model."""
        if not self._basis.moved(snapshot):
            return
        for cache in (
            self._pairings,
            self._terms,
            self._rows,
            self._alike,
            self._gaps,
            self._coefs,
            self._capped,
        ):
            cache.clear()
        self._no_share.clear()

    def decide(self, snapshot: Snapshot) -> Decision:
        pending = snapshot.pending
        if not pending:
            return Decision(default_reason=busy_reason(snapshot))
        shapes = self._shapes
        free = FreeGpus(snapshot)
        groups: list[SlotGroup] | None = None
        open_slots = 0
        examined = 0
        starts: list[Start] = []
        reasons: dict[str, str] = {}
        wake = math.inf
        lookahead_hit = False
        now = snapshot.now
        no_share = self._no_share
        if len(no_share) > 2 * len(pending) + 1024:
            queued = {j.job_id for j in pending}
            for job_id in [k for k in no_share if k not in queued]:
                del no_share[job_id]
        epoch = -1
        self._sync(snapshot)
        self._per_shape.clear()
        for job in ordered_pending(snapshot, SJF_ORDER):
            if free.total >= job.gpus:
                bad = shapes.unschedulable(job, snapshot)
                start = None if bad else place_exclusive(job, free, snapshot, shapes)
                if start is not None:
                    starts.append(start)
                else:
                    reasons[job.job_id] = bad or f"needs {job.gpus} GPUs"
                continue
            if groups is None:
                groups = self._slots.build(snapshot)
                epoch = self._slots.epoch
                open_slots = sum(len(g.slots) for g in groups)
            if free.total == 0 and open_slots == 0:
                break
            if examined >= self.share_lookahead:
                lookahead_hit = True
                break
            bad = shapes.unschedulable(job, snapshot)
            if bad:
                reasons[job.job_id] = bad
                continue
            if not job.allow_sharing:
                reasons[job.job_id] = (
                    f"needs {job.gpus} idle GPUs, {free.total} idle; it does not allow sharing"
                )
                continue
            examined += 1
            known = no_share.get(job.job_id)
            if (
                known is not None
                and known[0] is job
                and known[1] == epoch
                and now < known[2] - 2 * WAKE_MARGIN_S
            ):
                # no slot is new since this job last found no partner: it still finds none
                wake = min(wake, known[2])
                reasons[job.job_id] = f"needs {job.gpus} GPUs, {free.total} idle; {known[3]}"
                continue
            quick = False
            counts: dict[int, int] | None = None
            if known is not None and known[0] is job and now < known[4] - 2 * WAKE_MARGIN_S:
                # the slots it found no partner among have not entered a benefit window
                # since: only the slots born since can change the answer
                if job.gpus == 1:
                    quick = not self._new_slot_pays(job, groups, known[1], snapshot)
                elif known[5] is not None and self.fast_paths:
                    counts = dict(known[5])
                    extras = self._window_counts(job, groups, snapshot, known[1]) or {}
                    for k, extra in extras.items():
                        counts[k] = counts.get(k, 0) + extra
                    quick = max(counts.values(), default=0) < job.gpus
            if quick:  # it still finds none (its wake-up is worked out anew)
                choice, job_wake, why, recheck = self._no_partner(job, groups, snapshot)
            else:
                choice, job_wake, why, recheck, counts = self._search(
                    job, groups, snapshot, open_slots
                )
            if choice is None:
                no_share[job.job_id] = (job, epoch, job_wake, why, recheck, counts)
                wake = min(wake, job_wake)
                reasons[job.job_id] = f"needs {job.gpus} GPUs, {free.total} idle; {why}"
                continue
            start = self._apply(job, choice, groups)
            starts.append(start)
            self._slots.taken.update(start.gpu_ids)
            self._per_shape.clear()  # slots went away
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

    def _group_pairings(
        self, job: JobView, group: SlotGroup, snapshot: Snapshot
    ) -> tuple[Pairing, ...]:
        key = ((job.model, job.batch_size, job.gpus), group.key)
        pairings = self._pairings.get(key)
        if pairings is None:
            shape = key[0]
            terms = self._terms.get(shape)
            if terms is None:
                terms = self._terms[shape] = shape_terms(job, snapshot)
            # what a pairing depends on: each side's model, per-GPU batch (and the
            # resident's accumulation), and the memory beside the resident; residents of
            # another GPU count with the same per-GPU batch pair alike
            b = group.resident
            kind = (
                shape[0],
                shape[1] / shape[2],
                b.model,
                b.batch_size / b.gpus,
                b.accum_steps,
                group.mem_used_mb,
                group.gpu_mem_mb,
            )
            row = self._rows.get(kind)
            if row is None:
                row = self._rows[kind] = slowdown_row(job, group, snapshot, terms)
            alike = self._alike.get((shape, kind))
            if alike is None:
                pairings = pair(job, group, snapshot, terms, self._made, row)
                capped = False
                cap = self.max_resident_slowdown
                if cap is not None and pairings:
                    # a dominated pairing slows B at least as much as one that dominates
                    # it, so capping after the dominance filter drops the same ones
                    pairings = tuple(p for p in pairings if p.x_b <= cap)
                    capped = not pairings
                alike = self._alike[(shape, kind)] = (
                    pairings,
                    tuple(p for p in pairings if p.gap),
                    bound_coefficients(pairings) if pairings else None,
                    capped,
                )
            pairings, self._gaps[key], coefs, capped = alike
            self._pairings[key] = pairings
            if coefs is not None:
                self._coefs[key] = coefs
            if capped:
                self._capped.add(key)
        return pairings

    def _no_fit_reason(self, shape: tuple, group_keys: Iterable[tuple]) -> str:
        """Why a job of ``shape`` pairs with none of the groups of ``group_keys``."""
        capped = self._capped
        if capped and any((shape, key) in capped for key in group_keys):
            return (
                f"sharing would slow every running job it fits beside by more than "
                f"{self.max_resident_slowdown:g}x (max_resident_slowdown)"
            )
        return "no GPU holding a single job has memory for it"

    def _search(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot, open_slots: int = -1
    ) -> tuple[Choice | None, float, str, float, dict[int, int] | None]:
        """What ``_search_heap`` finds, by a shorter road where there is one: a one-GPU job
        needs no heap (its choice is its single best slot), and a job needing more GPUs
        than there are open slots cannot be placed at all (only its wake-up is left to
        work out). ``open_slots`` is the number of slots left in ``groups`` (-1: count).

        The fourth item is when, at the earliest, a slot it found no partner among could
        start to pay (-inf: unknown, search it in full next time); the fifth, for a job
        of several GPUs, how many slots per sub-batch lay in its windows (None: not
        counted)."""
        if not self.fast_paths:
            return (*self._search_heap(job, groups, snapshot), -math.inf, None)
        if job.gpus == 1:
            return (*self._search_one(job, groups, snapshot), None)
        if open_slots < 0:
            open_slots = sum(len(g.remaining) for g in groups)
        if job.gpus > open_slots:
            return (*self._no_partner(job, groups, snapshot)[:3], -math.inf, None)
        counts = self._window_counts(job, groups, snapshot)
        if counts is not None and max(counts.values(), default=0) < job.gpus:
            return (*self._no_partner(job, groups, snapshot), counts)
        return (*self._search_heap(job, groups, snapshot), -math.inf, None)

    def _window_counts(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot, since: int = -1
    ) -> dict[int, int] | None:
        """Per sub-batch of ``job``, how many slots (born after epoch ``since``) lie in its
        benefit windows over all groups. The heap search tries exactly those slots (and
        may reject some at a window edge), so where every count is below ``job.gpus`` it
        cannot place the job. Counting all slots needs every group paired with the job's
        shape: where one is not yet, this gives None and leaves it to the heap search,
        which pairs only the groups that can still win."""
        e_alone = job.remaining_s(snapshot.now)
        if e_alone < 1e-9:
            e_alone = 1e-9
        benefit = self.benefit_test
        counts: dict[int, int] = {}
        shape = (job.model, job.batch_size, job.gpus)
        known = self._pairings
        if since >= 0:
            for e_b, _, group in self._slots.born_since(since):
                found = known.get((shape, group.key))
                if found is None:
                    found = self._group_pairings(job, group, snapshot)
                for p in found:
                    if not benefit or (
                        e_b > e_alone * p.c_low1
                        and (e_b <= e_alone * p.c_high1 or e_b > e_alone * p.c_low2)
                    ):
                        counts[p.accum] = counts.get(p.accum, 0) + 1
            return counts
        for group in groups:
            rem = group.remaining
            n = len(rem)
            if not n:
                continue
            found = known.get((shape, group.key))
            if found is None:
                return None
            for p in found:
                if not benefit:
                    count = n
                else:  # the slots _first_slot walks: above low1, and at most high1 or above low2
                    i1 = bisect_right(rem, e_alone * p.c_low1)
                    j1 = bisect_right(rem, e_alone * p.c_high1)
                    i2 = max(i1, bisect_right(rem, e_alone * p.c_low2))
                    count = n - i1 if j1 >= i2 else max(0, j1 - i1) + (n - i2)
                counts[p.accum] = counts.get(p.accum, 0) + count
        return counts

    def _new_slot_pays(
        self, job: JobView, groups: list[SlotGroup], since: int, snapshot: Snapshot
    ) -> bool:
        """Whether a slot born after epoch ``since`` lies in one of the one-GPU ``job``'s
        benefit windows (or, without the benefit test, fits it at all)."""
        if job.gpus != 1 or not self.fast_paths:
            return True
        e_alone = job.remaining_s(snapshot.now)
        if e_alone < 1e-9:
            e_alone = 1e-9
        benefit = self.benefit_test
        shape = (job.model, job.batch_size, job.gpus)
        known = self._pairings
        for e_b, _, group in self._slots.born_since(since):
            pairings = known.get((shape, group.key))
            if pairings is None:
                pairings = self._group_pairings(job, group, snapshot)
            if pairings and not benefit:
                return True
            for p in pairings:  # as _first_slot reads a window
                if e_b > e_alone * p.c_low1 and (
                    e_b <= e_alone * p.c_high1 or e_b > e_alone * p.c_low2
                ):
                    return True
        return False

    def _group_bounds(
        self, shape: tuple, groups: list[SlotGroup], e_alone: float
    ) -> list[tuple[float, int]]:
        """(lower bound on the t_con of any of its slots, index) of every group a job of
        ``shape`` and exclusive time ``e_alone`` might share with: a paired group by its
        two precomputed lines, one not paired yet by a bound that needs no pairing, and a
        group where nothing of the shape fits not at all."""
        known = self._pairings
        coefs = self._coefs
        bounds: list[tuple[float, int]] = []
        for gi, group in enumerate(groups):
            rem = group.remaining
            if not rem:
                continue
            key = (shape, group.key)
            c = coefs.get(key)
            if c is not None:  # t_con grows with E_b: the smallest E_b bounds the group
                e_b = rem[0]
                one = c[0] * e_alone + c[1] * e_b
                two = c[2] * e_alone + 0.5 * e_b
                bounds.append((_TIGHT_SCALE * (one if one < two else two), gi))
            elif key not in known:
                bounds.append(((e_alone + rem[0]) * _BOUND_SCALE, gi))
        return bounds

    def _search_one(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot
    ) -> tuple[Choice | None, float, str, float]:
        """``_search_heap`` for a one-GPU job: groups in ascending order of their bound,
        each paired and its first paying slot taken, until a bound exceeds the best slot
        found. The heap would expand the same groups and pick the same slot: the least
        (t_con, group, pairing, slot)."""
        e_alone = job.remaining_s(snapshot.now)
        if e_alone < 1e-9:
            e_alone = 1e-9
        shape = (job.model, job.batch_size, job.gpus)
        known = self._pairings
        order = self._group_bounds(shape, groups, e_alone)
        order.sort()
        best: tuple[float, int, int, int] | None = None
        benefit = self.benefit_test
        edge = False
        for bound, gi in order:
            if best is not None and bound > best[0]:
                break
            group = groups[gi]
            rem = group.remaining
            pairings = known.get((shape, group.key))
            if pairings is None:
                pairings = self._group_pairings(job, group, snapshot)
            for pi, p in enumerate(pairings):
                if benefit:
                    i = bisect_right(rem, e_alone * p.c_low1)
                    if i >= len(rem) or rem[i] > e_alone * p.c_high1:
                        i = max(i, bisect_right(rem, e_alone * p.c_low2))
                        if i >= len(rem):
                            continue
                else:
                    i = 0
                e_b = rem[i]
                t_con = t_concurrent(e_alone * p.stretch, e_b, p.x_a, p.x_b)
                if benefit and not t_con < e_b + e_alone / 2:
                    edge = True
                    continue  # rounding at a window edge: this pairing has no slot
                if best is None or (t_con, gi, pi, i) < best:
                    best = (t_con, gi, pi, i)
        if best is None:
            found = self._no_partner(job, groups, snapshot)
            return found if not edge else (*found[:3], -math.inf)
        t_con, gi, pi, i = best
        accum = known[(shape, groups[gi].key)][pi].accum
        return Choice(score=t_con, accum=accum, picks=((t_con, gi, i),)), math.inf, "", math.inf

    def _no_partner(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot
    ) -> tuple[None, float, str, float]:
        """What ``_search_heap`` says of a job it cannot place: every group is paired, and
        the wake-up is when the least-loaded resident waiting to enter a benefit window
        enters it. Also when the first of all such residents enters one (the recheck
        time: residents progress at different rates)."""
        now = snapshot.now
        e_alone = -1.0
        fits = False
        gappy_any = False
        wake = math.inf
        recheck = math.inf
        shape = (job.model, job.batch_size, job.gpus)
        why = self._per_shape.get(shape)
        if why is not None:
            return None, math.inf, why, math.inf
        known, gaps = self._pairings, self._gaps
        for group in groups:
            rem = group.remaining
            if not rem:
                continue
            key = (shape, group.key)
            pairings = known.get(key)
            if pairings is None:
                pairings = self._group_pairings(job, group, snapshot)
            if not pairings:
                continue
            fits = True
            gappy = gaps[key]  # only a window with a gap can be entered by a shrinking E_b
            if not gappy:
                continue
            gappy_any = True
            if e_alone < 0.0:
                e_alone = job.remaining_s(now)
                if e_alone < 1e-9:
                    e_alone = 1e-9
            n = len(rem)
            slots = group.slots
            for p in gappy:
                high = e_alone * p.c_high1
                if not e_alone * p.c_low1 < high:
                    continue  # (see _wake_time)
                low2 = e_alone * p.c_low2
                i = bisect_right(rem, high)
                if i < n and rem[i] <= low2:  # _wake_time, inlined
                    rate = slots[i][2].progress_rate
                    if rate > 0:
                        at = now + (rem[i] - high) / rate + WAKE_MARGIN_S
                        if at < wake:
                            wake = at
                while i < n and rem[i] <= low2:
                    rate = slots[i][2].progress_rate
                    if rate > 0:
                        at = now + (rem[i] - high) / rate
                        if at < recheck:
                            recheck = at
                    i += 1
        if not fits:
            why = self._no_fit_reason(shape, (g.key for g in groups if g.remaining))
        else:
            why = "sharing with the running jobs would not lower mean completion time yet"
        if not gappy_any:
            self._per_shape[shape] = why
        return None, wake, why, recheck

    def _search_heap(
        self, job: JobView, groups: list[SlotGroup], snapshot: Snapshot
    ) -> tuple[Choice | None, float, str]:
        """The sub-batch whose ``gpus``-th best paying slot has the smallest t_con.

        Slots come off one heap in ascending t_con across every (group, sub-batch)
        pairing; the first sub-batch to collect ``gpus`` slots wins, so the search stops
        there instead of listing every candidate. A group enters the heap first as a
        lower bound, ``(E_a + smallest E_b) / 2`` (every t_con is at least that, since
        slowdowns and the accumulation stretch are >= 1), and its pairings are worked out
        only when that bound comes off the heap: groups that cannot beat the winner are
        never paired with the job at all. Each pairing in turn enters as the lesser of
        its two t_con lines at the group's smallest E_b, and its first paying slot is
        looked up only when that bound comes off. Ties go to the earlier group, pairing
        and slot, as a full scan would.
        """
        e_alone = max(job.remaining_s(snapshot.now), 1e-9)
        gpus = job.gpus
        retry = gpus > 1  # one GPU: a slot failing at a window edge rules out its pairing
        heap: list[tuple[float, int, int, int, int]] = [
            (bound, _GROUP, gi, 0, 0)
            for bound, gi in self._group_bounds((job.model, job.batch_size, gpus), groups, e_alone)
        ]
        heapq.heapify(heap)
        expanded: dict[int, tuple[Pairing, ...]] = {}
        #: per (sub-batch, GPU type): a job's GPUs are all of one type
        picks: dict[tuple[int, int], list[tuple[float, int, int]]] = {}
        while heap:
            value, kind, gi, pi, si = heapq.heappop(heap)
            if kind == _GROUP:
                pairings = expanded[gi] = self._group_pairings(job, groups[gi], snapshot)
                e_b = groups[gi].remaining[0]
                for pj, p in enumerate(pairings):
                    one = p.half_s * e_alone + p.line1 * e_b
                    two = p.line2 * e_alone + 0.5 * e_b
                    bound = _TIGHT_SCALE * (one if one < two else two)
                    heapq.heappush(heap, (bound, _PAIRING, gi, pj, 0))
                continue
            pairing = expanded[gi][pi]
            if kind == _PAIRING:
                found = self._next_pick(e_alone, groups[gi].remaining, pairing, 0, retry)
                if found is not None:
                    heapq.heappush(heap, (found[0], _SLOT, gi, pi, found[1]))
                continue
            chosen = picks.setdefault((pairing.accum, groups[gi].gpu_type), [])
            chosen.append((value, gi, si))
            if len(chosen) == gpus:
                return Choice(score=value, accum=pairing.accum, picks=tuple(chosen)), math.inf, ""
            found = self._next_pick(e_alone, groups[gi].remaining, pairing, si + 1, retry)
            if found is not None:
                heapq.heappush(heap, (found[0], _SLOT, gi, pi, found[1]))
        # no partner: every group has been paired by now (the heap held them all)
        if not any(expanded.values()):
            shape = (job.model, job.batch_size, gpus)
            # groups known to pair with nothing never entered the heap: ask of all of them
            why = self._no_fit_reason(shape, (g.key for g in groups if g.remaining))
            return None, math.inf, why
        wake = math.inf
        for gi, pairings in expanded.items():
            for pairing in pairings:
                if pairing.gap:
                    wake = min(wake, _wake_time(groups[gi], pairing.window(e_alone), snapshot.now))
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

    def _next_pick(
        self, e_alone: float, rem: list[float], entry: Pairing, start: int, retry: bool
    ) -> tuple[float, int] | None:
        """(t_con, slot index) of the next slot that pays, from ``start``."""
        i = self._first_slot(e_alone, rem, entry, start)
        while i < len(rem):
            e_b = rem[i]
            t_con = t_concurrent(e_alone * entry.stretch, e_b, entry.x_a, entry.x_b)
            if not self.benefit_test or t_con < t_sequential(e_alone, e_b):
                return (t_con, i)
            if not retry:
                return None
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
