"""Job sizes for recurring jobs, learned online from the jobs that completed.

Our design for A-SRPT's prediction step (the paper's text was not available; its
abstract says a random forest predicts the iterations of recurring jobs from what is
known at submission and falls back to the user's figure without history).

- **Features** (all known at submission): ``log2`` of the batch, the GPUs and the
  tensor- and pipeline-parallel degrees (1 where the spec has none); ``log`` of the
  declared iterations and whether there are any; and a bag of hashed tokens, each
  ``field=value`` string hashed with CRC-32 into one of ``buckets`` counters: the user,
  the model, the data set, the job's *template* (its name without the version suffix,
  see `template_of`) and every token of its name (split on ``-``, ``_``, ``.``, ``/``
  and spaces, version tokens such as ``v7`` or ``7`` dropped).
- **Target**: ``log`` of the true iterations; a prediction is ``exp`` of the forest's
  mean, so errors are symmetric in ratio.
- **Model**: scikit-learn's ``RandomForestRegressor`` (``n_estimators`` trees,
  ``random_state`` fixed, one thread), trained on the newest ``max_rows`` completed
  jobs. It is retrained when the completed jobs have grown by ``growth`` (x1.25) since
  the last training, and at least every ``every`` completions.
- **Fallback**: a job whose template (user and name stem) is not among the rows the
  forest was last trained on gets its declared iterations (the truth where the trace
  declares none: a trace without declarations is taken at its word).
- **Error**: each job's prediction at its submission against its truth: mean absolute
  percentage error, and the share of jobs within 10, 25 and 50 % (`SizeErrors`).
- **Stored form**: the training rows (plain fields, not the pickled forest), so a
  service can keep them in a NATS KV bucket; `SizePredictor.from_dict` retrains.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gpusched.libs.core.jobs import JobSpec

#: what ``--predictor`` accepts: the simulator's true sizes (today's default), the
#: users' declared sizes, or the random forest learning online
PREDICTORS = ("truth", "declared", "rf")
#: a job that ran past its predicted size is believed to have this share of the
#: prediction left (never nothing: a job believed done would hold its GPUs at no cost)
OVERRUN_SHARE = 0.05
#: bumped when the stored form changes
STORED_VERSION = 1

_SPLIT = re.compile(r"[-_./\s]+")
_VERSION = re.compile(r"^(v|ver|version|run|r)?\d+$", re.IGNORECASE)


@dataclass(frozen=True)
class ForestConfig:
    """How the forest is built and when it retrains; checked at construction."""

    n_estimators: int = 60
    buckets: int = 256
    growth: float = 1.25
    every: int = 200
    max_rows: int = 5000
    random_state: int = 0

    def __post_init__(self) -> None:
        for name in ("n_estimators", "buckets", "every", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.growth > 1 and math.isfinite(self.growth)):
            raise ValueError(f"growth must be a finite factor > 1, got {self.growth}")


@dataclass(frozen=True)
class SizeRow:
    """A completed job as the predictor keeps it: what was known at submission, and
    the iterations it really ran."""

    user: str
    name: str
    dataset: str
    model: str
    batch_size: int
    gpus: int
    tensor_parallel: int
    pipeline_parallel: int
    declared_iterations: float | None
    iterations: float

    @classmethod
    def of(cls, spec: JobSpec, iterations: float | None = None) -> SizeRow:
        return cls(
            user=spec.user,
            name=spec.name,
            dataset=spec.dataset,
            model=spec.model,
            batch_size=spec.batch_size,
            gpus=spec.gpus,
            tensor_parallel=int(getattr(spec, "tensor_parallel", 1) or 1),
            pipeline_parallel=int(getattr(spec, "pipeline_parallel", 1) or 1),
            declared_iterations=spec.declared_iterations,
            iterations=spec.iterations if iterations is None else iterations,
        )


def name_tokens(name: str) -> list[str]:
    """The tokens of a job name without version tokens (``v7``, ``7``, ``run3``)."""
    return [t.lower() for t in _SPLIT.split(name) if t and not _VERSION.match(t)]


def template_of(row: SizeRow) -> tuple[str, str]:
    """The job's template: its user and its name without version tokens; a job without
    a name is known by its model, data set, batch and GPUs."""
    tokens = name_tokens(row.name)
    if tokens:
        return row.user, "-".join(tokens)
    return row.user, f"{row.model}/{row.dataset}/{row.batch_size}/{row.gpus}"


def _bucket(text: str, buckets: int) -> int:
    return zlib.crc32(text.encode()) % buckets


N_NUMERIC = 6


def features(rows: Sequence[SizeRow], buckets: int) -> np.ndarray:
    """One feature row per job (see the module's text)."""
    out = np.zeros((len(rows), N_NUMERIC + buckets))
    for i, row in enumerate(rows):
        declared = row.declared_iterations
        out[i, 0] = math.log2(row.batch_size)
        out[i, 1] = math.log2(row.gpus)
        out[i, 2] = math.log2(max(1, row.tensor_parallel))
        out[i, 3] = math.log2(max(1, row.pipeline_parallel))
        out[i, 4] = math.log(declared) if declared else 0.0
        out[i, 5] = 1.0 if declared else 0.0
        user, stem = template_of(row)
        tokens = [f"user={user}", f"model={row.model}", f"dataset={row.dataset}"]
        tokens.append(f"template={user}/{stem}")
        tokens += [f"token={t}" for t in name_tokens(row.name)]
        for token in tokens:
            out[i, N_NUMERIC + _bucket(token, buckets)] += 1.0
    return out


@dataclass(frozen=True)
class Prediction:
    iterations: float
    #: "forest", or "declared" for a fallback
    source: str


class SizePredictor:
    """A random forest over submission features, trained online on completed jobs."""

    def __init__(self, config: ForestConfig | None = None) -> None:
        self.config = config or ForestConfig()
        self.rows: list[SizeRow] = []
        self.retrains = 0
        self._trained_on = 0
        self._known: set[tuple[str, str]] = set()
        self._forest: Any = None

    # ---- learning -------------------------------------------------------------------
    def observe(self, spec: JobSpec, iterations: float | None = None) -> bool:
        """Learn a completed job (its true ``iterations``, default the spec's); retrains
        when due and says whether it did."""
        self.rows.append(SizeRow.of(spec, iterations))
        if not self.retrain_due():
            return False
        self.train()
        return True

    def retrain_due(self) -> bool:
        n, last = len(self.rows), self._trained_on
        return n >= last * self.config.growth or n - last >= self.config.every

    def train(self) -> None:
        from sklearn.ensemble import RandomForestRegressor  # heavy: only once learning

        rows = self.rows[-self.config.max_rows :]
        self._trained_on = len(self.rows)
        self._known = {template_of(r) for r in rows}
        if not rows:
            self._forest = None
            return
        forest = RandomForestRegressor(
            n_estimators=self.config.n_estimators,
            random_state=self.config.random_state,
            n_jobs=1,
        )
        target = np.log([r.iterations for r in rows])
        forest.fit(features(rows, self.config.buckets), target)
        self._forest = forest
        self.retrains += 1

    # ---- predicting -----------------------------------------------------------------
    def predict(self, spec: JobSpec) -> Prediction:
        """The job's iterations as the forest predicts them, or its declared size when
        the forest has seen no job of its template."""
        row = SizeRow.of(spec)
        if self._forest is None or template_of(row) not in self._known:
            declared = spec.declared_iterations
            return Prediction(declared if declared is not None else spec.iterations, "declared")
        logged = float(self._forest.predict(features([row], self.config.buckets))[0])
        return Prediction(math.exp(logged), "forest")

    # ---- stored form ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STORED_VERSION,
            "config": asdict(self.config),
            "rows": [asdict(r) for r in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SizePredictor:
        """A predictor restored from `to_dict`, retrained on its rows."""
        if data.get("version") != STORED_VERSION:
            raise ValueError(f"version: expected {STORED_VERSION}, got {data.get('version')!r}")
        predictor = cls(ForestConfig(**data.get("config", {})))
        predictor.rows = [SizeRow(**r) for r in data.get("rows", ())]
        if predictor.rows:
            predictor.train()
        return predictor


@dataclass
class SizeErrors:
    """Each job's predicted size at submission against its truth."""

    #: per job: (predicted, true, source)
    predictions: dict[str, tuple[float, float, str]] = field(default_factory=dict)

    def add(self, job_id: str, predicted: float, truth: float, source: str) -> None:
        self.predictions[job_id] = (predicted, truth, source)

    def summary(self, job_ids: Sequence[str] | None = None) -> dict[str, float | int]:
        """MAPE and the shares within 10/25/50 % (percent), over ``job_ids`` (default
        all), with how many were fallbacks to the declared size."""
        ids = list(self.predictions) if job_ids is None else job_ids
        errors = [abs(p - t) / t for p, t, _ in (self.predictions[i] for i in ids)]
        n = len(errors)
        if not n:
            return {"jobs": 0}
        return {
            "jobs": n,
            "fallback_jobs": sum(1 for i in ids if self.predictions[i][2] != "forest"),
            "mape_pct": 100 * sum(errors) / n,
            "within_10_pct": 100 * sum(e <= 0.10 for e in errors) / n,
            "within_25_pct": 100 * sum(e <= 0.25 for e in errors) / n,
            "within_50_pct": 100 * sum(e <= 0.50 for e in errors) / n,
        }


class SubmissionSizes:
    """The sizes a simulated scheduler believes, as a live one with ``predictor``
    would: ``declared`` (the user's figure, the truth where there is none) or ``rf``
    (the forest, trained on the jobs completed so far in the run). A job's size is fixed
    at its submission; what it has left follows from it by
    ``libs/core/job_state.py``'s ``remaining_iterations``."""

    def __init__(self, predictor: str, config: ForestConfig | None = None) -> None:
        if predictor not in PREDICTORS or predictor == "truth":
            raise ValueError(f"predictor: expected declared or rf, got {predictor!r}")
        self.kind = predictor
        self.forest = SizePredictor(config) if predictor == "rf" else None
        self.errors = SizeErrors()
        self._predicted: dict[str, float] = {}

    def at_submission(self, spec: JobSpec) -> float:
        if self.forest is not None:
            guess = self.forest.predict(spec)
        else:
            declared = spec.declared_iterations
            guess = Prediction(declared if declared is not None else spec.iterations, "declared")
        self._predicted[spec.job_id] = guess.iterations
        self.errors.add(spec.job_id, guess.iterations, spec.iterations, guess.source)
        return guess.iterations

    def completed(self, spec: JobSpec) -> None:
        if self.forest is not None:
            self.forest.observe(spec)

    def report(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {"predictor": self.kind, **self.errors.summary()}
        if self.forest is not None:
            out["retrains"] = self.forest.retrains
        return out
