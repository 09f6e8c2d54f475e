"""Jobs with data, tensor and pipeline parallelism, and a communication-aware mapper.

A job with degrees ``(d, t, p)`` runs ``g = d * t * p`` workers (ranks). Rank ``r`` is

    r = (replica * p + stage) * t + tensor_index

so the ``t`` ranks of a tensor group are consecutive, the ``p`` tensor groups of one
replica (its pipeline stages) follow each other, and replicas come last. Rank ``r`` runs
on the job's ``r``-th GPU (``gpu_ids[r]``).

This is our own analytic model (no paper gives these numbers for the built-in models);
``docs/parallelism.md`` says the same with worked figures.

Communication per iteration, from a :class:`ModelProfile` (``comm_mb`` = gradient MB,
``mem_per_sample_mb`` = GPU memory per sample, mostly stored activations), the global
batch ``b`` and ``b_r = b / d`` samples per replica:

- ``LAYERS = 24``: every model is taken as 24 equal layers (the depth of BERT-large and
  GPT-2 medium); a stage holds ``LAYERS / p`` of them.
- ``ACTIVATION_FRACTION = 2 / 34``: the output of one layer, the tensor a stage boundary
  passes on and tensor parallelism all-reduces, is 2/34 of the activation memory one
  layer stores (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022: ``s b h (34 + 5 a s / h)`` bytes stored per layer against a
  ``2 s b h``-byte output, the attention-score term left out). So the activation MB per
  sample at a layer boundary is ``A = ACTIVATION_FRACTION * mem_per_sample_mb / LAYERS``.
- tensor parallelism (heaviest): ``TENSOR_ALLREDUCES_PER_LAYER = 4`` all-reduces of the
  layer output per layer (two forward, two backward: Shoeybi et al., "Megatron-LM",
  2019), inside each tensor group of ``t`` ranks: a group reduces
  ``tensor_mb = 4 * (LAYERS / p) * A * b_r`` MB per iteration.
- pipeline parallelism (next): at each of the ``p - 1`` stage boundaries, tensor rank
  ``j`` of stage ``s`` sends its ``1 / t`` slice of the boundary activations to tensor
  rank ``j`` of stage ``s + 1`` and gets their gradients back:
  ``pipeline_mb = 2 * A * b_r / t`` MB per iteration on each such edge.
- data parallelism (lightest per byte of model): each (stage, tensor index) holds
  ``1 / (t p)`` of the gradients and all-reduces them over its ``d`` replicas:
  ``data_mb = comm_mb / (t * p)`` MB per group.

A collective over a group is a ring (:func:`ring_factor` bytes per byte reduced on each
ring edge) laid out node by node, as NCCL lays out its rings: a group on ``n > 1``
servers crosses the network on ``n`` ring edges, one on a single server on none. A
pipeline edge crosses it when its two ranks are on different servers.

Time per iteration, with ``m = MICROBATCHES_PER_STAGE * p`` micro-batches and the
network of ``builtin/profiles.json`` (intra-server bytes at ``intra_node_gb_per_s``,
inter-server bytes at ``inter_node_gb_per_s`` plus its latency per message):

- compute: the model's one-GPU time at the replica's batch, split over ``t * p`` GPUs:
  ``compute_s(b_r) / (t p)``;
- tensor: ``m * 4 * (LAYERS / p)`` all-reduces of ``A * b_r / m`` MB each over the
  group (:meth:`Network.allreduce_s`), the slowest group counting;
- both stretched by the pipeline bubble ``1 + (p - 1) / m`` (GPipe, Huang et al. 2019);
- pipeline: per boundary, the slowest edge's ``pipeline_mb`` at its link's bandwidth
  plus ``2 m`` messages of latency when it crosses servers, summed over boundaries;
- data: the slowest data-parallel group's ``Network.allreduce_s(data_mb, d, n)``.

Nothing overlaps (the data-parallel model of the ground truth adds its all-reduce to
compute the same way). With gradient accumulation over ``a`` sub-batches, everything
but the data-parallel all-reduce runs ``a`` times at ``b / a``. For ``t = p = 1`` this is
exactly the ground truth's analytic data-parallel time.

The mapper (:func:`map_job`) keeps tensor groups inside a server first, then a
replica's pipeline stages, then replicas, on the fewest servers, and never moves more
inter-server bytes than the consolidated placement (``FreeGpus.take``'s servers filled
rank by rank), which it counts among its candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gpusched.libs.core.profiles.builtin import ModelProfile, Network, ring_factor

if TYPE_CHECKING:
    from gpusched.libs.core.cluster import Cluster
    from gpusched.libs.core.jobs import JobSpec

#: every model is taken as this many equal layers (BERT-large's, GPT-2 medium's depth)
LAYERS = 24
#: a layer's output over the activation memory it stores (Korthikanti et al. 2022)
ACTIVATION_FRACTION = 2.0 / 34.0
#: all-reduces of a layer's output per layer with tensor parallelism (Megatron-LM)
TENSOR_ALLREDUCES_PER_LAYER = 4
#: micro-batches per pipeline stage: m = MICROBATCHES_PER_STAGE * p
MICROBATCHES_PER_STAGE = 4


@dataclass(frozen=True, slots=True)
class Degrees:
    """Data, tensor and pipeline parallel degrees of a job; ``gpus`` is their product."""

    data: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name, value in (
            ("data", self.data),
            ("tensor", self.tensor),
            ("pipeline", self.pipeline),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: parallel degree must be an integer >= 1, got {value!r}")

    @classmethod
    def of(cls, gpus: int, tensor: int = 1, pipeline: int = 1) -> Degrees:
        """The degrees of a job of ``gpus`` GPUs: data parallel = gpus / (tensor * pipeline)."""
        model_parallel = tensor * pipeline
        if model_parallel < 1 or gpus % model_parallel:
            raise ValueError(
                f"tensor_parallel: tensor_parallel {tensor} x pipeline_parallel {pipeline} "
                f"does not divide {gpus} GPUs"
            )
        return cls(gpus // model_parallel, tensor, pipeline)

    @property
    def gpus(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline

    def rank(self, replica: int, stage: int, tensor_index: int) -> int:
        return (replica * self.pipeline + stage) * self.tensor + tensor_index

    def tensor_groups(self) -> list[range]:
        """Ranks of each tensor group, replica by replica, stage by stage."""
        t = self.tensor
        return [range(k * t, (k + 1) * t) for k in range(self.data * self.pipeline)]

    def data_groups(self) -> list[range]:
        """Ranks of each data-parallel group (one per stage and tensor index)."""
        stride = self.tensor * self.pipeline
        return [range(k, self.gpus, stride) for k in range(stride)]

    def pipeline_edges(self) -> list[list[tuple[int, int]]]:
        """Per stage boundary, the (sender, receiver) rank pairs that cross it."""
        return [
            [
                (self.rank(r, s, j), self.rank(r, s + 1, j))
                for r in range(self.data)
                for j in range(self.tensor)
            ]
            for s in range(self.pipeline - 1)
        ]


@dataclass(frozen=True, slots=True)
class Traffic:
    """MB per iteration: what one tensor group all-reduces, what one pipeline edge
    carries (both directions), what one data-parallel group all-reduces."""

    tensor_mb: float
    pipeline_mb: float
    data_mb: float


def activation_mb_per_sample(profile: ModelProfile) -> float:
    """MB of one sample's activations at a layer boundary (``A`` in the module doc)."""
    return ACTIVATION_FRACTION * profile.mem_per_sample_mb / LAYERS


def traffic(profile: ModelProfile, batch_size: float, degrees: Degrees) -> Traffic:
    """Bytes per iteration of a job of ``degrees`` at global batch ``batch_size``."""
    d, t, p = degrees.data, degrees.tensor, degrees.pipeline
    per_replica = batch_size / d
    act = activation_mb_per_sample(profile)
    return Traffic(
        tensor_mb=TENSOR_ALLREDUCES_PER_LAYER * (LAYERS / p) * act * per_replica if t > 1 else 0.0,
        pipeline_mb=2.0 * act * per_replica / t if p > 1 else 0.0,
        data_mb=profile.comm_mb / (t * p) if d > 1 else 0.0,
    )


def _span(node_of_rank: Sequence[int], ranks: range) -> int:
    return len({node_of_rank[r] for r in ranks})


def _ring_crossings(nodes: int) -> int:
    """Ring edges that cross servers for a ring laid out server by server."""
    return nodes if nodes > 1 else 0


def crossing_units(degrees: Degrees, node_of_rank: Sequence[int]) -> tuple[float, float, float]:
    """Inter-server volume per kind, in units of the kind's :class:`Traffic` figure:
    tensor, pipeline, data."""
    _check_placement(degrees, node_of_rank)
    tensor = sum(_ring_crossings(_span(node_of_rank, g)) for g in degrees.tensor_groups())
    pipeline = sum(
        node_of_rank[a] != node_of_rank[b] for edges in degrees.pipeline_edges() for a, b in edges
    )
    data = sum(_ring_crossings(_span(node_of_rank, g)) for g in degrees.data_groups())
    # a group of one rank never crosses (ring_factor(1) == 0)
    return (
        tensor * ring_factor(degrees.tensor),
        float(pipeline),
        data * ring_factor(degrees.data),
    )


def inter_server_mb(flows: Traffic, degrees: Degrees, node_of_rank: Sequence[int]) -> float:
    tensor, pipeline, data = crossing_units(degrees, node_of_rank)
    return tensor * flows.tensor_mb + pipeline * flows.pipeline_mb + data * flows.data_mb


def inter_server_bytes(
    degrees: Degrees, profile: ModelProfile, batch_size: float, node_of_rank: Sequence[int]
) -> float:
    """Bytes per iteration that cross servers when rank ``r`` runs on ``node_of_rank[r]``."""
    return inter_server_mb(traffic(profile, batch_size, degrees), degrees, node_of_rank) * 1e6


def _check_placement(degrees: Degrees, node_of_rank: Sequence[int]) -> None:
    if len(node_of_rank) != degrees.gpus:
        raise ValueError(
            f"node_of_rank: {len(node_of_rank)} ranks placed, the job has {degrees.gpus}"
        )


def iteration_time_at(
    profile: ModelProfile,
    network: Network,
    batch_size: float,
    degrees: Degrees,
    node_of_rank: Sequence[int],
    accum_steps: int = 1,
) -> float:
    """Seconds per iteration of the global batch at a placement (see the module doc)."""
    _check_placement(degrees, node_of_rank)
    if not batch_size > 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size!r}")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps!r}")
    d, t, p = degrees.data, degrees.tensor, degrees.pipeline
    m = MICROBATCHES_PER_STAGE * p
    sub = batch_size / accum_steps
    flows = traffic(profile, sub, degrees)
    compute = profile.compute_s(sub / d) / (t * p)
    tensor = 0.0
    if t > 1:
        calls = m * TENSOR_ALLREDUCES_PER_LAYER * (LAYERS / p)
        size = flows.tensor_mb / calls
        tensor = max(
            calls * network.allreduce_s(size, t, _span(node_of_rank, group))
            for group in degrees.tensor_groups()
        )
    pipeline = 0.0
    for edges in degrees.pipeline_edges():
        crosses = any(node_of_rank[a] != node_of_rank[b] for a, b in edges)
        if crosses:
            link = flows.pipeline_mb / (network.inter_node_gb_per_s * 1000.0)
            pipeline += link + 2 * m * network.inter_node_latency_s
        else:
            pipeline += flows.pipeline_mb / (network.intra_node_gb_per_s * 1000.0)
    data = 0.0
    if d > 1:
        data = max(
            network.allreduce_s(profile.comm_mb / (t * p), d, _span(node_of_rank, group))
            for group in degrees.data_groups()
        )
    bubble = 1.0 + (p - 1) / m
    return accum_steps * ((compute + tensor) * bubble + pipeline) + data


# ------------------------------------------------------------------------- the mapper


def consolidated(gpus: int, free_gpus_per_node: Sequence[int]) -> tuple[int, ...] | None:
    """Node of each rank where ``FreeGpus.take`` puts a job: the best-fit node (fewest
    free GPUs that hold it, lowest index) if one holds it, else the nodes with the most
    free GPUs first (lowest index on ties) until it fits; ranks fill them in that order."""
    if gpus > sum(free_gpus_per_node):
        return None
    fits = [(f, n) for n, f in enumerate(free_gpus_per_node) if f >= gpus]
    if fits:
        return (min(fits)[1],) * gpus
    order = sorted(range(len(free_gpus_per_node)), key=lambda n: (-free_gpus_per_node[n], n))
    return _fill(gpus, order, free_gpus_per_node)


def _fill(gpus: int, nodes: Sequence[int], free: Sequence[int]) -> tuple[int, ...]:
    out: list[int] = []
    for node in nodes:
        out.extend([node] * min(free[node], gpus - len(out)))
    return tuple(out)


def _fewest_servers(gpus: int, free: Sequence[int]) -> int:
    total = 0
    for k, f in enumerate(sorted(free, reverse=True), start=1):
        total += f
        if total >= gpus:
            return k
    raise ValueError(f"{gpus} GPUs do not fit {total} free")


def _tightest(gpus: int, k: int, free: Sequence[int]) -> list[int]:
    """``k`` servers holding ``gpus`` with little to spare: each pick is the server with
    the fewest free GPUs (lowest index) that still lets the largest remaining ones cover
    the rest."""
    left = sorted((n for n in range(len(free)) if free[n]), key=lambda n: (free[n], n))
    chosen: list[int] = []
    need = gpus
    for picks_after in range(k - 1, -1, -1):
        for i, node in enumerate(left):
            others = left[:i] + left[i + 1 :]
            reach = sum(free[n] for n in others[len(others) - picks_after :]) if picks_after else 0
            if free[node] + reach >= need:
                chosen.append(node)
                need -= free[node]
                del left[i]
                break
    return chosen


def _aligned(gpus: int, unit: int, free: Sequence[int]) -> list[int]:
    """Servers by the most whole groups of ``unit`` GPUs they hold (then fewest free,
    lowest index) until they hold ``gpus``."""
    order = sorted(
        (n for n in range(len(free)) if free[n]), key=lambda n: (-(free[n] // unit), free[n], n)
    )
    chosen: list[int] = []
    have = 0
    for node in order:
        if have >= gpus:
            break
        chosen.append(node)
        have += free[node]
    return chosen


def _best_fit(room: dict[int, int], size: int) -> int | None:
    fits = [(left, node) for node, left in room.items() if left >= size]
    return min(fits)[1] if fits else None


def _pack(degrees: Degrees, nodes: Sequence[int], free: Sequence[int]) -> tuple[int, ...]:
    """Ranks on ``nodes``: whole replicas best-fit, then whole tensor groups (a stage on
    the server of the stage before it where it fits, else best fit), then what is left
    rank by rank (the server of the rank before, else the one with most room)."""
    t, p = degrees.tensor, degrees.pipeline
    room = {n: free[n] for n in sorted(nodes)}
    out = [-1] * degrees.gpus
    replica_size = t * p
    replica = 0
    while replica < degrees.data:
        node = _best_fit(room, replica_size)
        if node is None:
            break
        start = replica * replica_size
        out[start : start + replica_size] = [node] * replica_size
        room[node] -= replica_size
        replica += 1
    previous: int | None = None
    for rank in range(replica * replica_size, degrees.gpus, t):
        if rank % replica_size == 0:
            previous = None
        node = previous if previous is not None and room[previous] >= t else _best_fit(room, t)
        if node is None:
            break
        out[rank : rank + t] = [node] * t
        room[node] -= t
        previous = node
    for rank in range(degrees.gpus):
        if out[rank] >= 0:
            continue
        before = out[rank - 1] if rank else -1
        if before < 0 or room.get(before, 0) == 0:
            before = min(room, key=lambda n: (-room[n], n))
        out[rank] = before
        room[before] -= 1
    return tuple(out)


def map_job(
    degrees: Degrees, free_gpus_per_node: Sequence[int], flows: Traffic | None = None
) -> tuple[int, ...] | None:
    """Node of each rank for a job of ``degrees``, or None when fewer GPUs are free.

    Candidates, all on the fewest servers: tensor groups, then pipeline stages, then
    replicas packed (``_pack``) onto the consolidated servers, onto the tightest set of
    servers, and onto the servers holding the most whole tensor groups; and the
    consolidated placement itself. The winner has the fewest servers, then the least
    inter-server traffic (MB under ``flows``; without it, tensor, then pipeline, then
    data crossings compared in that order), then the fewest free GPUs left on its
    servers, then the earliest candidate. Deterministic."""
    free = list(free_gpus_per_node)
    if any(f < 0 for f in free):
        raise ValueError("free_gpus_per_node: counts must be >= 0")
    gpus = degrees.gpus
    plain = consolidated(gpus, free)
    if plain is None:
        return None
    if len(set(plain)) == 1:
        return plain
    k = _fewest_servers(gpus, free)
    candidates: list[tuple[int, ...]] = []
    for nodes in (
        sorted(set(plain)),
        _tightest(gpus, k, free),
        _aligned(gpus, degrees.tensor, free),
    ):
        if sum(free[n] for n in nodes) >= gpus:
            candidates.append(_pack(degrees, nodes, free))
    candidates.append(plain)

    def cost(placement: tuple[int, ...]) -> tuple[float, ...]:
        used = set(placement)
        spare = sum(free[n] for n in used) - gpus
        crossing = (
            (inter_server_mb(flows, degrees, placement),)
            if flows is not None
            else crossing_units(degrees, placement)
        )
        return (len(used), *crossing, spare)

    return min(enumerate(candidates), key=lambda c: (*cost(c[1]), c[0]))[1]


# ------------------------------------------------------------- simulator and ground truth


@runtime_checkable
class ParallelPerformance(Protocol):
    """A performance model that times (d, t, p) jobs at a placement."""

    def parallel_iteration_time(
        self,
        model: str,
        batch_size: int,
        degrees: Degrees,
        node_of_rank: Sequence[int],
        accum_steps: int = 1,
    ) -> float: ...


def placed_iteration_time(
    truth: object, cluster: Cluster, spec: JobSpec, gpu_ids: Sequence[int], accum_steps: int = 1
) -> float | None:
    """Seconds per iteration of a (d, t, p) job on ``gpu_ids`` (rank r on gpu_ids[r]);
    None for a plain data-parallel job, or a model that does not time (d, t, p) jobs."""
    if spec.tensor_parallel * spec.pipeline_parallel == 1:
        return None
    if not isinstance(truth, ParallelPerformance) or len(gpu_ids) != spec.gpus:
        return None
    node_of = cluster.gpu_node
    return truth.parallel_iteration_time(
        spec.model, spec.batch_size, spec.degrees, [node_of[g] for g in gpu_ids], accum_steps
    )


def alone_iteration_time(truth: object, cluster: Cluster, spec: JobSpec) -> float | None:
    """As :func:`placed_iteration_time`, where the mapper puts the job on an idle cluster."""
    if spec.tensor_parallel * spec.pipeline_parallel == 1 or spec.gpus > cluster.total_gpus:
        return None
    nodes = map_job(spec.degrees, [n.gpus for n in cluster.nodes])
    if nodes is None or not isinstance(truth, ParallelPerformance):
        return None
    return truth.parallel_iteration_time(spec.model, spec.batch_size, spec.degrees, nodes)
