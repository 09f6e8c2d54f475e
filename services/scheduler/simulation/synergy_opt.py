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
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import pairwise
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies.base import Capabilities, Policy

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
    when no choice fits (the fair shares alone exceed the totals).

    Jobs alike (same GPUs, grid and floor) are one integer variable per cell, counting
    how many of them take it, and a cell another one beats (no more CPUs, memory or
    less throughput) is left out: neither changes the optimum, and both shrink the
    program a round of a whole cluster poses."""
    if not jobs:
        return OptResult(0.0, {})
    kinds: dict[tuple[int, float, tuple[tuple[Cell, float], ...]], list[int]] = {}
    for j, job in enumerate(jobs):
        key = (job.gpus, job.fair_throughput, tuple(sorted(job.throughput.items())))
        kinds.setdefault(key, []).append(j)
    columns: list[tuple[int, Cell, float]] = []  # kind, cell, throughput
    members = list(kinds.values())
    for k, ((_, floor, grid), _) in enumerate(kinds.items()):
        allowed = _frontier(floor, grid)
        if not allowed:
            raise ValueError(
                f"job {jobs[members[k][0]].job_id}: no cell reaches its fair-share throughput"
            )
        columns.extend((k, cell, t) for cell, t in allowed)
    n = len(columns)
    gain = np.array([t for _, _, t in columns])
    one_cell = np.zeros((len(members), n))
    use = np.zeros((2, n))
    for col, (k, (cpus, mem), _) in enumerate(columns):
        gpus = jobs[members[k][0]].gpus
        one_cell[k, col] = 1.0
        use[0, col] = cpus * gpus
        use[1, col] = mem * gpus
    counts = np.array([len(m) for m in members], dtype=float)
    result = milp(
        -gain,
        integrality=np.ones(n),
        bounds=Bounds(0, counts[[k for k, _, _ in columns]]),
        constraints=[
            LinearConstraint(one_cell, counts, counts),
            LinearConstraint(use, -np.inf, [total_cpus, total_mem_gb]),
        ],
    )
    if not result.success or result.x is None:
        raise ValueError(f"no CPU/memory split fits: {result.message}")
    cells: dict[str, Cell] = {}
    left = [iter(m) for m in members]
    for col, (k, cell, _) in enumerate(columns):
        for _ in range(round(result.x[col])):
            cells[jobs[next(left[k])].job_id] = cell
    return OptResult(float(-result.fun), cells)


@lru_cache(maxsize=4096)
def _frontier(floor: float, grid: tuple[tuple[Cell, float], ...]) -> tuple[tuple[Cell, float], ...]:
    """The cells at or above ``floor`` that no other cell beats (one with no more CPUs
    and memory and no less throughput)."""
    cells = [(cell, t) for cell, t in grid if t >= floor - 1e-9]
    return tuple(
        (cell, t)
        for cell, t in cells
        if not any(o != cell and o[0] <= cell[0] and o[1] <= cell[1] and u >= t for o, u in cells)
    )


# ------------------------------------------------------------------ the bound, per round


@dataclass(frozen=True)
class RoundBound:
    """One decision's jobs holding GPUs: their total normalised throughput at the
    allocation the decision left them and OPT's bound on it (None: no jobs, or OPT found
    no split, as when GPU sharing counts one GPU's share twice)."""

    time: float
    jobs: int
    policy: float
    opt: float | None


class OptBounded:
    """Decides as ``policy`` does and, after each decision, bounds the total normalised
    throughput of the jobs then holding GPUs with Synergy-OPT (over the whole cluster's
    CPUs and memory), beside the throughput of the allocation the decision gave them.

    A job's normalised throughput at (CPUs, GB) per GPU is the performance model's
    speed-up there over the one at its GPUs' proportional share, as the simulator speeds
    it. OPT's cells are the grid, the proportional share and the job's own allocation, so
    the allocation the policy chose is one of its choices and the bound is never below
    it. Nothing here changes the decision."""

    def __init__(
        self,
        policy: Policy,
        cpu_axis: Sequence[float] = CPU_AXIS,
        mem_axis: Sequence[float] = MEM_AXIS,
    ) -> None:
        self.policy = policy
        self.rounds: list[RoundBound] = []
        self._grid = tuple((c, m) for c in cpu_axis for m in mem_axis)
        self._jobs: dict[tuple[str, int, Cell, Cell], OptJob] = {}
        self._last: tuple[tuple[tuple[str, int, Cell, Cell], ...], float | None] | None = None

    @property
    def capabilities(self) -> Capabilities:
        return self.policy.capabilities

    def __getattr__(self, attr: str) -> Any:
        # name, preemptive, queue_sort and whatever else a driver asks the policy
        return getattr(self.policy, attr)

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.policy.decide(snapshot)
        self.rounds.append(self._bound(snapshot, decision))
        return decision

    def _bound(self, snapshot: Snapshot, decision: Decision) -> RoundBound:
        cluster = snapshot.cluster
        perf = snapshot.estimates
        kinds = []
        for model, gpu_ids, cpus, mem_gb in _holding(snapshot, decision):
            g = len(gpu_ids)
            fair_cpus, fair_mem = cluster.proportional_share(gpu_ids)
            fair = (fair_cpus / g, fair_mem / g)
            own = (
                fair[0] if cpus is None else cpus / g,
                fair[1] if mem_gb is None else mem_gb / g,
            )
            kinds.append((model, g, fair, own))
        if not kinds:
            return RoundBound(snapshot.now, 0, 0.0, None)
        grids = [self._grid_of(perf, kind) for kind in kinds]
        policy = sum(grid.throughput[kind[3]] for grid, kind in zip(grids, kinds, strict=True))
        key = tuple(sorted(kinds))
        if self._last is None or self._last[0] != key:
            jobs = [replace(grid, job_id=str(i)) for i, grid in enumerate(grids)]
            total_cpus = sum(float(n.cpus) for n in cluster.nodes)
            total_mem = sum(n.host_mem_gb for n in cluster.nodes)
            try:
                opt: float | None = synergy_opt(jobs, total_cpus, total_mem).total_throughput
            except ValueError:
                opt = None
            self._last = (key, opt)
        return RoundBound(snapshot.now, len(kinds), policy, self._last[1])

    def _grid_of(self, perf: PerformanceModel, kind: tuple[str, int, Cell, Cell]) -> OptJob:
        """The normalised grid of jobs of one kind (model, GPUs, fair cell, own cell)."""
        job = self._jobs.get(kind)
        if job is None:
            model, gpus, fair, own = kind
            at_fair = perf.cpu_mem_speedup(model, gpus, *fair)
            job = self._jobs[kind] = OptJob(
                "",
                gpus,
                {
                    cell: perf.cpu_mem_speedup(model, gpus, *cell) / at_fair
                    for cell in {*self._grid, fair, own}
                },
            )
        return job

    def summary(self) -> dict[str, float | int]:
        """Over the run: decisions bounded (and those with jobs OPT found no split for),
        OPT's bound and the policy's throughput as means over simulated time (each
        decision standing until the next), the bound's least, and the policy's share of
        the bound (mean over time, and its worst decision)."""
        rounds = self.rounds
        spans = [later.time - r.time for r, later in pairwise(rounds)]
        bounded = [
            (r, opt, span)
            for r, span in zip(rounds, [*spans, 0.0], strict=True)
            if (opt := r.opt) is not None
        ]
        figures: dict[str, float | int] = {
            "decisions": len(bounded),
            "unbounded": sum(1 for r in rounds if r.jobs and r.opt is None),
        }
        if not bounded:
            return figures
        total = sum(span for _, _, span in bounded)

        def mean(values: list[float]) -> float:
            if not total:  # every bounded decision at one instant
                return sum(values) / len(values)
            return sum(v * span for v, (_, _, span) in zip(values, bounded, strict=True)) / total

        ratios = [r.policy / opt for r, opt, _ in bounded]
        return figures | {
            "opt_throughput_mean": mean([opt for _, opt, _ in bounded]),
            "opt_throughput_min": min(opt for _, opt, _ in bounded),
            "policy_throughput_mean": mean([r.policy for r, _, _ in bounded]),
            "policy_to_opt_mean": mean(ratios),
            "policy_to_opt_min": min(ratios),
        }


def _holding(
    snapshot: Snapshot, decision: Decision
) -> list[tuple[str, tuple[int, ...], float | None, float | None]]:
    """(model, GPUs, CPUs, GB) of every job holding GPUs once ``decision`` is applied."""
    gone = {p.job_id for p in decision.preemptions}
    moved = {r.job_id: r.gpu_ids for r in decision.resizes}
    realloc = {r.job_id: (r.cpus, r.mem_gb) for r in decision.reallocations}
    held = [
        (
            job.model,
            moved.get(job.job_id, job.gpu_ids),
            *realloc.get(job.job_id, (job.cpus, job.mem_gb)),
        )
        for job in snapshot.running
        if job.job_id not in gone
    ]
    held += [(snapshot.job(s.job_id).model, s.gpu_ids, s.cpus, s.mem_gb) for s in decision.starts]
    return held
