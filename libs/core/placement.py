"""GPU placement: consolidated best fit, spreading across nodes only when needed.

``FreeGpus`` is a working copy of which GPUs are idle, built from a snapshot and
consumed as a policy places jobs within one decision. Nodes are bucketed by their free
GPU count, each bucket a heap of node indices, so best fit costs O(GPUs per node + log
nodes) rather than a scan of the cluster.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from gpusched.libs.core.parallelism import Degrees, Traffic, map_job
from gpusched.libs.core.snapshot import Snapshot


class FreeGpus:
    def __init__(self, snapshot: Snapshot) -> None:
        cluster = snapshot.cluster
        self._offsets = cluster.offsets
        self._node_size = cluster.node_sizes
        self._load = list(snapshot.gpu_load)
        self._free = list(snapshot.node_free)
        self._max = cluster.max_gpus_per_node
        self._buckets: list[list[int]] = [[] for _ in range(self._max + 1)]
        for node, free in enumerate(self._free):
            if free:
                self._buckets[free].append(node)
        # node indices were appended in ascending order, so each bucket is already a heap
        self.total = sum(self._free)

    def largest_block(self) -> int:
        for k in range(self._max, 0, -1):
            if self._peek(k) is not None:
                return k
        return 0

    def _peek(self, k: int) -> int | None:
        bucket = self._buckets[k]
        while bucket and self._free[bucket[0]] != k:
            heapq.heappop(bucket)  # stale entry: the node's free count changed
        return bucket[0] if bucket else None

    def _take_from_node(self, node: int, count: int) -> list[int]:
        start = self._offsets[node]
        load = self._load
        taken: list[int] = []
        for gpu in range(start, start + self._node_size[node]):
            if load[gpu] == 0:
                taken.append(gpu)
                load[gpu] = 1
                if len(taken) == count:
                    break
        self._free[node] -= count
        self.total -= count
        if self._free[node]:
            heapq.heappush(self._buckets[self._free[node]], node)
        return taken

    def take(self, gpus: int) -> list[int] | None:
        """Place a job: best-fit node if one node can hold it, else the fewest nodes."""
        if gpus > self.total:
            return None
        for k in range(gpus, self._max + 1):
            node = self._peek(k)
            if node is not None:
                return self._take_from_node(node, gpus)
        nodes = self._spread(gpus)
        taken: list[int] = []
        for node in nodes:
            taken.extend(self._take_from_node(node, min(self._free[node], gpus - len(taken))))
        return taken

    def free_per_node(self) -> list[int]:
        """Free GPUs of each node, by node index."""
        return list(self._free)

    def take_idle_on(self, nodes: Sequence[int]) -> list[int]:
        """Take every free GPU of ``nodes``, node by node in that order."""
        taken: list[int] = []
        for node in nodes:
            if self._free[node]:
                taken.extend(self._take_from_node(node, self._free[node]))
        return taken

    def take_ranks(self, node_of_rank: Sequence[int]) -> list[int]:
        """Take one free GPU on ``node_of_rank[r]`` for each rank r; the GPUs in rank order.
        Raises ValueError, taking nothing, when a node has too few free GPUs."""
        counts: dict[int, int] = {}
        for node in node_of_rank:
            counts[node] = counts.get(node, 0) + 1
        for node, count in counts.items():
            if not 0 <= node < len(self._free) or self._free[node] < count:
                raise ValueError(f"node_of_rank: node {node} has no {count} free GPUs")
        taken = {node: iter(self._take_from_node(node, count)) for node, count in counts.items()}
        return [next(taken[node]) for node in node_of_rank]

    def take_parallel(self, degrees: Degrees, flows: Traffic | None = None) -> list[int] | None:
        """Place a (d, t, p) job where ``gpusched.libs.core.parallelism.map_job`` maps it, GPUs in
        rank order; a job with t = p = 1 exactly as :meth:`take` places it."""
        if degrees.model_parallel == 1:
            return self.take(degrees.gpus)
        if degrees.gpus > self.total:
            return None
        nodes = map_job(degrees, self._free, flows)
        return None if nodes is None else self.take_ranks(nodes)

    def _spread(self, gpus: int) -> list[int]:
        """Fewest nodes: fullest-free nodes first, lowest index on ties."""
        chosen: list[int] = []
        need = gpus
        for k in range(self._max, 0, -1):
            for node in sorted(set(self._buckets[k])):
                if self._free[node] != k:
                    continue
                chosen.append(node)
                need -= k
                if need <= 0:
                    return chosen
        return chosen

    def give_back(self, gpu_ids: tuple[int, ...] | list[int], node_of: tuple[int, ...]) -> None:
        """Return GPUs of a job that a decision removes (e.g. a preemption)."""
        for gpu in gpu_ids:
            self._load[gpu] -= 1
            if self._load[gpu] > 0:
                continue  # a co-runner still holds it
            node = node_of[gpu]
            self._free[node] += 1
            self.total += 1
            heapq.heappush(self._buckets[self._free[node]], node)
