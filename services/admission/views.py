"""Response bodies beyond the wire schemas (JSON over HTTP)."""

from __future__ import annotations

import msgspec

from libs.common.schemas import GpuTelemetry, JobRecord


class JobList(msgspec.Struct, frozen=True):
    jobs: list[JobRecord]
    #: pass as ``after`` for the next page; null on the last page
    next: str | None


class GpuView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    model: str
    memory_mb: int
    #: ids of the unfinished jobs placed on this GPU (by the job records)
    jobs: list[str]
    #: the node agent's latest DCGM-style sample of this GPU, if any arrived
    telemetry: GpuTelemetry | None = None


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cpus: int
    host_mem_gb: float
    net_gbps: float
    emulated: bool
    started_at: float
    gpus: list[GpuView]
    #: when the latest telemetry of this node was taken (seconds since the epoch)
    telemetry_at: float | None = None


class ClusterTotals(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int
    gpus: int
    #: GPUs holding at least one unfinished job
    busy_gpus: int
    #: busy_gpus / gpus (0 on an empty cluster)
    utilisation: float
    #: mean DCGM_FI_DEV_GPU_UTIL over the GPUs that reported telemetry
    mean_gpu_util: float | None = None


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[NodeView]
    totals: ClusterTotals


class Health(msgspec.Struct, frozen=True):
    status: str
