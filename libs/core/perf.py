"""The performance-model interface.

Two implementations of one protocol, never confused: the ground truth (what really
happens; drives the simulator and emulated GPUs) and the estimates a scheduler
believes (learned or profiled, possibly wrong). Policies only ever see estimates.

Contract every implementation keeps (the simulator's invariants rely on it):
- ``iteration_time`` > 0; it never decreases when a job spans more nodes for the same
  GPU count, and ``accum_steps`` > 1 never makes an iteration of the global batch
  faster than ``accum_steps`` == 1;
- ``colocation_slowdown`` >= 1;
- ``gpu_memory_mb`` > 0 and never decreases as the per-GPU batch grows.
Implementations cache: these calls sit on the simulator's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.shape import JobShape


class UnknownModelError(KeyError):
    """A model name the performance model has no profile for."""

    def __init__(self, model: str, known: tuple[str, ...]) -> None:
        super().__init__(model)
        self.model = model
        self.known = known

    def __str__(self) -> str:
        return f"unknown model {self.model!r}; known models: {', '.join(sorted(self.known))}"


@dataclass(frozen=True, slots=True)
class CpuMemDemand:
    """A model's best-case CPU/memory demand on one GPU (Synergy's optimistic profile):
    the CPU cores and host memory per GPU at which its throughput peaks, and the
    speed-up that gives over the GPU-proportional share."""

    cpus_per_gpu: float
    mem_gb_per_gpu: float
    speedup: float


def demand_on_node(
    demand: CpuMemDemand,
    gpus: int,
    node_cpus: float,
    node_gpus: int,
    fair_cpus_per_gpu: float,
    fair_mem_gb_per_gpu: float,
) -> CpuMemDemand:
    """The best-case demand of a job of ``gpus`` GPUs on servers of ``node_cpus`` CPUs and
    ``node_gpus`` GPUs, as Synergy scales it: the 1-GPU vector per GPU; where the job's
    CPUs would exceed the server's, capped at the server's and the speed-up scaled down
    linearly, ``s = 1 + (s_best - 1)(C - f g)/(g c_best - f g)`` (C the server's CPUs, f
    the fair CPUs per GPU); a job wider than a server gets the fair share (speed-up 1)."""
    fair = CpuMemDemand(fair_cpus_per_gpu, fair_mem_gb_per_gpu, 1.0)
    if gpus > node_gpus:
        return fair
    wanted = gpus * demand.cpus_per_gpu
    if wanted <= node_cpus:
        return demand
    above_fair = wanted - gpus * fair_cpus_per_gpu
    room = node_cpus - gpus * fair_cpus_per_gpu
    if above_fair <= 0 or room <= 0:
        return fair
    speedup = 1.0 + (demand.speedup - 1.0) * room / above_fair
    return CpuMemDemand(node_cpus / gpus, demand.mem_gb_per_gpu, speedup)


@runtime_checkable
class PerformanceModel(Protocol):
    def models(self) -> tuple[str, ...]:
        """Every model name this performance model knows."""
        ...

    def default_batch_size(self, model: str) -> int:
        """The global batch size a job of this model uses when its trace gives none."""
        ...

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        """Seconds per iteration of the global ``batch_size``, running alone on its GPUs.

        ``nodes`` is how many servers the ``gpus`` span; ``accum_steps`` splits the
        per-GPU batch into that many sub-batches (gradient accumulation).
        """
        ...

    def colocation_slowdown(self, shape: JobShape, partner: JobShape) -> float:
        """Co-located iteration time / exclusive iteration time of a job of ``shape``
        beside one of ``partner`` (>= 1).

        What shares a GPU is one worker of each job, so the value may depend on the two
        models and on each one's per-GPU batch and accumulation steps (its sub-batch),
        not on the GPU count itself: policies reuse one value for every job shape of a
        model with the same per-GPU batch."""
        ...

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        """GPU memory one worker of ``model`` holds with this per-GPU (sub-)batch."""
        ...

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        """Throughput relative to the GPU-proportional CPU and memory share (1.0 there)."""
        ...

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        """The 1-GPU best-case CPU/memory vector of ``model`` and its speed-up over the
        GPU-proportional share."""
        ...


@runtime_checkable
class ConvergenceSource(Protocol):
    """A ground truth that knows how long some models train to converge at each batch
    (their jobs then end on convergence, and a new batch changes what is left)."""

    def convergence(self, model: str) -> Convergence | None:
        """The convergence curve of ``model``; None where its jobs run fixed iterations."""
        ...


class DelegatingModel:
    """A :class:`PerformanceModel` that answers everything from ``inner``: the base of a
    wrapper that changes some answers (it overrides just those methods)."""

    def __init__(self, inner: PerformanceModel) -> None:
        self.inner = inner

    def models(self) -> tuple[str, ...]:
        return self.inner.models()

    def default_batch_size(self, model: str) -> int:
        return self.inner.default_batch_size(model)

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        return self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)

    def colocation_slowdown(self, shape: JobShape, partner: JobShape) -> float:
        return self.inner.colocation_slowdown(shape, partner)

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        return self.inner.gpu_memory_mb(model, per_gpu_batch)

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        return self.inner.cpu_mem_speedup(model, gpus, cpus_per_gpu, mem_gb_per_gpu)

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        return self.inner.cpu_mem_demand(model)
