"""GPU placement: one index of idle GPUs for every policy that places jobs exclusively.

``FreeGpus`` is a working copy of which GPUs are idle, built from a snapshot and
consumed as a policy places jobs within one decision: consolidated best fit, spreading
over the fewest nodes only when no node holds a job. Nodes are kept in buckets by their
free GPU count, each bucket in ascending node index, built on the first question that
needs them, so best fit costs O(GPUs per node + nodes in a bucket) and a decision that
places nothing never builds them.

Policies that need more than idle GPUs extend it rather than keep an index of their own:

- ``FreeCapacity`` adds each node's free CPU cores and host memory (Synergy's TUNE);
- ``ContiguousGpus`` keeps who holds each GPU and lays jobs on consecutive GPUs, the
  free block of most overlap with a job's current GPUs, fewest nodes and tightest run
  first (ONES's layout).

Beside it: whether a job can ever run on a cluster (``unschedulable_reason``), the
accumulation it needs on an idle GPU (``exclusive_accum``), both cached per job shape
(``ShapeCache``), and ``place_exclusive``, which gives a queued job idle GPUs of its
own.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain

import numpy as np

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.decision import Start
from gpusched.libs.core.parallelism import Degrees, Traffic, map_job
from gpusched.libs.core.shape import accum_steps_choices
from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot


class FreeGpus:
    def __init__(self, snapshot: Snapshot) -> None:
        #: jobs resident on every GPU (0: idle), as this decision changes it
        self._load = list(snapshot.gpu_load)
        self._index(snapshot.cluster, list(snapshot.node_free))

    def _index(self, cluster: Cluster, free: list[int]) -> None:
        """Index ``free`` (idle GPUs per node, a list this object then owns)."""
        self._offsets = cluster.offsets
        self._node_size = cluster.node_sizes
        self._free = free
        self._max = cluster.max_gpus_per_node
        #: GPU type of every node where the cluster has several: a job spans one type
        self._node_type = cluster.node_type if cluster.mixed else None
        self.total = sum(free)
        #: nodes by free GPU count, each list ascending; None until first needed
        self._buckets: list[list[int]] | None = None

    def _by_free(self) -> list[list[int]]:
        buckets = self._buckets
        if buckets is None:
            buckets = self._buckets = [[] for _ in range(self._max + 1)]
            for node, free in enumerate(self._free):
                if free:
                    buckets[free].append(node)
        return buckets

    def _set_free(self, node: int, free: int) -> None:
        buckets = self._buckets
        if buckets is not None:
            old = self._free[node]
            if old:
                bucket = buckets[old]
                del bucket[bisect_left(bucket, node)]
            if free:
                insort(buckets[free], node)
        self._free[node] = free

    # ---- questions -------------------------------------------------------------------
    def largest_block(self) -> int:
        """Most idle GPUs on one node."""
        buckets = self._by_free()
        for k in range(self._max, 0, -1):
            if buckets[k]:
                return k
        return 0

    def free_on(self, node: int) -> int:
        """Idle GPUs of ``node``."""
        return self._free[node]

    def free_per_node(self) -> list[int]:
        """Free GPUs of each node, by node index."""
        return list(self._free)

    def nodes_holding(self, gpus: int, *, best_fit: bool = True) -> Iterator[int]:
        """Nodes with at least ``gpus`` idle GPUs: with ``best_fit`` the fewest idle
        first, else by index (lowest index first among equals either way). Lazy: stop
        reading it before taking GPUs."""
        buckets = self._by_free()[gpus:]
        return chain.from_iterable(buckets) if best_fit else heapq.merge(*buckets)

    def spread(self, gpus: int) -> dict[int, int] | None:
        """The fewest nodes that hold ``gpus`` idle GPUs together and how many each
        gives: the most idle first, lowest index among equals; None if fewer are idle.
        On a cluster of several GPU types, nodes of one type: the type that needs the
        fewest nodes (the first type among equals)."""
        if gpus > self.total:
            return None
        if self._node_type is not None:
            return self._spread_in_one_type(gpus)
        chosen: dict[int, int] = {}
        need = gpus
        free = self._free
        for node in chain.from_iterable(reversed(self._by_free())):
            take = min(need, free[node])
            chosen[node] = take
            need -= take
            if need == 0:
                break
        return chosen

    def _spread_in_one_type(self, gpus: int) -> dict[int, int] | None:
        node_type = self._node_type
        assert node_type is not None
        free = self._free
        chosen: dict[int, dict[int, int]] = {}
        need: dict[int, int] = {}
        for node in chain.from_iterable(reversed(self._by_free())):
            kind = node_type[node]
            left = need.setdefault(kind, gpus)
            if left == 0:
                continue
            take = min(left, free[node])
            chosen.setdefault(kind, {})[node] = take
            need[kind] = left - take
        done = [(len(nodes), kind) for kind, nodes in chosen.items() if need[kind] == 0]
        return chosen[min(done)[1]] if done else None

    def type_free(self) -> dict[int, int]:
        """Idle GPUs of each GPU type, by type index (one entry, 0, on a cluster of one)."""
        if self._node_type is None:
            return {0: self.total}
        totals: dict[int, int] = {}
        for node, free in enumerate(self._free):
            kind = self._node_type[node]
            totals[kind] = totals.get(kind, 0) + free
        return totals

    # ---- taking and giving back ------------------------------------------------------
    def _take_from_node(self, node: int, count: int) -> list[int]:
        taken = self._claim(node, count)
        self._set_free(node, self._free[node] - count)
        self.total -= count
        return taken

    def _claim(self, node: int, count: int) -> list[int]:
        """Mark ``count`` idle GPUs of ``node`` taken, the lowest first; they, ascending."""
        start = self._offsets[node]
        load = self._load
        taken: list[int] = []
        for gpu in range(start, start + self._node_size[node]):
            if load[gpu] == 0:
                taken.append(gpu)
                load[gpu] = 1
                if len(taken) == count:
                    break
        return taken

    def _release(self, gpu: int) -> bool:
        """Let go of one job's hold on ``gpu``; whether it is idle now."""
        self._load[gpu] -= 1
        return not self._load[gpu] > 0

    def take(self, gpus: int) -> list[int] | None:
        """Place a job: best-fit node if one node can hold it, else the fewest nodes."""
        if gpus > self.total:
            return None
        buckets = self._by_free()
        for k in range(gpus, self._max + 1):
            if buckets[k]:
                return self._take_from_node(buckets[k][0], gpus)
        spread = self.spread(gpus)
        if spread is None:  # idle GPUs enough, but not of one type
            return None
        taken: list[int] = []
        for node, count in spread.items():
            taken.extend(self._take_from_node(node, count))
        return taken

    def take_on(self, counts: Mapping[int, int]) -> tuple[int, ...]:
        """Take ``counts[node]`` idle GPUs of each node (the lowest there); the GPUs
        ascending. The caller has made sure the nodes have them."""
        taken: list[int] = []
        for node, count in sorted(counts.items()):
            taken.extend(self._take_from_node(node, count))
        return tuple(sorted(taken))

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
        if self._node_type is None:
            nodes = map_job(degrees, self._free, flows)
        else:
            nodes = self._map_in_one_type(degrees, flows)
        return None if nodes is None else self.take_ranks(nodes)

    def _map_in_one_type(
        self, degrees: Degrees, flows: Traffic | None
    ) -> tuple[int, ...] | None:
        """Where ``map_job`` maps the job on the idle GPUs of one type alone: the type
        whose mapping spans the fewest nodes (the first type among equals)."""
        node_type = self._node_type
        assert node_type is not None
        best: tuple[int, ...] | None = None
        for kind, idle in sorted(self.type_free().items()):
            if idle < degrees.gpus:
                continue
            free = [f if node_type[n] == kind else 0 for n, f in enumerate(self._free)]
            nodes = map_job(degrees, free, flows)
            if nodes is not None and (best is None or len(set(nodes)) < len(set(best))):
                best = nodes
        return best

    def give_back(self, gpu_ids: tuple[int, ...] | list[int], node_of: tuple[int, ...]) -> None:
        """Return GPUs of a job that a decision removes (e.g. a preemption)."""
        for gpu in gpu_ids:
            if not self._release(gpu):
                continue  # a co-runner still holds it
            node = node_of[gpu]
            self._set_free(node, self._free[node] + 1)
            self.total += 1


class FreeCapacity(FreeGpus):
    """Idle GPUs plus each node's free CPU cores and host memory (GB), as a decision
    gives jobs allocations of their own (``Start.cpus``, ``Reallocate``)."""

    def __init__(self, snapshot: Snapshot, cpus: list[float], mem_gb: list[float]) -> None:
        super().__init__(snapshot)
        #: free CPU cores and host memory of every node (this object changes the lists)
        self.cpus = cpus
        self.mem = mem_gb

    def charge(
        self, nodes: Mapping[int, int], gpus: int, cpus: float, mem_gb: float, sign: float = 1.0
    ) -> None:
        """Take (``sign`` -1: give back) a whole job's ``cpus`` and ``mem_gb``, split over
        its ``nodes`` (node -> its GPUs there, ``gpus`` in all) in proportion to its GPUs."""
        for node in nodes:
            part = nodes[node] / gpus
            self.cpus[node] -= sign * cpus * part
            self.mem[node] -= sign * mem_gb * part


#: ``ContiguousGpus.owner`` of an idle GPU
FREE = -1
#: ``ContiguousGpus.owner`` of a GPU taken by a plain ``FreeGpus`` method (no job named)
TAKEN = -2


class ContiguousGpus(FreeGpus):
    """Idle GPUs for a policy that lays every job on consecutive GPUs (ONES): ``owner``
    holds, for every global GPU, the number of the job on it (``FREE``: idle), and a
    job goes to a free block of consecutive GPUs (``best_block``, ``take_block``), a
    one-GPU job that holds none to the first GPU of the tightest free run
    (``take_tightest``)."""

    def __init__(
        self, cluster: Cluster, owner: np.ndarray, node_of: np.ndarray | None = None
    ) -> None:
        #: job number on every GPU (``FREE``: idle); this object changes the array
        self.owner = owner
        if node_of is None:
            node_of = np.asarray(cluster.gpu_node, dtype=np.int64)
        self._node_of = node_of
        self._gpu_node = cluster.gpu_node
        #: on a cluster of several GPU types, a number per run of consecutive GPUs of one
        #: type: a block may not span two
        self._type_run: np.ndarray | None = None
        if cluster.mixed:
            kinds = np.asarray(cluster.gpu_type, dtype=np.int64)
            self._type_run = np.concatenate(([0], np.cumsum(kinds[1:] != kinds[:-1])))
        free = np.bincount(node_of[owner == FREE], minlength=len(cluster.nodes))
        self._index(cluster, free.tolist())
        #: free runs as a heap of (length, start) while only one-GPU jobs are placed
        #: (None: to be read from ``owner`` again)
        self._runs: list[tuple[int, int]] | None = None

    def _claim(self, node: int, count: int) -> list[int]:
        start = self._offsets[node]
        idle = np.flatnonzero(self.owner[start : start + self._node_size[node]] == FREE)
        taken = idle[:count] + start
        self.owner[taken] = TAKEN
        self._runs = None
        return [int(g) for g in taken]

    def _release(self, gpu: int) -> bool:
        self.owner[gpu] = FREE
        self._runs = None
        return True

    def _took(self, start: int, n: int) -> None:
        """Count the ``n`` GPUs from ``start`` as taken, node by node."""
        end = start + n
        gpu = start
        while gpu < end:
            node = self._gpu_node[gpu]
            stop = min(end, self._offsets[node] + self._node_size[node])
            self._set_free(node, self._free[node] - (stop - gpu))
            gpu = stop
        self.total -= n

    def is_free(self, start: int, n: int) -> bool:
        """Whether the ``n`` GPUs from ``start`` are all idle."""
        return bool((self.owner[start : start + n] == FREE).all())

    def best_block(self, n: int, own: np.ndarray | None = None) -> int | None:
        """Start of the free block of ``n`` GPUs that overlaps the GPUs counted in ``own``
        (a prefix sum over GPUs; None: no GPU) most, spans the fewest nodes and sits in
        the tightest free run (lowest start among equals); None if no free run holds n."""
        occ = self.owner
        total = len(occ)
        edges = np.diff(np.concatenate(([0], (occ == FREE).view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        runs = np.flatnonzero(edges == -1) - starts
        roomy = runs >= n
        if not roomy.any():
            return None
        starts, runs = starts[roomy], runs[roomy]
        # every window start inside every run that holds n
        windows = runs - n + 1
        offsets = np.arange(int(windows.sum())) - np.repeat(np.cumsum(windows) - windows, windows)
        s = np.repeat(starts, windows) + offsets
        run = np.repeat(runs, windows)
        if self._type_run is not None:  # only blocks of one GPU type
            one_type = self._type_run[s] == self._type_run[s + n - 1]
            if not one_type.any():
                return None
            s, run = s[one_type], run[one_type]
        overlap = 0 if own is None else own[s + n] - own[s]
        node_of = self._node_of
        nodes = node_of[s + n - 1] - node_of[s] + 1
        base = total + 1
        key = (((n - overlap) * base + nodes) * base + run) * base + s
        return int(s[np.argmin(key)])

    def take_block(self, start: int, n: int, job: int) -> None:
        """Give ``job`` the ``n`` GPUs from ``start`` (idle: see ``best_block``)."""
        self.owner[start : start + n] = job
        self._runs = None
        self._took(start, n)

    def take_tightest(self, job: int) -> int | None:
        """Give ``job`` the first GPU of the tightest free run (lowest start among
        equals), where ``best_block(1)`` puts a job that holds no GPU; None if none is
        idle."""
        runs = self._runs
        if runs is None:
            runs = self._runs = free_runs(self.owner)
        if not runs:
            return None
        length, start = heapq.heappop(runs)
        if length > 1:
            heapq.heappush(runs, (length - 1, start + 1))
        self.owner[start] = job
        node = self._gpu_node[start]
        if self._buckets is None:  # the common case, kept short: one job per idle GPU
            self._free[node] -= 1
        else:
            self._set_free(node, self._free[node] - 1)
        self.total -= 1
        return start


def free_runs(owner: np.ndarray) -> list[tuple[int, int]]:
    """The runs of idle GPUs (``FREE`` in ``owner``) as a heap of (length, start)."""
    edges = np.diff(np.concatenate(([0], (owner == FREE).view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    runs = list(zip((np.flatnonzero(edges == -1) - starts).tolist(), starts.tolist(), strict=True))
    heapq.heapify(runs)
    return runs


# ---- whether and how a job runs on GPUs of its own --------------------------------------


def accum_choices(job: JobView) -> tuple[int, ...]:
    """Accumulation steps that leave every sub-batch at least one sample."""
    return accum_steps_choices(job.batch_size, job.gpus)


def exclusive_accum(job: JobView, snapshot: Snapshot, gpu_mem_mb: float) -> int | None:
    """Fewest accumulation steps whose per-GPU memory fits an idle GPU, None if none does."""
    est = snapshot.estimates
    for k in accum_choices(job):
        if est.gpu_memory_mb(job.model, job.batch_size / (job.gpus * k)) <= gpu_mem_mb:
            return k
    return None


def unschedulable_reason(job: JobView, snapshot: Snapshot) -> str | None:
    """Why the job can never run on this cluster, or None if it can."""
    total = snapshot.cluster.total_gpus
    if job.gpus > total:
        return f"unschedulable: needs {job.gpus} GPUs; the cluster has {total}"
    cluster = snapshot.cluster
    if cluster.mixed and job.gpus > max(cluster.type_gpus):
        most = max(cluster.type_gpus)
        kind = cluster.gpu_types[cluster.type_gpus.index(most)]
        return (
            f"unschedulable: needs {job.gpus} GPUs of one type; the most of one type "
            f"are {most} ({kind})"
        )
    biggest = snapshot.cluster.max_gpu_mem_mb
    if exclusive_accum(job, snapshot, biggest) is None:
        smallest = job.batch_size / (job.gpus * max(accum_choices(job) or (1,)))
        need = snapshot.estimates.gpu_memory_mb(job.model, smallest)
        return (
            f"unschedulable: needs {need:.0f} MiB per GPU even at a sub-batch of "
            f"{smallest:g}; the largest GPU has {biggest} MiB"
        )
    return None


class ShapeCache:
    """Per job shape (model, batch, GPUs), for one cluster and one performance model: why
    the shape can never run (None if it can) and the accumulation it runs alone with.

    Both depend only on the shape, so a policy that keeps one of these asks the
    performance model once per shape instead of once per queued job and decision. It
    forgets everything when a snapshot brings another cluster or model.
    """

    def __init__(self) -> None:
        self._basis = ModelBasis()
        self._bad: dict[tuple[str, int, int], str | None] = {}
        self._accum: dict[tuple[str, int, int], int] = {}

    def _sync(self, snapshot: Snapshot) -> None:
        if self._basis.moved(snapshot):
            self._bad.clear()
            self._accum.clear()

    def unschedulable(self, job: JobView, snapshot: Snapshot) -> str | None:
        self._sync(snapshot)
        key = (job.model, job.batch_size, job.gpus)
        try:
            return self._bad[key]
        except KeyError:
            bad = self._bad[key] = unschedulable_reason(job, snapshot)
            return bad

    def exclusive_accum(self, job: JobView, snapshot: Snapshot) -> int:
        """Accumulation steps for an idle GPU of the smallest memory (1 if none fits)."""
        self._sync(snapshot)
        key = (job.model, job.batch_size, job.gpus)
        try:
            return self._accum[key]
        except KeyError:
            accum = exclusive_accum(job, snapshot, snapshot.cluster.min_gpu_mem_mb) or 1
            self._accum[key] = accum
            return accum


def place_exclusive(
    job: JobView, free: FreeGpus, snapshot: Snapshot, shapes: ShapeCache | None = None
) -> Start | None:
    """Start ``job`` on idle GPUs of ``free`` (best fit, or where the mapper puts a job
    with tensor or pipeline parallelism) with the accumulation an idle GPU of the
    smallest memory needs; None if they are not there."""
    if job.gpus > free.total:
        return None
    if shapes is not None:
        accum = shapes.exclusive_accum(job, snapshot)
    else:
        accum = exclusive_accum(job, snapshot, snapshot.cluster.min_gpu_mem_mb) or 1
    gpus = free.take(job.gpus) if model_parallel(job) == 1 else free.take_parallel(
        Degrees.of(job.gpus, job.tensor_parallel, job.pipeline_parallel)
    )
    if gpus is None:
        return None
    return Start(job.job_id, tuple(gpus), accum)


def model_parallel(job: JobView) -> int:
    """A job's tensor x pipeline degree; 1 (placed as plain data parallel) for a job
    resized to a GPU count that degree does not divide, which then runs data parallel."""
    degree = job.tensor_parallel * job.pipeline_parallel
    return degree if degree > 1 and job.gpus % degree == 0 else 1
