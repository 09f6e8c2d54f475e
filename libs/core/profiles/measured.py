"""Measured profiles: iteration time and peak memory per (model, per-GPU batch) as one
GPU type really runs them (docs/profiles.md).

A node measures them with the training worker's ``--profile`` on its own GPU (or, on a
node with emulated GPUs, takes them from the ground truth and says so); the predictor
keeps one :class:`GpuProfile` per GPU type, and the simulator reads one from a file
(``gpusched simulate --profiles FILE``). This module is the one definition of the
format: :func:`parse_profile` reads a JSON document (every error names the file and
the field at fault), :func:`profile_document` writes one, and :class:`ModelFigures`
interpolates between measured batches.

The JSON document::

    {"format": "gpusched-measured-profile", "version": 1,
     "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_type": "h100-80gb-hbm3",
     "models": {"resnet50": {"architecture": "stand-in", "device": "cuda",
                             "torch": "2.4.1+cu121", "measured_at": "2025-01-31T12:00:00Z",
                             "node": "gpu-1",
                             "points": [{"batch_size": 32, "iteration_s": 0.0121,
                                         "memory_mb": 2311.5}]}}}
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "gpusched-measured-profile"
VERSION = 1
#: what a model's figures were taken from: the real architecture, the worker's small
#: stand-in of the same kind (its zoo model), or the ground truth of an emulated node
ARCHITECTURES = ("real", "stand-in", "emulated")
MAX_TYPE_KEY = 64
#: words of an NVML name that say nothing about the GPU type
_VENDOR_WORDS = re.compile(r"\b(nvidia|tesla|geforce|quadro)\b")


class MeasuredProfileError(ValueError):
    """A measured profile that cannot be read; the message names where and what."""


def gpu_type_key(name: str) -> str:
    """The normalised GPU type of an NVML (or emulated) GPU name: lower case, vendor
    words dropped, every other run of characters but letters and digits one ``-``;
    ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``, ``"V100-32GB"`` -> ``"v100-32gb"``.
    Safe in NATS subjects and KV keys; at most :data:`MAX_TYPE_KEY` characters."""
    text = _VENDOR_WORDS.sub(" ", name.lower())
    key = re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:MAX_TYPE_KEY].strip("-")
    if not key:
        raise ValueError(f"GPU name {name!r} leaves no type key")
    return key


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """One measurement: a worker at ``batch_size`` samples per iteration on one device."""

    batch_size: int
    iteration_s: float
    memory_mb: float


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's measured points on one GPU type, and where they come from.

    :meth:`iteration_s` and :meth:`memory_mb` interpolate linearly between measured
    batches; outside them they answer None (the caller scales its own figure there).
    Memory never falls as the batch grows: each point's memory is at least that of every
    smaller batch (a process's resident size is noisy)."""

    model: str
    architecture: str
    device: str
    torch: str
    measured_at: str
    points: tuple[MeasuredPoint, ...]
    node: str = ""
    _batches: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _memory: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple(sorted(self.points, key=lambda p: p.batch_size))
        if not points:
            raise ValueError(f"model {self.model!r}: no points")
        object.__setattr__(self, "points", points)
        object.__setattr__(self, "_batches", tuple(p.batch_size for p in points))
        memory, highest = [], 0.0
        for point in points:
            highest = max(highest, point.memory_mb)
            memory.append(highest)
        object.__setattr__(self, "_memory", tuple(memory))

    @property
    def emulated(self) -> bool:
        return self.architecture == "emulated"

    @property
    def batch_range(self) -> tuple[int, int]:
        return self._batches[0], self._batches[-1]

    def has_batch(self, batch_size: int) -> bool:
        return batch_size in self._batches

    def iteration_s(self, batch: float) -> float | None:
        """Seconds per iteration at per-GPU ``batch`` between measured batches, else None."""
        return self._between(batch, [p.iteration_s for p in self.points])

    def memory_mb(self, batch: float) -> float | None:
        """Peak MiB at per-GPU ``batch`` between measured batches, else None."""
        return self._between(batch, self._memory)

    def edge(self, batch: float) -> MeasuredPoint:
        """The measured point nearest ``batch`` outside the range (the first or last),
        with its memory as :meth:`memory_mb` reads it."""
        i = 0 if batch < self._batches[0] else len(self.points) - 1
        point = self.points[i]
        return MeasuredPoint(point.batch_size, point.iteration_s, self._memory[i])

    def _between(self, batch: float, values: list[float] | tuple[float, ...]) -> float | None:
        batches = self._batches
        if batch < batches[0] or batch > batches[-1]:
            return None
        i = bisect.bisect_left(batches, batch)
        if batches[i] == batch:
            return values[i]
        b0, b1 = batches[i - 1], batches[i]
        share = (batch - b0) / (b1 - b0)
        return values[i - 1] + share * (values[i] - values[i - 1])


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Every measured model of one GPU type."""

    gpu_name: str
    gpu_type: str
    models: Mapping[str, ModelFigures]

    def figures(self, model: str) -> ModelFigures | None:
        return self.models.get(model)


# ---- reading ------------------------------------------------------------------------


def read_profile(path: str | Path) -> GpuProfile:
    """The measured profile in the JSON file ``path``. Raises
    :class:`MeasuredProfileError` naming the file (and the field) when it is missing,
    not JSON or not a measured profile."""
    where = Path(path)
    try:
        text = where.read_text("utf-8")
    except FileNotFoundError:
        raise MeasuredProfileError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MeasuredProfileError(f"{where}: cannot be read ({exc})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MeasuredProfileError(
            f"{where}, line {exc.lineno}: not valid JSON ({exc.msg})"
        ) from None
    return parse_profile(document, str(where))


def parse_profile(document: Any, where: str = "measured profile") -> GpuProfile:
    """A measured profile from its JSON document (see the module); ``where`` names the
    source in errors."""
    if not isinstance(document, dict):
        raise MeasuredProfileError(f"{where}: expected a JSON object, got {_kind(document)}")
    if document.get("format") != FORMAT:
        raise MeasuredProfileError(
            f"{where}, field 'format': expected {FORMAT!r}, got {document.get('format')!r}"
        )
    if document.get("version") != VERSION:
        raise MeasuredProfileError(
            f"{where}, field 'version': expected {VERSION}, got {document.get('version')!r}"
        )
    gpu_name = _text(document, "gpu_name", where)
    gpu_type = _text(document, "gpu_type", where)
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", gpu_type):
        raise MeasuredProfileError(
            f"{where}, field 'gpu_type': expected a lower-case key of letters, digits, "
            f"'-' and '_' (e.g. {gpu_type_key(gpu_name)!r}), got {gpu_type!r}"
        )
    models = document.get("models")
    if not isinstance(models, dict) or not models:
        raise MeasuredProfileError(
            f"{where}, field 'models': expected an object of at least one model, got "
            f"{_kind(models)}"
        )
    figures = {
        str(name): _parse_model(str(name), entry, f"{where}, models.{name}")
        for name, entry in models.items()
    }
    return GpuProfile(gpu_name=gpu_name, gpu_type=gpu_type, models=figures)


def _parse_model(name: str, entry: Any, where: str) -> ModelFigures:
    if not isinstance(entry, dict):
        raise MeasuredProfileError(f"{where}: expected an object, got {_kind(entry)}")
    architecture = _text(entry, "architecture", where)
    if architecture not in ARCHITECTURES:
        raise MeasuredProfileError(
            f"{where}, field 'architecture': expected one of {', '.join(ARCHITECTURES)}, "
            f"got {architecture!r}"
        )
    points = entry.get("points")
    if not isinstance(points, list) or not points:
        raise MeasuredProfileError(
            f"{where}, field 'points': expected a list of at least one point, got "
            f"{_kind(points)}"
        )
    parsed = [_parse_point(p, f"{where}, points[{i}]") for i, p in enumerate(points)]
    batches = [p.batch_size for p in parsed]
    if len(set(batches)) != len(batches):
        raise MeasuredProfileError(f"{where}, field 'points': a batch_size appears twice")
    return ModelFigures(
        model=name,
        architecture=architecture,
        device=_text(entry, "device", where),
        torch=_text(entry, "torch", where, required=False),
        measured_at=_text(entry, "measured_at", where),
        node=_text(entry, "node", where, required=False),
        points=tuple(parsed),
    )


def _parse_point(entry: Any, where: str) -> MeasuredPoint:
    if not isinstance(entry, dict):
        raise MeasuredProfileError(f"{where}: expected an object, got {_kind(entry)}")
    batch = entry.get("batch_size")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise MeasuredProfileError(
            f"{where}, field 'batch_size': expected an integer >= 1, got {batch!r}"
        )
    return MeasuredPoint(
        batch_size=batch,
        iteration_s=_number(entry, "iteration_s", where, positive=True),
        memory_mb=_number(entry, "memory_mb", where, positive=False),
    )


def _number(entry: dict[str, Any], key: str, where: str, *, positive: bool) -> float:
    value = entry.get(key)
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if numeric and value is not None else None
    if number is None or not math.isfinite(number) or (number <= 0 if positive else number < 0):
        bound = "> 0" if positive else ">= 0"
        raise MeasuredProfileError(
            f"{where}, field {key!r}: expected a finite number {bound}, got {value!r}"
        )
    return number


def _text(entry: dict[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = entry.get(key, None if required else "")
    if not isinstance(value, str) or (required and not value.strip()):
        raise MeasuredProfileError(
            f"{where}, field {key!r}: expected a non-empty string, got {value!r}"
        )
    return value


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


# ---- writing ------------------------------------------------------------------------


def profile_document(profile: GpuProfile) -> dict[str, Any]:
    """The JSON document of ``profile`` (what :func:`parse_profile` reads back)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "gpu_name": profile.gpu_name,
        "gpu_type": profile.gpu_type,
        "models": {
            name: {
                "architecture": f.architecture,
                "device": f.device,
                "torch": f.torch,
                "measured_at": f.measured_at,
                **({"node": f.node} if f.node else {}),
                "points": [
                    {"batch_size": p.batch_size, "iteration_s": p.iteration_s,
                     "memory_mb": p.memory_mb}
                    for p in f.points
                ],
            }
            for name, f in sorted(profile.models.items())
        },
    }


def write_profile(path: str | Path, profile: GpuProfile) -> None:
    Path(path).write_text(json.dumps(profile_document(profile), indent=2) + "\n", "utf-8")


def merged(old: ModelFigures | None, new: ModelFigures) -> ModelFigures:
    """``new`` measurements added to ``old`` ones of the same model: where both come
    from the same architecture on the same device, the points of both, ``new``'s where
    a batch was measured twice; otherwise the newer replaces the older, except that an
    emulated node's figures never replace ones a GPU measured."""
    if old is None:
        return new
    if new.emulated and not old.emulated:
        return old
    if (old.architecture, old.device) != (new.architecture, new.device):
        return new
    points = {p.batch_size: p for p in old.points}
    points.update({p.batch_size: p for p in new.points})
    return ModelFigures(
        model=new.model, architecture=new.architecture, device=new.device, torch=new.torch,
        measured_at=new.measured_at, node=new.node, points=tuple(points.values()),
    )  # fmt: skip


def with_figures(profile: GpuProfile | None, gpu_name: str, new: ModelFigures) -> GpuProfile:
    """``profile`` (a new one of ``gpu_name`` when None) with ``new`` merged in."""
    if profile is None:
        return GpuProfile(gpu_name, gpu_type_key(gpu_name), {new.model: new})
    models = dict(profile.models)
    models[new.model] = merged(models.get(new.model), new)
    return GpuProfile(profile.gpu_name, profile.gpu_type, models)


#: the profiles the project measured itself and ships (docs/profiles.md)
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "builtin" / "measured"


def shipped_gpu_profiles() -> list[GpuProfile]:
    """The shipped profiles that a GPU measured (the CPU measurement of the stand-ins
    is an example of the format, not a GPU type's figures), by GPU type."""
    found = [read_profile(path) for path in sorted(SHIPPED_DIR.glob("*.json"))]
    return [
        profile for profile in found
        if any(figures.device == "cuda" for figures in profile.models.values())
    ]  # fmt: skip


def with_missing_models(profile: GpuProfile | None, shipped: GpuProfile) -> GpuProfile:
    """``profile`` with the models only ``shipped`` has figures of: what a cluster's own
    nodes measured always stands, the shipped figures fill the rest."""
    if profile is None:
        return shipped
    models = {**shipped.models, **profile.models}
    return GpuProfile(profile.gpu_name, profile.gpu_type, models)

