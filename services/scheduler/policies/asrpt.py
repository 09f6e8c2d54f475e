"""A-SRPT: SRPT on a virtual single machine, played out on the real cluster.

Our design from the paper's abstract and the lemma quoted in DESIGN.md section 5 (the
paper's text was not available).

- **Virtual sizes.** A job of ``g`` GPUs with predicted exclusive run time ``p_hat``
  (its ``est_remaining_s``: the simulator's truth, the users' declared sizes or the
  random forest of ``gpusched.libs.core.size_predictor``, less the progress it has made) is a job
  of size ``g * p_hat / G`` on a single machine as fast as the ``G``-GPU cluster.
- **Virtual schedule.** Preemptive SRPT on that machine always serves the job with the
  least remaining virtual work. We rank every job, running or queued, by that remaining
  work, smallest first (ties: submit time, then id). *Our choice*, so that the policy
  stays a pure function of the snapshot: a job's remaining virtual work is derived from
  the service it really attained (its view's remaining time, corrected by observed
  progress), not from a separately simulated virtual machine, which would need every
  past job and would drift from what really ran. A job that must restore a checkpoint
  before it runs again (it was preempted) carries ``restart_s`` more work: the restart
  is charged in its rank.
- **Real schedule.** Jobs start in that order on the cluster's placement (the
  consolidated greedy ``FreeGpus.take``; a job with tensor or pipeline parallelism where
  the communication-aware mapper puts it, ``FreeGpus.take_parallel``), with
  backfilling: a job that does not fit the GPUs left is skipped and later ones may
  start.
- **Preemption** only with ``preemptive`` and only of a running job whose restart cost is
  below the bound: ``restart_s <= max_restart_share x`` its predicted remaining time.
  Others keep their GPUs. Among the preemptable, the lowest-ranked go first, and only
  when a higher-ranked queued job needs their GPUs (`decide_by_rank`).
- **Lemma 1.** ``rho = max_i alpha_max / alpha_min`` over the jobs it has started,
  ``alpha`` being the job's iteration time at its most spread placement (one GPU per
  node, as far as the nodes go) and at its most consolidated one, from the snapshot's
  performance model; `Asrpt.rho` reports it (the simulator puts it in summary.json).
  It is a report, and changes no decision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import ClassVar

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.placement import ShapeCache
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies.base import (
    PLAIN,
    Capabilities,
    QueueSort,
    by_priority_ranked,
    has_priorities,
)
from gpusched.services.scheduler.policies.preemptive import Moved, Ranked, decide_by_rank

#: the rank's work of a running job that may not be preempted: below every real amount
#: of work (>= 0), so such jobs rank before every other job. One float rather than a
#: (tier, work) pair keeps a rank's first item distinct, which sorts several times faster
KEEP = -1.0


_rank_of = itemgetter(0)


def virtual_work(job: JobView, remaining_s: float) -> float:
    """GPU-seconds of predicted work left: ``G`` times the job's remaining work on the
    virtual single machine."""
    return job.gpus * remaining_s


def _queued_key(job: JobView, restart_s: float) -> tuple[float, float, str]:
    restore = restart_s if job.preemptions else 0.0
    return (virtual_work(job, job.est_remaining_s + restore), job.submit_time, job.job_id)


def asrpt_order(restart_s: float) -> QueueSort:
    """Queued jobs in rank order, a preempted job charged ``restart_s`` (a queued job's
    rank does not change while it waits, so a driver may keep the queue so)."""
    return QueueSort(f"virtual-remaining+{restart_s!r}", partial(_queued_key, restart_s=restart_s))


class LemmaRho:
    """``max alpha_max / alpha_min`` over the job shapes seen, per cluster and model."""

    def __init__(self) -> None:
        self.value = 1.0
        self._seen: set[tuple[str, int, int]] = set()

    def see(self, jobs: Iterable[JobView], snapshot: Snapshot) -> None:
        cluster, perf = snapshot.cluster, snapshot.estimates
        for job in jobs:
            shape = (job.model, job.batch_size, job.gpus)
            if shape in self._seen:
                continue
            self._seen.add(shape)
            packed = perf.iteration_time(job.model, job.batch_size, job.gpus,
                                         cluster.fewest_nodes(job.gpus))
            spread = perf.iteration_time(job.model, job.batch_size, job.gpus,
                                         min(job.gpus, len(cluster.nodes)))
            if packed > 0 and math.isfinite(spread):
                self.value = max(self.value, spread / packed)


@dataclass(frozen=True)
class Asrpt:
    """A-SRPT: start jobs in the order of a virtual single machine's preemptive SRPT on
    sizes ``g * p_hat / G`` (remaining virtual work, smallest first) with backfilling;
    preempt only when configured to and the victim's restart is cheap."""

    name: str = "asrpt"
    #: whether it preempts at all
    preemptive: bool = True
    #: seconds of checkpoint and restart a preempted job pays; charged in its rank
    restart_s: float = 30.0
    #: a running job is preempted only if ``restart_s`` is at most this share of its
    #: predicted remaining time
    max_restart_share: float = 0.5
    capabilities: ClassVar[Capabilities] = PLAIN
    _order: QueueSort = field(init=False, compare=False, repr=False)
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _rho: LemmaRho = field(default_factory=LemmaRho, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise ValueError(f"restart_s must be a finite number >= 0, got {self.restart_s}")
        if not self.max_restart_share >= 0:
            raise ValueError(f"max_restart_share must be >= 0, got {self.max_restart_share}")
        object.__setattr__(self, "_order", asrpt_order(self.restart_s))

    @property
    def queue_sort(self) -> QueueSort:
        return self._order

    @property
    def rho(self) -> float:
        """Lemma 1's factor over the jobs this policy has started."""
        return self._rho.value

    def decide(self, snapshot: Snapshot) -> Decision:
        now, order = snapshot.now, self._order
        # the least predicted remaining time a victim may have
        if self.restart_s == 0:
            floor = 0.0
        else:
            floor = self.restart_s / self.max_restart_share if self.max_restart_share else math.inf
        if not self.preemptive:
            floor = math.inf
        # one comprehension per case, JobView.remaining_s inlined in the first: this runs
        # for every running job at every decision
        if floor > 0.0:  # a job with no work left is kept too
            running: list[Ranked] = [
                ((j.gpus * left if left >= floor else KEEP, j.submit_time, j.job_id), j)
                for j in snapshot.running
                for left in (j.est_remaining_s - (now - j.as_of) * j.progress_rate,)
            ]
        else:
            running = [
                ((j.gpus * j.remaining_s(now), j.submit_time, j.job_id), j)
                for j in snapshot.running
            ]
        running.sort(key=_rank_of)
        pending: Iterable[Ranked]
        if snapshot.queue_order == order.name:  # already in rank order: keys made lazily
            pending = ((order.key(j), j) for j in snapshot.pending)
        else:
            pending = sorted(((order.key(j), j) for j in snapshot.pending), key=_rank_of)
        if has_priorities(snapshot):  # a tenant's ranks by priority (base.by_priority_ranked);
            # a running job that may not be preempted keeps its rank
            kept = [r for r in running if r[0][0] == KEEP]
            contested, pending = by_priority_ranked(
                [r for r in running if r[0][0] != KEEP], list(pending)
            )
            running = kept + contested
        total = snapshot.cluster.total_gpus

        def describe(job: JobView) -> str:
            work = virtual_work(job, job.remaining_s(now))
            return f"{work / total:.0f} s of virtual work left ({work:.0f} GPU-s predicted)"

        moved = Moved()
        decision = decide_by_rank(snapshot, running, pending, describe, self._shapes, moved=moved)
        self._rho.see(moved.started, snapshot)
        return decision
