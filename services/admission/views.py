"""Response bodies beyond the wire schemas (JSON over HTTP)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gpusched.libs.common.schemas import GpuTelemetry, JobRecord
from gpusched.libs.core.lifecycle import JobState


class JobDetail(JobRecord, frozen=True, kw_only=True):
    """A job as the API shows it: the stored record, its deadline and whether the
    deadline will likely be met (see ``deadline_likely_met``)."""

    #: the spec's deadline, seconds since the epoch (null: none)
    deadline: float | None = None
    #: null without a deadline (or before the scheduler's first estimate); a finished
    #: job: whether it succeeded by its deadline; otherwise whether the scheduler's
    #: expected end is by the deadline
    deadline_likely_met: bool | None = None


def deadline_likely_met(record: JobRecord, now: float) -> bool | None:
    """Our rule. A running job meets its deadline when ``now`` + its predicted remaining
    time is by it; a waiting job when ``now`` + its predicted wait + its run time is,
    where the wait is at least 0 (so never later than its run time alone from now). The
    scheduler stores the expected end (``est_end_at``) and the run time still needed
    (``est_run_s``) of every job with a deadline; a stored end in the past means now."""
    deadline = record.spec.deadline
    if deadline is None:
        return None
    if record.state.terminal:
        ended = record.history[-1].at if record.history else math.inf
        return record.state is JobState.SUCCEEDED and ended <= deadline
    if now > deadline:
        return False
    if record.est_end_at is None:
        return None
    end = max(record.est_end_at, now)
    if record.state.waiting and record.est_run_s is not None:
        end = max(end, now + record.est_run_s)
    return end <= deadline


def job_detail(record: JobRecord, now: float) -> JobDetail:
    return JobDetail(**_detail_fields(record, now))


def _detail_fields(record: JobRecord, now: float) -> dict[str, Any]:
    fields = msgspec.structs.asdict(record)
    fields["deadline"] = record.spec.deadline
    fields["deadline_likely_met"] = deadline_likely_met(record, now)
    return fields


class SubmittedJob(JobDetail, frozen=True, kw_only=True):
    """The answer to a submission: the job, and what its submitter should know at once."""

    #: sentences about the job as submitted, e.g. that no node registered today can hold
    #: it (it is accepted all the same and waits: nodes may join later)
    warnings: list[str] = msgspec.field(default_factory=list)


def submitted_job(record: JobRecord, now: float, warnings: list[str]) -> SubmittedJob:
    """The answer to a submission, built in one step from the record (it answers every
    accepted submission)."""
    return SubmittedJob(**_detail_fields(record, now), warnings=warnings)


class JobList(msgspec.Struct, frozen=True):
    jobs: list[JobDetail]
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
    #: mean DCGM_FI_DEV_GPU_UTIL over every GPU reading of the last ``util_window_s``
    #: seconds (null: none arrived in that time)
    window_gpu_util: float | None = None
    util_window_s: float = 0.0


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[NodeView]
    totals: ClusterTotals


class Health(msgspec.Struct, frozen=True, omit_defaults=True):
    #: "ok", or "degraded" (with a 503) while one of ``problems`` holds
    status: str
    #: why the cluster cannot take or schedule jobs now: the store does not take
    #: writes, no scheduler leads
    problems: list[str] = []
