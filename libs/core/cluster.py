"""Nodes and clusters: the hardware a scheduler places jobs on.

GPUs are addressed by a global integer index so that placements are plain tuples of
ints; a cluster maps each index back to its node.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

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
    def max_gpus_per_node(self) -> int:
        return max(n.gpus for n in self.nodes)

    @cached_property
    def _largest_first_totals(self) -> tuple[int, ...]:
        """GPUs of the k largest nodes together, for k = 1, 2, ..."""
        return tuple(accumulate(sorted((n.gpus for n in self.nodes), reverse=True)))

    def fewest_nodes(self, gpus: int) -> int:
        """Nodes a job of ``gpus`` GPUs spans alone on this idle cluster: its most
        consolidated placement, one node if a node holds it, else the fewest nodes,
        largest first (where ``FreeGpus.take`` puts it). Raises ValueError when the
        cluster has fewer than ``gpus`` GPUs."""
        if not 1 <= gpus <= self.total_gpus:
            raise ValueError(f"{gpus} GPUs do not fit a cluster of {self.total_gpus}")
        return bisect_left(self._largest_first_totals, gpus) + 1

    def node_gpus(self, node_index: int) -> range:
        start = self.offsets[node_index]
        return range(start, start + self.nodes[node_index].gpus)

    def nodes_spanned(self, gpu_ids: tuple[int, ...]) -> int:
        gpu_node = self.gpu_node
        return len({gpu_node[g] for g in gpu_ids})

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
        """Parse ``NODESxGPUS`` such as ``64x8``, of at most `MAX_SPEC_GPUS` GPUs and
        `MAX_SPEC_GPUS_PER_NODE` a node."""
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
        if not match:
            raise ValueError(f"cluster spec {spec!r} is not NODESxGPUS, e.g. 64x8")
        nodes, gpus = int(match.group(1)), int(match.group(2))
        if nodes * gpus > MAX_SPEC_GPUS:
            raise ValueError(
                f"{nodes} x {gpus} = {nodes * gpus:,} GPUs; at most {MAX_SPEC_GPUS:,} are supported"
            )
        if gpus > MAX_SPEC_GPUS_PER_NODE:
            raise ValueError(
                f"{gpus:,} GPUs per node; at most {MAX_SPEC_GPUS_PER_NODE:,} are supported"
            )
        return cls.uniform(nodes, gpus, gpu_mem_mb)
