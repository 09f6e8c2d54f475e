"""Reading a trace file's rows: CSV and its header, each row's fields converted and
checked (a bad field names itself), rows collected into jobs or counted as skipped or
left out, and the jobs sorted and shifted so the first arrives at 0. Every format's
loader (philly.py, alibaba.py, pollux.py, native.py) builds on these."""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TextIO, TypeVar

from gpusched.libs.core.traces.job import (
    MAX_TRACE_COUNT,
    MAX_TRACE_SECONDS,
    LoadedTrace,
    TraceError,
    TraceJob,
)

#: the reason a row with no GPU is left out (pods and nodes alike)
NO_GPU = "no GPU (num_gpu = 0)"


@dataclass(frozen=True)
class Options:
    skip_bad_rows: bool
    data_dir: Path | None


class BadField(Exception):
    """A row-level problem; the collector adds the file and line."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.message = message


T = TypeVar("T")
Row = tuple[int, "Mapping[str, object] | BadField"]
#: A row parser returns an item or, for a row the format leaves out, the reason.
RowParser = Callable[[int, Mapping[str, object]], "T | str"]


@dataclass
class Collected(Generic[T]):
    path: Path
    items: list[T] = field(default_factory=list)
    skipped: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


def collect(path: Path, rows: Iterator[Row], parse: RowParser[T], opts: Options) -> Collected[T]:
    out: Collected[T] = Collected(path)
    try:
        for line, row in rows:
            _take(out, line, row, parse, opts)
    except (UnicodeDecodeError, csv.Error) as exc:
        # the reader cannot go on past undecodable bytes, so this is never skippable
        raise TraceError(f"{path}: not readable as UTF-8 text: {exc}") from None
    return out


def _take(
    out: Collected[T],
    line: int,
    row: Mapping[str, object] | BadField,
    parse: RowParser[T],
    opts: Options,
) -> None:
    try:
        if isinstance(row, BadField):
            raise row
        result = parse(line, row)
    except BadField as bad:
        if not opts.skip_bad_rows:
            where = f"field {bad.field_name!r}: " if bad.field_name else ""
            raise TraceError(f"{out.path}:{line}: {where}{bad.message}") from None
        out.skipped += 1
        return
    if isinstance(result, str):
        out.filtered[result] += 1
    else:
        out.items.append(result)


def finish(collected: Collected[TraceJob], limit: int | None) -> LoadedTrace:
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
        j.min_batch_size,
        j.max_batch_size,
        j.min_gpus,
        j.max_gpus,
        j.measured_iteration_s,
        j.measured_gpu_model,
        j.live_jct_s,
        j.live_queue_s,
        j.live_state,
        j.live_policy,
    )


def resolve(path: Path, data_dir: Path | None) -> Path:
    if path.exists():
        return path
    if data_dir is not None and not path.is_absolute() and (data_dir / path).exists():
        return data_dir / path
    raise TraceError(f"trace file not found: {path}")


def open_csv(path: Path, required: tuple[str, ...]) -> tuple[list[str], Iterator[Row]]:
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
        raise TraceError(f"{path}:1: missing column(s) {names(missing)}; header is {header}")
    return header, _csv_rows(handle, header)


def _csv_rows(handle: TextIO, header: list[str]) -> Iterator[Row]:
    with handle:
        reader = csv.reader(handle)
        width = len(header)
        for values in reader:
            line = reader.line_num + 1  # the header was read before the reader started
            if not values or values == [""]:
                continue  # blank lines carry nothing; several published files end with one
            if len(values) < width:
                yield line, BadField(header[len(values)], "missing (row has too few values)")
            elif len(values) > width:
                yield line, BadField(None, f"row has {len(values)} values, header {width}")
            else:
                yield line, dict(zip(header, values, strict=True))


def names(names: list[str] | set[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


# ------------------------------------------------------------------- field converters


def int_field(
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
        raise BadField(name, f"expected {kind}, got {value!r}")
    if number > maximum:
        raise BadField(name, f"expected at most {maximum:,}, got {value!r}")
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


def float_field(row: Mapping[str, object], name: str, *, positive: bool) -> float:
    value = row.get(name)
    number = math.nan
    if isinstance(value, str):
        number = _str_to_float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    # NaN fails both comparisons; infinities are rejected as no trace means them
    if not (math.isfinite(number) and (number > 0 or (number == 0 and not positive))):
        kind = "a positive number" if positive else "a number >= 0"
        raise BadField(name, f"expected {kind}, got {value!r}")
    return number


def seconds_field(row: Mapping[str, object], name: str, *, positive: bool) -> float:
    """A time or duration: a number (> 0 if ``positive``, else >= 0) of at most
    `MAX_TRACE_SECONDS`."""
    number = float_field(row, name, positive=positive)
    if number > MAX_TRACE_SECONDS:
        raise BadField(
            name, f"expected at most {MAX_TRACE_SECONDS:g} seconds, got {row.get(name)!r}"
        )
    return number


def _str_to_float(text: str) -> float:
    # try/except rather than contextlib.suppress: this runs once per row of large traces
    try:
        return float(text)
    except ValueError:
        return math.nan


def absent(value: object) -> bool:
    return value is None or (isinstance(value, str) and value.strip() == "")


def job_id(row: Mapping[str, object], name: str) -> str:
    value = row.get(name)
    # the same rule as JobSpec: ids appear in NATS subjects, so no dots or spaces
    if not isinstance(value, str) or not value or "." in value or any(c.isspace() for c in value):
        raise BadField(name, f"expected a non-empty id without dots or spaces, got {value!r}")
    return value
