"""Microsoft's Philly trace as the Pollux artifact preprocessed it:
``timestamp,duration,num_gpus,gpu_time,cluster`` (docs/trace-format.md)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from gpusched.libs.core.traces.job import TraceJob
from gpusched.libs.core.traces.rows import (
    BadField,
    Collected,
    Options,
    collect,
    int_field,
    open_csv,
    seconds_field,
)

_PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
_EPOCH = datetime(1970, 1, 1)


def load_philly(path: Path, opts: Options) -> Collected[TraceJob]:
    _, rows = open_csv(path, _PHILLY_COLUMNS)
    parsed = collect(path, rows, _philly_row, opts)
    # shift while building: re-creating 82k frozen jobs afterwards would double the cost
    t0 = min((p[0] for p in parsed.items), default=0.0)
    jobs = [
        TraceJob(f"philly-{line}", submit - t0, gpus, duration_s=duration, user=user, line=line)
        for submit, line, gpus, duration, user in parsed.items
    ]
    return Collected(path, jobs, parsed.skipped, parsed.filtered, parsed.notes)


def _philly_row(line: int, row: Mapping[str, object]) -> tuple[float, int, int, float, str]:
    stamp = row["timestamp"]
    try:
        moment = datetime.fromisoformat(str(stamp))
    except ValueError:
        raise BadField("timestamp", f"expected 'YYYY-MM-DD HH:MM:SS', got {stamp!r}") from None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    # the published timestamps are naive times of one cluster: only differences matter
    submit = (moment - _EPOCH).total_seconds()
    gpus, duration = int_field(row, "num_gpus"), seconds_field(row, "duration", positive=True)
    return submit, line, gpus, duration, str(row["cluster"])
