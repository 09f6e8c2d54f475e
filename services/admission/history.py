"""``GET /v1/history/export``: a tenant's finished jobs (an operator's: every tenant's)
of a window of submission times, as a native trace the simulator replays, with the
cluster's shape beside it (docs/http-api.md, docs/trace-format.md "Exported history").

A job is exported when it has finished (SUCCEEDED, FAILED or CANCELLED: a job still
queued or running has no final size yet); its iterations are those it really ran, so a
cancelled or failed job replays the work it did, and one that reported none is left
out. What is left out is counted, by reason."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

import msgspec
from multidict import MultiMapping

from gpusched.libs.common.schemas import JobRecord, JobState, NodeInfo
from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.cluster_file import cluster_document
from gpusched.libs.core.traces import NativeRow, TraceJob, native_row
from gpusched.services.admission.problems import ProblemError

#: the states a job ends in, all exported
EXPORTED_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
PARAMETERS = ("since", "until")
#: a time: unix seconds (``1767225600``, ``1767225600.5``), or an ISO 8601 date or date
#: and time with an optional zone (``2026-01-01``, ``2026-01-01T09:30``,
#: ``2026-01-01 09:30:00.25+01:00``, ``...Z``); a time without a zone is UTC
UNIX_SECONDS_PATTERN = r"[0-9]{1,11}(?:\.[0-9]{1,9})?"
ISO_8601_PATTERN = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r"(?:[T ][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]{1,6})?)?(?:Z|[+-][0-9]{2}:[0-9]{2})?)?"
)
TIME_PATTERN = f"^(?:{UNIX_SECONDS_PATTERN}|{ISO_8601_PATTERN})$"
#: why a finished job is not in the trace
NEVER_RAN = "failed or cancelled before reporting an iteration"
UNFINISHED = "not finished yet (queued, running or preempted)"

_time = re.compile(TIME_PATTERN)
_unix = re.compile(UNIX_SECONDS_PATTERN)


class NodeShape(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    gpus: int
    #: its GPUs' model (the most common one on a node of mixed GPUs)
    gpu_model: str
    #: the smallest memory of its GPUs
    gpu_mem_mb: int
    cpus: int
    host_mem_gb: float
    net_gbps: float


class ClusterShape(msgspec.Struct, frozen=True, kw_only=True):
    """The nodes with GPUs registered at the export (a cluster file's content)."""

    nodes: list[NodeShape]


class HistoryExport(msgspec.Struct, frozen=True, kw_only=True):
    """Finished jobs of a window as a native trace, and the cluster's shape."""

    #: the window asked for, seconds since the epoch (null: unbounded): jobs submitted
    #: at or after ``since`` and before ``until``
    since: float | None
    until: float | None
    #: when the first and the last exported job were submitted (seconds since the
    #: epoch); the trace's clock starts at ``first_submitted_at``
    first_submitted_at: float
    last_submitted_at: float
    #: whether the caller's token sees every tenant's jobs (an operator's), or its own
    all_tenants: bool
    #: the tenants whose jobs the trace holds
    tenants: list[str]
    #: exported jobs by final state
    states: dict[str, int]
    #: jobs submitted in the window that the trace does not hold, by reason
    left_out: dict[str, int]
    #: the trace, ordered by submission: native trace records, as a .jsonl export's
    #: lines (docs/trace-format.md "Exported history")
    jobs: list[NativeRow]
    cluster: ClusterShape
    #: ``--cluster`` for ``gpusched simulate`` when every node has as many GPUs
    #: (``NODESxGPUS``); null otherwise or without nodes
    cluster_spec: str | None = None
    #: what a reader of the trace should know, in words
    notes: list[str] = []
    #: the nodes' time scale (wall seconds per second of the jobs' own time): every time
    #: in the trace was divided by it, so the trace is in the jobs' own seconds
    time_scale: float = 1.0


def window(query: MultiMapping[str]) -> tuple[float | None, float | None]:
    """``since`` and ``until`` from the query, in seconds since the epoch; 400 for any
    other parameter, 422 naming the field for a malformed time or since not before
    until."""
    for name in query:
        if name not in PARAMETERS:
            raise ProblemError(
                400, "invalid-parameter",
                f"{name}: unknown query parameter; known: {', '.join(PARAMETERS)}",
                field=name,
            )
    since, until = (_instant(name, query.getall(name, [])) for name in PARAMETERS)
    if since is not None and until is not None and since >= until:
        raise ProblemError(
            422, "invalid-parameter",
            f"since: {query['since']} ({_iso(since)}) is not before until {query['until']} "
            f"({_iso(until)})",
            field="since",
        )
    return since, until


def _instant(name: str, values: list[str]) -> float | None:
    if not values:
        return None
    if len(values) > 1:
        raise ProblemError(422, "invalid-parameter", f"{name}: given {len(values)} times",
                           field=name)
    raw = values[0]
    problem = None
    if _time.fullmatch(raw) is None:
        problem = "expected unix seconds or an ISO 8601 date or time"
    elif _unix.fullmatch(raw):
        return float(raw)
    else:
        try:
            at = datetime.fromisoformat(raw)
            return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()
        except (ValueError, OverflowError) as exc:
            problem = f"not a valid time ({exc})"
    raise ProblemError(
        422, "invalid-parameter",
        f"{name}: {raw!r}: {problem}, e.g. 1767225600 or 2026-01-01T09:30:00Z (no zone: UTC)",
        field=name,
    )


def _iso(at: float) -> str:
    try:
        return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return f"{at:g} s"


def export(
    records: Iterable[JobRecord],
    nodes: Iterable[NodeInfo],
    since: float | None,
    until: float | None,
    *,
    all_tenants: bool,
    tenant: str,
    policy: str | None = None,
) -> HistoryExport:
    """The export of ``records`` (a tenant's, or every tenant's) in the window; 404
    when it holds no finished job. ``policy``, the live scheduler's where the caller
    knows it, goes in every row's ``live_policy``."""
    registered = {node.name: node for node in nodes}
    chosen: list[JobRecord] = []
    left_out: Counter[str] = Counter()
    for record in records:
        if (since is not None and record.submitted_at < since) or (
            until is not None and record.submitted_at >= until
        ):
            continue
        if not record.state.terminal:
            left_out[UNFINISHED] += 1
        elif _iterations(record) < 1:
            left_out[NEVER_RAN] += 1
        else:
            chosen.append(record)
    if not chosen:
        raise _nothing_to_export(since, until, left_out, all_tenants, tenant)
    chosen.sort(key=lambda r: (r.submitted_at, r.id))
    start = chosen[0].submitted_at
    shape, spec, notes = _cluster(registered.values())
    scale = _time_scale(registered.values(), notes)
    jobs = [native_row(_trace_job(record, start, registered, policy, scale)) for record in chosen]
    unmeasured = sum(job.measured_iteration_s is None for job in jobs)
    if unmeasured:
        notes.append(
            f"{unmeasured} of {len(jobs)} jobs have no measured_iteration_s: they finished "
            "before their node reported a speed, or the last speed reported was of a run "
            "in another shape (a resize)"
        )
    return HistoryExport(
        since=since,
        until=until,
        first_submitted_at=start,
        last_submitted_at=chosen[-1].submitted_at,
        all_tenants=all_tenants,
        tenants=sorted({record.tenant for record in chosen}),
        states=dict(sorted(Counter(record.state.value for record in chosen).items())),
        left_out=dict(sorted(left_out.items())),
        jobs=jobs,
        cluster=shape,
        cluster_spec=spec,
        notes=notes,
        time_scale=scale,
    )


def _time_scale(nodes: Iterable[NodeInfo], notes: list[str]) -> float:
    """The registered nodes' time scale (the most common one where they differ, said in
    ``notes``; 1.0 without nodes)."""
    scales = Counter(node.time_scale for node in nodes if node.time_scale > 0)
    if not scales:
        return 1.0
    scale = scales.most_common(1)[0][0]
    if len(scales) > 1:
        notes.append(
            f"the nodes run at different time scales ({sorted(scales)}): the trace's times "
            f"are divided by the most common one, {scale:g}"
        )
    elif scale != 1.0:
        notes.append(
            f"the nodes run their jobs at time scale {scale:g}: the trace's times are wall "
            f"seconds divided by it, the jobs' own seconds"
        )
    return scale


def _iterations(record: JobRecord) -> int:
    """The iterations the job ran: its last reported progress, else, for a job that
    succeeded without reporting any (a command without the SDK), its total (as the
    predictor's size error counts it)."""
    if record.progress.iteration > 0 or record.state is not JobState.SUCCEEDED:
        return record.progress.iteration
    return record.total_iterations


def _trace_job(
    record: JobRecord, start: float, nodes: Mapping[str, NodeInfo], policy: str | None = None,
    scale: float = 1.0,
) -> TraceJob:
    """``record`` as a trace job; its times (wall seconds) divided by ``scale``. The
    measured iteration time is in the jobs' own seconds already (nodes report speeds so)."""
    spec = record.spec
    submit = (record.submitted_at - start) / scale
    deadline = None
    if spec.deadline is not None and spec.deadline > record.submitted_at:
        deadline = submit + (spec.deadline - record.submitted_at) / scale
    iteration_s, gpu_model = _measured(record, nodes)
    jct, queue = _live_times(record)
    if scale != 1.0:
        jct = None if jct is None else round(jct / scale, 3)
        queue = None if queue is None else round(queue / scale, 3)
    return TraceJob(
        job_id=record.id,
        submit_time=submit,
        gpus=spec.gpus,
        model=spec.model,
        batch_size=spec.batch_size,
        iterations=_iterations(record),
        allow_sharing=spec.allow_sharing,
        deadline=deadline,
        user=record.tenant,
        cpus_per_gpu=spec.cpus_per_gpu,
        mem_gb_per_gpu=spec.mem_gb_per_gpu,
        priority=spec.priority,
        tensor_parallel=spec.tensor_parallel,
        pipeline_parallel=spec.pipeline_parallel,
        min_batch_size=spec.min_batch_size,
        max_batch_size=spec.max_batch_size,
        measured_iteration_s=iteration_s,
        measured_gpu_model=gpu_model,
        live_jct_s=jct,
        live_queue_s=queue,
        live_state=record.state.value,
        live_policy=policy or None,
    )


def _live_times(record: JobRecord) -> tuple[float | None, float | None]:
    """``live_jct_s`` (from submission to the last change into the final state, its end)
    and ``live_queue_s`` (the time in QUEUED or PREEMPTED before it), from the record's
    history; None when the history does not reach the end."""
    ended = [change.at for change in record.history if change.state == record.state]
    if not ended or ended[-1] < record.submitted_at:
        return None, None
    end = ended[-1]
    waited = 0.0
    state, since = JobState.QUEUED, record.submitted_at
    for change in record.history:
        at = min(max(change.at, since), end)
        if state.waiting:
            waited += at - since
        state, since = change.state, at
    jct = end - record.submitted_at
    # milliseconds: the clocks behind a history are no more precise than that
    return round(jct, 3), round(min(waited, jct), 3)


def _measured(
    record: JobRecord, nodes: Mapping[str, NodeInfo]
) -> tuple[float | None, str | None]:
    """Seconds per iteration of the job's last reported speed, when that speed is of a
    run in the shape the row describes (the spec's batch and GPUs: a resize changes the
    iteration); the GPU model of the node it ran on, where the record still names it and
    the node is registered.

    A record keeps the last progress a run reported, across runs: a job resized from 1
    GPU to 2 and back whose last run ended before reporting keeps the 2-GPU run's speed.
    Nodes stamp each progress with its run's shape (``Progress.batch_size``/``gpus``),
    and a speed of another shape is not exported. A progress without the stamp (from
    before it, or of a run whose end reported its own progress) is exported only for a
    job that ran in one shape throughout: never preempted or resized and still in the
    spec's shape."""
    progress = record.progress
    rate = progress.samples_per_s
    spec = record.spec
    if not (rate > 0 and math.isfinite(rate)):
        return None, None
    if progress.batch_size is not None or progress.gpus is not None:
        if (progress.batch_size, progress.gpus) != (spec.batch_size, spec.gpus):
            return None, None
    elif (record.batch_size or spec.batch_size) != spec.batch_size or (
        record.gpus or spec.gpus
    ) != spec.gpus or record.preemptions or _resized(record):
        return None, None
    model = None
    if record.placement:
        first = record.placement[0]
        node = nodes.get(first.node)
        if node is not None:
            models = Counter(gpu.model for gpu in node.gpus if gpu.index in first.gpus)
            model = models.most_common(1)[0][0] if models else None
    # six significant digits: a reported rate is no more precise than that
    return float(f"{spec.batch_size / rate:.6g}"), model


def _resized(record: JobRecord) -> bool:
    """Whether the record's history shows a resize in place."""
    return any(change.reason.startswith("resized") for change in record.history)


def _cluster(nodes: Iterable[NodeInfo]) -> tuple[ClusterShape, str | None, list[str]]:
    shaped = [_node(info) for info in sorted(nodes, key=lambda n: n.name) if info.gpus]
    notes = []
    if not shaped:
        notes.append(
            "no node with GPUs is registered now, so the cluster is empty: simulate with "
            "--cluster NODESxGPUS"
        )
        return ClusterShape(nodes=[]), None, notes
    document = cluster_document(Cluster(tuple(shaped)))
    sizes = {node.gpus for node in shaped}
    spec = f"{len(shaped)}x{sizes.pop()}" if len(sizes) == 1 else None
    notes.append("the cluster is the nodes registered now, not those of the window")
    return msgspec.convert(document, ClusterShape), spec, notes


def _node(info: NodeInfo) -> Node:
    models = Counter(gpu.model for gpu in info.gpus)
    return Node(
        name=info.name,
        gpus=len(info.gpus),
        gpu_mem_mb=max(1, min(gpu.memory_mb for gpu in info.gpus)),
        cpus=info.cpus,
        host_mem_gb=info.host_mem_gb,
        net_gbps=info.net_gbps,
        gpu_model=models.most_common(1)[0][0] or "unknown",
    )


def _nothing_to_export(
    since: float | None, until: float | None, left_out: Counter[str], all_tenants: bool,
    tenant: str,
) -> ProblemError:
    bounds = [f"{name} {_iso(at)}" for name, at in (("since", since), ("until", until))
              if at is not None]
    where = f"in the window ({', '.join(bounds)})" if bounds else "so far"
    who = "no finished job was" if all_tenants else f"tenant {tenant} has no finished job"
    detail = f"no job to export: {who} submitted {where}"
    if left_out:
        detail += "; left out: " + "; ".join(f"{n} {why}" for why, n in sorted(left_out.items()))
    return ProblemError(404, "no-finished-jobs", detail)
