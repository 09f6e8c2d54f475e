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
3. **Preemption: A-SRPT's rank and restart bound** (``asrpt.py``). A-SRPT ranks every
   job, running or queued, by its remaining virtual work (GPUs x predicted remaining
   time, a preempted job charged its 30 s restart) and would preempt a running job
   ranked below a queued one whose restart costs at most half its predicted remaining
   time. ``auto`` takes those victims, lets GENIE decide again as if they were queued,
   and preempts a victim only where GENIE then starts another job on its GPUs (the
   victim waits its turn; it does not start again in the same decision). Measured, it
   is what lowers the mean JCT most (docs/results.md, "auto"); ``preempt=False`` turns it
   off.
4. **GPU sharing: SJF-BSBF's benefit rule** (``sjf_bsbf.py``), off unless a cap on the
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

5. **Elastic jobs: ONES's search** (``ones.py``), for the jobs that declare elastic
   bounds (``min_gpus``/``max_gpus`` or batch bounds; ``JobView.elastic``) and no
   priority (the search re-plans sizes, so no order could honour one). Rules 1-4 decide
   over the other jobs, seeing elastic jobs only where they run (A-SRPT's preemption
   spares them). Then ONES's search runs over the elastic jobs alone, on a cluster of
   the GPUs that decision leaves: it starts queued ones (on one GPU, at their per-GPU
   batch) and sizes running ones within their bounds (growth, shrinking, a batch along
   the model's convergence curve). Elastic jobs only borrow GPUs (ours): while a job
   without bounds is left waiting, a running elastic job is left as it is unless it
   holds more GPUs than it asked for and may change (past ONES's epoch gate), and then
   it is shrunk back to what it asked, so the borrowed GPUs go back to the queue; a
   queued elastic job gets no more than it asked for. A workload without elastic jobs
   never runs the search; one of elastic jobs only is scheduled exactly as ``ones``
   schedules it. Measured on ``mixed:2000`` (30 % elastic, docs/results.md "auto"),
   resizing under load only added restarts, hence the rule's second half.

6. **Mixed GPU types: each start on the type where its job gains most** (after Gavel's
   heterogeneity-aware allocation, greedily, ours). On a cluster of several GPU types,
   the GPUs of this decision's starts and the idle ones form a pool; the starts, the
   job that gains most from its fastest type over its slowest first (speeds per model
   and type from ``libs/core/type_speed.py`` over the policy's estimates), each take
   the fastest type with room for their gang, on the fewest nodes (the fullest node
   that fits it, else the nodes with most room first). A start whose memory does not
   fit a type's GPUs skips that type; where some start finds no room, the decision is
   left as GENIE placed it. Jobs with tensor or pipeline parallelism, joins and
   ONES's starts keep their GPUs; running jobs are not moved between types.

7. **CPU and memory: Synergy's best case where it fits** (``synergy.py``, TUNE's first
   step and its victims' rule, ours to apply after placement), **off by default**
   (``tune_cpu_mem``): on a live cluster the CPUs it gave left a job that would share
   a GPU no room for its own share, so the sharing a cap allows stopped. Where the
   driver tracks nodes' CPUs and memory, every start is first counted at its
   GPU-proportional share; where that overcommits a node (running jobs hold more than
   their share), running jobs there with an allocation of their own drop to their
   share, most CPUs per GPU first, until it fits (so too where ONES resizes a job onto
   a node; ONES's resizes are put in an order in which each fits when applied); where
   that is not enough, the last starts there wait. Then each start on one node, in the
   decision's order, gets its model's best-case vector (capped to the node) where the
   node has room for it; else it keeps its share. Joins, ONES's starts, elastic jobs
   (their resizes give them the share) and jobs spread over nodes keep the share. A
   model that gains nothing from more than its share so takes less (its best case),
   which leaves room for one that gains: on Synergy's workload this took ``auto`` from
   22.05 h to 18.82 h mean JCT; giving the best case only to the models that gain
   changed nothing (22.07 h). Unlike Synergy, placement does not follow the CPUs
   (GENIE places by GPUs), and a running job is not raised back to its best case
   later. The rule is kept only where the driver's own check accepts what it changed.

Sharing is not combined with preemption in one decision: a decision that preempts
shares nothing.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.decision import (
    Decision,
    Preempt,
    Start,
    decision_problems,
)
from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.libs.core.type_speed import TypeSpeeds
from gpusched.services.scheduler.policies.asrpt import Asrpt
from gpusched.services.scheduler.policies.auto_resources import (
    on_fastest_types,
    sized_by_search,
    with_cpu_mem,
)
from gpusched.services.scheduler.policies.base import Capabilities, QueueSort, queue_in
from gpusched.services.scheduler.policies.genie import SLACK_ORDER, Genie
from gpusched.services.scheduler.policies.ones import Ones
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf, resident_cap_problem

AUTO_CAPABILITIES = Capabilities(
    without_deadlines="its deadline order and admission had nothing to act on: it ran "
    "jobs shortest predicted run time first, with backfill and A-SRPT's preemptions"
)
AUTO_SHARING_CAPABILITIES = replace(AUTO_CAPABILITIES, shares_gpus=True)


@dataclass(frozen=True)
class Auto:
    """The default, ours: GENIE's order, admission and placement over time, A-SRPT's
    preemptions, a bound on being passed over, ONES's search for elastic jobs, each
    start on its fastest GPU type, Synergy's CPU and memory, and SJF-BSBF's sharing
    with a cap (see the module)."""

    name: str = "auto"
    #: a job waiting longer than this many times its predicted run time (and at least
    #: ``min_wait_s``) goes to the head of the queue
    max_wait_factor: float = 10.0
    min_wait_s: float = 3 * 24 * 3600.0
    #: the most a resident may be slowed by a job joining its GPUs; 0: no sharing, None:
    #: SJF-BSBF's benefit rule with no cap
    max_resident_slowdown: float | None = 0.0
    #: A-SRPT's preemption: a running job ranked below a queued one by remaining
    #: virtual work, and whose restart costs at most half its predicted remaining time,
    #: is preempted when GENIE then gives its GPUs to another job
    preempt: bool = True
    #: ONES's search over the jobs that declare elastic bounds; False: they run at the
    #: size they asked for, as every other job
    elastic: bool = True
    #: on a cluster of several GPU types, each start on the type where its job gains
    #: most (rule 6); False: where GENIE places it
    type_aware: bool = True
    #: where nodes have CPUs and memory tracked, starts get their best-case vector
    #: where it fits (rule 7); off by default: live, the CPUs it gives left a job
    #: waiting to share a GPU no room for its share (tests/test_live_auto.py)
    tune_cpu_mem: bool = False
    _genie: Genie = field(default_factory=Genie, compare=False, repr=False)
    _asrpt: Asrpt = field(default_factory=Asrpt, compare=False, repr=False)
    _sharing: SjfBsbf | None = field(default=None, compare=False, repr=False)
    _ones: Ones = field(default_factory=Ones, compare=False, repr=False)
    _speeds: dict[tuple[int, int], TypeSpeeds] = field(
        default_factory=dict, compare=False, repr=False
    )

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
        return replace(
            self,
            min_wait_s=self.min_wait_s * time_scale,
            _sharing=None,
            _ones=self._ones.scaled(time_scale),
        )

    @property
    def preemptive(self) -> bool:
        return self.preempt

    @property
    def queue_sort(self) -> QueueSort:
        return SLACK_ORDER

    @property
    def capabilities(self) -> Capabilities:
        can = AUTO_CAPABILITIES if self._sharing is None else AUTO_SHARING_CAPABILITIES
        if self.tune_cpu_mem:
            can = replace(can, tunes_cpu_mem=True)
        if self.elastic:
            # ONES's fitness counts the samples a converging elastic job has left
            ones = self._ones.capabilities
            can = replace(
                can,
                resizes=True,
                predicts_progress=True,
                progress_seed=ones.progress_seed,
                sizes_only_elastic=True,
            )
        if self.preempt:
            # the driver keeps the queue in A-SRPT's rank too (Snapshot.orders)
            return replace(can, extra_sorts=(self._asrpt.queue_sort,))
        return can

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self._decide_types_blind(snapshot)
        if self.type_aware and snapshot.cluster.mixed and decision.starts:
            decision = on_fastest_types(snapshot, decision, self._type_speeds(snapshot))
        if self.tune_cpu_mem and snapshot.node_cpus_used and (decision.starts or decision.resizes):
            tuned = with_cpu_mem(snapshot, decision)
            # the rule's own count of a node's CPUs can differ from the driver's (a
            # driver's view of allocations, shared GPUs): it never turns a decision the
            # driver accepts into one it refuses
            if not decision_problems(snapshot, tuned) or decision_problems(snapshot, decision):
                decision = tuned
        return decision

    def _type_speeds(self, snapshot: Snapshot) -> TypeSpeeds:
        key = (id(snapshot.cluster), id(snapshot.estimates))
        found = self._speeds.get(key)
        if found is None:
            self._speeds.clear()  # one cluster and model at a time
            found = self._speeds[key] = TypeSpeeds(snapshot.cluster, snapshot.estimates)
        return found

    def _decide_types_blind(self, snapshot: Snapshot) -> Decision:
        if not self.elastic or not (
            any(sized_by_search(j) for j in snapshot.running)
            or any(sized_by_search(j) for j in snapshot.pending)
        ):
            return self._rigid_decide(snapshot)
        # elastic jobs are the search's to start: rules 1-4 see them only running
        rigid = replace(
            snapshot,
            pending=tuple(j for j in snapshot.pending if not sized_by_search(j)),
            orders={
                k: tuple(j for j in v if not sized_by_search(j))
                for k, v in snapshot.orders.items()
            },
            index=None,
            _by_id={},
        )
        return self._with_elastic(snapshot, self._rigid_decide(rigid))

    def _with_elastic(self, snapshot: Snapshot, decision: Decision) -> Decision:
        """``decision`` with ONES's search run over the elastic jobs on the GPUs it
        leaves (rule 5): their resizes and starts, the search's preemptions of elastic
        jobs, and the reasons of those it leaves waiting."""
        started = {s.job_id for s in decision.starts}
        preempted = {p.job_id for p in decision.preemptions}
        rigid_waits = any(
            not sized_by_search(j) for j in snapshot.pending if j.job_id not in started
        )
        ones = self._ones
        running: list[JobView] = []
        for job in snapshot.running:
            if job.job_id in preempted or not sized_by_search(job):
                continue
            if rigid_waits:
                asked = ones.asked_gpus(job)
                frozen = snapshot.now - job.started_at < ones.settling_s(job)
                if frozen or job.gpus <= asked:
                    # it stays as it is: resizing it under load only adds restarts
                    continue
                job = _capped(job, asked)
            running.append(job)
        pending = [
            _capped(j, ones.asked_gpus(j)) if rigid_waits else j
            for j in snapshot.pending
            if j.job_id not in started and sized_by_search(j)
        ]
        if not running and not pending:
            return decision
        base = _without(snapshot, preempted) if preempted else snapshot
        searched = {j.job_id for j in running}
        taken = {gpu for j in base.running if j.job_id not in searched for gpu in j.gpu_ids}
        for start in decision.starts:
            taken.update(start.gpu_ids)
        # an elastic job on a GPU another job shares stays as it is
        running = [j for j in running if taken.isdisjoint(j.gpu_ids)]
        view, local_to_global = _elastic_view(base, tuple(running), tuple(pending), taken)
        sized = _on_global_gpus(ones.decide(view), local_to_global)
        placed = {s.job_id for s in sized.starts}
        reasons = {k: v for k, v in decision.reasons.items() if k not in placed}
        for job_id, why in sized.reasons.items():
            if job_id not in placed:
                reasons.setdefault(job_id, why)
        wakes = [w for w in (decision.wake_at, sized.wake_at) if w is not None]
        return replace(
            decision,
            starts=decision.starts + sized.starts,
            preemptions=decision.preemptions + sized.preemptions,
            resizes=decision.resizes + sized.resizes,
            reasons=reasons,
            wake_at=min(wakes) if wakes else None,
        )

    def _rigid_decide(self, snapshot: Snapshot) -> Decision:
        """Rules 1-4 over every job, elastic ones at the size they asked for."""
        snapshot = self._starving_first(snapshot)
        decision = None
        if self.preempt and snapshot.pending and snapshot.running:
            decision = self._preempting(snapshot)
        if decision is None:
            decision = self._genie.decide(snapshot)
        if self._sharing is None or not snapshot.running or decision.preemptions:
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

    def _preempting(self, snapshot: Snapshot) -> Decision | None:
        """A-SRPT's preemptions where GENIE, deciding without the victims, gives their
        GPUs to other jobs: the victims so taken and GENIE's starts; None where A-SRPT
        preempts nobody or GENIE would give no victim's GPUs away."""
        ranked = self._asrpt.queue_sort
        asrpt_view = replace(
            snapshot, pending=tuple(queue_in(snapshot, ranked)), queue_order=ranked.name
        )
        victims = {
            p.job_id for p in self._asrpt.decide(asrpt_view).preemptions
            if not (self.elastic and sized_by_search(snapshot.job(p.job_id)))
        }
        if not victims:
            return None
        decision = self._genie.decide(_without(snapshot, victims))
        held = {j.job_id: set(j.gpu_ids) for j in snapshot.running if j.job_id in victims}
        # a victim does not start again in the same decision (it waits its turn), and is
        # preempted only where another start takes its GPUs; a start on a spared victim's
        # GPUs is dropped, which may spare another victim: until nothing changes
        starts = [s for s in decision.starts if s.job_id not in victims]
        while True:
            taken = {
                v for v, its in held.items() if any(its.intersection(s.gpu_ids) for s in starts)
            }
            spared = set().union(*(its for v, its in held.items() if v not in taken))
            kept = [s for s in starts if not spared.intersection(s.gpu_ids)]
            if len(kept) == len(starts):
                break
            starts = kept
        if not taken:
            return None
        return Decision(
            starts=tuple(starts),
            preemptions=tuple(
                Preempt(v, "a queued job has less virtual work left (A-SRPT's rank)")
                for v in sorted(taken)
            ),
            reasons={k: v for k, v in decision.reasons.items() if k not in victims},
            default_reason=decision.default_reason,
            wake_at=decision.wake_at,
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
        rest = [j for j in queue_in(snapshot, SLACK_ORDER) if j.job_id not in first]
        return replace(snapshot, pending=(*starving, *rest), queue_order=SLACK_ORDER.name)


def _capped(job: JobView, most: int) -> JobView:
    """``job`` with its elastic bounds letting it run on at most ``most`` GPUs."""
    bounds = job.elastic or Elastic()
    most = max(bounds.min_gpus, most)
    if bounds.max_gpus is not None and bounds.max_gpus <= most:
        return job
    return replace(job, elastic=replace(bounds, max_gpus=most))


def _elastic_view(
    snapshot: Snapshot,
    running: tuple[JobView, ...],
    pending: tuple[JobView, ...],
    taken: set[int],
) -> tuple[Snapshot, tuple[int, ...]]:
    """What ONES's search sees: only the elastic jobs, on a cluster of the GPUs not
    ``taken`` (other jobs', and this decision's starts), each node keeping only those;
    and the global index of each of its GPUs. The search treats every GPU of its
    cluster as its own, so the others are left out rather than marked busy."""
    cluster = snapshot.cluster
    local_to_global = tuple(g for g in range(cluster.total_gpus) if g not in taken)
    global_to_local = {g: i for i, g in enumerate(local_to_global)}
    kept = [0] * len(cluster.nodes)
    for g in local_to_global:
        kept[cluster.gpu_node[g]] += 1
    sub = Cluster(tuple(replace(n, gpus=k) for n, k in zip(cluster.nodes, kept, strict=True)))
    moved = tuple(
        replace(j, gpu_ids=tuple(global_to_local[g] for g in j.gpu_ids)) for j in running
    )
    view = Snapshot.of_jobs(
        snapshot.now,
        sub,
        pending,
        moved,
        snapshot.estimates,
        max_jobs_per_gpu=snapshot.max_jobs_per_gpu,
        queue_order=snapshot.queue_order,
        prioritized=False,
    )
    return view, local_to_global


def _on_global_gpus(decision: Decision, local_to_global: tuple[int, ...]) -> Decision:
    """``decision``, taken on the search's cluster, on the whole cluster's GPUs."""

    def moved(gpu_ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(local_to_global[g] for g in gpu_ids)

    return replace(
        decision,
        starts=tuple(replace(s, gpu_ids=moved(s.gpu_ids)) for s in decision.starts),
        resizes=tuple(replace(r, gpu_ids=moved(r.gpu_ids)) for r in decision.resizes),
    )


def _requeued(job: JobView, now: float) -> JobView:
    """A running job's view once it is preempted now: queued, with what it has left."""
    return replace(
        job, state=JobState.QUEUED, gpu_ids=(), accum_steps=1, progress_rate=0.0,
        started_at=0.0, cpus=None, mem_gb=None, epoch_s=None, queued_since=now,
        est_remaining_s=job.remaining_s(now), as_of=now,
        attained_gpu_s=job.attained_gpu_s + max(0.0, now - job.as_of) * job.gpus,
        preemptions=job.preemptions + 1,
    )


def _without(snapshot: Snapshot, victims: set[str]) -> Snapshot:
    """The snapshot once ``victims`` are preempted: queued again in GENIE's order, their
    GPUs free (a GPU they shared keeps its other job and that job's memory)."""
    now = snapshot.now
    key = SLACK_ORDER.key
    load, used = list(snapshot.gpu_load), list(snapshot.gpu_mem_used)
    node_free, gpu_node = list(snapshot.node_free), snapshot.cluster.gpu_node
    running: list[JobView] = []
    back: list[JobView] = []
    for job in snapshot.running:
        if job.job_id not in victims:
            running.append(job)
            continue
        back.append(_requeued(job, now))
        mem = snapshot.estimates.gpu_memory_mb(
            job.model, job.batch_size / (job.gpus * max(1, job.accum_steps))
        )
        for gpu in job.gpu_ids:
            load[gpu] -= 1
            used[gpu] = max(0.0, used[gpu] - mem) if load[gpu] else 0.0
            if not load[gpu]:
                node_free[gpu_node[gpu]] += 1
    back.sort(key=key)
    return replace(
        snapshot,
        pending=tuple(heapq.merge(queue_in(snapshot, SLACK_ORDER), back, key=key)),
        running=tuple(running),
        gpu_load=tuple(load),
        gpu_mem_used=tuple(used),
        node_free=tuple(node_free),
        queue_order=SLACK_ORDER.name,
        orders={},
        index=None,
        _by_id={},
    )


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
