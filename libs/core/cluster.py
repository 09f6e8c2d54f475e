"""Nodes and clusters: the hardware a scheduler places jobs on.

GPUs are addressed by a global integer index so that placements are plain tuples of
ints; a cluster maps each index back to its node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

#: GPU memory of the SJF-BSBF testbed's GPUs, used when a cluster spec names none.
DEFAULT_GPU_MEM_MB = 49_140
DEFAULT_CPUS_PER_GPU = 4
DEFAULT_HOST_MEM_GB_PER_GPU = 62.5
DEFAULT_NET_GBPS = 100.0


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
        """Parse ``NODESxGPUS`` such as ``64x8``."""
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
        if not match:
            raise ValueError(f"cluster spec {spec!r} is not NODESxGPUS, e.g. 64x8")
        return cls.uniform(int(match.group(1)), int(match.group(2)), gpu_mem_mb)
