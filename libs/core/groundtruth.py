"""The ground-truth performance model: what really happens when a job runs.

It drives the simulator and the node agent's emulated GPUs; schedulers never read it
directly (they see estimates, e.g. :class:`NoisyEstimates`).

Two layers:

- the project's own analytic profiles (``builtin/profiles.json``), which cover every
  model and make every command work without research data;
- research profiles read at run time from a data directory (never copied into the
  project), each overriding the analytic layer only where it has measurements:
  Pollux step times by placement and per-GPU batch (iteration time), Gavel throughputs
  of co-located pairs on V100 (co-location slowdown) and Synergy's throughput grids over
  CPU cores and memory per GPU (CPU/memory speedup).

Interpolated measurements are noisy, so the contract of
:class:`~libs.core.perf.PerformanceModel` is enforced explicitly on top of them (for
example, an iteration on more nodes takes the maximum of its own estimate and the
estimate on fewer nodes). Every public method caches its results by argument tuple: the
model is immutable after construction and these calls sit on the simulator's hot path.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import math
import random
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from libs.core.perf import PerformanceModel, UnknownModelError

#: slowdown reported for a pair that Gavel measured as not fitting on one GPU together;
#: large enough that no sharing policy picks it, yet finite so arithmetic stays sane
DOES_NOT_FIT_SLOWDOWN = 10.0
#: the Gavel table used for co-location: V100 is closest to the GPUs we simulate
GAVEL_GPU = "v100"
#: floor of the compute part of a step, so that noisy data never yields a zero time
MIN_COMPUTE_S = 1e-6
#: beyond the largest profiled batch a GPU is saturated, so each extra sample costs at
#: least this fraction of the average cost per sample at the last profiled point
MIN_MARGINAL_FRACTION = 0.5
#: below the smallest profiled batch, the fixed overhead is kept within this fraction of
#: the step time at that batch (and the step time itself)
MIN_OVERHEAD_FRACTION = 0.1
#: Synergy's GPU-proportional share per GPU, used when models.json does not state one
SYNERGY_FAIR_CPUS = 3.0
SYNERGY_FAIR_MEM_GB = 62.5

CATEGORIES = ("image", "language", "speech", "recommendation", "rl")


# --------------------------------------------------------------------------- profiles


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model of the built-in analytic profile set (see ``builtin/profiles.json``)."""

    name: str
    category: str
    default_batch_size: int
    t0_s: float
    per_sample_s: float
    mem_base_mb: float
    mem_per_sample_mb: float
    intensity: float
    comm_mb: float
    cpu_mem_class: str
    gavel_type: str | None
    synergy_model: str | None

    def compute_s(self, per_gpu_batch: float) -> float:
        return self.t0_s + self.per_sample_s * per_gpu_batch


@dataclass(frozen=True, slots=True)
class Network:
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    inter_node_latency_s: float

    def allreduce_s(self, comm_mb: float, gpus: int, nodes: int) -> float:
        """Ring all-reduce of ``comm_mb`` over ``gpus`` GPUs on ``nodes`` servers."""
        if gpus <= 1:
            return 0.0
        if nodes <= 1:
            return _ring(gpus) * comm_mb / (self.intra_node_gb_per_s * 1000.0)
        # the slowest link (the network) bounds a ring that leaves the server; every
        # extra server adds a hop of latency in each of the two phases
        transfer = _ring(gpus) * comm_mb / (self.inter_node_gb_per_s * 1000.0)
        return transfer + 2 * (nodes - 1) * self.inter_node_latency_s


def _ring(gpus: int) -> float:
    """Bytes each GPU sends in a ring all-reduce, per byte of gradients."""
    return 2.0 * (gpus - 1) / gpus


def _builtin_field(name: str, entry: Mapping[str, Any], field: str, kind: type) -> Any:
    value = entry.get(field)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(
            f"builtin/profiles.json: model {name!r}, field {field!r}: "
            f"expected {kind.__name__}, got {value!r}"
        )
    return value


def _parse_builtin_model(name: str, entry: Mapping[str, Any]) -> ModelProfile:
    def num(field: str) -> float:
        value = float(_builtin_field(name, entry, field, float))
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"builtin/profiles.json: model {name!r}, field {field!r}: "
                f"expected a finite number >= 0, got {value!r}"
            )
        return value

    def optional_str(field: str) -> str | None:
        return None if entry.get(field) is None else str(_builtin_field(name, entry, field, str))

    profile = ModelProfile(
        name=name,
        category=_builtin_field(name, entry, "category", str),
        default_batch_size=_builtin_field(name, entry, "default_batch_size", int),
        t0_s=num("t0_s"),
        per_sample_s=num("per_sample_s"),
        mem_base_mb=num("mem_base_mb"),
        mem_per_sample_mb=num("mem_per_sample_mb"),
        intensity=num("intensity"),
        comm_mb=num("comm_mb"),
        cpu_mem_class=_builtin_field(name, entry, "cpu_mem_class", str),
        gavel_type=optional_str("gavel_type"),
        synergy_model=optional_str("synergy_model"),
    )
    _check_builtin_model(profile)
    return profile


def _check_builtin_model(p: ModelProfile) -> None:
    problems = []
    if p.category not in CATEGORIES:
        problems.append(f"category must be one of {CATEGORIES}")
    if p.default_batch_size < 1:
        problems.append("default_batch_size must be >= 1")
    if p.t0_s + p.per_sample_s <= 0:
        problems.append("t0_s + per_sample_s must be > 0")
    if p.mem_base_mb <= 0:
        problems.append("mem_base_mb must be > 0")
    if p.intensity > 1:
        problems.append("intensity must be in 0..1")
    if problems:
        raise ValueError(f"builtin/profiles.json: model {p.name!r}: {'; '.join(problems)}")


def _load_builtin() -> tuple[dict[str, ModelProfile], Network]:
    text = resources.files("libs.core").joinpath("builtin/profiles.json").read_text("utf-8")
    document = json.loads(text)
    net = document["network"]
    network = Network(
        intra_node_gb_per_s=float(net["intra_node_gb_per_s"]),
        inter_node_gb_per_s=float(net["inter_node_gb_per_s"]),
        inter_node_latency_s=float(net["inter_node_latency_s"]),
    )
    profiles = {
        name: _parse_builtin_model(name, entry) for name, entry in document["models"].items()
    }
    return profiles, network


# --------------------------------------------------------------------------- parsing


def _number(path: Path, line: int, field: str, raw: str | None, *, positive: bool) -> float:
    """Parse one numeric CSV cell, naming file, line and field when it is malformed."""
    try:
        value = float(raw) if raw is not None else math.nan
    except ValueError:
        value = math.nan
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{path}, line {line}, field {field!r}: expected a finite number {bound}, got {raw!r}"
        )
    return value


def _integer(path: Path, line: int, field: str, raw: str | None) -> int:
    value = _number(path, line, field, raw, positive=True)
    if value != int(value):
        raise ValueError(f"{path}, line {line}, field {field!r}: expected an integer, got {raw!r}")
    return int(value)


def _csv_rows(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Rows of a CSV file with the line number each ends on; checks the header."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [f for f in fields if f not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{path}, line 1, field {missing[0]!r}: missing from the header "
                f"(expected columns {', '.join(fields)})"
            )
        for row in reader:
            yield reader.line_num, row


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from err


# --------------------------------------------------------------------------- Pollux


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


def _read_placements(path: Path) -> dict[str, StepCurve]:
    points = _new_points()
    for line, row in _csv_rows(path, _PLACEMENT_FIELDS):
        placement = (row["placement"] or "").strip()
        if not re.fullmatch(r"[1-9]+", placement):
            raise ValueError(
                f"{path}, line {line}, field 'placement': expected digits 1-9 "
                f"(GPUs per node), got {row['placement']!r}"
            )
        bsz = _number(path, line, "local_bsz", row["local_bsz"], positive=True)
        step = _number(path, line, "step_time", row["step_time"], positive=True)
        sync = _number(path, line, "sync_time", row["sync_time"], positive=False)
        points[placement][bsz].append((step, sync))
    return _curves(points)


def _read_scalability(path: Path) -> dict[tuple[int, int], StepCurve]:
    """Scalability runs keyed by (gpus, nodes)."""
    points = _new_points()
    for line, row in _csv_rows(path, _SCALABILITY_FIELDS):
        nodes = _integer(path, line, "num_nodes", row["num_nodes"])
        gpus = _integer(path, line, "num_replicas", row["num_replicas"])
        if gpus < nodes:
            raise ValueError(
                f"{path}, line {line}, field 'num_replicas': "
                f"{gpus} replicas cannot span {nodes} nodes"
            )
        bsz = _number(path, line, "local_bsz", row["local_bsz"], positive=True)
        step = _number(path, line, "step_time", row["step_time"], positive=True)
        sync = _number(path, line, "sync_time", row["sync_time"], positive=False)
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
        sync = curve.sync_at(batch) * _ring(gpus) / _ring(ref_gpus)
        return self.compute_s(batch) + sync, sync

    def _reference(self, gpus: int, nodes: int) -> tuple[int, StepCurve] | None:
        same_kind = [k for k in self.configs if k[0] > 1 and (k[1] > 1) == (nodes > 1)]
        if not same_kind:
            return None
        # nearest node count first (ties: more nodes, the pessimistic side), then GPUs
        key = min(same_kind, key=lambda k: (abs(k[1] - nodes), -k[1], abs(k[0] - gpus), -k[0]))
        return key[0], self.configs[key]


def _read_pollux_model(directory: Path) -> PolluxProfile | None:
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


# --------------------------------------------------------------------------- Gavel

GavelKey = tuple[str, int | None]
_GAVEL_OUTER = re.compile(r"\('(?P<job>.+)', (?P<scale>\d+)\)")
_GAVEL_BATCH = re.compile(r"(?P<type>.+) \(batch size (?P<batch>\d+)\)")


def _gavel_key(path: Path, raw: str) -> tuple[GavelKey, int]:
    """('<job type> (batch size N)', scale) -> ((job type, N or None), scale)."""
    outer = _GAVEL_OUTER.fullmatch(raw)
    if outer is None:
        raise ValueError(
            f"{path}: key {raw!r} in table {GAVEL_GPU!r} is not ('<job type>', <scale factor>)"
        )
    job, scale = outer["job"], int(outer["scale"])
    inner = _GAVEL_BATCH.fullmatch(job)
    if inner is None:
        return (job, None), scale
    return (inner["type"], int(inner["batch"])), scale


def _gavel_rate(path: Path, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{path}: {where}: expected a finite number of steps/s, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class GavelTable:
    """Single-GPU steps/s of Gavel job types, alone and co-located with each other."""

    alone: Mapping[GavelKey, float]
    #: (self, partner) -> own steps/s while co-located
    together: Mapping[tuple[GavelKey, GavelKey], float]
    #: job type -> the batch sizes measured (None for types without one)
    batches: Mapping[str, tuple[int | None, ...]]

    def key(self, job_type: str | None, batch: float) -> GavelKey | None:
        """The measured (type, batch) nearest ``batch`` on a log scale."""
        if job_type is None or not self.batches.get(job_type):
            return None
        measured = self.batches[job_type]
        if measured[0] is None:
            return job_type, None
        target = math.log(max(batch, 1e-9))
        nearest = min(measured, key=lambda b: (abs(math.log(b or 1) - target), b or 0))
        return job_type, nearest

    def slowdown(self, own: GavelKey, partner: GavelKey) -> float | None:
        alone, together = self.alone.get(own), self.together.get((own, partner))
        if alone is None or together is None:
            return None
        if alone <= 0 or together <= 0:
            return DOES_NOT_FIT_SLOWDOWN
        return max(1.0, alone / together)


def _read_gavel(path: Path) -> GavelTable:
    table = _load_json(path)
    rows = table.get(GAVEL_GPU) if isinstance(table, dict) else None
    if not isinstance(rows, dict):
        raise ValueError(f"{path}: expected an object with a {GAVEL_GPU!r} table")
    alone: dict[GavelKey, float] = {}
    together: dict[tuple[GavelKey, GavelKey], float] = {}
    for raw, row in rows.items():
        own, scale = _gavel_key(path, raw)
        if scale != 1:
            continue  # Gavel measured co-location on single-GPU jobs only
        if not isinstance(row, dict) or "null" not in row:
            raise ValueError(f"{path}: {raw}: expected an object with a 'null' entry")
        alone[own] = _gavel_rate(path, f"{raw} -> null", row["null"])
        together.update(_gavel_pairs(path, raw, own, row))
    batches: dict[str, set[int | None]] = defaultdict(set)
    for job_type, batch in alone:
        batches[job_type].add(batch)
    return GavelTable(alone, together, {t: _sorted_batches(b) for t, b in batches.items()})


def _gavel_pairs(
    path: Path, raw: str, own: GavelKey, row: Mapping[str, Any]
) -> Iterator[tuple[tuple[GavelKey, GavelKey], float]]:
    for raw_partner, rates in row.items():
        if raw_partner == "null":
            continue
        partner, scale = _gavel_key(path, raw_partner)
        where = f"{raw} -> {raw_partner}"
        if not isinstance(rates, list) or len(rates) != 2:
            raise ValueError(f"{path}: {where}: expected [own steps/s, partner steps/s]")
        if scale == 1:
            yield (own, partner), _gavel_rate(path, where, rates[0])


def _sorted_batches(batches: set[int | None]) -> tuple[int | None, ...]:
    if None in batches:
        return (None,)
    return tuple(sorted(b for b in batches if b is not None))


# --------------------------------------------------------------------------- Synergy


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
class SynergyData:
    #: Synergy model name -> GPU count profiled -> grid
    grids: Mapping[str, Mapping[int, SynergyGrid]]
    fair_cpus: float
    fair_mem_gb: float

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
        values = [_gavel_rate(path, f"{where}, row {r}", x) for x in row]
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


def _read_synergy(path: Path) -> SynergyData:
    document = _load_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("models"), dict):
        raise ValueError(f"{path}: expected an object with a 'models' object")
    cpu_axis = _axis(path, document, "cpu_per_gpu_axis")
    mem_axis = _axis(path, document, "mem_gb_per_gpu_axis")
    fair = document.get("fair_share_per_gpu") or {}
    grids = {
        name: _read_synergy_model(path, name, entry, cpu_axis, mem_axis)
        for name, entry in document["models"].items()
    }
    return SynergyData(
        grids,
        fair_cpus=float(fair.get("cpu", SYNERGY_FAIR_CPUS)),
        fair_mem_gb=float(fair.get("mem_gb", SYNERGY_FAIR_MEM_GB)),
    )


# --------------------------------------------------------------------------- the model


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class ProfilePerformanceModel:
    """The ground truth: built-in analytic profiles, overridden by research data.

    Build one with :meth:`builtin` or :meth:`from_data_dir`. Instances are immutable;
    every query is cached by its arguments.
    """

    __slots__ = (
        "_gavel",
        "_iter_cache",
        "_mem_cache",
        "_network",
        "_pollux",
        "_profiles",
        "_slow_cache",
        "_speed_cache",
        "_synergy",
    )

    def __init__(
        self,
        profiles: Mapping[str, ModelProfile],
        network: Network,
        pollux: Mapping[str, PolluxProfile] | None = None,
        gavel: GavelTable | None = None,
        synergy: SynergyData | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a performance model needs at least one model profile")
        self._profiles = dict(profiles)
        self._network = network
        self._pollux = dict(pollux or {})
        self._gavel = gavel
        self._synergy = synergy
        self._iter_cache: dict[tuple[str, int, int, int, int], float] = {}
        self._slow_cache: dict[tuple[str, int, int, int, str, int, int, int], float] = {}
        self._mem_cache: dict[tuple[str, float], float] = {}
        self._speed_cache: dict[tuple[str, int, float, float], float] = {}

    # ----------------------------------------------------------------- construction

    @classmethod
    def builtin(cls) -> ProfilePerformanceModel:
        """Only the project's own analytic profiles; needs no data directory."""
        profiles, network = _load_builtin()
        return cls(profiles, network)

    @classmethod
    def from_data_dir(cls, path: str | Path) -> ProfilePerformanceModel:
        """The built-in profiles, overridden where the research data in ``path`` covers
        a model (``profiles/pollux``, ``profiles/gavel``, ``profiles/synergy``).

        Missing files keep the built-in values; malformed ones raise ``ValueError``
        naming the file and the line or key at fault.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"data directory {root} does not exist")
        profiles, network = _load_builtin()
        profiles_dir = root / "profiles"
        pollux = {}
        for name in profiles:
            model_dir = profiles_dir / "pollux" / name
            found = _read_pollux_model(model_dir) if model_dir.is_dir() else None
            if found is not None:
                pollux[name] = found
        gavel_json = profiles_dir / "gavel" / "simulation_throughputs.json"
        synergy_json = profiles_dir / "synergy" / "models.json"
        gavel = _read_gavel(gavel_json) if gavel_json.is_file() else None
        synergy = _read_synergy(synergy_json) if synergy_json.is_file() else None
        return cls(profiles, network, pollux, gavel, synergy)

    # ----------------------------------------------------------------- introspection

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._profiles))

    def profile(self, model: str) -> ModelProfile:
        """The built-in analytic profile of ``model`` (category, defaults, intensity...)."""
        try:
            return self._profiles[model]
        except KeyError:
            raise UnknownModelError(model, self.models()) from None

    def data_sources(self, model: str) -> dict[str, str]:
        """Which source backs each method for ``model``: 'builtin' or the data set."""
        p = self.profile(model)
        gavel_ok = self._gavel is not None and p.gavel_type in self._gavel.batches
        synergy_ok = self._synergy is not None and p.synergy_model in self._synergy.grids
        return {
            "iteration_time": "pollux" if model in self._pollux else "builtin",
            "colocation_slowdown": f"gavel:{GAVEL_GPU}:{p.gavel_type}" if gavel_ok else "builtin",
            "cpu_mem_speedup": f"synergy:{p.synergy_model}" if synergy_ok else "builtin",
            "gpu_memory_mb": "builtin",
            "default_batch_size": "builtin",
        }

    def default_batch_size(self, model: str) -> int:
        return self.profile(model).default_batch_size

    # ----------------------------------------------------------------- iteration time

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        key = (model, batch_size, gpus, nodes, accum_steps)
        try:
            return self._iter_cache[key]
        except KeyError:
            return self._iteration_time_miss(model, batch_size, gpus, nodes, accum_steps)

    def _iteration_time_miss(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int
    ) -> float:
        self.profile(model)
        _check_positive(batch_size=batch_size, gpus=gpus, nodes=nodes, accum_steps=accum_steps)
        if nodes > gpus or nodes != int(nodes) or gpus != int(gpus):
            raise ValueError(f"{gpus} GPUs cannot span {nodes} nodes")
        if accum_steps != int(accum_steps):
            raise ValueError(f"accum_steps must be an integer, got {accum_steps!r}")
        # enforce the contract on top of noisy data: walk up from one node, so that a
        # wider spread is never faster, and never let accumulation beat a single pass
        slowest = 0.0
        for spread in range(1, nodes + 1):
            key = (model, batch_size, gpus, spread, accum_steps)
            value = self._iter_cache.get(key)
            if value is None:
                value = self._raw_iteration_time(
                    model, batch_size / gpus, gpus, spread, accum_steps
                )
                if accum_steps > 1:
                    value = max(value, self.iteration_time(model, batch_size, gpus, spread))
                value = max(value, slowest)
                self._iter_cache[key] = value
            slowest = value
        return slowest

    def _raw_iteration_time(
        self, model: str, per_gpu_batch: float, gpus: int, nodes: int, accum_steps: int
    ) -> float:
        step, sync = self._step_sync(model, per_gpu_batch / accum_steps, gpus, nodes)
        if accum_steps == 1:
            return step  # exactly the measured value at a profiled point
        # every sub-batch but the last skips the all-reduce (as Pollux models it)
        return accum_steps * max(step - sync, MIN_COMPUTE_S) + sync

    def _step_sync(self, model: str, batch: float, gpus: int, nodes: int) -> tuple[float, float]:
        """One step of ``batch`` per GPU, and the sync wait it includes."""
        pollux = self._pollux.get(model)
        measured = pollux.step_sync(batch, gpus, nodes) if pollux is not None else None
        if measured is None:
            p = self._profiles[model]
            sync = self._network.allreduce_s(p.comm_mb, gpus, nodes)
            return p.compute_s(batch) + sync, sync
        step, sync = measured
        return max(step, sync + MIN_COMPUTE_S), sync

    # ----------------------------------------------------------------- co-location

    def colocation_slowdown(
        self,
        model: str,
        batch_size: int,
        gpus: int,
        accum_steps: int,
        partner: str,
        partner_batch_size: int,
        partner_gpus: int,
        partner_accum_steps: int,
    ) -> float:
        key = (
            model,
            batch_size,
            gpus,
            accum_steps,
            partner,
            partner_batch_size,
            partner_gpus,
            partner_accum_steps,
        )
        try:
            return self._slow_cache[key]
        except KeyError:
            pass
        own, other = self.profile(model), self.profile(partner)
        _check_positive(
            batch_size=batch_size,
            gpus=gpus,
            accum_steps=accum_steps,
            partner_batch_size=partner_batch_size,
            partner_gpus=partner_gpus,
            partner_accum_steps=partner_accum_steps,
        )
        # what shares a GPU is one worker's sub-batch, whatever the job's size
        own_sub = batch_size / (gpus * accum_steps)
        other_sub = partner_batch_size / (partner_gpus * partner_accum_steps)
        value = self._gavel_slowdown(own, own_sub, other, other_sub)
        if value is None:
            value = self._analytic_slowdown(own, own_sub, other, other_sub)
        self._slow_cache[key] = value
        return value

    def _gavel_slowdown(
        self, own: ModelProfile, own_sub: float, other: ModelProfile, other_sub: float
    ) -> float | None:
        if self._gavel is None:
            return None
        own_key = self._gavel.key(own.gavel_type, own_sub)
        other_key = self._gavel.key(other.gavel_type, other_sub)
        if own_key is None or other_key is None:
            return None
        return self._gavel.slowdown(own_key, other_key)

    @staticmethod
    def _analytic_slowdown(
        own: ModelProfile, own_sub: float, other: ModelProfile, other_sub: float
    ) -> float:
        """1.1 (time-slicing overhead) up to 2.0 (two saturating jobs): the partner's
        pressure hurts more the more this job needs the GPU itself."""
        pressure = _effective_intensity(other, other_sub)
        need = _effective_intensity(own, own_sub)
        return 1.1 + 0.9 * pressure * (0.4 + 0.6 * need)

    # ----------------------------------------------------------------- memory, CPU

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        key = (model, per_gpu_batch)
        try:
            return self._mem_cache[key]
        except KeyError:
            pass
        p = self.profile(model)
        if not per_gpu_batch >= 0 or not math.isfinite(per_gpu_batch):
            raise ValueError(f"per_gpu_batch must be a finite number >= 0, got {per_gpu_batch!r}")
        value = self._mem_cache[key] = p.mem_base_mb + p.mem_per_sample_mb * per_gpu_batch
        return value

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        key = (model, gpus, cpus_per_gpu, mem_gb_per_gpu)
        try:
            return self._speed_cache[key]
        except KeyError:
            pass
        p = self.profile(model)
        _check_positive(gpus=gpus)
        for name, value in (("cpus_per_gpu", cpus_per_gpu), ("mem_gb_per_gpu", mem_gb_per_gpu)):
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        speedup = None
        if self._synergy is not None and p.synergy_model is not None:
            speedup = self._synergy.speedup(p.synergy_model, gpus, cpus_per_gpu, mem_gb_per_gpu)
        # the analytic profiles assume the GPU-proportional share is always enough
        result = self._speed_cache[key] = 1.0 if speedup is None else speedup
        return result


def _effective_intensity(profile: ModelProfile, sub_batch: float) -> float:
    """A smaller sub-batch leaves more of the GPU idle, so it presses less (mildly)."""
    ratio = min(1.0, sub_batch / profile.default_batch_size)
    return profile.intensity * (0.7 + 0.3 * ratio)


# --------------------------------------------------------------------------- estimates


#: |log| of the largest factor `NoisyEstimates` applies (e^100, about 2.7e43)
MAX_LOG_FACTOR = 100.0


class NoisyEstimates:
    """A :class:`PerformanceModel` that believes iteration times off by a fixed factor.

    Each model's iteration time is multiplied by ``exp(sigma * z)``, with ``z`` a
    standard normal drawn deterministically from ``seed`` and the model name: the same
    model is always mis-predicted the same way, as a profiler with a systematic bias
    would. The median factor is 1, and ``sigma * z`` is clamped to
    ``+-MAX_LOG_FACTOR`` so that no sigma overflows. Everything else passes through
    unchanged, and a positive factor per model keeps the contract.
    """

    __slots__ = ("_base", "_factors", "seed", "sigma")

    def __init__(self, base: PerformanceModel, sigma: float, seed: int = 0) -> None:
        if not sigma >= 0 or not math.isfinite(sigma):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
        self._base = base
        self.sigma = sigma
        self.seed = seed
        self._factors: dict[str, float] = {}

    def factor(self, model: str) -> float:
        """The multiplier applied to ``model``'s iteration times."""
        try:
            return self._factors[model]
        except KeyError:
            pass
        digest = hashlib.sha256(f"{self.seed}/{model}".encode()).digest()
        z = random.Random(int.from_bytes(digest[:8], "big")).gauss(0.0, 1.0)
        # clamped, so that any finite sigma gives finite times that still sum finitely
        log_factor = max(-MAX_LOG_FACTOR, min(MAX_LOG_FACTOR, self.sigma * z))
        value = self._factors[model] = math.exp(log_factor)
        return value

    def models(self) -> tuple[str, ...]:
        return self._base.models()

    def default_batch_size(self, model: str) -> int:
        return self._base.default_batch_size(model)

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        exact = self._base.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        return exact * self.factor(model)

    def colocation_slowdown(
        self,
        model: str,
        batch_size: int,
        gpus: int,
        accum_steps: int,
        partner: str,
        partner_batch_size: int,
        partner_gpus: int,
        partner_accum_steps: int,
    ) -> float:
        return self._base.colocation_slowdown(
            model,
            batch_size,
            gpus,
            accum_steps,
            partner,
            partner_batch_size,
            partner_gpus,
            partner_accum_steps,
        )

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        return self._base.gpu_memory_mb(model, per_gpu_batch)

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        return self._base.cpu_mem_speedup(model, gpus, cpus_per_gpu, mem_gb_per_gpu)


def load_performance_model(data_dir: str | Path | None) -> ProfilePerformanceModel:
    """The ground truth: built-in profiles alone (``None``), or overridden by the
    research data in ``data_dir``."""
    if data_dir is None:
        return ProfilePerformanceModel.builtin()
    return ProfilePerformanceModel.from_data_dir(data_dir)
