"""The project's own analytic profiles (``libs/core/builtin/profiles.json``): one entry
per model, and the network a job's all-reduce crosses."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from gpusched.libs.core.perf import CpuMemDemand

CATEGORIES = ("image", "language", "speech", "recommendation", "rl")
#: the GPU-proportional share the built-in CPU/memory sensitivity is relative to
#: (Synergy's: 24 CPUs and 500 GB for 8 GPUs)
FAIR_CPUS_PER_GPU = 3.0
FAIR_MEM_GB_PER_GPU = 62.5


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
    #: the best-case CPU/memory vector of ``cpu_mem_class`` (our own numbers)
    cpu_mem: CpuMemDemand = field(
        default_factory=lambda: CpuMemDemand(FAIR_CPUS_PER_GPU, FAIR_MEM_GB_PER_GPU, 1.0)
    )

    def compute_s(self, per_gpu_batch: float) -> float:
        return self.t0_s + self.per_sample_s * per_gpu_batch

    def cpu_mem_speedup(self, cpus_per_gpu: float, mem_gb_per_gpu: float) -> float:
        """Speed-up over the fair share: 1 there, the best case at the best-case vector.
        CPUs feed the input pipeline, so the gain grows linearly with them; memory
        (caching the data set) scales it, from half the gain at the fair memory to all
        of it at the best case. No slowdown below the fair share: the analytic profiles
        have nothing to say there."""
        best = self.cpu_mem
        if best.speedup <= 1.0:
            return 1.0
        cpus = _fraction(cpus_per_gpu, FAIR_CPUS_PER_GPU, best.cpus_per_gpu)
        mem = _fraction(mem_gb_per_gpu, FAIR_MEM_GB_PER_GPU, best.mem_gb_per_gpu)
        return 1.0 + (best.speedup - 1.0) * cpus * (0.5 + 0.5 * mem)


def _fraction(value: float, fair: float, best: float) -> float:
    """How far ``value`` has come from ``fair`` to ``best`` (0..1; 1 when best <= fair)."""
    if best <= fair:
        return 1.0
    return min(1.0, max(0.0, (value - fair) / (best - fair)))


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


def _parse_cpu_mem_classes(document: Mapping[str, Any]) -> dict[str, CpuMemDemand]:
    classes = {}
    for name, entry in (document.get("cpu_mem_classes") or {}).items():
        values: list[float] = []
        for key in _DEMAND_FIELDS:
            value = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(value, int | float) or isinstance(value, bool):
                value = math.nan
            values.append(float(value))
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(
                f"builtin/profiles.json: cpu_mem_classes {name!r}: expected "
                f"{', '.join(_DEMAND_FIELDS)} as finite numbers > 0"
            )
        classes[name] = CpuMemDemand(*values)
    return classes


_DEMAND_FIELDS = ("best_cpus_per_gpu", "best_mem_gb_per_gpu", "speedup")


def _parse_builtin_model(
    name: str, entry: Mapping[str, Any], classes: Mapping[str, CpuMemDemand]
) -> ModelProfile:
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

    cpu_mem_class = _builtin_field(name, entry, "cpu_mem_class", str)
    if cpu_mem_class not in classes:
        raise ValueError(
            f"builtin/profiles.json: model {name!r}, field 'cpu_mem_class': "
            f"expected one of {sorted(classes)}, got {cpu_mem_class!r}"
        )
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
        cpu_mem_class=cpu_mem_class,
        gavel_type=optional_str("gavel_type"),
        synergy_model=optional_str("synergy_model"),
        cpu_mem=classes[cpu_mem_class],
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
    package = resources.files("gpusched.libs.core")
    text = package.joinpath("builtin/profiles.json").read_text("utf-8")
    document = json.loads(text)
    net = document["network"]
    network = Network(
        intra_node_gb_per_s=float(net["intra_node_gb_per_s"]),
        inter_node_gb_per_s=float(net["inter_node_gb_per_s"]),
        inter_node_latency_s=float(net["inter_node_latency_s"]),
    )
    classes = _parse_cpu_mem_classes(document)
    profiles = {
        name: _parse_builtin_model(name, entry, classes)
        for name, entry in document["models"].items()
    }
    return profiles, network
