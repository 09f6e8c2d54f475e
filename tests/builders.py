"""Builders for policy and simulator tests: a table-driven performance model whose
numbers can be worked out by hand, and snapshot builders."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpusched.libs.core.cluster import (
    DEFAULT_CPUS_PER_GPU,
    DEFAULT_HOST_MEM_GB_PER_GPU,
    Cluster,
    Node,
)
from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.perf import CpuMemDemand, UnknownModelError
from gpusched.libs.core.shape import JobShape
from gpusched.libs.core.snapshot import JobView, Snapshot


@dataclass(frozen=True)
class TablePerf:
    """Seconds per iteration = ``iter_s[model]`` on one node (x ``spread_penalty`` per extra
    node, x accum_steps ** accum_exponent), slowdown = ``slowdown[(model, partner)]``
    (default ``default_slowdown``), memory = ``mem_mb[model]`` x (per-GPU batch /
    ``ref_batch``) ** 0.5."""

    iter_s: dict[str, float] = field(default_factory=lambda: {"a": 1.0, "b": 1.0})
    slowdown: dict[tuple[str, str], float] = field(default_factory=dict)
    default_slowdown: float = 1.25
    mem_mb: dict[str, float] = field(default_factory=dict)
    ref_batch: float = 32.0
    spread_penalty: float = 1.0
    accum_exponent: float = 0.0
    #: best-case CPU/memory demand per model (default: 3 CPUs, 62.5 GB, speed-up 1)
    demand: dict[str, CpuMemDemand] = field(default_factory=dict)

    def models(self) -> tuple[str, ...]:
        return tuple(self.iter_s)

    def _check(self, model: str) -> None:
        if model not in self.iter_s:
            raise UnknownModelError(model, self.models())

    def default_batch_size(self, model: str) -> int:
        self._check(model)
        return 32

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        self._check(model)
        return (
            self.iter_s[model]
            * self.spread_penalty ** (nodes - 1)
            * accum_steps**self.accum_exponent
        )

    def colocation_slowdown(self, shape: JobShape, partner: JobShape) -> float:
        return self.slowdown.get((shape.model, partner.model), self.default_slowdown)

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        return self.mem_mb.get(model, 1000.0) * (per_gpu_batch / self.ref_batch) ** 0.5

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        return 1.0

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        return self.demand.get(model, CpuMemDemand(3.0, 62.5, 1.0))



@dataclass(frozen=True)
class ConvergingPerf(TablePerf):
    """``TablePerf`` whose models in ``curves`` end on convergence (a ground truth the
    simulator then follows across batch changes)."""

    curves: dict[str, Convergence] = field(default_factory=dict)

    def convergence(self, model: str) -> Convergence | None:
        return self.curves.get(model)

def cluster(
    nodes: int = 1,
    gpus: int = 4,
    gpu_mem_mb: int = 10_000,
    cpus: int = DEFAULT_CPUS_PER_GPU * 8,
    host_mem_gb: float = DEFAULT_HOST_MEM_GB_PER_GPU * 8,
) -> Cluster:
    return Cluster(tuple(Node(f"n{i}", gpus, gpu_mem_mb, cpus, host_mem_gb) for i in range(nodes)))


def job(
    job_id: str,
    submit: float = 0.0,
    iterations: int = 100,
    gpus: int = 1,
    model: str = "a",
    batch: int = 32,
    share: bool = True,
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        submit_time=submit,
        model=model,
        gpus=gpus,
        batch_size=batch,
        iterations=iterations,
        allow_sharing=share,
    )


def pending(
    job_id: str,
    remaining_s: float,
    gpus: int = 1,
    submit: float = 0.0,
    model: str = "a",
    batch: int = 32,
    share: bool = True,
    attained: float = 0.0,
    queued_since: float = 0.0,
) -> JobView:
    return JobView(
        job_id=job_id,
        submit_time=submit,
        model=model,
        gpus=gpus,
        batch_size=batch,
        est_remaining_s=remaining_s,
        attained_gpu_s=attained,
        allow_sharing=share,
        oracle_remaining_s=remaining_s,
        queued_since=queued_since,
    )


def running(
    job_id: str,
    remaining_s: float,
    gpu_ids: tuple[int, ...],
    model: str = "a",
    batch: int = 32,
    share: bool = True,
    attained: float = 0.0,
    as_of: float = 0.0,
    accum: int = 1,
    cpus: float | None = None,
    mem_gb: float | None = None,
) -> JobView:
    return JobView(
        job_id=job_id,
        submit_time=0.0,
        model=model,
        gpus=len(gpu_ids),
        batch_size=batch,
        est_remaining_s=remaining_s,
        attained_gpu_s=attained,
        as_of=as_of,
        allow_sharing=share,
        oracle_remaining_s=remaining_s,
        state=JobState.RUNNING,
        gpu_ids=gpu_ids,
        accum_steps=accum,
        progress_rate=1.0,
        cpus=cpus,
        mem_gb=mem_gb,
    )


def snapshot(
    cl: Cluster,
    perf: TablePerf,
    pending_jobs: list[JobView] = (),  # type: ignore[assignment]
    running_jobs: list[JobView] = (),
    now: float = 0.0,
) -> Snapshot:  # type: ignore[assignment]
    return Snapshot.of_jobs(now, cl, tuple(pending_jobs), tuple(running_jobs), perf)
