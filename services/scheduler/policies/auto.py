"""``auto``: one policy to leave on, built from the seed methods' rules (ours: no paper
combines them; each rule below names where it comes from).

1. **Order, deadlines and placement over time: GENIE** (``genie.py``). Jobs with a
   deadline that can still meet it go first, smallest waiting allowance first, under
   GENIE's admission (a job that would make several others miss is deferred); then
   the jobs without one, shortest predicted run time first (the predicted size is what
   the driver's size predictor believes, A-SRPT's learned sizes where it has them);
   each job starts at its most consolidated free placement, or waits for a
   consolidated one when that finishes sooner; later jobs that fit start past one that
   does not (backfill).
2. **A bound on being passed over** (ours). A queued job that has waited more than
   ``max_wait_factor`` times its own predicted run time, and at least ``min_wait_s``,
   goes to the head of the queue, longest waiting first: shortest-first orders starve
   long jobs under sustained load, and this bounds how long they can be passed over.
3. **GPU sharing: SJF-BSBF's benefit rule** (``sjf_bsbf.py``), off unless a cap on the
   resident's slowdown is given (``max_resident_slowdown``, CLI
   ``--max-resident-slowdown``): then a job GENIE left waiting may join a running job's
   GPUs, with gradient accumulation where that is what fits, when SJF-BSBF's pairwise
   test says the pair finishes sooner on average than the job waiting for the resident
   to end, and the resident is slowed by at most the cap. A job never joins a job
   started in the same decision, nor takes an idle GPU this way (idle GPUs are GENIE's
   to give, or to hold for a job waiting for a consolidated placement). Off by default
   because, measured on the first 20,000 Philly jobs (docs/results.md, "auto"), every
   cap tried raised the mean JCT: the pairwise test does not see the jobs queued
   behind a slowed resident.

Not yet part of ``auto``: Synergy's CPU/memory tuning, ONES's elastic resizing and a
GPU-type-aware placement; on a workload that needs them the seed policy does better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import Capabilities, QueueSort
from gpusched.services.scheduler.policies.genie import GENIE_CAPABILITIES, SLACK_ORDER, Genie
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf, resident_cap_problem

AUTO_CAPABILITIES = Capabilities(without_deadlines=GENIE_CAPABILITIES.without_deadlines)
AUTO_SHARING_CAPABILITIES = replace(AUTO_CAPABILITIES, shares_gpus=True)


@dataclass(frozen=True)
class Auto:
    """GENIE's order, admission and placement over time, a bound on being passed over,
    and SJF-BSBF's sharing for the jobs left waiting (see the module)."""

    name: str = "auto"
    preemptive: bool = False
    #: a job waiting longer than this many times its predicted run time (and at least
    #: ``min_wait_s``) goes to the head of the queue
    max_wait_factor: float = 10.0
    min_wait_s: float = 3 * 24 * 3600.0
    #: the most a resident may be slowed by a job joining its GPUs; 0: no sharing, None:
    #: SJF-BSBF's benefit rule with no cap
    max_resident_slowdown: float | None = 0.0
    _genie: Genie = field(default_factory=Genie, compare=False, repr=False)
    _sharing: SjfBsbf | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.max_wait_factor > 0 and math.isfinite(self.max_wait_factor)):
            raise ValueError(f"max_wait_factor: must be a finite number > 0, got "
                             f"{self.max_wait_factor}")
        if not (self.min_wait_s >= 0 and math.isfinite(self.min_wait_s)):
            raise ValueError(f"min_wait_s: must be a finite number >= 0, got {self.min_wait_s}")
        cap = self.max_resident_slowdown
        if cap != 0:
            problem = resident_cap_problem(cap)
            if problem:
                raise ValueError(f"max_resident_slowdown: {problem}")
            if self._sharing is None:
                object.__setattr__(self, "_sharing", SjfBsbf(max_resident_slowdown=cap))

    def with_max_resident_slowdown(self, cap: float) -> Auto:
        return replace(self, max_resident_slowdown=cap, _sharing=None)

    def scaled(self, time_scale: float) -> Auto:
        """This policy on a cluster whose seconds are ``time_scale`` of the jobs' own."""
        return replace(self, min_wait_s=self.min_wait_s * time_scale, _sharing=None)

    @property
    def queue_sort(self) -> QueueSort:
        return SLACK_ORDER

    @property
    def capabilities(self) -> Capabilities:
        return AUTO_CAPABILITIES if self._sharing is None else AUTO_SHARING_CAPABILITIES

    def decide(self, snapshot: Snapshot) -> Decision:
        snapshot = self._starving_first(snapshot)
        decision = self._genie.decide(snapshot)
        if self._sharing is None or not snapshot.running:
            return decision
        started = {s.job_id for s in decision.starts}
        waiting = tuple(
            j for j in snapshot.pending if j.job_id not in started and j.allow_sharing
        )
        if not waiting:
            return decision
        shared = self._sharing.decide(_only_residents(snapshot, waiting, decision.starts))
        joins = tuple(s for s in shared.starts if s.shares_with)
        if not joins:
            return decision
        joined = {s.job_id for s in joins}
        reasons = {k: v for k, v in decision.reasons.items() if k not in joined}
        wakes = [w for w in (decision.wake_at, shared.wake_at) if w is not None]
        return Decision(
            starts=decision.starts + joins,
            reasons=reasons,
            default_reason=decision.default_reason,
            wake_at=min(wakes) if wakes else None,
        )

    def _starving_first(self, snapshot: Snapshot) -> Snapshot:
        """The snapshot with the jobs waiting past their bound at the head of the queue
        (longest waiting first), the rest in GENIE's order; itself when none is."""
        now = snapshot.now
        floor, factor = self.min_wait_s, self.max_wait_factor
        starving = [
            j for j in snapshot.pending
            if now - j.queued_since > max(floor, factor * j.est_remaining_s)
        ]
        if not starving:
            return snapshot
        starving.sort(key=lambda j: (j.queued_since, j.job_id))
        first = {j.job_id for j in starving}
        ordered = snapshot.pending if snapshot.queue_order == SLACK_ORDER.name else sorted(
            snapshot.pending, key=SLACK_ORDER.key
        )
        rest = [j for j in ordered if j.job_id not in first]
        return replace(snapshot, pending=(*starving, *rest), queue_order=SLACK_ORDER.name,
                       orders={})


def _only_residents(
    snapshot: Snapshot, waiting: tuple[JobView, ...], starts: tuple[Start, ...]
) -> Snapshot:
    """What the sharing rule sees: the jobs left waiting, and a cluster whose every GPU
    without a running job counts as taken (GENIE's to give or hold), as do the GPUs of
    this decision's starts. So a job can only join a job already running."""
    load = list(snapshot.gpu_load)
    for gpu, jobs in enumerate(load):
        if jobs == 0:
            load[gpu] = snapshot.max_jobs_per_gpu
    for start in starts:
        for gpu in start.gpu_ids:
            load[gpu] = snapshot.max_jobs_per_gpu
    return replace(
        snapshot,
        pending=waiting,
        gpu_load=tuple(load),
        node_free=(0,) * len(snapshot.node_free),
        queue_order="arrival",
        orders={},
        index=None,
        _by_id={},
    )
