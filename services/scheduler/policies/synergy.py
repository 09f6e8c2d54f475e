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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from libs.core.cluster import Cluster, Node
from libs.core.decision import Decision, Reallocate, Start
from libs.core.perf import demand_on_node
from libs.core.snapshot import JobView, Snapshot
from services.scheduler.policies.base import ModelBasis, QueueSort, ShapeCache, ordered_pending
from services.scheduler.policies.preemptive import SRTF_ORDER
from services.scheduler.policies.simple import FIFO_ORDER

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
    """Best-case vectors per (model, GPUs, node) and fair shares per GPU layout, for one
    cluster and performance model: a decision asks for them for every running job."""

    def __init__(self) -> None:
        self._basis = ModelBasis()
        self._best: dict[tuple[str, int, str], Vector] = {}
        self._fair: dict[tuple[tuple[int, int], ...], Vector] = {}
        self._floors: dict[tuple[str, tuple[tuple[int, int], ...]], Vector] = {}

    def sync(self, snapshot: Snapshot) -> None:
        if self._basis.moved(snapshot):
            self._best.clear()
            self._fair.clear()
            self._floors.clear()

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


class _Cluster:
    """Idle GPUs, free CPUs and free memory per node, as the decision changes them."""

    def __init__(self, snapshot: Snapshot, held: dict[str, _Held]) -> None:
        cluster = snapshot.cluster
        self.cluster = cluster
        self.idle: list[list[int]] = [[] for _ in cluster.nodes]
        for gpu, load in enumerate(snapshot.gpu_load):
            if load == 0:
                self.idle[cluster.gpu_node[gpu]].append(gpu)
        self.cpus = [float(n.cpus) for n in cluster.nodes]
        self.mem = [float(n.host_mem_gb) for n in cluster.nodes]
        for h in held.values():
            self.charge(h, h.alloc)

    def charge(self, held: _Held, alloc: Vector, sign: float = 1.0) -> None:
        for node in held.nodes:
            part = held.share(node)
            self.cpus[node] -= sign * alloc.cpus * part
            self.mem[node] -= sign * alloc.mem_gb * part

    def set_alloc(self, held: _Held, alloc: Vector) -> None:
        self.charge(held, held.alloc, -1.0)
        held.alloc = alloc
        self.charge(held, alloc)

    def free_gpus(self, node: int) -> int:
        return len(self.idle[node])

    def gpu_preference(self, gpus: int) -> list[int]:
        """Nodes with ``gpus`` idle GPUs in Synergy's order: one GPU goes to the node with
        the fewest idle GPUs, more to the first node (lowest index) that has them."""
        nodes = [n for n in range(len(self.idle)) if self.free_gpus(n) >= gpus]
        if gpus == 1:
            nodes.sort(key=lambda n: (self.free_gpus(n), n))
        return nodes

    def spread(self, gpus: int) -> dict[int, int] | None:
        """The fewest nodes holding ``gpus`` idle GPUs (most idle first, lowest index)."""
        order = sorted(range(len(self.idle)), key=lambda n: (-self.free_gpus(n), n))
        chosen: dict[int, int] = {}
        need = gpus
        for node in order:
            if need == 0 or self.free_gpus(node) == 0:
                break
            take = min(need, self.free_gpus(node))
            chosen[node] = take
            need -= take
        return None if need else chosen

    def start(
        self,
        held: dict[str, _Held],
        job: JobView,
        nodes: dict[int, int],
        alloc: Vector,
        floor: Vector,
    ) -> None:
        """Book ``job`` on idle GPUs of ``nodes`` with ``alloc`` and record it in ``held``."""
        fair = _fair_over(self.cluster, nodes)
        gpu_ids = self.take(nodes)
        h = held[job.job_id] = _Held(
            replace(job, gpu_ids=gpu_ids), nodes, Vector(0.0, 0.0), floor, fair, True
        )
        self.set_alloc(h, alloc)

    def take(self, nodes: dict[int, int]) -> tuple[int, ...]:
        gpus: list[int] = []
        for node, count in sorted(nodes.items()):
            gpus.extend(self.idle[node][:count])
            del self.idle[node][:count]
        return tuple(sorted(gpus))


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
    #: raise running jobs back to their best case when their node has room again
    retune_running: bool = True
    _shapes: ShapeCache = field(default_factory=ShapeCache, compare=False, repr=False)
    _vectors: _VectorCache = field(default_factory=_VectorCache, compare=False, repr=False)

    @property
    def queue_sort(self) -> QueueSort | None:
        return self.order

    def decide(self, snapshot: Snapshot) -> Decision:
        cluster = snapshot.cluster
        node_of = cluster.gpu_node
        self._vectors.sync(snapshot)
        held: dict[str, _Held] = {}
        for job in snapshot.running:
            nodes: dict[int, int] = {}
            for gpu in job.gpu_ids:
                nodes[node_of[gpu]] = nodes.get(node_of[gpu], 0) + 1
            fair, floor = self._vectors.fair_and_floor(
                cluster, nodes, job, partial(self._floor, snapshot, job, nodes)
            )
            held[job.job_id] = _Held(job, nodes, _current(job, fair), floor, fair, False)
        state = _Cluster(snapshot, held)
        before = {job_id: h.alloc for job_id, h in held.items()}
        reasons: dict[str, str] = {}
        started: list[str] = []
        idle = sum(map(len, state.idle))
        # idle GPUs only go down within a decision: once no set of idle GPUs holds g,
        # none holds g or more for a later job either
        too_many = math.inf
        for job in ordered_pending(snapshot, self.order):
            if not idle:
                break
            bad = self._shapes.unschedulable(job, snapshot)
            if bad:
                reasons[job.job_id] = bad
                continue
            if job.gpus >= too_many:
                reasons[job.job_id] = _no_gpus(job.gpus, idle)
                continue
            placed = self._place(snapshot, state, held, job)
            if isinstance(placed, str):
                reasons[job.job_id] = placed
                if placed == _no_gpus(job.gpus, idle):
                    too_many = min(too_many, job.gpus)
            else:
                started.append(job.job_id)
                idle = sum(map(len, state.idle))
        if self.retune_running:
            self._retune(snapshot, state, held)
        return self._decision(snapshot, held, before, started, reasons)

    # ------------------------------------------------------------------ one job

    def _floor(
        self, snapshot: Snapshot, job: JobView, nodes: dict[int, int], fair: Vector
    ) -> Vector:
        if len(nodes) != 1:
            return fair
        node = snapshot.cluster.nodes[next(iter(nodes))]
        return self._vectors.best_case(snapshot, job, node).at_most(fair)

    def _place(
        self, snapshot: Snapshot, state: _Cluster, held: dict[str, _Held], job: JobView
    ) -> str | None:
        """Start ``job`` (recorded in ``held``) or say why it waits."""
        cluster = snapshot.cluster
        candidates = state.gpu_preference(job.gpus)
        if not candidates:
            spread = state.spread(job.gpus)
            if spread is None:
                return _no_gpus(job.gpus, sum(map(len, state.idle)))
            return self._place_fair(snapshot, state, held, job, spread)
        # (1) the best-case vector, (2) at most fair in every dimension
        for step in (0, 1):
            for node in candidates:
                n = cluster.nodes[node]
                want = self._vectors.best_case(snapshot, job, n)
                if step == 1:
                    fair = fair_share(n, job.gpus)
                    if want.fits(fair.cpus, fair.mem_gb):
                        continue  # nothing above fair: step 2 does not apply
                    want = want.at_most(fair)
                if want.fits(state.cpus[node], state.mem[node]):
                    state.start(
                        held,
                        job,
                        {node: job.gpus},
                        want,
                        self._floor(snapshot, job, {node: job.gpus}, fair_share(n, job.gpus)),
                    )
                    return None
        # (3) victims on the node the GPUs choose, (4) retry once at fair
        return self._place_fair(snapshot, state, held, job, {candidates[0]: job.gpus})

    def _place_fair(
        self,
        snapshot: Snapshot,
        state: _Cluster,
        held: dict[str, _Held],
        job: JobView,
        nodes: dict[int, int],
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
            victims = sorted(
                (h for h in held.values() if node in h.nodes and h not in drops), key=_victim_key
            )
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
        state.start(held, job, nodes, want, want)
        return None

    # --------------------------------------------------------------- re-tuning

    def _retune(self, snapshot: Snapshot, state: _Cluster, held: dict[str, _Held]) -> None:
        """Give running single-node jobs their best case back where their node has room,
        in the base order."""
        running = [h for h in held.values() if not (h.started or h.dropped) and len(h.nodes) == 1]
        running.sort(key=lambda h: self.order.key(h.job))
        for h in running:
            node = next(iter(h.nodes))
            want = self._vectors.best_case(snapshot, h.job, snapshot.cluster.nodes[node])
            if want == h.alloc:
                continue
            extra_cpus = want.cpus - h.alloc.cpus
            extra_mem = want.mem_gb - h.alloc.mem_gb
            if extra_cpus <= state.cpus[node] + EPS and extra_mem <= state.mem[node] + EPS:
                state.set_alloc(h, want)

    # ---------------------------------------------------------------- decision

    def _decision(
        self,
        snapshot: Snapshot,
        held: dict[str, _Held],
        before: dict[str, Vector],
        started: Sequence[str],
        reasons: dict[str, str],
    ) -> Decision:
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


def _no_gpus(gpus: int, idle: int) -> str:
    return f"needs {gpus} GPU{'s' if gpus > 1 else ''}; {idle} idle"
