"""Trace loaders: research cluster traces and the project's own format as `TraceJob`s.

A `TraceJob` is what a trace says about a job, no more: many traces give no model or
batch size, some give a run time and others an iteration count. `gpusched.libs.core.workload`
turns trace jobs into runnable `JobSpec`s with a performance model.

Every loader shifts submit times so the first job arrives at 0, sorts jobs by
(submit time, source line), and reports a malformed row as a `TraceError` naming the
file, the line and the field, or, with ``skip_bad_rows=True``, counts and skips it.
Rows a format defines as out of scope (pods with no GPU, pods never scheduled) are
not errors: they are counted in `LoadedTrace.filtered` and explained in its notes.

File layouts and where to obtain each research trace: docs/trace-format.md.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, TextIO, TypeVar

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.convergence import BUILTIN as BUILTIN_CONVERGENCE
from gpusched.libs.core.convergence import Convergence, load_convergence

FORMATS = ("philly", "alibaba", "pollux", "native")

#: Fields of the native format, in the order `write_native` writes them.
NATIVE_FIELDS = (
    "job_id",
    "submit_time",
    "gpus",
    "model",
    "batch_size",
    "duration_s",
    "iterations",
    "allow_sharing",
    "deadline",
    "user",
    "cpus_per_gpu",
    "mem_gb_per_gpu",
    "priority",
    "tensor_parallel",
    "pipeline_parallel",
)
#: Largest time a trace may state, in seconds (about 317 years; Philly spans one). Near
#: 1e20 s two neighbouring floats are hours apart, so a short job there would end at the
#: very moment it starts; a larger value is refused as a malformed field.
MAX_TRACE_SECONDS = 1e10
#: Largest count (GPUs, batch size, iterations) a trace may state; beyond it a count
#: no longer fits the simulator's floating-point arithmetic with room to spare.
MAX_TRACE_COUNT = 10**12
NATIVE_CSV_SUFFIXES = (".csv",)
NATIVE_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class TraceError(ValueError):
    """A trace file that cannot be read: missing, malformed header, or a bad row."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job as a trace describes it.

    Exactly one of ``duration_s`` (exclusive run time, seconds) and ``iterations`` is
    set. ``submit_time`` and ``deadline`` are absolute seconds on the trace's clock,
    which starts at the first submission. ``line`` is the job's line in its source
    file (its position, for generated jobs), so messages can point back at it.
    """

    job_id: str
    submit_time: float
    gpus: int
    model: str | None = None
    batch_size: int | None = None
    duration_s: float | None = None
    iterations: int | None = None
    allow_sharing: bool = True
    deadline: float | None = None
    user: str = ""
    cpus_per_gpu: float | None = None
    mem_gb_per_gpu: float | None = None
    line: int = 0
    #: the tenant's own order of its jobs, -1000..1000 (see ``gpusched.libs.core.jobs.JobSpec``)
    priority: int = 0
    #: tensor and pipeline parallel degrees (their product divides ``gpus``)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"trace job {self.job_id}: gpus must be >= 1, got {self.gpus}")
        if (self.duration_s is None) == (self.iterations is None):
            raise ValueError(
                f"trace job {self.job_id}: give exactly one of duration_s and iterations"
            )
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"trace job {self.job_id}: duration_s must be > 0")
        if self.iterations is not None and self.iterations < 1:
            raise ValueError(f"trace job {self.job_id}: iterations must be >= 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"trace job {self.job_id}: batch_size must be >= 1")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(f"trace job {self.job_id}: parallel degrees must be >= 1")
        if self.gpus % (self.tensor_parallel * self.pipeline_parallel):
            raise ValueError(
                f"trace job {self.job_id}: tensor_parallel x pipeline_parallel must divide gpus"
            )


@dataclass
class LoadedTrace:
    jobs: list[TraceJob]
    #: malformed rows dropped because ``skip_bad_rows`` was set
    skipped_rows: int = 0
    notes: list[str] = field(default_factory=list)
    #: well-formed rows the format leaves out, by reason (e.g. ``"no GPU": 1088``)
    filtered: dict[str, int] = field(default_factory=dict)


def load_trace(
    path: str | Path,
    fmt: str,
    *,
    skip_bad_rows: bool = False,
    data_dir: str | Path | None = None,
    limit: int | None = None,
) -> LoadedTrace:
    """Load a trace file of format ``fmt`` (one of `FORMATS`).

    ``data_dir`` is a folder laid out like ``traces/...`` and ``profiles/...``: a
    relative ``path`` not found as given is looked up inside it, and the Pollux loader
    reads training-progress profiles from it. ``limit`` keeps the first jobs by
    submit time.
    """
    loader = _LOADERS.get(fmt)
    if loader is None:
        raise TraceError(f"unknown trace format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    root = Path(data_dir) if data_dir is not None else None
    source = _resolve(Path(path), root)
    collected = loader(source, _Options(skip_bad_rows, root))
    return _finish(collected, limit)


# --------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class _Options:
    skip_bad_rows: bool
    data_dir: Path | None


class _BadField(Exception):
    """A row-level problem; the collector adds the file and line."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.message = message


_T = TypeVar("_T")
_Row = tuple[int, "Mapping[str, object] | _BadField"]
#: A row parser returns an item or, for a row the format leaves out, the reason.
_RowParser = Callable[[int, Mapping[str, object]], "_T | str"]


@dataclass
class _Collected(Generic[_T]):
    path: Path
    items: list[_T] = field(default_factory=list)
    skipped: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


def _collect(
    path: Path, rows: Iterator[_Row], parse: _RowParser[_T], opts: _Options
) -> _Collected[_T]:
    out: _Collected[_T] = _Collected(path)
    try:
        for line, row in rows:
            _take(out, line, row, parse, opts)
    except (UnicodeDecodeError, csv.Error) as exc:
        # the reader cannot go on past undecodable bytes, so this is never skippable
        raise TraceError(f"{path}: not readable as UTF-8 text: {exc}") from None
    return out


def _take(
    out: _Collected[_T],
    line: int,
    row: Mapping[str, object] | _BadField,
    parse: _RowParser[_T],
    opts: _Options,
) -> None:
    try:
        if isinstance(row, _BadField):
            raise row
        result = parse(line, row)
    except _BadField as bad:
        if not opts.skip_bad_rows:
            where = f"field {bad.field_name!r}: " if bad.field_name else ""
            raise TraceError(f"{out.path}:{line}: {where}{bad.message}") from None
        out.skipped += 1
        return
    if isinstance(result, str):
        out.filtered[result] += 1
    else:
        out.items.append(result)


def _finish(collected: _Collected[TraceJob], limit: int | None) -> LoadedTrace:
    loaded = collected.items
    jobs = _shift_to_zero(sorted(loaded, key=lambda j: (j.submit_time, j.line)))
    if limit is not None:
        jobs = jobs[:limit]
    notes = [f"{collected.path}: {len(loaded)} jobs"]
    if collected.skipped:
        notes.append(f"skipped {collected.skipped} malformed rows")
    notes += [f"left out {n} rows: {why}" for why, n in sorted(collected.filtered.items())]
    notes += collected.notes
    if limit is not None and limit < len(loaded):
        notes.append(f"kept the first {limit} jobs by submit time")
    return LoadedTrace(jobs, collected.skipped, notes, dict(collected.filtered))


def _shift_to_zero(jobs: list[TraceJob]) -> list[TraceJob]:
    """Move the clock so the first job arrives at 0 (deadlines move with it)."""
    if not jobs or jobs[0].submit_time == 0:
        return jobs
    t0 = jobs[0].submit_time
    return [_shifted(j, t0) for j in jobs]


def _shifted(j: TraceJob, t0: float) -> TraceJob:
    # positional construction: dataclasses.replace is several times slower at 82k rows
    return TraceJob(
        j.job_id,
        j.submit_time - t0,
        j.gpus,
        j.model,
        j.batch_size,
        j.duration_s,
        j.iterations,
        j.allow_sharing,
        None if j.deadline is None else j.deadline - t0,
        j.user,
        j.cpus_per_gpu,
        j.mem_gb_per_gpu,
        j.line,
        j.priority,
        j.tensor_parallel,
        j.pipeline_parallel,
    )


def _resolve(path: Path, data_dir: Path | None) -> Path:
    if path.exists():
        return path
    if data_dir is not None and not path.is_absolute() and (data_dir / path).exists():
        return data_dir / path
    raise TraceError(f"trace file not found: {path}")


def _open_csv(path: Path, required: tuple[str, ...]) -> tuple[list[str], Iterator[_Row]]:
    """Open a CSV file, check its header has ``required``, and return (header, rows)."""
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"cannot read trace file {path}: {exc.strerror}") from None
    try:
        first = handle.readline()
    except UnicodeDecodeError as exc:
        handle.close()
        raise TraceError(f"{path}: not readable as UTF-8 text: {exc}") from None
    if not first.strip():
        handle.close()
        raise TraceError(f"{path}: empty file, expected a header line")
    header = [h.strip() for h in next(csv.reader([first]))]
    missing = [c for c in required if c not in header]
    if missing:
        handle.close()
        raise TraceError(f"{path}:1: missing column(s) {_names(missing)}; header is {header}")
    return header, _csv_rows(handle, header)


def _csv_rows(handle: TextIO, header: list[str]) -> Iterator[_Row]:
    with handle:
        reader = csv.reader(handle)
        width = len(header)
        for values in reader:
            line = reader.line_num + 1  # the header was read before the reader started
            if not values or values == [""]:
                continue  # blank lines carry nothing; several published files end with one
            if len(values) < width:
                yield line, _BadField(header[len(values)], "missing (row has too few values)")
            elif len(values) > width:
                yield line, _BadField(None, f"row has {len(values)} values, header {width}")
            else:
                yield line, dict(zip(header, values, strict=True))


def _names(names: list[str] | set[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


# ------------------------------------------------------------------- field converters


def _int(
    row: Mapping[str, object], name: str, minimum: int = 1, maximum: int = MAX_TRACE_COUNT
) -> int:
    value = row.get(name)
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        number = _str_to_int(value)
    if number is None or number < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _BadField(name, f"expected {kind}, got {value!r}")
    if number > maximum:
        raise _BadField(name, f"expected at most {maximum:,}, got {value!r}")
    return number


def _str_to_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)  # "8.0" is a common export of integer columns
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _float(row: Mapping[str, object], name: str, *, positive: bool) -> float:
    value = row.get(name)
    number = math.nan
    if isinstance(value, str):
        number = _str_to_float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    # NaN fails both comparisons; infinities are rejected as no trace means them
    if not (math.isfinite(number) and (number > 0 or (number == 0 and not positive))):
        kind = "a positive number" if positive else "a number >= 0"
        raise _BadField(name, f"expected {kind}, got {value!r}")
    return number


def _seconds(row: Mapping[str, object], name: str, *, positive: bool) -> float:
    """A time or duration: a number (> 0 if ``positive``, else >= 0) of at most
    `MAX_TRACE_SECONDS`."""
    number = _float(row, name, positive=positive)
    if number > MAX_TRACE_SECONDS:
        raise _BadField(
            name, f"expected at most {MAX_TRACE_SECONDS:g} seconds, got {row.get(name)!r}"
        )
    return number


def _str_to_float(text: str) -> float:
    # try/except rather than contextlib.suppress: this runs once per row of large traces
    try:
        return float(text)
    except ValueError:
        return math.nan


def _absent(value: object) -> bool:
    return value is None or (isinstance(value, str) and value.strip() == "")


# ----------------------------------------------------------------------------- philly

_PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
_EPOCH = datetime(1970, 1, 1)


def _load_philly(path: Path, opts: _Options) -> _Collected[TraceJob]:
    _, rows = _open_csv(path, _PHILLY_COLUMNS)
    parsed = _collect(path, rows, _philly_row, opts)
    # shift while building: re-creating 82k frozen jobs afterwards would double the cost
    t0 = min((p[0] for p in parsed.items), default=0.0)
    jobs = [
        TraceJob(f"philly-{line}", submit - t0, gpus, duration_s=duration, user=user, line=line)
        for submit, line, gpus, duration, user in parsed.items
    ]
    return _Collected(path, jobs, parsed.skipped, parsed.filtered, parsed.notes)


def _philly_row(line: int, row: Mapping[str, object]) -> tuple[float, int, int, float, str]:
    stamp = row["timestamp"]
    try:
        moment = datetime.fromisoformat(str(stamp))
    except ValueError:
        raise _BadField("timestamp", f"expected 'YYYY-MM-DD HH:MM:SS', got {stamp!r}") from None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    # the published timestamps are naive times of one cluster: only differences matter
    submit = (moment - _EPOCH).total_seconds()
    gpus, duration = _int(row, "num_gpus"), _seconds(row, "duration", positive=True)
    return submit, line, gpus, duration, str(row["cluster"])


# ---------------------------------------------------------------------------- alibaba

_ALIBABA_POD_FILE = "openb_pod_list_default.csv"
_ALIBABA_NODE_FILE = "openb_node_list_gpu_node.csv"
_ALIBABA_RESOURCES = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_ALIBABA_TIMES = ("creation_time", "deletion_time", "scheduled_time")
_NO_GPU = "no GPU (num_gpu = 0)"
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


def _load_alibaba(path: Path, opts: _Options) -> _Collected[TraceJob]:
    if path.is_dir():
        path = path / _ALIBABA_POD_FILE
        if not path.exists():
            raise TraceError(f"trace file not found: {path}")
    header, rows = _open_csv(path, _ALIBABA_RESOURCES)
    lacking = [c for c in _ALIBABA_TIMES if c not in header]
    if lacking:
        raise TraceError(
            f"{path} has no timing columns ({', '.join(lacking)} missing), so its pods "
            f"cannot be replayed; use a pod list with creation, deletion and scheduled "
            f"times such as {_ALIBABA_POD_FILE}"
        )
    collected = _collect(path, rows, _alibaba_row, opts)
    collected.notes.append(
        "alibaba: pods with gpu_milli < 1000 share one GPU (allow_sharing); whole-GPU pods "
        "are exclusive, as in the trace; user is the pod's QoS class"
    )
    return collected


def _alibaba_row(line: int, row: Mapping[str, object]) -> TraceJob | str:
    gpus = _int(row, "num_gpu", minimum=0)
    if gpus == 0:
        return _NO_GPU
    if _absent(row["scheduled_time"]):
        return _NEVER_SCHEDULED
    milli = _int(row, "gpu_milli")
    if milli > 1000:
        raise _BadField("gpu_milli", f"expected 1..1000 per GPU, got {row['gpu_milli']!r}")
    created = _seconds(row, "creation_time", positive=False)
    started = _seconds(row, "scheduled_time", positive=False)
    ended = _seconds(row, "deletion_time", positive=False)
    if ended <= started:
        raise _BadField("deletion_time", f"must be after scheduled_time {started:g}, got {ended:g}")
    return TraceJob(
        job_id=_job_id(row, "name"),
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
    total = _float(row, name, positive=False)
    return total / divisor if total > 0 else None


def _job_id(row: Mapping[str, object], name: str) -> str:
    value = row.get(name)
    # the same rule as JobSpec: ids appear in NATS subjects, so no dots or spaces
    if not isinstance(value, str) or not value or "." in value or any(c.isspace() for c in value):
        raise _BadField(name, f"expected a non-empty id without dots or spaces, got {value!r}")
    return value


def load_alibaba_nodes(path: str | Path) -> Cluster:
    """The GPU nodes of an Alibaba node list (``openb_node_list_gpu_node.csv``).

    ``path`` is the file or the folder holding it. Nodes without GPUs are left out.
    """
    source = Path(path)
    if source.is_dir():
        source = source / _ALIBABA_NODE_FILE
    if not source.exists():
        raise TraceError(f"node list not found: {source}")
    _, rows = _open_csv(source, ("sn", "cpu_milli", "memory_mib", "gpu", "model"))
    nodes = _collect(source, rows, _alibaba_node_row, _Options(False, None)).items
    if not nodes:
        raise TraceError(f"{source}: no node with a GPU")
    return Cluster(tuple(nodes))


def _alibaba_node_row(line: int, row: Mapping[str, object]) -> Node | str:
    gpus = _int(row, "gpu", minimum=0)
    if gpus == 0:
        return _NO_GPU
    model = str(row["model"]).strip() or "unknown"
    return Node(
        name=_job_id(row, "sn"),
        gpus=gpus,
        gpu_mem_mb=ALIBABA_GPU_MEM_GB.get(model, ALIBABA_UNKNOWN_GPU_MEM_GB) * 1024,
        cpus=int(_float(row, "cpu_milli", positive=True) // 1000),
        host_mem_gb=_float(row, "memory_mib", positive=True) / 1024,
        gpu_model=model,
    )


# ----------------------------------------------------------------------------- pollux

_POLLUX_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


class _PolluxIterations:
    """Iterations a Pollux job of (application, batch size) runs until it converges:
    from the application's training-progress traces under the data folder, or the
    project's built-in curves (see :mod:`gpusched.libs.core.convergence`)."""

    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = data_dir
        self._curves: dict[str, tuple[Convergence | None, str]] = {}
        self.sources: Counter[str] = Counter()

    def __call__(self, app: str, batch_size: int) -> int:
        if app not in self._curves:
            self._curves[app] = self._curve(app)
        curve, source = self._curves[app]
        if curve is None:
            known = _names(set(BUILTIN_CONVERGENCE))
            raise _BadField("application", f"no profile or default for {app!r}; known: {known}")
        self.sources[source] += 1
        return max(1, round(curve.total_iterations(batch_size)))

    def _curve(self, app: str) -> tuple[Convergence | None, str]:
        try:
            curve, measured = load_convergence(app, self.data_dir)
        except ValueError as bad:
            raise TraceError(str(bad)) from None
        return curve, "profiles" if measured else "built-in defaults"


def _load_pollux(path: Path, opts: _Options) -> _Collected[TraceJob]:
    _, rows = _open_csv(path, _POLLUX_COLUMNS)
    iterations = _PolluxIterations(opts.data_dir)

    def parse(line: int, row: Mapping[str, object]) -> TraceJob:
        app = str(row["application"]).strip()
        if not app:
            raise _BadField("application", "expected an application name, got ''")
        batch = _int(row, "batch_size")
        return TraceJob(
            job_id=_job_id(row, "name"),
            submit_time=_seconds(row, "time", positive=False),
            gpus=_int(row, "num_replicas"),
            model=app,
            batch_size=batch,
            iterations=iterations(app, batch),
            line=line,
        )

    collected = _collect(path, rows, parse, opts)
    used = ", ".join(f"{n} jobs from {src}" for src, n in sorted(iterations.sources.items()))
    collected.notes.append(f"pollux: iterations: {used or 'none'}")
    return collected


# ----------------------------------------------------------------------------- native

_NATIVE_REQUIRED = ("submit_time", "gpus")
_TRUE = frozenset({"true", "1", "yes", "y", "t"})
_FALSE = frozenset({"false", "0", "no", "n", "f"})


def _load_native(path: Path, opts: _Options) -> _Collected[TraceJob]:
    suffix = path.suffix.lower()
    if suffix in NATIVE_CSV_SUFFIXES:
        header, rows = _open_csv(path, _NATIVE_REQUIRED)
        unknown = set(header) - set(NATIVE_FIELDS)
        if unknown:
            raise TraceError(
                f"{path}:1: unknown column(s) {_names(unknown)}; "
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
            raise _BadField("job_id", f"duplicate job_id {job.job_id!r} (first on line {first})")
        return job

    return _collect(path, rows, parse, opts)


def _jsonl_rows(path: Path) -> Iterator[_Row]:
    try:
        handle = path.open(encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"cannot read trace file {path}: {exc.strerror}") from None
    return _parse_jsonl(handle)


def _parse_jsonl(handle: TextIO) -> Iterator[_Row]:
    with handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line, _BadField(None, f"invalid JSON: {exc.msg} at column {exc.colno}")
                continue
            if not isinstance(value, dict):
                yield line, _BadField(None, f"expected a JSON object, got {type(value).__name__}")
                continue
            unknown = set(value) - set(NATIVE_FIELDS)
            if unknown:
                valid = ", ".join(NATIVE_FIELDS)
                message = f"unknown key(s) {_names(unknown)}; valid keys: {valid}"
                yield line, _BadField(min(unknown), message)
                continue
            yield line, value


def _native_row(line: int, row: Mapping[str, object]) -> TraceJob:
    # CSV gives empty strings and JSON gives null for an absent optional field
    row = {k: v for k, v in row.items() if not _absent(v)}
    for name in _NATIVE_REQUIRED:
        if name not in row:
            raise _BadField(name, "required, but missing")
    has_duration, has_iterations = "duration_s" in row, "iterations" in row
    if has_duration == has_iterations:
        both = "both are" if has_duration else "neither is"
        raise _BadField("duration_s", f"give exactly one of duration_s and iterations; {both} set")
    submit = _seconds(row, "submit_time", positive=False)
    relative_deadline = _seconds(row, "deadline", positive=True) if "deadline" in row else None
    return TraceJob(
        job_id=_job_id(row, "job_id") if "job_id" in row else f"job-{line}",
        submit_time=submit,
        gpus=_int(row, "gpus"),
        model=_text(row, "model") if "model" in row else None,
        batch_size=_int(row, "batch_size") if "batch_size" in row else None,
        duration_s=_seconds(row, "duration_s", positive=True) if has_duration else None,
        iterations=_int(row, "iterations") if has_iterations else None,
        allow_sharing=_bool(row, "allow_sharing") if "allow_sharing" in row else True,
        # the file says "seconds after submission"; a TraceJob holds the absolute time
        deadline=None if relative_deadline is None else submit + relative_deadline,
        user=_text(row, "user") if "user" in row else "",
        cpus_per_gpu=_float(row, "cpus_per_gpu", positive=True) if "cpus_per_gpu" in row else None,
        mem_gb_per_gpu=(
            _float(row, "mem_gb_per_gpu", positive=True) if "mem_gb_per_gpu" in row else None
        ),
        **_degrees(row),
        line=line,
        priority=_int(row, "priority", minimum=-1000, maximum=1000) if "priority" in row else 0,
    )


def _degrees(row: Mapping[str, object]) -> dict[str, int]:
    """The optional tensor and pipeline parallel degrees; their product divides gpus."""
    degrees = {name: _int(row, name) if name in row else 1 for name in _DEGREES}
    model_parallel = degrees["tensor_parallel"] * degrees["pipeline_parallel"]
    if _int(row, "gpus") % model_parallel:
        field = "tensor_parallel" if "tensor_parallel" in row else "pipeline_parallel"
        raise _BadField(
            field,
            f"tensor_parallel x pipeline_parallel = {model_parallel} does not divide "
            f"gpus {row['gpus']}",
        )
    return degrees


_DEGREES = ("tensor_parallel", "pipeline_parallel")


def _text(row: Mapping[str, object], name: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise _BadField(name, f"expected a string, got {value!r}")
    return value.strip()


def _bool(row: Mapping[str, object], name: str) -> bool:
    value = row[name]
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _BadField(name, f"expected true or false, got {value!r}")


def write_native(path: str | Path, jobs: Iterable[TraceJob]) -> None:
    """Write ``jobs`` as a native trace: CSV or JSON lines, by the file's extension.

    Loading the file back gives the same jobs (new ``line`` numbers aside) when the
    first job is submitted at 0, as every loader and generator here produces them.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    records = [_native_record(j) for j in jobs]
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


def _native_record(job: TraceJob) -> dict[str, object]:
    return {
        "job_id": job.job_id,
        "submit_time": job.submit_time,
        "gpus": job.gpus,
        "model": job.model,
        "batch_size": job.batch_size,
        "duration_s": job.duration_s,
        "iterations": job.iterations,
        "allow_sharing": job.allow_sharing,
        "deadline": None if job.deadline is None else job.deadline - job.submit_time,
        "user": job.user or None,
        "cpus_per_gpu": job.cpus_per_gpu,
        "mem_gb_per_gpu": job.mem_gb_per_gpu,
        "priority": job.priority or None,
        "tensor_parallel": None if job.tensor_parallel == 1 else job.tensor_parallel,
        "pipeline_parallel": None if job.pipeline_parallel == 1 else job.pipeline_parallel,
    }


def _csv_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # str(float) is the shortest text that reads back exactly


_LOADERS: Mapping[str, Callable[[Path, _Options], _Collected[TraceJob]]] = {
    "philly": _load_philly,
    "alibaba": _load_alibaba,
    "pollux": _load_pollux,
    "native": _load_native,
}
