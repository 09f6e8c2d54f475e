"""How long a model trains to converge at each global batch size (statistical efficiency).

Progress is counted as Pollux counts it: in iterations at a reference batch ``M0`` (the
smallest batch profiled), so a model converges at the same progress ``P`` whatever batch
it runs at, while a larger batch makes less progress per sample once it exceeds the
gradient noise scale. A :class:`Convergence` holds, for a few profiled batches, the
cumulative iterations each needs to reach each progress knot; any other batch is
interpolated between the two nearest in log-log space (so iterations never grow and
samples never shrink as the batch grows).

Two sources:

- :func:`read_convergence`: the Pollux training-progress traces
  ``profiles/pollux/<model>/validation-<batch>.csv`` (``progress,iteration,...``), each a
  real run at one batch to the same final progress. The measured iterations are used as
  they are: recomputing them from the gradient statistics in the same files with
  Pollux's gain formula agrees within 4 % for five models but is 37 % off for yolov3.
- :func:`builtin_convergence`: the project's own figures where no traces are at hand:
  ``samples(M) = samples(M0) (1 + M/B) / (1 + M0/B)`` with a critical batch ``B`` per
  model (McCandlish et al.'s form), ``B`` fitted by us to those traces' totals.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusched.libs.core.profiles.files import csv_rows, number_cell


@dataclass(frozen=True, slots=True)
class Convergence:
    """Cumulative iterations to each progress knot at each profiled global batch.

    ``knots`` start at 0 and end at the target progress; ``iterations[j][k]`` is what
    batch ``batches[j]`` needs to reach ``knots[k]`` (0 at knot 0).
    """

    knots: tuple[float, ...]
    batches: tuple[float, ...]
    iterations: tuple[tuple[float, ...], ...]
    #: samples in one epoch of the model's data set; None: not known
    epoch_samples: float | None = None
    #: validation metric reached at each knot (the one at knot 0 repeats knot 1's);
    #: None: not measured
    metric: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.knots) < 2 or self.knots[0] != 0.0:
            raise ValueError("knots must start at 0 and hold at least two points")
        if any(b <= a for a, b in itertools.pairwise(self.knots)):
            raise ValueError("knots must increase")
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError("batches must be positive")
        if any(b <= a for a, b in itertools.pairwise(self.batches)):
            raise ValueError("batches must increase")
        if len(self.iterations) != len(self.batches):
            raise ValueError("one row of iterations per batch")
        if self.epoch_samples is not None and not self.epoch_samples > 0:
            raise ValueError("epoch_samples must be > 0")
        if self.metric is not None and len(self.metric) != len(self.knots):
            raise ValueError("one metric per knot")
        for row in self.iterations:
            if len(row) != len(self.knots) or row[0] != 0.0:
                raise ValueError("each row has one count per knot, starting at 0")
            if any(b <= a for a, b in itertools.pairwise(row)):
                raise ValueError("iterations must increase with progress")

    @property
    def target(self) -> float:
        """Progress at convergence."""
        return self.knots[-1]

    @property
    def max_batch(self) -> float:
        """The largest batch profiled (the model's largest useful batch, as Pollux has it)."""
        return self.batches[-1]

    def curve(self, batch: float) -> tuple[float, ...]:
        """Cumulative iterations at each knot for ``batch``."""
        if not (batch > 0 and math.isfinite(batch)):
            raise ValueError(f"batch must be a finite number > 0, got {batch!r}")
        batches, rows = self.batches, self.iterations
        if len(batches) == 1 or batch <= batches[0]:
            # below the smallest profiled batch every sample counts fully
            scale = batches[0] / batch
            return tuple(c * scale for c in rows[0])
        j = bisect.bisect_left(batches, batch)
        if j < len(batches) and batches[j] == batch:
            return rows[j]
        lo = min(j, len(batches) - 1) - 1
        hi = lo + 1
        t = math.log(batch / batches[lo]) / math.log(batches[hi] / batches[lo])
        # past the largest batch its trend goes on, within "iterations never grow" and
        # "samples never shrink"
        steepest = -math.log(batches[hi] / batches[lo])
        curve = [0.0]
        for k in range(1, len(self.knots)):
            trend = math.log(rows[hi][k] / rows[lo][k])
            if t > 1:
                trend = min(0.0, max(steepest, trend))
            curve.append(max(rows[lo][k] * math.exp(t * trend), curve[-1]))
        return tuple(curve)

    def iterations_to(self, batch: float, progress: float) -> float:
        """Iterations at ``batch`` from the start to ``progress``."""
        return _interp(self.knots, self.curve(batch), progress)

    def total_iterations(self, batch: float) -> float:
        return self.curve(batch)[-1]

    def progress_after(self, batch: float, iterations: float) -> float:
        """Progress reached after ``iterations`` at ``batch`` from the start."""
        return _interp(self.curve(batch), self.knots, iterations)

    def metric_at(self, progress: float) -> float | None:
        """The validation metric at ``progress``; None where none was measured."""
        return None if self.metric is None else _interp(self.knots, self.metric, progress)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points; clamped to the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def remaining_after_resize(
    conv: Convergence, old_batch: float, remaining: float, new_batch: float, scale: float = 1.0
) -> float:
    """Iterations left at ``new_batch`` for a job that had ``remaining`` left at
    ``old_batch``: the progress it made carries over, not its iteration count. ``scale``
    is the job's own total over the curve's (a trace may fix a job's length)."""
    done = max(0.0, scale * conv.total_iterations(old_batch) - remaining)
    progress = conv.progress_after(old_batch, done / scale)
    return scale * (conv.total_iterations(new_batch) - conv.iterations_to(new_batch, progress))


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True, slots=True)
class _Builtin:
    reference_batch: int
    samples: int
    critical_batch: float
    max_batch: int
    epoch_samples: int


#: our own figures for the six Pollux applications: total samples at the reference batch
#: (a typical epoch count times the data set size: cifar10 100 x 50,000; imagenet 90 x
#: 1.28 M; bert 2 x 88 k; the rest our estimates of the same kind), a critical batch
#: fitted to the Pollux traces' totals, the largest batch they profile, and the data
#: set's size
BUILTIN: Mapping[str, _Builtin] = {
    "bert": _Builtin(12, 180_000, 8_700.0, 384, 88_000),
    "cifar10": _Builtin(128, 5_000_000, 5_900.0, 4_096, 50_000),
    "deepspeech2": _Builtin(20, 570_000, 1_050.0, 640, 7_000),
    "imagenet": _Builtin(200, 115_000_000, 20_000.0, 12_800, 1_281_000),
    "ncf": _Builtin(256, 50_000_000, 1_500_000.0, 32_768, 5_000_000),
    "yolov3": _Builtin(8, 830_000, 500.0, 512, 16_500),
}


def builtin_convergence(model: str) -> Convergence | None:
    """The project's own convergence curve for a Pollux application; None for others."""
    spec = BUILTIN.get(model)
    if spec is None:
        return None
    m0, b = spec.reference_batch, spec.critical_batch
    batches: list[float] = []
    batch = float(m0)
    while batch < spec.max_batch:
        batches.append(batch)
        batch *= 2
    batches.append(float(spec.max_batch))
    target = spec.samples / m0
    rows = tuple((0.0, spec.samples * (1 + m / b) / (1 + m0 / b) / m) for m in batches)
    return Convergence((0.0, target), tuple(batches), rows, float(spec.epoch_samples))


_VALIDATION = re.compile(r"validation-(\d+)\.csv")


def read_convergence(folder: Path) -> Convergence | None:
    """The convergence curve measured by a Pollux model's training-progress traces;
    None when the folder holds none. Knots are the smallest batch's progress points."""
    runs: list[tuple[int, list[tuple[float, float]]]] = []
    metrics: dict[int, list[float]] = {}
    for path in sorted(folder.glob("validation-*.csv")):
        found = _VALIDATION.fullmatch(path.name)
        if found is None:
            continue
        points = [(0.0, 0.0)]
        metric: list[float] = []
        for line, row in csv_rows(path, ("progress", "iteration")):
            if row.get("metric") not in (None, ""):
                metric.append(number_cell(path, line, "metric", row["metric"], positive=False))
            progress = number_cell(path, line, "progress", row["progress"], positive=True)
            iteration = number_cell(path, line, "iteration", row["iteration"], positive=True)
            if progress <= points[-1][0] or iteration <= points[-1][1]:
                raise ValueError(
                    f"{path}, line {line}: progress and iteration must increase "
                    f"(got {progress}, {iteration} after {points[-1]})"
                )
            points.append((progress, iteration))
        if len(points) >= 2:
            runs.append((int(found.group(1)), points))
            if len(metric) == len(points) - 1:
                metrics[int(found.group(1))] = [metric[0], *metric]
    if not runs:
        return None
    runs.sort()
    knots = tuple(p for p, _ in runs[0][1])
    rows: list[tuple[float, ...]] = []
    for batch, points in runs:
        reached = [p for p, _ in points]
        counted = [i for _, i in points]
        counts = [0.0]
        for knot in knots[1:]:
            if knot <= reached[-1]:
                value = _interp(reached, counted, knot)
            else:  # a run that stopped a little short: its last pace continues
                pace = (counted[-1] - counted[-2]) / (reached[-1] - reached[-2])
                value = counted[-1] + pace * (knot - reached[-1])
            counts.append(value)
        if rows:
            # noise in the traces must not make a larger batch need more iterations or
            # fewer samples than a smaller one
            prev, ratio = rows[-1], runs[len(rows) - 1][0] / batch
            counts = [min(v, p) for v, p in zip(counts, prev, strict=True)]
            counts = [max(v, p * ratio) for v, p in zip(counts, prev, strict=True)]
        rows.append(tuple(counts))
    # the smallest batch's run is the reference: its first row is one epoch
    reference, first = runs[0][0], runs[0][1][1][0]
    return Convergence(
        knots,
        tuple(float(b) for b, _ in runs),
        tuple(rows),
        epoch_samples=first * reference,
        metric=tuple(metrics[reference]) if reference in metrics else None,
    )


def load_convergence(model: str, data_dir: Path | None) -> tuple[Convergence | None, bool]:
    """A model's convergence curve and whether it was measured: its Pollux traces under
    ``data_dir`` where they exist, else the built-in curve (None for a model with
    neither)."""
    if data_dir is not None:
        folder = data_dir / "profiles" / "pollux" / model
        measured = read_convergence(folder) if folder.is_dir() else None
        if measured is not None:
            return measured, True
    return builtin_convergence(model), False


def convergence_models(data_dir: Path | None) -> dict[str, Convergence]:
    """Every Pollux application's convergence curve (see :func:`load_convergence`)."""
    found: dict[str, Convergence] = {}
    for model in BUILTIN:
        curve, _ = load_convergence(model, data_dir)
        if curve is not None:
            found[model] = curve
    return found
