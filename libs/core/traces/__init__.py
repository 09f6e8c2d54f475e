"""Trace loaders: research cluster traces and the project's own format as `TraceJob`s.

A `TraceJob` is what a trace says about a job, no more: many traces give no model or
batch size, some give a run time and others an iteration count. `gpusched.libs.core.workload`
turns trace jobs into runnable `JobSpec`s with a performance model.

Every loader shifts submit times so the first job arrives at 0, sorts jobs by
(submit time, source line), and reports a malformed row as a `TraceError` naming the
file, the line and the field, or, with ``skip_bad_rows=True``, counts and skips it.
Rows a format defines as out of scope (pods with no GPU, pods never scheduled) are
not errors: they are counted in `LoadedTrace.filtered` and explained in its notes.

The types are in job.py, the reading of rows and fields every format shares in rows.py,
and each format in a module of its own (philly.py, alibaba.py, pollux.py, native.py).
File layouts and where to obtain each research trace: docs/trace-format.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from gpusched.libs.core.traces.alibaba import (
    ALIBABA_GPU_MEM_GB,
    ALIBABA_UNKNOWN_GPU_MEM_GB,
    load_alibaba,
    load_alibaba_nodes,
)
from gpusched.libs.core.traces.job import (
    MAX_TRACE_COUNT,
    MAX_TRACE_SECONDS,
    LoadedTrace,
    TraceError,
    TraceJob,
)
from gpusched.libs.core.traces.native import (
    LIVE_FIELDS,
    NATIVE_CSV_SUFFIXES,
    NATIVE_FIELDS,
    NATIVE_JSONL_SUFFIXES,
    NativeRow,
    load_native,
    native_job,
    native_record,
    native_row,
    write_native,
)
from gpusched.libs.core.traces.philly import load_philly
from gpusched.libs.core.traces.pollux import load_pollux
from gpusched.libs.core.traces.rows import Collected, Options, finish, resolve

FORMATS = ("philly", "alibaba", "pollux", "native")


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
    source = resolve(Path(path), root)
    collected = loader(source, Options(skip_bad_rows, root))
    return finish(collected, limit)


_LOADERS: Mapping[str, Callable[[Path, Options], Collected[TraceJob]]] = {
    "philly": load_philly,
    "alibaba": load_alibaba,
    "pollux": load_pollux,
    "native": load_native,
}


__all__ = [
    "ALIBABA_GPU_MEM_GB",
    "ALIBABA_UNKNOWN_GPU_MEM_GB",
    "FORMATS",
    "LIVE_FIELDS",
    "MAX_TRACE_COUNT",
    "MAX_TRACE_SECONDS",
    "NATIVE_CSV_SUFFIXES",
    "NATIVE_FIELDS",
    "NATIVE_JSONL_SUFFIXES",
    "LoadedTrace",
    "NativeRow",
    "TraceError",
    "TraceJob",
    "load_alibaba_nodes",
    "load_trace",
    "native_job",
    "native_record",
    "native_row",
    "write_native",
]
