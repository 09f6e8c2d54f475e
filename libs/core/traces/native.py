"""The project's own trace format, CSV or JSON lines: reading it and writing jobs as it
(docs/trace-format.md)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TextIO

import msgspec

from gpusched.libs.core.elastic import BOUND_FIELDS, bounds_problem
from gpusched.libs.core.traces.job import TraceError, TraceJob
from gpusched.libs.core.traces.rows import (
    BadField,
    Collected,
    Options,
    Row,
    absent,
    collect,
    float_field,
    int_field,
    job_id,
    names,
    open_csv,
    seconds_field,
)


class NativeRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One job as a native trace record, as `write_native` writes it: its fields are the
    CSV form's columns and the JSON-lines form's keys, in order (docs/trace-format.md).
    An absent optional field is None (an empty cell; a key left out of JSON)."""

    job_id: str
    #: seconds on the trace's clock (an export: after its first job's submission)
    submit_time: float
    gpus: int
    model: str | None = None
    batch_size: int | None = None
    #: exactly one of duration_s and iterations (an export: the iterations it ran)
    duration_s: float | None = None
    iterations: int | None = None
    allow_sharing: bool = True
    #: seconds after the job's submission
    deadline: float | None = None
    #: the tenant
    user: str | None = None
    cpus_per_gpu: float | None = None
    mem_gb_per_gpu: float | None = None
    priority: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    #: the elastic bounds of the GPU count (docs/trace-format.md)
    min_gpus: int | None = None
    max_gpus: int | None = None
    #: seconds per iteration a live cluster measured, at ``batch_size`` and ``gpus``
    measured_iteration_s: float | None = None
    #: the GPU model it was measured on
    measured_gpu_model: str | None = None
    #: what really happened on the live cluster: seconds from submission to the job's
    #: end, of which it waited (queued or preempted), its final state, and the policy
    live_jct_s: float | None = None
    live_queue_s: float | None = None
    live_state: str | None = None
    live_policy: str | None = None


#: Fields of the native format, in the order `write_native` writes them.
NATIVE_FIELDS: tuple[str, ...] = NativeRow.__struct_fields__
#: the columns of what a live cluster really did with each job (`gpusched history
#: export` writes them, `gpusched history whatif` reads them; the simulator ignores them)
LIVE_FIELDS = NATIVE_FIELDS[-4:]
NATIVE_CSV_SUFFIXES = (".csv",)
NATIVE_JSONL_SUFFIXES = (".jsonl", ".ndjson")


_NATIVE_REQUIRED = ("submit_time", "gpus")
_TRUE = frozenset({"true", "1", "yes", "y", "t"})
_FALSE = frozenset({"false", "0", "no", "n", "f"})


def load_native(path: Path, opts: Options) -> Collected[TraceJob]:
    suffix = path.suffix.lower()
    if suffix in NATIVE_CSV_SUFFIXES:
        header, rows = open_csv(path, _NATIVE_REQUIRED)
        unknown = set(header) - set(NATIVE_FIELDS)
        if unknown:
            raise TraceError(
                f"{path}:1: unknown column(s) {names(unknown)}; "
                f"valid columns: {', '.join(NATIVE_FIELDS)}"
            )
    elif suffix in NATIVE_JSONL_SUFFIXES:
        rows = _jsonl_rows(path)
    else:
        valid = ", ".join(NATIVE_CSV_SUFFIXES + NATIVE_JSONL_SUFFIXES)
        raise TraceError(f"{path}: a native trace is named *{valid.replace(', ', ' or *')}")
    seen: dict[str, int] = {}

    def parse(line: int, row: Mapping[str, object]) -> TraceJob:
        job = _native_row(line, row)
        first = seen.setdefault(job.job_id, line)
        if first != line:
            raise BadField("job_id", f"duplicate job_id {job.job_id!r} (first on line {first})")
        return job

    return collect(path, rows, parse, opts)


def _jsonl_rows(path: Path) -> Iterator[Row]:
    try:
        handle = path.open(encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"cannot read trace file {path}: {exc.strerror}") from None
    return _parse_jsonl(handle)


def _parse_jsonl(handle: TextIO) -> Iterator[Row]:
    with handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line, BadField(None, f"invalid JSON: {exc.msg} at column {exc.colno}")
                continue
            if not isinstance(value, dict):
                yield line, BadField(None, f"expected a JSON object, got {type(value).__name__}")
                continue
            unknown = set(value) - set(NATIVE_FIELDS)
            if unknown:
                valid = ", ".join(NATIVE_FIELDS)
                message = f"unknown key(s) {names(unknown)}; valid keys: {valid}"
                yield line, BadField(min(unknown), message)
                continue
            yield line, value


def native_job(row: Mapping[str, object], line: int = 0) -> TraceJob:
    """One job from a native record (a JSON-lines object, or a CSV row as a mapping),
    checked as the reader checks a row; a bad or unknown field raises `TraceError`
    naming it. ``line`` says where the record came from, for messages."""
    unknown = set(row) - set(NATIVE_FIELDS)
    try:
        if unknown:
            raise BadField(min(unknown), f"unknown key(s) {names(unknown)}")
        return _native_row(line, row)
    except BadField as bad:
        where = f"record {line}: " if line else ""
        field = f"field {bad.field_name!r}: " if bad.field_name else ""
        raise TraceError(f"{where}{field}{bad.message}") from None


def _native_row(line: int, row: Mapping[str, object]) -> TraceJob:
    # CSV gives empty strings and JSON gives null for an absent optional field
    row = {k: v for k, v in row.items() if not absent(v)}
    for name in _NATIVE_REQUIRED:
        if name not in row:
            raise BadField(name, "required, but missing")
    has_duration, has_iterations = "duration_s" in row, "iterations" in row
    if has_duration == has_iterations:
        both = "both are" if has_duration else "neither is"
        raise BadField("duration_s", f"give exactly one of duration_s and iterations; {both} set")
    submit = seconds_field(row, "submit_time", positive=False)
    relative_deadline = seconds_field(row, "deadline", positive=True) if "deadline" in row else None
    batch = int_field(row, "batch_size") if "batch_size" in row else None
    gpus = int_field(row, "gpus")
    low_gpus, high_gpus, low, high = (
        int_field(row, name) if name in row else None for name in BOUND_FIELDS
    )
    problem = bounds_problem(gpus, batch, low_gpus, high_gpus, low, high)
    if problem:
        raise BadField(*problem)
    _live_check(row)
    return TraceJob(
        job_id=job_id(row, "job_id") if "job_id" in row else f"job-{line}",
        submit_time=submit,
        gpus=gpus,
        model=_text(row, "model") if "model" in row else None,
        batch_size=batch,
        duration_s=seconds_field(row, "duration_s", positive=True) if has_duration else None,
        iterations=int_field(row, "iterations") if has_iterations else None,
        allow_sharing=_bool(row, "allow_sharing") if "allow_sharing" in row else True,
        # the file says "seconds after submission"; a TraceJob holds the absolute time
        deadline=None if relative_deadline is None else submit + relative_deadline,
        user=_text(row, "user") if "user" in row else "",
        cpus_per_gpu=(
            float_field(row, "cpus_per_gpu", positive=True) if "cpus_per_gpu" in row else None
        ),
        mem_gb_per_gpu=(
            float_field(row, "mem_gb_per_gpu", positive=True) if "mem_gb_per_gpu" in row else None
        ),
        **_degrees(row),
        line=line,
        priority=(
            int_field(row, "priority", minimum=-1000, maximum=1000) if "priority" in row else 0
        ),
        min_batch_size=low,
        max_batch_size=high,
        min_gpus=low_gpus,
        max_gpus=high_gpus,
        measured_iteration_s=(
            seconds_field(row, "measured_iteration_s", positive=True)
            if "measured_iteration_s" in row else None
        ),
        measured_gpu_model=(
            _text(row, "measured_gpu_model") if "measured_gpu_model" in row else None
        ),
        live_jct_s=(
            seconds_field(row, "live_jct_s", positive=False) if "live_jct_s" in row else None
        ),
        live_queue_s=(
            seconds_field(row, "live_queue_s", positive=False) if "live_queue_s" in row else None
        ),
        live_state=_text(row, "live_state") if "live_state" in row else None,
        live_policy=_text(row, "live_policy") if "live_policy" in row else None,
    )


def _live_check(row: Mapping[str, object]) -> None:
    """The live outcome columns agree: a job waited no longer than it took."""
    if "live_jct_s" in row and "live_queue_s" in row:
        jct = seconds_field(row, "live_jct_s", positive=False)
        queue = seconds_field(row, "live_queue_s", positive=False)
        if queue > jct:
            raise BadField("live_queue_s", f"waited {queue:g} s, more than live_jct_s {jct:g} s")


def _degrees(row: Mapping[str, object]) -> dict[str, int]:
    """The optional tensor and pipeline parallel degrees; their product divides gpus."""
    degrees = {name: int_field(row, name) if name in row else 1 for name in _DEGREES}
    model_parallel = degrees["tensor_parallel"] * degrees["pipeline_parallel"]
    if int_field(row, "gpus") % model_parallel:
        field = "tensor_parallel" if "tensor_parallel" in row else "pipeline_parallel"
        raise BadField(
            field,
            f"tensor_parallel x pipeline_parallel = {model_parallel} does not divide "
            f"gpus {row['gpus']}",
        )
    return degrees


_DEGREES = ("tensor_parallel", "pipeline_parallel")


def _text(row: Mapping[str, object], name: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise BadField(name, f"expected a string, got {value!r}")
    return value.strip()


def _bool(row: Mapping[str, object], name: str) -> bool:
    value = row[name]
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise BadField(name, f"expected true or false, got {value!r}")


def write_native(path: str | Path, jobs: Iterable[TraceJob]) -> None:
    """Write ``jobs`` as a native trace: CSV or JSON lines, by the file's extension.

    Loading the file back gives the same jobs (new ``line`` numbers aside) when the
    first job is submitted at 0, as every loader and generator here produces them.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    records = [native_record(j) for j in jobs]
    if suffix in NATIVE_CSV_SUFFIXES:
        with target.open("w", newline="", encoding="utf-8") as out:
            writer = csv.DictWriter(out, NATIVE_FIELDS)
            writer.writeheader()
            for record in records:
                writer.writerow({k: _csv_cell(v) for k, v in record.items()})
    elif suffix in NATIVE_JSONL_SUFFIXES:
        with target.open("w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
    else:
        valid = ", ".join(NATIVE_CSV_SUFFIXES + NATIVE_JSONL_SUFFIXES)
        raise ValueError(f"{target}: a native trace file ends in one of {valid}")


def native_record(job: TraceJob) -> dict[str, object]:
    """``job`` as a native record: every field of `NATIVE_FIELDS`, None where absent."""
    row = native_row(job)
    return {name: getattr(row, name) for name in NATIVE_FIELDS}


def native_row(job: TraceJob) -> NativeRow:
    """``job`` as the `NativeRow` `write_native` writes (its deadline relative to its
    submission, a default value absent)."""
    return NativeRow(
        job_id=job.job_id,
        submit_time=job.submit_time,
        gpus=job.gpus,
        model=job.model,
        batch_size=job.batch_size,
        duration_s=job.duration_s,
        iterations=job.iterations,
        allow_sharing=job.allow_sharing,
        deadline=None if job.deadline is None else job.deadline - job.submit_time,
        user=job.user or None,
        cpus_per_gpu=job.cpus_per_gpu,
        mem_gb_per_gpu=job.mem_gb_per_gpu,
        priority=job.priority or None,
        tensor_parallel=None if job.tensor_parallel == 1 else job.tensor_parallel,
        pipeline_parallel=None if job.pipeline_parallel == 1 else job.pipeline_parallel,
        min_batch_size=job.min_batch_size,
        max_batch_size=job.max_batch_size,
        min_gpus=job.min_gpus,
        max_gpus=job.max_gpus,
        measured_iteration_s=job.measured_iteration_s,
        measured_gpu_model=job.measured_gpu_model or None,
        live_jct_s=job.live_jct_s,
        live_queue_s=job.live_queue_s,
        live_state=job.live_state or None,
        live_policy=job.live_policy or None,
    )


def _csv_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # str(float) is the shortest text that reads back exactly
