"""Alibaba's PAI GPU cluster trace of 2023: its pod list (CPU, memory, GPU count and
GPU fraction, QoS class, times) and its node list (docs/trace-format.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.traces.job import TraceError, TraceJob
from gpusched.libs.core.traces.rows import (
    NO_GPU,
    BadField,
    Collected,
    Options,
    absent,
    collect,
    float_field,
    int_field,
    job_id,
    open_csv,
    seconds_field,
)

_ALIBABA_POD_FILE = "openb_pod_list_default.csv"
_ALIBABA_NODE_FILE = "openb_node_list_gpu_node.csv"
_ALIBABA_RESOURCES = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_ALIBABA_TIMES = ("creation_time", "deletion_time", "scheduled_time")
_NEVER_SCHEDULED = "never scheduled (no scheduled_time)"

#: GPU memory in GiB per GPU model of the Alibaba node list. V100M16/M32, P100, T4 and
#: A10 are the cards' nominal sizes; G2 and G3 are anonymised in the trace, and any
#: other name is unknown: both get 16 GiB, the smallest size in the trace, so jobs
#: placed on them are never promised memory they might not have.
ALIBABA_GPU_MEM_GB: Mapping[str, int] = {
    "V100M16": 16,
    "V100M32": 32,
    "P100": 16,
    "T4": 16,
    "A10": 24,
    "G2": 16,
    "G3": 16,
}
ALIBABA_UNKNOWN_GPU_MEM_GB = 16


def load_alibaba(path: Path, opts: Options) -> Collected[TraceJob]:
    if path.is_dir():
        path = path / _ALIBABA_POD_FILE
        if not path.exists():
            raise TraceError(f"trace file not found: {path}")
    header, rows = open_csv(path, _ALIBABA_RESOURCES)
    lacking = [c for c in _ALIBABA_TIMES if c not in header]
    if lacking:
        raise TraceError(
            f"{path} has no timing columns ({', '.join(lacking)} missing), so its pods "
            f"cannot be replayed; use a pod list with creation, deletion and scheduled "
            f"times such as {_ALIBABA_POD_FILE}"
        )
    collected = collect(path, rows, _alibaba_row, opts)
    collected.notes.append(
        "alibaba: pods with gpu_milli < 1000 share one GPU (allow_sharing); whole-GPU pods "
        "are exclusive, as in the trace; user is the pod's QoS class"
    )
    return collected


def _alibaba_row(line: int, row: Mapping[str, object]) -> TraceJob | str:
    gpus = int_field(row, "num_gpu", minimum=0)
    if gpus == 0:
        return NO_GPU
    if absent(row["scheduled_time"]):
        return _NEVER_SCHEDULED
    milli = int_field(row, "gpu_milli")
    if milli > 1000:
        raise BadField("gpu_milli", f"expected 1..1000 per GPU, got {row['gpu_milli']!r}")
    created = seconds_field(row, "creation_time", positive=False)
    started = seconds_field(row, "scheduled_time", positive=False)
    ended = seconds_field(row, "deletion_time", positive=False)
    if ended <= started:
        raise BadField("deletion_time", f"must be after scheduled_time {started:g}, got {ended:g}")
    return TraceJob(
        job_id=job_id(row, "name"),
        submit_time=created,
        gpus=gpus,
        duration_s=ended - started,
        allow_sharing=milli < 1000,
        user=str(row.get("qos") or ""),
        cpus_per_gpu=_per_gpu(row, "cpu_milli", 1000 * gpus),
        mem_gb_per_gpu=_per_gpu(row, "memory_mib", 1024 * gpus),
        line=line,
    )


def _per_gpu(row: Mapping[str, object], name: str, divisor: int) -> float | None:
    # a request of 0 is Kubernetes for "none stated", not a demand of nothing
    total = float_field(row, name, positive=False)
    return total / divisor if total > 0 else None


def load_alibaba_nodes(path: str | Path) -> Cluster:
    """The GPU nodes of an Alibaba node list (``openb_node_list_gpu_node.csv``).

    ``path`` is the file or the folder holding it. Nodes without GPUs are left out.
    """
    source = Path(path)
    if source.is_dir():
        source = source / _ALIBABA_NODE_FILE
    if not source.exists():
        raise TraceError(f"node list not found: {source}")
    _, rows = open_csv(source, ("sn", "cpu_milli", "memory_mib", "gpu", "model"))
    nodes = collect(source, rows, _alibaba_node_row, Options(False, None)).items
    if not nodes:
        raise TraceError(f"{source}: no node with a GPU")
    return Cluster(tuple(nodes))


def _alibaba_node_row(line: int, row: Mapping[str, object]) -> Node | str:
    gpus = int_field(row, "gpu", minimum=0)
    if gpus == 0:
        return NO_GPU
    model = str(row["model"]).strip() or "unknown"
    return Node(
        name=job_id(row, "sn"),
        gpus=gpus,
        gpu_mem_mb=ALIBABA_GPU_MEM_GB.get(model, ALIBABA_UNKNOWN_GPU_MEM_GB) * 1024,
        cpus=int(float_field(row, "cpu_milli", positive=True) // 1000),
        host_mem_gb=float_field(row, "memory_mib", positive=True) / 1024,
        gpu_model=model,
    )
