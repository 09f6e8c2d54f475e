"""Synergy-TUNE: CPU and memory per job by sensitivity, over FIFO, SRTF or LAS order.

Each job has a best-case demand vector (CPU cores and host memory per GPU at which its
throughput peaks, from ``PerformanceModel.cpu_mem_demand``). Jobs are taken in the base
order, with backfilling, and each gets (DESIGN.md section 5, Synergy):

1. its best-case vector (times its GPUs, capped to the node) on a node where it fits;
2. else, if some dimension is above the fair share (the GPU-proportional share), every
   dimension at most fair, on a node where that fits;
3. else a node by GPUs alone (g > 1: the first node with g free GPUs; g = 1: the node
   with the fewest free GPUs), and victims there, sorted by nodes spanned, then CPU per
   GPU, then memory per GPU (most first), added until their above-fair excess covers the
   shortfall; the victims drop to the fair share;
4. the fair vector on that node, once.

Nobody is ever given less than ``min(best case, fair)`` in a dimension, so no job's
throughput falls below what the fair share gives it. Jobs on more GPUs than a node has
(or that only fit spread over nodes) get the fair share. GPUs are never preempted: a
running job keeps its GPUs, and only its CPU/memory may change (``Reallocate``), either
down to fair as a victim or back up to its best case when the node has room again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar, NamedTuple

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision, Reallocate, Start
from gpusched.libs.core.perf import demand_on_node
from gpusched.libs.core.placement import FreeCapacity, ShapeCache
from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot
from gpusched.services.scheduler.policies.base import (
    Capabilities,
    QueueSort,
    SkippedReasons,
    ordered_pending,
)
from gpusched.services.scheduler.policies.preemptive import SRTF_ORDER
from gpusched.services.scheduler.policies.simple import FIFO_ORDER

#: allocations within this much of each other are the same (float sums over nodes)
EPS = 1e-9


def las_key(job: JobView) -> tuple[float, int, float, str]:
    """Least attained service first; among equals the most GPUs first (Synergy's LAS
    re-sorts by GPU demand, largest first)."""
    return (job.attained_gpu_s, -job.gpus, job.submit_time, job.job_id)


LAS_ORDER = QueueSort("attained-service", las_key)


@dataclass(frozen=True)
class Vector:
    """CPU cores and host memory (GB) for a whole job."""

    cpus: float
    mem_gb: float

    def fits(self, cpus: float, mem_gb: float) -> bool:
        return self.cpus <= cpus + EPS and self.mem_gb <= mem_gb + EPS

    def at_most(self, other: Vector) -> Vector:
        return Vector(min(self.cpus, other.cpus), min(self.mem_gb, other.mem_gb))

    def scaled(self, factor: float) -> Vector:
        return Vector(self.cpus * factor, self.mem_gb * factor)


def fair_share(node: Node, gpus: int) -> Vector:
    """The GPU-proportional share of a node for ``gpus`` of its GPUs."""
    return Vector(node.cpus * gpus / node.gpus, node.host_mem_gb * gpus / node.gpus)


def best_case(snapshot: Snapshot, job: JobView, node: Node) -> Vector:
    """The job's best-case vector on ``node``: the 1-GPU vector times its GPUs, capped to
    the node (``demand_on_node``); the fair share for a job on more GPUs than the node
    has."""
    fair = fair_share(node, 1)
    demand = demand_on_node(
        snapshot.estimates.cpu_mem_demand(job.model),
        job.gpus,
        node.cpus,
        node.gpus,
        fair.cpus,
        fair.mem_gb,
    )
    return Vector(
        min(demand.cpus_per_gpu * job.gpus, node.cpus),
        min(demand.mem_gb_per_gpu * job.gpus, node.host_mem_gb),
    )


class _VectorCache:
    """What TUNE derives from a cluster and performance model alone, kept across
    decisions: best-case vectors per (model, GPUs, node), fair shares per GPU layout,
    floors per (model, layout), and each running job's record while its view stays the
    same object (a driver keeps a running job's view until something about it changes)."""

    def __init__(self) -> None:
        self._basis = ModelBasis()
        self._best: dict[tuple[str, int, str], Vector] = {}
        self._fair: dict[tuple[tuple[int, int], ...], Vector] = {}
        self._floors: dict[tuple[str, tuple[tuple[int, int], ...]], Vector] = {}
        self.running: dict[str, _Running] = {}
        #: every node's CPUs and memory, before any job's allocation is taken off
        self.capacity: tuple[list[float], list[float]] = ([], [])
        #: all nodes alike (GPUs, CPUs, memory): a job's best case is the same on each
        self.one_shape = False
        #: the running tuple last read, with its records and what they left free per
        #: node: a driver that hands the same tuple again changed no running job
        self.last_running: tuple[JobView, ...] | None = None
        self.last_read: tuple[list[_Running], tuple[float, ...], tuple[float, ...]] | None = None

    def sync(self, snapshot: Snapshot) -> None:
        if self._basis.moved(snapshot):
            self._best.clear()
            self._fair.clear()
            self._floors.clear()
            self.running.clear()
            self.last_running = self.last_read = None
            nodes = snapshot.cluster.nodes
            self.capacity = ([float(n.cpus) for n in nodes], [float(n.host_mem_gb) for n in nodes])
            self.one_shape = len({(n.gpus, n.cpus, n.host_mem_gb) for n in nodes}) == 1

    def best_case(self, snapshot: Snapshot, job: JobView, node: Node) -> Vector:
        key = (job.model, job.gpus, node.name)
        vector = self._best.get(key)
        if vector is None:
            vector = self._best[key] = best_case(snapshot, job, node)
        return vector

    def fair_and_floor(
        self,
        cluster: Cluster,
        nodes: dict[int, int],
        job: JobView,
        floor_of: Callable[[Vector], Vector],
    ) -> tuple[Vector, Vector]:
        """The fair share over a running job's GPU layout and its floor (``floor_of``
        the fair share), both the same for every job of its model on that layout."""
        layout = tuple(sorted(nodes.items()))
        fair = self._fair.get(layout)
        if fair is None:
            fair = self._fair[layout] = _fair_over(cluster, nodes)
        key = (job.model, layout)
        floor = self._floors.get(key)
        if floor is None:
            floor = self._floors[key] = floor_of(fair)
        return fair, floor

    def forget_finished(self, running: Sequence[JobView]) -> None:
        """Drop the records of jobs no longer running, once they outnumber the rest."""
        if len(self.running) > 2 * len(running) + 64:
            kept = {job.job_id for job in running}
            self.running = {k: v for k, v in self.running.items() if k in kept}


class _Raise(NamedTuple):
    """Raising a single-node job to its best case ``want`` on ``node`` takes ``cpus``
    more CPUs and ``mem_gb`` more GB there (``want - alloc``)."""

    node: int
    want: Vector
    cpus: float
    mem_gb: float


@dataclass(frozen=True, slots=True)
class _Running:
    """A running job as its view shows it, with what TUNE works out from that alone."""

    job: JobView
    nodes: dict[int, int]  # node index -> GPUs there
    alloc: Vector
    floor: Vector
    fair: Vector
    #: (node, CPUs, GB) the job holds on each of its nodes
    charges: tuple[tuple[int, float, float], ...]
    #: a single-node job not at its best case there: what raising it takes; else None
    raise_to: _Raise | None


@dataclass
class _Held:
    """A job's allocation as this decision changes it."""

    job: JobView
    nodes: dict[int, int]  # node index -> GPUs there
    alloc: Vector
    #: min(best case, fair) per dimension: never go below it
    floor: Vector
    #: the fair share over its GPUs
    fair: Vector
    started: bool  # started by this decision (else running before it)
    #: dropped to fair by this decision: it stays there until the next one
    dropped: bool = False

    def share(self, node: int) -> float:
        return self.nodes[node] / self.job.gpus

    def excess_on(self, node: int) -> Vector:
        """What dropping to ``floor`` would give back on ``node``."""
        part = self.share(node)
        return Vector(
            max(0.0, self.alloc.cpus - self.floor.cpus) * part,
            max(0.0, self.alloc.mem_gb - self.floor.mem_gb) * part,
        )


class _Cluster(FreeCapacity):
    """Idle GPUs, free CPUs and free memory per node, as the decision changes them, and
    the jobs it has looked at closely (``held``: started, victims and their rivals,
    raised). The jobs on a node are listed only for the nodes asked about."""

    def __init__(
        self,
        snapshot: Snapshot,
        records: list[_Running],
        cpus: list[float],
        mem: list[float],
    ) -> None:
        super().__init__(snapshot, cpus, mem)
        self.cluster = snapshot.cluster
        self.records = records
        self.held: dict[str, _Held] = {}
        #: allocation before this decision of every running job in ``held``
        self.before: dict[str, Vector] = {}
        self._on_node: dict[int, list[_Running | _Held]] | None = None

    # ------------------------------------------------------------------ CPU, memory

    def set_alloc(self, held: _Held, alloc: Vector) -> None:
        job_gpus = held.job.gpus
        self.charge(held.nodes, job_gpus, held.alloc.cpus, held.alloc.mem_gb, -1.0)
        held.alloc = alloc
        self.charge(held.nodes, job_gpus, alloc.cpus, alloc.mem_gb)

    def held_of(self, rec: _Running) -> _Held:
        """The running job's allocation as this decision changes it."""
        job_id = rec.job.job_id
        h = self.held.get(job_id)
        if h is None:
            h = self.held[job_id] = _Held(rec.job, rec.nodes, rec.alloc, rec.floor, rec.fair, False)
            self.before[job_id] = rec.alloc
        return h

    def jobs_on(self, node: int) -> list[_Held]:
        """Every job holding GPUs of ``node``, running or started by this decision."""
        if self._on_node is None:
            on: dict[int, list[_Running | _Held]] = {}
            for rec in self.records:
                for n in rec.nodes:
                    on.setdefault(n, []).append(rec)
            for h in self.held.values():
                if h.started:
                    for n in h.nodes:
                        on.setdefault(n, []).append(h)
            self._on_node = on
        return [x if isinstance(x, _Held) else self.held_of(x) for x in self._on_node.get(node, ())]

    # ------------------------------------------------------------------ GPUs

    def gpu_preference(self, gpus: int) -> Iterator[int]:
        """Nodes with ``gpus`` idle GPUs in Synergy's order: one GPU goes to the node with
        the fewest idle GPUs, more to the first node (lowest index) that has them."""
        return self.nodes_holding(gpus, best_fit=gpus == 1)

    def start(self, job: JobView, nodes: dict[int, int], alloc: Vector, floor: Vector) -> None:
        """Book ``job`` on idle GPUs of ``nodes`` with ``alloc`` and record it in ``held``."""
        fair = _fair_over(self.cluster, nodes)
        gpu_ids = self.take_on(nodes)
        h = self.held[job.job_id] = _Held(
            replace(job, gpu_ids=gpu_ids), nodes, Vector(0.0, 0.0), floor, fair, True
        )
        self.set_alloc(h, alloc)
        if self._on_node is not None:
            for n in nodes:
                self._on_node.setdefault(n, []).append(h)


def _fair_over(cluster: Cluster, nodes: dict[int, int]) -> Vector:
    cpus = sum(fair_share(cluster.nodes[n], k).cpus for n, k in nodes.items())
    mem = sum(fair_share(cluster.nodes[n], k).mem_gb for n, k in nodes.items())
    return Vector(cpus, mem)


def _current(job: JobView, fair: Vector) -> Vector:
    """A running job's allocation; none recorded means the GPU-proportional share."""
    return Vector(
        fair.cpus if job.cpus is None else job.cpus,
        fair.mem_gb if job.mem_gb is None else job.mem_gb,
    )


def _victim_key(h: _Held) -> tuple[int, float, float, str]:
    # most nodes spanned, then most CPU per GPU, then most memory per GPU, then the id
    g = h.job.gpus
    return (-len(h.nodes), -h.alloc.cpus / g, -h.alloc.mem_gb / g, h.job.job_id)


@dataclass(frozen=True)
class SynergyTune:
    """Synergy-TUNE: CPU and memory by sensitivity, never below anyone's fair share."""

    order: QueueSort = FIFO_ORDER
    name: str = "synergy-fifo"
    preemptive: bool = False
    capabilities: ClassVar[Capabilities] = Capabilities(tunes_cpu_mem=True)
    #: raise running jobs back to their best case when their node has room again
    retune_running: bool = True
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _vectors: _VectorCache = field(default_factory=_VectorCache, compare=False, repr=False)

    @property
    def queue_sort(self) -> QueueSort | None:
        return self.order

    def decide(self, snapshot: Snapshot) -> Decision:
        state = self._read_running(snapshot)
        reasons: dict[str, str] = {}
        #: jobs wider than the idle GPUs, now or later in this decision: why they wait
        #: is written only when asked for (a long queue is mostly these)
        skipped: dict[str, tuple[JobView, int, int]] = {}
        started: list[str] = []
        for job in ordered_pending(snapshot, self.order):
            idle = state.total
            if not idle:
                break
            if job.gpus > idle:
                skipped[job.job_id] = (job, idle, 0)
                continue
            bad = self._shapes.unschedulable(job, snapshot)
            if bad:
                reasons[job.job_id] = bad
            else:
                placed = self._place(snapshot, state, job)
                if placed is None:
                    started.append(job.job_id)
                else:
                    reasons[job.job_id] = placed
        if self.retune_running:
            self._retune(state)
        explained: Mapping[str, str] = reasons
        if skipped:
            explained = SkippedReasons(reasons, skipped, self._shapes, snapshot, _skipped_text)
        return self._decision(snapshot, state, started, explained)

    def _read_running(self, snapshot: Snapshot) -> _Cluster:
        """The running jobs' records (kept from the last decision where the view is the
        same) and what their allocations leave free on every node."""
        cluster = snapshot.cluster
        vectors = self._vectors
        vectors.sync(snapshot)
        if snapshot.running is vectors.last_running and vectors.last_read is not None:
            kept, free_cpus, free_mem = vectors.last_read
            return _Cluster(snapshot, kept, list(free_cpus), list(free_mem))
        known = vectors.running
        cpus, mem = (list(c) for c in vectors.capacity)
        records: list[_Running] = []
        for job in snapshot.running:
            rec = known.get(job.job_id)
            if rec is None or rec.job is not job:
                rec = known[job.job_id] = self._record(snapshot, cluster, job)
            for node, c, m in rec.charges:
                cpus[node] -= c
                mem[node] -= m
            records.append(rec)
        vectors.forget_finished(snapshot.running)
        vectors.last_running = snapshot.running
        vectors.last_read = (records, tuple(cpus), tuple(mem))
        return _Cluster(snapshot, records, cpus, mem)

    def _record(self, snapshot: Snapshot, cluster: Cluster, job: JobView) -> _Running:
        node_of = cluster.gpu_node
        nodes: dict[int, int] = {}
        for gpu in job.gpu_ids:
            nodes[node_of[gpu]] = nodes.get(node_of[gpu], 0) + 1
        fair, floor = self._vectors.fair_and_floor(
            cluster, nodes, job, partial(self._floor, snapshot, job, nodes)
        )
        alloc = _current(job, fair)
        charges = tuple(
            (node, alloc.cpus * (k / job.gpus), alloc.mem_gb * (k / job.gpus))
            for node, k in nodes.items()
        )
        raise_to = None
        if len(nodes) == 1:
            node = next(iter(nodes))
            want = self._vectors.best_case(snapshot, job, cluster.nodes[node])
            if want != alloc:
                raise_to = _Raise(node, want, want.cpus - alloc.cpus, want.mem_gb - alloc.mem_gb)
        return _Running(job, nodes, alloc, floor, fair, charges, raise_to)

    # ------------------------------------------------------------------ one job

    def _floor(
        self, snapshot: Snapshot, job: JobView, nodes: dict[int, int], fair: Vector
    ) -> Vector:
        if len(nodes) != 1:
            return fair
        node = snapshot.cluster.nodes[next(iter(nodes))]
        return self._vectors.best_case(snapshot, job, node).at_most(fair)

    def _place(self, snapshot: Snapshot, state: _Cluster, job: JobView) -> str | None:
        """Start ``job`` (recorded in ``state.held``) or say why it waits; the caller has
        made sure enough GPUs are idle."""
        cluster = snapshot.cluster
        first = next(state.gpu_preference(job.gpus), None)
        if first is None:
            spread = state.spread(job.gpus)
            if spread is None:  # idle GPUs enough, but not of one GPU type
                return f"needs {job.gpus} idle GPUs of one type; {state.total} idle of several"
            return self._place_fair(snapshot, state, job, spread)
        # (1) the best-case vector, (2) at most fair in every dimension; on a cluster of
        # one node shape every node asks for the same, worked out once
        same = self._vectors.one_shape
        cpus, mem = state.cpus, state.mem
        for step in (0, 1):
            shared: Vector | None = None
            for node in state.gpu_preference(job.gpus):
                n = cluster.nodes[node]
                want = shared if shared is not None else self._want(snapshot, job, n, step)
                if want is None:  # nothing above fair: step 2 does not apply
                    if same:
                        break
                    continue
                if same:
                    shared = want
                if want.cpus <= cpus[node] + EPS and want.mem_gb <= mem[node] + EPS:
                    state.start(
                        job,
                        {node: job.gpus},
                        want,
                        self._floor(snapshot, job, {node: job.gpus}, fair_share(n, job.gpus)),
                    )
                    return None
        # (3) victims on the node the GPUs choose, (4) retry once at fair
        return self._place_fair(snapshot, state, job, {first: job.gpus})

    def _want(self, snapshot: Snapshot, job: JobView, node: Node, step: int) -> Vector | None:
        """What step (1) or (2) asks of ``node`` for ``job``; None where step (2) does not
        apply (nothing of the best case is above fair)."""
        want = self._vectors.best_case(snapshot, job, node)
        if step == 0:
            return want
        fair = fair_share(node, job.gpus)
        return None if want.fits(fair.cpus, fair.mem_gb) else want.at_most(fair)

    def _place_fair(
        self, snapshot: Snapshot, state: _Cluster, job: JobView, nodes: dict[int, int]
    ) -> str | None:
        cluster = snapshot.cluster
        fair = _fair_over(cluster, nodes)
        want = self._floor(snapshot, job, nodes, fair)
        drops: list[_Held] = []
        for node, count in nodes.items():
            need = want.scaled(count / job.gpus)
            short = Vector(need.cpus - state.cpus[node], need.mem_gb - state.mem[node])
            if short.cpus <= EPS and short.mem_gb <= EPS:
                continue
            victims = sorted((h for h in state.jobs_on(node) if h not in drops), key=_victim_key)
            got = Vector(0.0, 0.0)
            for victim in victims:
                if got.cpus >= short.cpus - EPS and got.mem_gb >= short.mem_gb - EPS:
                    break
                excess = victim.excess_on(node)
                if excess.cpus <= EPS and excess.mem_gb <= EPS:
                    continue
                drops.append(victim)
                got = Vector(got.cpus + excess.cpus, got.mem_gb + excess.mem_gb)
            if got.cpus < short.cpus - EPS or got.mem_gb < short.mem_gb - EPS:
                return (
                    f"needs {need.cpus:g} CPUs and {need.mem_gb:g} GB on "
                    f"{cluster.nodes[node].name}; {max(0.0, state.cpus[node]):g} CPUs and "
                    f"{max(0.0, state.mem[node]):g} GB free, {got.cpus:g} CPUs and "
                    f"{got.mem_gb:g} GB more above others' fair share"
                )
        for victim in drops:
            state.set_alloc(victim, victim.alloc.at_most(victim.floor))
            victim.dropped = True
        state.start(job, nodes, want, want)
        return None

    # --------------------------------------------------------------- re-tuning

    def _retune(self, state: _Cluster) -> None:
        """Give running single-node jobs their best case back where their node has room,
        in the base order. Nodes are independent, so each is settled on its own, and a
        node where none of them fits now is passed over unsorted (room only shrinks)."""
        on_node: dict[int, list[tuple[_Running, _Raise]]] = {}
        for rec in state.records:
            up = rec.raise_to
            if up is not None:
                held = state.held.get(rec.job.job_id)
                if held is None or not held.dropped:
                    on_node.setdefault(up.node, []).append((rec, up))
        cpus, mem = state.cpus, state.mem
        for node, raises in on_node.items():
            if not any(
                up.cpus <= cpus[node] + EPS and up.mem_gb <= mem[node] + EPS for _, up in raises
            ):
                continue
            raises.sort(key=lambda pair: self.order.key(pair[0].job))
            for rec, up in raises:
                if up.cpus <= cpus[node] + EPS and up.mem_gb <= mem[node] + EPS:
                    state.set_alloc(state.held_of(rec), up.want)

    # ---------------------------------------------------------------- decision

    def _decision(
        self,
        snapshot: Snapshot,
        state: _Cluster,
        started: Sequence[str],
        reasons: Mapping[str, str],
    ) -> Decision:
        held = state.held
        starts = tuple(
            Start(
                h.job.job_id,
                h.job.gpu_ids,
                self._shapes.exclusive_accum(h.job, snapshot),
                cpus=h.alloc.cpus,
                mem_gb=h.alloc.mem_gb,
            )
            for h in (held[job_id] for job_id in started)
        )
        # shrinking first, so that a driver applying them in order never overcommits a
        # node on the way (a raise may use what a drop frees)
        before = state.before
        changed = sorted(
            (job_id for job_id, old in before.items() if _differs(held[job_id].alloc, old)),
            key=lambda job_id: (not _shrinks(held[job_id].alloc, before[job_id]), job_id),
        )
        reallocations = tuple(
            Reallocate(
                job_id,
                held[job_id].alloc.cpus,
                held[job_id].alloc.mem_gb,
                reason=_realloc_reason(held[job_id], before[job_id]),
            )
            for job_id in changed
        )
        default = f"all {snapshot.cluster.total_gpus} GPUs are busy; waiting for a job to finish"
        return Decision(
            starts=starts,
            reallocations=reallocations,
            reasons=reasons,
            default_reason=default,
        )


def _differs(a: Vector, b: Vector) -> bool:
    return abs(a.cpus - b.cpus) > EPS or abs(a.mem_gb - b.mem_gb) > EPS


def _shrinks(new: Vector, old: Vector) -> bool:
    return new.cpus <= old.cpus + EPS and new.mem_gb <= old.mem_gb + EPS


def _realloc_reason(h: _Held, old: Vector) -> str:
    verb = "down to its fair share" if _shrinks(h.alloc, old) else "up to its best case"
    return (
        f"{verb}: {h.alloc.cpus:g} CPUs, {h.alloc.mem_gb:g} GB "
        f"(was {old.cpus:g} CPUs, {old.mem_gb:g} GB)"
    )


def synergy(order: QueueSort, name: str) -> Callable[[], SynergyTune]:
    return lambda: SynergyTune(order=order, name=name)


SYNERGY_POLICIES: dict[str, Callable[[], SynergyTune]] = {
    "synergy-fifo": synergy(FIFO_ORDER, "synergy-fifo"),
    "synergy-srtf": synergy(SRTF_ORDER, "synergy-srtf"),
    "synergy-las": synergy(LAS_ORDER, "synergy-las"),
}

__all__ = [
    "LAS_ORDER",
    "SYNERGY_POLICIES",
    "SynergyTune",
    "Vector",
    "best_case",
    "fair_share",
    "las_key",
]


def _skipped_text(job: JobView, idle: int, _block: int) -> str:
    return f"needs {job.gpus} GPU{'s' if job.gpus > 1 else ''}; {idle} idle"
