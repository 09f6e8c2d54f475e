"""The Pollux artifact's workloads: ``name,time,application,num_replicas,batch_size``,
each job running until it converges (docs/trace-format.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from gpusched.libs.core.convergence import BUILTIN as BUILTIN_CONVERGENCE
from gpusched.libs.core.convergence import Convergence, load_convergence
from gpusched.libs.core.traces.job import TraceError, TraceJob
from gpusched.libs.core.traces.rows import (
    BadField,
    Collected,
    Options,
    collect,
    int_field,
    job_id,
    names,
    open_csv,
    seconds_field,
)

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
            known = names(set(BUILTIN_CONVERGENCE))
            raise BadField("application", f"no profile or default for {app!r}; known: {known}")
        self.sources[source] += 1
        return max(1, round(curve.total_iterations(batch_size)))

    def _curve(self, app: str) -> tuple[Convergence | None, str]:
        try:
            curve, measured = load_convergence(app, self.data_dir)
        except ValueError as bad:
            raise TraceError(str(bad)) from None
        return curve, "profiles" if measured else "built-in defaults"


def load_pollux(path: Path, opts: Options) -> Collected[TraceJob]:
    _, rows = open_csv(path, _POLLUX_COLUMNS)
    iterations = _PolluxIterations(opts.data_dir)

    def parse(line: int, row: Mapping[str, object]) -> TraceJob:
        app = str(row["application"]).strip()
        if not app:
            raise BadField("application", "expected an application name, got ''")
        batch = int_field(row, "batch_size")
        return TraceJob(
            job_id=job_id(row, "name"),
            submit_time=seconds_field(row, "time", positive=False),
            gpus=int_field(row, "num_replicas"),
            model=app,
            batch_size=batch,
            iterations=iterations(app, batch),
            line=line,
            # Pollux's workloads are of adaptive jobs: the scheduler picks each job's
            # GPUs and batch, so every job declares itself elastic (1 GPU at least)
            min_gpus=1,
        )

    collected = collect(path, rows, parse, opts)
    used = ", ".join(f"{n} jobs from {src}" for src, n in sorted(iterations.sources.items()))
    collected.notes.append(f"pollux: iterations: {used or 'none'}")
    return collected
