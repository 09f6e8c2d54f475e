"""Synergy-OPT: the best total throughput any CPU/memory split could give the running
jobs, as an integer program. An upper bound to hold TUNE against, never a schedule (it
ignores which node each job sits on).

Each job picks one cell of a (CPU per GPU, memory per GPU) grid; its normalised
throughput there (1.0 at the fair share) comes from the performance model. The program
maximises the sum of throughputs under the cluster's CPU and memory totals, with every
job at or above its fair-share throughput. Solved with scipy's ``milp`` (HiGHS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from libs.core.perf import PerformanceModel

#: Synergy's grid: CPU cores per GPU and host memory GB per GPU
CPU_AXIS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 12.0, 24.0)
MEM_AXIS = (20.83, 62.5, 125.0, 187.5, 250.0)

Cell = tuple[float, float]


@dataclass(frozen=True)
class OptJob:
    job_id: str
    gpus: int
    #: normalised throughput per (CPU per GPU, memory GB per GPU) cell
    throughput: Mapping[Cell, float]
    #: the fair-share throughput the job may not fall below
    fair_throughput: float = 1.0


@dataclass(frozen=True)
class OptResult:
    total_throughput: float
    #: the cell each job got, by job id
    cells: Mapping[str, Cell]


def opt_jobs(
    perf: PerformanceModel,
    jobs: Sequence[tuple[str, str, int]],
    cpu_axis: Sequence[float] = CPU_AXIS,
    mem_axis: Sequence[float] = MEM_AXIS,
) -> list[OptJob]:
    """(job id, model, GPUs) -> the grid of each job as the performance model gives it."""
    return [
        OptJob(
            job_id,
            gpus,
            {(c, m): perf.cpu_mem_speedup(model, gpus, c, m) for c in cpu_axis for m in mem_axis},
        )
        for job_id, model, gpus in jobs
    ]


def synergy_opt(jobs: Sequence[OptJob], total_cpus: float, total_mem_gb: float) -> OptResult:
    """The cells that maximise the jobs' total throughput within ``total_cpus`` and
    ``total_mem_gb``, each job at least at its fair-share throughput. Raises ValueError
    when no choice fits (the fair shares alone exceed the totals)."""
    if not jobs:
        return OptResult(0.0, {})
    columns: list[tuple[int, Cell]] = []
    for j, job in enumerate(jobs):
        allowed = [
            cell for cell, t in sorted(job.throughput.items()) if t >= job.fair_throughput - 1e-9
        ]
        if not allowed:
            raise ValueError(f"job {job.job_id}: no cell reaches its fair-share throughput")
        columns.extend((j, cell) for cell in allowed)
    n = len(columns)
    gain = np.array([jobs[j].throughput[cell] for j, cell in columns])
    one_cell = np.zeros((len(jobs), n))
    use = np.zeros((2, n))
    for k, (j, (cpus, mem)) in enumerate(columns):
        one_cell[j, k] = 1.0
        use[0, k] = cpus * jobs[j].gpus
        use[1, k] = mem * jobs[j].gpus
    result = milp(
        -gain,
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        constraints=[
            LinearConstraint(one_cell, 1, 1),
            LinearConstraint(use, -np.inf, [total_cpus, total_mem_gb]),
        ],
    )
    if not result.success or result.x is None:
        raise ValueError(f"no CPU/memory split fits: {result.message}")
    cells = {jobs[j].job_id: cell for k, (j, cell) in enumerate(columns) if result.x[k] > 0.5}
    return OptResult(float(-result.fun), cells)
