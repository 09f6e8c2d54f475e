"""Gavel's throughputs of co-located job pairs on one GPU
(``profiles/gavel/simulation_throughputs.json``): what the ground truth takes a
co-location slowdown from where a model has a Gavel job type, and (``GavelSpeeds``) how
fast a job type runs alone on each of Gavel's GPU types against a V100."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.libs.core.profiles.files import finite_rate, load_json

#: slowdown reported for a pair that Gavel measured as not fitting on one GPU together;
#: large enough that no sharing policy picks it, yet finite so arithmetic stays sane
DOES_NOT_FIT_SLOWDOWN = 10.0
#: the Gavel table used for co-location: V100 is closest to the GPUs we simulate
GAVEL_GPU = "v100"
#: the GPU types Gavel measured every job type alone on
GAVEL_GPUS = ("k80", "p100", "v100")


GavelKey = tuple[str, int | None]
_GAVEL_OUTER = re.compile(r"\('(?P<job>.+)', (?P<scale>\d+)\)")
_GAVEL_BATCH = re.compile(r"(?P<type>.+) \(batch size (?P<batch>\d+)\)")


def _gavel_key(path: Path, raw: str, gpu: str = GAVEL_GPU) -> tuple[GavelKey, int]:
    """('<job type> (batch size N)', scale) -> ((job type, N or None), scale)."""
    outer = _GAVEL_OUTER.fullmatch(raw)
    if outer is None:
        raise ValueError(
            f"{path}: key {raw!r} in table {gpu!r} is not ('<job type>', <scale factor>)"
        )
    job, scale = outer["job"], int(outer["scale"])
    inner = _GAVEL_BATCH.fullmatch(job)
    if inner is None:
        return (job, None), scale
    return (inner["type"], int(inner["batch"])), scale


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


@dataclass(frozen=True, slots=True)
class GavelSpeeds:
    """Gavel's single-GPU steps/s of its job types alone on each of its GPU types."""

    tables: Mapping[str, GavelTable]

    def speed(self, job_type: str | None, batch: float, gpu: str) -> float | None:
        """Steps/s of ``job_type`` at the measured batch nearest ``batch`` on ``gpu``
        over on a V100; None where Gavel has no such job type or GPU, or a rate of 0."""
        table, v100 = self.tables.get(gpu), self.tables.get(GAVEL_GPU)
        if table is None or v100 is None:
            return None
        key = v100.key(job_type, batch)
        if key is None:
            return None
        rate, reference = table.alone.get(key), v100.alone.get(key)
        if not rate or not reference:
            return None
        return rate / reference


def read_gavel_speeds(path: Path) -> GavelSpeeds:
    """The tables of every GPU type in :data:`GAVEL_GPUS` the file has."""
    table = load_json(path)
    found = [gpu for gpu in GAVEL_GPUS if isinstance(table, dict) and gpu in table]
    return GavelSpeeds({gpu: read_gavel(path, gpu, table) for gpu in found})


def read_gavel(path: Path, gpu: str = GAVEL_GPU, table: Any = None) -> GavelTable:
    """The table of ``gpu`` (``table``: the file's document, where already read)."""
    if table is None:
        table = load_json(path)
    rows = table.get(gpu) if isinstance(table, dict) else None
    if not isinstance(rows, dict):
        raise ValueError(f"{path}: expected an object with a {gpu!r} table")
    alone: dict[GavelKey, float] = {}
    together: dict[tuple[GavelKey, GavelKey], float] = {}
    for raw, row in rows.items():
        own, scale = _gavel_key(path, raw, gpu)
        if scale != 1:
            continue  # Gavel measured co-location on single-GPU jobs only
        if not isinstance(row, dict) or "null" not in row:
            raise ValueError(f"{path}: {raw}: expected an object with a 'null' entry")
        alone[own] = finite_rate(path, f"{raw} -> null", row["null"])
        together.update(_gavel_pairs(path, raw, own, row, gpu))
    batches: dict[str, set[int | None]] = defaultdict(set)
    for job_type, batch in alone:
        batches[job_type].add(batch)
    return GavelTable(alone, together, {t: _sorted_batches(b) for t, b in batches.items()})


def _gavel_pairs(
    path: Path, raw: str, own: GavelKey, row: Mapping[str, Any], gpu: str = GAVEL_GPU
) -> Iterator[tuple[tuple[GavelKey, GavelKey], float]]:
    for raw_partner, rates in row.items():
        if raw_partner == "null":
            continue
        partner, scale = _gavel_key(path, raw_partner, gpu)
        where = f"{raw} -> {raw_partner}"
        if not isinstance(rates, list) or len(rates) != 2:
            raise ValueError(f"{path}: {where}: expected [own steps/s, partner steps/s]")
        if scale == 1:
            yield (own, partner), finite_rate(path, where, rates[0])


def _sorted_batches(batches: set[int | None]) -> tuple[int | None, ...]:
    if None in batches:
        return (None,)
    return tuple(sorted(b for b in batches if b is not None))
