"""The project's own analytic profiles (``libs/core/builtin/profiles.json``): one entry
per model, and the network a job's all-reduce crosses."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

CATEGORIES = ("image", "language", "speech", "recommendation", "rl")


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
            return ring_factor(gpus) * comm_mb / (self.intra_node_gb_per_s * 1000.0)
        # the slowest link (the network) bounds a ring that leaves the server; every
        # extra server adds a hop of latency in each of the two phases
        transfer = ring_factor(gpus) * comm_mb / (self.inter_node_gb_per_s * 1000.0)
        return transfer + 2 * (nodes - 1) * self.inter_node_latency_s


def ring_factor(gpus: int) -> float:
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


def load_builtin() -> tuple[dict[str, ModelProfile], Network]:
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
