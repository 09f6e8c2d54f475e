"""Synergy's throughput grids over CPU cores and memory per GPU
(``profiles/synergy/models.json``): what the ground truth takes a CPU/memory speedup from
where a model has a Synergy counterpart."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.libs.core.perf import CpuMemDemand
from gpusched.libs.core.profiles.files import finite_rate, load_json

#: Synergy's GPU-proportional share per GPU, used when models.json does not state one
SYNERGY_FAIR_CPUS = 3.0
SYNERGY_FAIR_MEM_GB = 62.5


@dataclass(frozen=True, slots=True)
class SynergyGrid:
    """Throughput over CPU cores per GPU (rows) x memory GB per GPU (columns)."""

    cpu_axis: tuple[float, ...]
    mem_axis: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]

    def at(self, cpus: float, mem_gb: float) -> float:
        """Bilinear interpolation, clamped to the grid's edges."""
        i, fi = _bracket(self.cpu_axis, cpus)
        j, fj = _bracket(self.mem_axis, mem_gb)
        v = self.values
        low = v[i][j] + (v[i][j + 1] - v[i][j]) * fj
        high = v[i + 1][j] + (v[i + 1][j + 1] - v[i + 1][j]) * fj
        return low + (high - low) * fi


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """Index of the cell holding ``x`` and the fraction across it (clamped)."""
    if x <= axis[0]:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 2, 1.0
    i = bisect.bisect_right(axis, x) - 1
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclass(frozen=True, slots=True)
class SynergyModel:
    """What Synergy profiled of one model on one GPU besides its grid."""

    #: the best-case vector and its speed-up (``best_*``, ``speedup_at_best``)
    demand: CpuMemDemand
    #: seconds per iteration of ``batch_size`` at the fair share
    iter_time_s: float
    batch_size: int


@dataclass(frozen=True, slots=True)
class SynergyData:
    #: Synergy model name -> GPU count profiled -> grid
    grids: Mapping[str, Mapping[int, SynergyGrid]]
    fair_cpus: float
    fair_mem_gb: float
    #: Synergy model name -> its 1-GPU profile (models without one are left out)
    models: Mapping[str, SynergyModel] = field(default_factory=dict)

    def speedup(self, synergy_model: str, gpus: int, cpus: float, mem_gb: float) -> float | None:
        by_gpus = self.grids.get(synergy_model)
        if not by_gpus:
            return None
        fitting = [g for g in by_gpus if g <= gpus]
        grid = by_gpus[max(fitting) if fitting else min(by_gpus)]
        fair = grid.at(self.fair_cpus, self.fair_mem_gb)
        if fair <= 0:
            return None
        return max(grid.at(cpus, mem_gb) / fair, 0.01)


def _axis(path: Path, document: Mapping[str, Any], field: str) -> tuple[float, ...]:
    axis = document.get(field)
    numbers = isinstance(axis, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in axis
    )
    values = tuple(float(x) for x in axis) if numbers and axis else ()
    if len(values) < 2 or list(values) != sorted(set(values)):
        raise ValueError(f"{path}: field {field!r}: expected an increasing list of numbers")
    return values


def _grid_rows(path: Path, where: str, raw: Any, cpu_n: int, mem_n: int) -> list[list[float]]:
    """Rows of a grid, each right-aligned to the memory axis (short rows lack the
    smallest memory sizes); 0 marks a cell Synergy did not measure (None here)."""
    if not isinstance(raw, list) or len(raw) != cpu_n:
        raise ValueError(f"{path}: {where}: expected {cpu_n} rows (one per CPU count)")
    rows = []
    for r, row in enumerate(raw):
        if not isinstance(row, list) or not 1 <= len(row) <= mem_n:
            raise ValueError(f"{path}: {where}, row {r}: expected 1..{mem_n} values")
        values = [finite_rate(path, f"{where}, row {r}", x) for x in row]
        if any(x < 0 for x in values):
            raise ValueError(f"{path}: {where}, row {r}: throughputs must be >= 0")
        rows.append([math.nan] * (mem_n - len(row)) + [x if x > 0 else math.nan for x in values])
    return rows


def _fill_grid(rows: list[list[float]], fallback: SynergyGrid | None) -> list[list[float]]:
    """Complete unmeasured cells: memory columns missing for multi-GPU grids come from
    the single-GPU grid; an unmeasured CPU count behaves like the nearest measured one
    (more cores than measured never hurt, so the lower neighbour is preferred)."""
    unmeasured = [j for j in range(len(rows[0])) if all(math.isnan(r[j]) for r in rows)]
    if fallback is not None:
        for i, row in enumerate(rows):
            for j in unmeasured:
                row[j] = fallback.values[i][j]
    for j in range(len(rows[0])):
        column = [r[j] for r in rows]
        measured = [i for i, v in enumerate(column) if not math.isnan(v)]
        for i in range(len(rows)):
            if math.isnan(rows[i][j]) and measured:
                below = [m for m in measured if m < i]
                rows[i][j] = column[max(below) if below else min(measured)]
    for row in rows:  # a column still without values copies its neighbour on the right
        for j in range(len(row) - 2, -1, -1):
            if math.isnan(row[j]):
                row[j] = row[j + 1]
    return rows


def _read_synergy_model(
    path: Path, name: str, entry: Any, cpu_axis: tuple[float, ...], mem_axis: tuple[float, ...]
) -> dict[int, SynergyGrid]:
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"{path}: model {name!r}: expected an object keyed by GPU count")
    grids: dict[int, SynergyGrid] = {}
    for raw_gpus in sorted(entry, key=lambda k: int(k) if str(k).isdigit() else 0):
        where = f"model {name!r}, gpus {raw_gpus!r}"
        if not str(raw_gpus).isdigit() or int(raw_gpus) < 1:
            raise ValueError(f"{path}: {where}: GPU count must be a positive integer")
        cell = entry[raw_gpus]
        raw = cell.get("normalized_throughput") if isinstance(cell, dict) else None
        rows = _grid_rows(path, where, raw, len(cpu_axis), len(mem_axis))
        if all(math.isnan(v) for row in rows for v in row):
            raise ValueError(f"{path}: {where}: the grid holds no measurement")
        filled = _fill_grid(rows, grids.get(1))
        grids[int(raw_gpus)] = SynergyGrid(cpu_axis, mem_axis, tuple(map(tuple, filled)))
    return grids


def _number(path: Path, where: str, cell: Mapping[str, Any], key: str) -> float | None:
    value = cell.get(key)
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not value > 0 or not math.isfinite(value):
        raise ValueError(
            f"{path}: {where}, field {key!r}: expected a finite number > 0, got {value!r}"
        )
    return float(value)


def _read_one_gpu_profile(
    path: Path, name: str, entry: Any, mem_axis: tuple[float, ...]
) -> SynergyModel | None:
    """The 1-GPU best case and iteration time; a best-case memory of null (Synergy's
    "any") is the smallest memory profiled."""
    cell = entry.get("1") if isinstance(entry, dict) else None
    if not isinstance(cell, dict):
        return None
    where = f"model {name!r}, gpus '1'"
    cpus = _number(path, where, cell, "best_cpu_per_gpu")
    mem = _number(path, where, cell, "best_mem_gb_per_gpu")
    speedup = _number(path, where, cell, "speedup_at_best")
    iter_s = _number(path, where, cell, "iter_time_s_at_fair_share")
    batch = _number(path, where, cell, "batch_size")
    if cpus is None or speedup is None or iter_s is None or batch is None:
        return None
    demand = CpuMemDemand(cpus, mem_axis[0] if mem is None else mem, speedup)
    return SynergyModel(demand, iter_s, max(1, round(batch)))


def read_synergy(path: Path) -> SynergyData:
    document = load_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("models"), dict):
        raise ValueError(f"{path}: expected an object with a 'models' object")
    cpu_axis = _axis(path, document, "cpu_per_gpu_axis")
    mem_axis = _axis(path, document, "mem_gb_per_gpu_axis")
    fair = document.get("fair_share_per_gpu") or {}
    grids = {
        name: _read_synergy_model(path, name, entry, cpu_axis, mem_axis)
        for name, entry in document["models"].items()
    }
    profiles = {
        name: _read_one_gpu_profile(path, name, entry, mem_axis)
        for name, entry in document["models"].items()
    }
    return SynergyData(
        grids,
        fair_cpus=float(fair.get("cpu", SYNERGY_FAIR_CPUS)),
        fair_mem_gb=float(fair.get("mem_gb", SYNERGY_FAIR_MEM_GB)),
        models={name: found for name, found in profiles.items() if found is not None},
    )
