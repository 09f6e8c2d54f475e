"""A job as ONES's search sees it in one decision (``SearchJob``: the GPU counts it may
hold and what each costs), and how those are chosen: the batches a size may run at, the
largest batch worth growing to, the samples a job has left at another batch (its
convergence curve), and how far padding may grow a running job."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.perf import ConvergenceSource
from gpusched.libs.core.snapshot import JobView, Snapshot

#: per-GPU batches up to 2 ** this times a job's own are tried (``batch_search``)
BATCH_SPREAD_LOG2 = 3


@dataclass
class SearchJob:
    """One job as the search sees it in this decision."""

    view: JobView
    #: GPUs and batch it asked for (first seen)
    asked_gpus: int
    asked_batch: int
    #: "new" (queued), "frozen" (running, too soon to change) or "running"
    kind: str
    #: GPU counts it may hold, ascending (never empty)
    sizes: list[int]
    #: size -> (predicted remaining seconds, accumulation steps, batch)
    cost: dict[int, tuple[float, int, int]]
    #: predicted remaining time on one GPU (padding order)
    one_gpu_s: float

    @property
    def current(self) -> int:
        return self.view.gpus if self.view.running else 0


def largest_useful_batch(snapshot: Snapshot, model: str) -> int:
    """The largest global batch worth growing a job of ``model`` to: the largest batch
    its convergence curve was measured at (Pollux bounds its jobs' batches the same
    way); unbounded where the estimates know no curve."""
    curve = curve_of(snapshot, model)
    return sys.maxsize if curve is None else int(curve.max_batch)


def curve_of(snapshot: Snapshot, model: str) -> Convergence | None:
    """The model's convergence curve, where the snapshot's estimates know one."""
    estimates = snapshot.estimates
    return estimates.convergence(model) if isinstance(estimates, ConvergenceSource) else None


def batch_choices(ones_batch: int, base: int, n: int, largest: int) -> list[int]:
    """Global batches a job may run at on ``n`` GPUs: ONES's (first) and per-GPU batches
    from a quarter to BATCH_SPREAD times the base, within ``n`` and ``largest``."""
    found = [ones_batch]
    for k in range(-2, BATCH_SPREAD_LOG2 + 1):
        per_gpu = base * 2.0**k
        batch = int(min(max(per_gpu * n, n), largest))
        if batch not in found:
            found.append(batch)
    return found


def within_batch_bounds(choices: list[int], bounds: Elastic, n: int) -> list[int]:
    """The batches of ``choices`` a job of ``bounds`` may run at on ``n`` GPUs (at least
    one sample a GPU); where none is, the first moved into the bounds; none where no
    batch within them gives every GPU a sample."""
    low = max(bounds.min_batch_size, n)
    high = bounds.max_batch_size
    if high is not None and high < low:
        return []
    kept = [b for b in choices if low <= b and (high is None or b <= high)]
    return kept or [bounds.batch_within(max(choices[0], n))]


def worth_growing(job: SearchJob, restart_s: float) -> int:
    """The largest size padding may give ``job``: any of its sizes for a new job; for a
    running one its size now or a larger one whose predicted remaining time plus the
    restart is shorter than at its size now."""
    if job.kind != "running" or job.current not in job.cost:
        return job.sizes[-1]
    now = job.cost[job.current][0]
    return max(n for n in job.sizes if n <= job.current or job.cost[n][0] + restart_s < now)


def samples_at(
    curves: dict[tuple[str, int], np.ndarray],
    curve: Convergence,
    view: JobView,
    samples: float,
    batch: int,
) -> float:
    """Samples a job with ``samples`` left at its batch has left at ``batch``: the
    progress it made carries over (the convergence curve's statistical efficiency, as
    the simulator's ``remaining_after_resize``). ``curves`` caches each batch's
    cumulative iterations per progress knot."""
    if batch == view.batch_size or samples <= 0:
        return samples

    def at(b: int) -> np.ndarray:
        found = curves.get((view.model, b))
        if found is None:
            found = curves[(view.model, b)] = np.asarray(curve.curve(b))
        return found

    knots = np.asarray(curve.knots)
    old, new = at(view.batch_size), at(batch)
    # the curve's iterations left at the job's batch (at most its whole run there), and
    # at ``batch`` from the same progress; their ratio scales the job's own estimate
    now = min(samples / view.batch_size, float(old[-1]))
    if now <= 0:
        return samples
    progress = float(np.interp(old[-1] - now, old, knots))
    then = float(new[-1] - np.interp(progress, knots, new))
    return samples * (batch * then) / (view.batch_size * now)


def doubling_floor(n: int) -> int:
    """The largest power of two not above ``n`` (the sizes ONES grows a job through)."""
    return 1 << (n.bit_length() - 1)
