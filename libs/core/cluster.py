"""Nodes and clusters: the hardware a scheduler places jobs on.

GPUs are addressed by a global integer index so that placements are plain tuples of
ints; a cluster maps each index back to its node.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate

from gpusched.libs.core.gpu_types import family, known_families, type_key

#: GPU memory of the SJF-BSBF testbed's GPUs, used when a cluster spec names none.
DEFAULT_GPU_MEM_MB = 49_140
DEFAULT_CPUS_PER_GPU = 4
DEFAULT_HOST_MEM_GB_PER_GPU = 62.5
DEFAULT_NET_GBPS = 100.0
#: Most GPUs in all, and on one node, that a ``NODESxGPUS`` spec may ask for. A
#: simulated decision copies a few numbers per GPU and walks a node's GPUs one by one,
#: so a replay slows with both: 300 jobs take about 5 s a policy on 125,000 x 8 and on
#: 1 x 16,384, and a node of 1,000,000 GPUs takes seconds per decision.
MAX_SPEC_GPUS = 1_000_000
MAX_SPEC_GPUS_PER_NODE = 16_384


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: int
    gpu_mem_mb: int = DEFAULT_GPU_MEM_MB
    cpus: int = DEFAULT_CPUS_PER_GPU * 8
    host_mem_gb: float = DEFAULT_HOST_MEM_GB_PER_GPU * 8
    net_gbps: float = DEFAULT_NET_GBPS
    gpu_model: str = "generic"

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"node {self.name}: gpus must be >= 0, got {self.gpus}")
        if self.gpu_mem_mb <= 0:
            raise ValueError(f"node {self.name}: gpu_mem_mb must be > 0, got {self.gpu_mem_mb}")

    @property
    def fair_cpus_per_gpu(self) -> float:
        """The GPU-proportional share of CPU cores one GPU of this node comes with."""
        return self.cpus / self.gpus if self.gpus else 0.0

    @property
    def fair_mem_gb_per_gpu(self) -> float:
        """The GPU-proportional share of host memory one GPU of this node comes with."""
        return self.host_mem_gb / self.gpus if self.gpus else 0.0


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    #: first global GPU index of each node
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a cluster needs at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        offsets, total = [], 0
        for node in self.nodes:
            offsets.append(total)
            total += node.gpus
        object.__setattr__(self, "offsets", tuple(offsets))

    @cached_property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @cached_property
    def gpu_node(self) -> tuple[int, ...]:
        """Node index of every global GPU index."""
        return tuple(i for i, node in enumerate(self.nodes) for _ in range(node.gpus))

    @cached_property
    def gpu_mem_mb(self) -> tuple[int, ...]:
        """Memory of every global GPU index."""
        return tuple(node.gpu_mem_mb for node in self.nodes for _ in range(node.gpus))

    @cached_property
    def max_gpu_mem_mb(self) -> int:
        return max(n.gpu_mem_mb for n in self.nodes)

    @cached_property
    def min_gpu_mem_mb(self) -> int:
        return min(n.gpu_mem_mb for n in self.nodes if n.gpus) if self.total_gpus else 0

    @cached_property
    def node_sizes(self) -> tuple[int, ...]:
        """GPUs of every node, by node index."""
        return tuple(n.gpus for n in self.nodes)

    @cached_property
    def max_gpus_per_node(self) -> int:
        return max(n.gpus for n in self.nodes)

    @cached_property
    def _largest_first_totals(self) -> tuple[int, ...]:
        """GPUs of the k largest nodes together, for k = 1, 2, ..."""
        return tuple(accumulate(sorted((n.gpus for n in self.nodes), reverse=True)))

    def fewest_nodes(self, gpus: int) -> int:
        """Nodes a job of ``gpus`` GPUs spans alone on this idle cluster: its most
        consolidated placement, one node if a node holds it, else the fewest nodes,
        largest first (where ``FreeGpus.take`` puts it); on a cluster of several GPU
        types, the fewest within one type (over all nodes where no type holds it).
        Raises ValueError when the cluster has fewer than ``gpus`` GPUs."""
        if not 1 <= gpus <= self.total_gpus:
            raise ValueError(f"{gpus} GPUs do not fit a cluster of {self.total_gpus}")
        if self.mixed:
            within = [
                bisect_left(totals, gpus) + 1
                for totals in self._largest_first_by_type
                if totals[-1] >= gpus
            ]
            if within:
                return min(within)
        return bisect_left(self._largest_first_totals, gpus) + 1

    # ---- GPU types ---------------------------------------------------------------------
    @cached_property
    def gpu_types(self) -> tuple[str, ...]:
        """The GPU types of the nodes (``gpu_types.type_key`` of each ``gpu_model``), in
        the order the nodes first name them (nodes without GPUs name none); the first is
        the cluster's reference type, the one a type-blind performance model's figures
        are taken to be of."""
        named = [n for n in self.nodes if n.gpus] or self.nodes
        return tuple(dict.fromkeys(type_key(n.gpu_model) for n in named))

    @cached_property
    def mixed(self) -> bool:
        """Whether the nodes have GPUs of more than one type: a job then runs on GPUs of
        one type only."""
        return len(self.gpu_types) > 1

    @cached_property
    def node_type(self) -> tuple[int, ...]:
        """Index in ``gpu_types`` of every node's GPU type, by node index (0 for a node
        without GPUs of a type no other node has)."""
        index = {t: i for i, t in enumerate(self.gpu_types)}
        return tuple(index.get(type_key(n.gpu_model), 0) for n in self.nodes)

    @cached_property
    def gpu_type(self) -> tuple[int, ...]:
        """Index in ``gpu_types`` of every global GPU's type."""
        node_type = self.node_type
        return tuple(node_type[node] for node in self.gpu_node)

    @cached_property
    def type_gpus(self) -> tuple[int, ...]:
        """GPUs of each type, by type index."""
        counts = [0] * len(self.gpu_types)
        for node, kind in zip(self.nodes, self.node_type, strict=True):
            counts[kind] += node.gpus
        return tuple(counts)

    def types_of(self, gpu_ids: Iterable[int]) -> set[int]:
        """The type indices of ``gpu_ids`` (indices outside the cluster left out)."""
        kinds, total = self.gpu_type, self.total_gpus
        return {kinds[g] for g in gpu_ids if 0 <= g < total}

    @cached_property
    def _largest_first_by_type(self) -> tuple[tuple[int, ...], ...]:
        sizes: list[list[int]] = [[] for _ in self.gpu_types]
        for node, kind in zip(self.nodes, self.node_type, strict=True):
            sizes[kind].append(node.gpus)
        return tuple(tuple(accumulate(sorted(s, reverse=True))) for s in sizes)

    def node_gpus(self, node_index: int) -> range:
        start = self.offsets[node_index]
        return range(start, start + self.nodes[node_index].gpus)

    def nodes_spanned(self, gpu_ids: tuple[int, ...]) -> int:
        gpu_node = self.gpu_node
        return len({gpu_node[g] for g in gpu_ids})

    def gpus_by_node(self, gpu_ids: tuple[int, ...]) -> dict[int, int]:
        """How many of ``gpu_ids`` each node holds, by node index, in first-seen order."""
        gpu_node = self.gpu_node
        counts: dict[int, int] = {}
        for gpu in gpu_ids:
            node = gpu_node[gpu]
            counts[node] = counts.get(node, 0) + 1
        return counts

    def proportional_share(self, gpu_ids: tuple[int, ...]) -> tuple[float, float]:
        """CPU cores and host memory GB that ``gpu_ids`` come with, summed over nodes."""
        cpus = mem = 0.0
        for node, count in self.gpus_by_node(gpu_ids).items():
            cpus += self.nodes[node].fair_cpus_per_gpu * count
            mem += self.nodes[node].fair_mem_gb_per_gpu * count
        return cpus, mem

    def with_host_resources(self, cpus: int | None, host_mem_gb: float | None) -> Cluster:
        """The same cluster with every node's CPU cores and host memory set (None keeps
        a node's own)."""
        return Cluster(
            tuple(
                replace(
                    node,
                    cpus=node.cpus if cpus is None else cpus,
                    host_mem_gb=node.host_mem_gb if host_mem_gb is None else host_mem_gb,
                )
                for node in self.nodes
            )
        )

    @classmethod
    def uniform(
        cls,
        nodes: int,
        gpus_per_node: int,
        gpu_mem_mb: int = DEFAULT_GPU_MEM_MB,
        gpu_model: str = "generic",
    ) -> Cluster:
        if nodes <= 0 or gpus_per_node <= 0:
            raise ValueError("a cluster needs nodes >= 1 and gpus_per_node >= 1")
        return cls(
            tuple(
                Node(
                    name=f"node{i:04d}",
                    gpus=gpus_per_node,
                    gpu_mem_mb=gpu_mem_mb,
                    cpus=DEFAULT_CPUS_PER_GPU * gpus_per_node,
                    host_mem_gb=DEFAULT_HOST_MEM_GB_PER_GPU * gpus_per_node,
                    gpu_model=gpu_model,
                )
                for i in range(nodes)
            )
        )

    @classmethod
    def parse(cls, spec: str, gpu_mem_mb: int = DEFAULT_GPU_MEM_MB) -> Cluster:
        """Parse ``NODESxGPUS`` such as ``64x8``, or groups of nodes of one GPU type
        each, ``NODESxGPUS:TYPE,...`` such as ``8x4:V100,8x4:P100,16x4:K80`` (a type
        of a known family, see ``gpu_types``; a group without one is ``generic``), of at
        most `MAX_SPEC_GPUS` GPUs and `MAX_SPEC_GPUS_PER_NODE` a node. Nodes are named
        ``node0000`` on, group after group. Errors name the group at fault."""
        parts = spec.split(",")
        groups = [_spec_group(part, len(parts) > 1) for part in parts]
        total = sum(nodes * gpus for nodes, gpus, _ in groups)
        if total > MAX_SPEC_GPUS:
            raise ValueError(
                f"{spec.strip()!r} asks for {total:,} GPUs; at most {MAX_SPEC_GPUS:,} are supported"
            )
        if len(groups) == 1:
            nodes, gpus, model = groups[0]
            return cls.uniform(nodes, gpus, gpu_mem_mb, model)
        made: list[Node] = []
        for nodes, gpus, model in groups:
            first = len(made)
            made.extend(
                replace(node, name=f"node{first + i:04d}")
                for i, node in enumerate(cls.uniform(nodes, gpus, gpu_mem_mb, model).nodes)
            )
        return cls(tuple(made))


def _spec_group(part: str, several: bool) -> tuple[int, int, str]:
    """(nodes, GPUs per node, GPU model) of one ``NODESxGPUS[:TYPE]`` group; errors
    name the group where the spec has ``several``."""
    where = f"{part.strip()!r}: " if several else ""
    if not part.strip() and several:
        raise ValueError("an empty group in a cluster spec: two commas, or one at an end")
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*(?::\s*([^:,]*?)\s*)?", part)
    if not match:
        raise ValueError(
            f"cluster spec {part.strip()!r} is not NODESxGPUS, e.g. 64x8, "
            "or NODESxGPUS:TYPE,..., e.g. 8x4:V100,16x4:K80"
        )
    nodes, gpus, model = int(match.group(1)), int(match.group(2)), match.group(3)
    if nodes < 1 or gpus < 1:
        raise ValueError(f"{where}a group needs nodes >= 1 and GPUs per node >= 1")
    if nodes * gpus > MAX_SPEC_GPUS:
        raise ValueError(
            f"{where}{nodes} x {gpus} = {nodes * gpus:,} GPUs; at most {MAX_SPEC_GPUS:,} "
            "are supported"
        )
    if gpus > MAX_SPEC_GPUS_PER_NODE:
        raise ValueError(
            f"{where}{gpus:,} GPUs per node; at most {MAX_SPEC_GPUS_PER_NODE:,} are supported"
        )
    if model is None:
        return nodes, gpus, "generic"
    if not model or family(type_key(model)) is None:
        raise ValueError(f"{where}unknown GPU type {model!r}; known: {known_families()}")
    return nodes, gpus, model


#: a job's GPUs, CPU cores and host memory GB (None: the GPU-proportional share)
Allocation = tuple[tuple[int, ...], float | None, float | None]


class HostUse:
    """CPU cores and host memory in use per node, changed job by job. Explicit
    allocations add up; the GPU-proportional share goes with a GPU, so the jobs that
    share one GPU without an allocation of their own count its share once.

    It starts from per-node totals (``base_cpus``, ``base_mem``) and ``base_holders``,
    how many jobs hold the proportional share of a GPU there; only the nodes and GPUs
    touched since are copied, so a change costs its own size, not the cluster's."""

    def __init__(
        self,
        cluster: Cluster,
        base_cpus: Sequence[float] | None = None,
        base_mem: Sequence[float] | None = None,
        base_holders: Callable[[int], int] | None = None,
    ) -> None:
        self.cluster = cluster
        #: without a base, the totals are this object's own lists, changed in place
        self._owned = base_cpus is None or base_mem is None
        self._owned_cpus = [0.0] * len(cluster.nodes) if self._owned else []
        self._owned_mem = [0.0] * len(cluster.nodes) if self._owned else []
        self._base_cpus = self._owned_cpus if base_cpus is None else base_cpus
        self._base_mem = self._owned_mem if base_mem is None else base_mem
        self._base_holders = base_holders or (lambda gpu: 0)
        self._cpus: dict[int, float] = {}
        self._mem: dict[int, float] = {}
        #: jobs with the proportional share on each GPU touched
        self._holders: dict[int, int] = {}

    @classmethod
    def of_jobs(cls, cluster: Cluster, jobs: Iterable[Allocation]) -> HostUse:
        use = cls(cluster)
        for gpu_ids, cpus, mem_gb in jobs:
            use.add(gpu_ids, cpus, mem_gb, +1)
        return use

    def cpus(self, node_index: int) -> float:
        return self._cpus.get(node_index, self._base_cpus[node_index])

    def mem(self, node_index: int) -> float:
        return self._mem.get(node_index, self._base_mem[node_index])

    def all_cpus(self) -> tuple[float, ...]:
        if self._owned:
            return tuple(self._owned_cpus)
        return tuple(self.cpus(n) for n in range(len(self.cluster.nodes)))

    def all_mem(self) -> tuple[float, ...]:
        if self._owned:
            return tuple(self._owned_mem)
        return tuple(self.mem(n) for n in range(len(self.cluster.nodes)))

    def _shift(self, node_index: int, cpus: float, mem_gb: float) -> None:
        if self._owned:
            self._owned_cpus[node_index] += cpus
            self._owned_mem[node_index] += mem_gb
            return
        self._cpus[node_index] = self.cpus(node_index) + cpus
        self._mem[node_index] = self.mem(node_index) + mem_gb

    def add(
        self, gpu_ids: tuple[int, ...], cpus: float | None, mem_gb: float | None, sign: int
    ) -> None:
        """Count (``sign`` +1) or uncount (-1) a job's allocation on ``gpu_ids``."""
        cluster = self.cluster
        if cpus is None and mem_gb is None:
            for gpu in gpu_ids:
                before = self._holders.get(gpu)
                if before is None:
                    before = self._base_holders(gpu)
                after = self._holders[gpu] = before + sign
                if (before == 0) != (after == 0):
                    node_index = cluster.gpu_node[gpu]
                    node = cluster.nodes[node_index]
                    self._shift(
                        node_index, sign * node.fair_cpus_per_gpu, sign * node.fair_mem_gb_per_gpu
                    )
            return
        for node_index, count in cluster.gpus_by_node(gpu_ids).items():
            node = cluster.nodes[node_index]
            part = count / len(gpu_ids)
            own_cpus = node.fair_cpus_per_gpu * count if cpus is None else cpus * part
            own_mem = node.fair_mem_gb_per_gpu * count if mem_gb is None else mem_gb * part
            self._shift(node_index, sign * own_cpus, sign * own_mem)

    def overcommitted(self, job_id: str, gpu_ids: tuple[int, ...]) -> list[str]:
        """What the nodes of ``gpu_ids`` hold beyond their CPUs or memory, as problems
        of giving ``job_id`` its allocation."""
        problems = []
        for node_index in self.cluster.gpus_by_node(gpu_ids):
            node = self.cluster.nodes[node_index]
            cpus, mem = self.cpus(node_index), self.mem(node_index)
            if cpus > node.cpus + HOST_SLACK:
                problems.append(
                    f"gave {job_id} CPUs beyond node {node.name}'s: {cpus:g} > {node.cpus:g}"
                )
            if mem > node.host_mem_gb + HOST_SLACK:
                problems.append(
                    f"gave {job_id} host memory beyond node {node.name}'s: "
                    f"{mem:g} GB > {node.host_mem_gb:g} GB"
                )
        return problems


#: CPU cores or host GB a node may appear to exceed by: float rounding of the sums
HOST_SLACK = 1e-6
