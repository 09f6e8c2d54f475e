"""Pollux step and sync times by placement and per-GPU batch (``profiles/pollux/<model>``):
what the ground truth takes an iteration time from where a model has them."""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.libs.core.profiles.builtin import ring_factor
from gpusched.libs.core.profiles.files import csv_rows, integer_cell, number_cell

#: floor of the compute part of a step, so that noisy data never yields a zero time
MIN_COMPUTE_S = 1e-6
#: beyond the largest profiled batch a GPU is saturated, so each extra sample costs at
#: least this fraction of the average cost per sample at the last profiled point
MIN_MARGINAL_FRACTION = 0.5
#: below the smallest profiled batch, the fixed overhead is kept within this fraction of
#: the step time at that batch (and the step time itself)
MIN_OVERHEAD_FRACTION = 0.1


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation, constant beyond the ends; exact at the knots."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class StepCurve:
    """Pollux step and sync time of one configuration at increasing per-GPU batch sizes.

    As in Pollux, ``step`` includes ``sync`` (the gradient all-reduce wait), and a
    gradient-accumulation sub-step costs ``step - sync``.
    """

    bsz: tuple[float, ...]
    step: tuple[float, ...]
    sync: tuple[float, ...]

    def covers(self, batch: float) -> bool:
        return self.bsz[0] <= batch <= self.bsz[-1]

    def sync_at(self, batch: float) -> float:
        # waiting for the all-reduce hardly depends on the batch: hold it at the ends
        return _interp(self.bsz, self.sync, batch)

    def step_at(self, batch: float) -> float:
        if self.covers(batch):
            return _interp(self.bsz, self.step, batch)
        if batch > self.bsz[-1]:
            return self._beyond(batch)
        return self._below(batch)

    def _beyond(self, batch: float) -> float:
        x1, y1 = self.bsz[-1], self.step[-1]
        slope = MIN_MARGINAL_FRACTION * y1 / x1
        if len(self.bsz) >= 2:
            slope = max(slope, (y1 - self.step[-2]) / (x1 - self.bsz[-2]))
        return y1 + slope * (batch - x1)

    def _below(self, batch: float) -> float:
        x0, y0 = self.bsz[0], self.step[0]
        intercept = MIN_OVERHEAD_FRACTION * y0
        if len(self.bsz) >= 2:
            slope = (self.step[1] - y0) / (self.bsz[1] - x0)
            intercept = min(y0, max(intercept, y0 - slope * x0))
        return intercept + (y0 - intercept) * batch / x0


#: measurements by configuration, then per-GPU batch: every (step, sync) seen there
_Points = dict[Any, dict[float, list[tuple[float, float]]]]


def _new_points() -> _Points:
    return defaultdict(lambda: defaultdict(list))


def _curves(points: _Points) -> dict[Any, StepCurve]:
    """Average repeated measurements and sort each configuration by batch size."""
    curves = {}
    for key, by_bsz in points.items():
        bsz = tuple(sorted(by_bsz))
        means = [_mean_pair(by_bsz[b]) for b in bsz]
        curves[key] = StepCurve(bsz, tuple(m[0] for m in means), tuple(m[1] for m in means))
    return curves


def _mean_pair(values: list[tuple[float, float]]) -> tuple[float, float]:
    return (sum(v[0] for v in values) / len(values), sum(v[1] for v in values) / len(values))


_PLACEMENT_FIELDS = ("placement", "local_bsz", "step_time", "sync_time")
_SCALABILITY_FIELDS = ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")


def _step_point(path: Path, line: int, row: Mapping[str, Any]) -> tuple[float, float, float]:
    """(per-GPU batch, step time, sync time) of one measured row."""
    bsz = number_cell(path, line, "local_bsz", row["local_bsz"], positive=True)
    step = number_cell(path, line, "step_time", row["step_time"], positive=True)
    sync = number_cell(path, line, "sync_time", row["sync_time"], positive=False)
    return bsz, step, sync


def _read_placements(path: Path) -> dict[str, StepCurve]:
    points = _new_points()
    for line, row in csv_rows(path, _PLACEMENT_FIELDS):
        placement = (row["placement"] or "").strip()
        if not re.fullmatch(r"[1-9]+", placement):
            raise ValueError(
                f"{path}, line {line}, field 'placement': expected digits 1-9 "
                f"(GPUs per node), got {row['placement']!r}"
            )
        bsz, step, sync = _step_point(path, line, row)
        points[placement][bsz].append((step, sync))
    return _curves(points)


def _read_scalability(path: Path) -> dict[tuple[int, int], StepCurve]:
    """Scalability runs keyed by (gpus, nodes)."""
    points = _new_points()
    for line, row in csv_rows(path, _SCALABILITY_FIELDS):
        nodes = integer_cell(path, line, "num_nodes", row["num_nodes"])
        gpus = integer_cell(path, line, "num_replicas", row["num_replicas"])
        if gpus < nodes:
            raise ValueError(
                f"{path}, line {line}, field 'num_replicas': "
                f"{gpus} replicas cannot span {nodes} nodes"
            )
        bsz, step, sync = _step_point(path, line, row)
        points[(gpus, nodes)][bsz].append((step, sync))
    return _curves(points)


def _by_gpus_and_nodes(placements: Mapping[str, StepCurve]) -> dict[tuple[int, int], StepCurve]:
    """The most consolidated placement for each (gpus, nodes) the file profiles: the one
    with the most GPUs on its fullest servers (ties: the smallest string)."""
    best: dict[tuple[int, int], str] = {}
    for placement in sorted(placements):
        key = (sum(int(c) for c in placement), len(placement))
        if key not in best or _shape(placement) > _shape(best[key]):
            best[key] = placement
    return {key: placements[p] for key, p in best.items()}


def _shape(placement: str) -> tuple[int, ...]:
    """GPUs per server, fullest first: compares by consolidation."""
    return tuple(sorted((int(c) for c in placement), reverse=True))


@dataclass(frozen=True, slots=True)
class PolluxProfile:
    """Pollux measurements of one model: one GPU, and (gpus, nodes) configurations."""

    single: StepCurve
    configs: Mapping[tuple[int, int], StepCurve]

    def compute_s(self, batch: float) -> float:
        """Time of one forward/backward pass of ``batch`` on one GPU, without sync."""
        return max(self.single.step_at(batch) - self.single.sync_at(batch), MIN_COMPUTE_S)

    def step_sync(self, batch: float, gpus: int, nodes: int) -> tuple[float, float] | None:
        """Step and sync time at this per-GPU batch; None where nothing profiled fits."""
        if (gpus, nodes) == (1, 1):
            return self.single.step_at(batch), self.single.sync_at(batch)
        curve = self.configs.get((gpus, nodes))
        if curve is not None:
            return self._profiled(curve, batch)
        return self._scaled(batch, gpus, nodes)

    def _profiled(self, curve: StepCurve, batch: float) -> tuple[float, float]:
        sync = curve.sync_at(batch)
        if curve.covers(batch):
            return curve.step_at(batch), sync
        # outside this configuration's batches: follow the single-GPU compute curve
        # (profiled more widely) plus the overhead measured at the nearest edge
        edge = curve.bsz[0] if batch < curve.bsz[0] else curve.bsz[-1]
        overhead = curve.step_at(edge) - self.compute_s(edge)
        return self.compute_s(batch) + overhead, sync

    def _scaled(self, batch: float, gpus: int, nodes: int) -> tuple[float, float] | None:
        """An unprofiled size: scale the sync of the nearest profiled configuration by
        the ring all-reduce volume, which keeps the testbed's real bandwidths."""
        ref = self._reference(gpus, nodes)
        if ref is None:
            return None
        ref_gpus, curve = ref
        sync = curve.sync_at(batch) * ring_factor(gpus) / ring_factor(ref_gpus)
        return self.compute_s(batch) + sync, sync

    def _reference(self, gpus: int, nodes: int) -> tuple[int, StepCurve] | None:
        same_kind = [k for k in self.configs if k[0] > 1 and (k[1] > 1) == (nodes > 1)]
        if not same_kind:
            return None
        # nearest node count first (ties: more nodes, the pessimistic side), then GPUs
        key = min(same_kind, key=lambda k: (abs(k[1] - nodes), -k[1], abs(k[0] - gpus), -k[0]))
        return key[0], self.configs[key]


def read_pollux_model(directory: Path) -> PolluxProfile | None:
    """Pollux profile of one model, or None when it lacks single-GPU measurements."""
    placements_csv, scalability_csv = directory / "placements.csv", directory / "scalability.csv"
    placements = _read_placements(placements_csv) if placements_csv.is_file() else {}
    scalability = _read_scalability(scalability_csv) if scalability_csv.is_file() else {}
    single = placements.get("1")
    if single is None:
        return None
    # a measured placement is better evidence than a scalability run of the same size
    configs = {**scalability, **_by_gpus_and_nodes(placements)}
    configs.pop((1, 1), None)
    return PolluxProfile(single, configs)
