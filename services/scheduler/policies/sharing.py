"""The sharing math of SJF-BSBF (see ``sjf_bsbf``): the mean completion time of two jobs
run one after the other or side by side, the remaining times of a resident for which
sharing pays (a benefit window), and a job shape's pairings with a kind of resident at
each of its sub-batches, with the slowdowns and memory they rest on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpusched.libs.core.placement import accum_choices
from gpusched.libs.core.shape import JobShape
from gpusched.libs.core.snapshot import JobView, Snapshot

if TYPE_CHECKING:
    from gpusched.services.scheduler.policies.slots import SlotGroup


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
        # an empty first interval is (split, split]: a scan that starts after low1 then
        # still reaches the second interval, which does not depend on the first
        return cls(low1=min(low1, split), high1=split, low2=low2)


@dataclass(frozen=True, slots=True)
class Terms:
    fits: bool
    x_a: float
    x_b: float
    stretch: float


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
    #: t_con's two lines, ``half_s E_a + line1 E_b`` and ``line2 E_a + E_b / 2``
    half_s: float
    line1: float
    line2: float

    @classmethod
    def of(cls, accum: int, terms: Terms) -> Pairing:
        return cls.make(accum, terms.x_a, terms.x_b, terms.stretch)

    @classmethod
    def make(cls, accum: int, x_a: float, x_b: float, stretch: float) -> Pairing:
        unit = BenefitWindow.of(1.0, stretch, x_a, x_b)
        low1, high1, low2 = unit.low1, unit.high1, unit.low2
        return cls(
            accum,
            x_a,
            x_b,
            stretch,
            low1,
            high1,
            low2,
            low1 < high1 < low2,
            0.5 * stretch,
            (1 - 1 / (2 * x_a)) * x_b,
            (1 - 1 / (2 * x_b)) * x_a * stretch,
        )

    def window(self, e_alone: float) -> BenefitWindow:
        return BenefitWindow(e_alone * self.c_low1, e_alone * self.c_high1, e_alone * self.c_low2)


#: per job shape: (sub-batch accumulation, its per-GPU memory, its stretch) for every
#: sub-batch, worked out once and shared by every group the shape is paired with
ShapeTerms = tuple[tuple[int, float, float], ...]


def shape_terms(job: JobView, snapshot: Snapshot) -> ShapeTerms:
    est = snapshot.estimates
    model, batch, gpus = job.model, job.batch_size, job.gpus
    nodes = -(-gpus // snapshot.cluster.max_gpus_per_node)
    alone = 0.0
    terms: list[tuple[int, float, float]] = []
    for k in accum_choices(job):
        mem = est.gpu_memory_mb(model, batch / (gpus * k))
        if not alone:
            alone = est.iteration_time(model, batch, gpus, nodes, 1)
        terms.append((k, mem, est.iteration_time(model, batch, gpus, nodes, k) / alone))
    return tuple(terms)


#: per sub-batch of a job shape (as in ``ShapeTerms``), the job's and the resident's
#: slowdowns side by side, or None where the sub-batch does not fit beside the resident
SlowdownRow = tuple[tuple[float, float] | None, ...]


def slowdown_row(
    job: JobView, group: SlotGroup, snapshot: Snapshot, terms: ShapeTerms
) -> SlowdownRow:
    """The slowdowns of ``job`` beside ``group``'s kind of resident, for each of its
    sub-batches. Slowdowns and memory depend on each worker's sub-batch, not on the GPU
    count (see ``PerformanceModel.colocation_slowdown``), so one row serves every shape
    of the model with the same per-GPU batch."""
    slowdown = snapshot.estimates.colocation_slowdown
    b = group.resident
    resident = JobShape(b.model, b.batch_size, b.gpus, b.accum_steps)
    used, capacity = group.mem_used_mb, group.gpu_mem_mb
    row: list[tuple[float, float] | None] = []
    for k, mem, _ in terms:
        if not mem + used <= capacity:
            row.append(None)
            continue
        shape = JobShape(job.model, job.batch_size, job.gpus, k)
        row.append((slowdown(shape, resident), slowdown(resident, shape)))
    return tuple(row)


def pair(
    job: JobView,
    group: SlotGroup,
    snapshot: Snapshot,
    terms: ShapeTerms | None = None,
    made: dict[tuple[int, float, float, float], Pairing] | None = None,
    row: SlowdownRow | None = None,
) -> tuple[Pairing, ...]:
    """Every sub-batch of ``job`` worth trying against ``group``'s kind of resident: those
    that fit in memory beside it and that no other fitting sub-batch beats on every count
    (slowdown of A, slowdown of B, and A's accumulation stretch). ``terms`` (the job
    shape's, see ``shape_terms``), ``row`` (see ``slowdown_row``) and ``made`` (pairings
    already built, by their numbers) may be kept by the caller across groups and shapes."""
    if terms is None:
        terms = shape_terms(job, snapshot)
    if row is None:
        row = slowdown_row(job, group, snapshot, terms)
    fitting = [
        (xs[0], xs[1], stretch, k)
        for (k, _, stretch), xs in zip(terms, row, strict=True)
        if xs is not None
    ]
    kept: list[Pairing] = []
    for x_a, x_b, stretch, k in fitting:
        dominated = False
        for o_a, o_b, o_s, _ in fitting:
            if (
                o_a <= x_a
                and o_b <= x_b
                and o_s <= stretch
                and (o_a != x_a or o_b != x_b or o_s != stretch)
            ):
                dominated = True
                break
        if not dominated:
            if made is None:
                kept.append(Pairing.make(k, x_a, x_b, stretch))
                continue
            key = (k, x_a, x_b, stretch)
            pairing = made.get(key)
            if pairing is None:
                pairing = made[key] = Pairing.make(k, x_a, x_b, stretch)
            kept.append(pairing)
    return tuple(kept)


def bound_coefficients(pairings: tuple[Pairing, ...]) -> tuple[float, float, float]:
    """(a1, b1, a2) such that, for E_a, E_b >= 0, ``min(a1 E_a + b1 E_b, a2 E_a + E_b / 2)``
    is at most the t_con of every pairing (A's time alone E_a, B's remaining E_b).

    t_con is one of two lines, ``s E_a / 2 + (1 - 1/(2 x_a)) x_b E_b`` (B finishes first)
    and ``E_b / 2 + (1 - 1/(2 x_b)) x_a s E_a``, so it is at least the lesser of them; and
    each line is at least the one built from the least coefficients over the pairings."""
    first = pairings[0]
    a1, b1, a2 = first.half_s, first.line1, first.line2
    for p in pairings:
        if p.half_s < a1:
            a1 = p.half_s
        if p.line1 < b1:
            b1 = p.line1
        if p.line2 < a2:
            a2 = p.line2
    return a1, b1, a2
