"""The size forest in the predictor service: recurring jobs' iterations, learned live.

Our design around `gpusched.libs.core.size_predictor` (the simulator's ``--predictor rf``):

- **Asking**: ``gpusched.predictor.iterations`` reads a request's submission fields
  (``tenant``, ``name``, ``dataset``, declared ``iterations``, degrees; see
  `spec_of`). A request whose template (tenant and name stem) the forest was trained on
  gets the forest's figure (source ``forest``); any other gets the baseline answer, the
  declared figure where there is one (source ``declared``).
- **Predicting at submission**: the service hears every submission
  (``gpusched.job.<id>.submitted``), reads the job's record and remembers the answer
  ``iterations`` gives for it (`request_of`; the data set is the job's label
  ``dataset``), the newest `MAX_PENDING` jobs at most.
- **Telling the scheduler**: each prediction at submission is published on
  ``gpusched.job.<id>.predicted_size`` (`predicted_size`), which the jobs stream stores
  (``Nats-Msg-Id`` `predicted_size_msg_id`, so a repeat is stored once); the scheduler
  writes it into the job's record and believes a ``forest`` figure
  (services/scheduler/live/state.py, `LiveJob.remaining_s`).
- **Learning**: a SUCCEEDED job's record gives the iterations it really ran (its last
  progress, else its planned total; `truth_of`). It becomes a training row, its
  remembered prediction is scored against it, and the forest is retrained by
  `SizePredictor`'s rule (x1.25 rows, at least every 200) on the newest ``max_rows``
  rows, in a thread; the new forest replaces the old one when its fit is done.
- **Error**: MAPE and the shares within 10, 25 and 50 % over the newest `SCORE_WINDOW`
  scored jobs (`SizeErrorReport`).
- **Stored form** (`StoredSizes`): the rows, the remembered predictions and the scores,
  trimmed oldest first to fit one NATS message; a restarted service retrains on the rows
  before it answers.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

import msgspec

from gpusched.libs.common.schemas import (
    SOURCE_FOREST,
    JobRecord,
    PredictRequest,
    SizeErrorReport,
    SizePredicted,
)
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.size_predictor import (
    STORED_VERSION,
    ForestConfig,
    SizeErrors,
    SizePredictor,
    SizeRow,
)

#: jobs whose prediction at submission is remembered until they finish
MAX_PENDING = 100_000
#: scored jobs the error figures are taken over
SCORE_WINDOW = 10_000
#: the job label that names its data set
DATASET_LABEL = "dataset"


class StoredRow(msgspec.Struct, frozen=True, array_like=True):
    """A `SizeRow`, as a compact array."""

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


class StoredGuess(msgspec.Struct, frozen=True, array_like=True):
    job_id: str
    predicted: float
    source: str


class StoredScore(msgspec.Struct, frozen=True, array_like=True):
    job_id: str
    predicted: float
    truth: float
    source: str


class StoredSizes(msgspec.Struct, kw_only=True):
    """What the size forest keeps between restarts (key ``size_rows``)."""

    version: int = STORED_VERSION
    config: dict[str, int | float] = {}
    rows: list[StoredRow] = []
    pending: list[StoredGuess] = []
    scored: list[StoredScore] = []


def spec_of(req: PredictRequest) -> JobSpec:
    """The core job spec of a request's submission fields (its declared iterations stand
    in for the truth, which nobody knows yet). Raises ValueError naming a field."""
    declared = float(req.iterations) if req.iterations is not None else None
    return JobSpec(
        job_id="request",
        submit_time=0.0,
        model=req.model,
        gpus=req.gpus,
        batch_size=req.batch_size,
        iterations=declared or 1.0,
        user=req.tenant,
        name=req.name,
        dataset=req.dataset,
        declared_iterations=declared,
        tensor_parallel=req.tensor_parallel,
        pipeline_parallel=req.pipeline_parallel,
    )


def request_of(record: JobRecord) -> PredictRequest:
    """What a job's record says of it at submission, as an ``iterations`` request."""
    spec = record.spec
    return PredictRequest(
        model=spec.model,
        batch_size=spec.batch_size,
        gpus=spec.gpus,
        cpus_per_gpu=spec.cpus_per_gpu,
        mem_gb_per_gpu=spec.mem_gb_per_gpu,
        iterations=record.total_iterations,
        tenant=record.tenant,
        name=spec.name,
        dataset=spec.labels.get(DATASET_LABEL, ""),
        tensor_parallel=spec.tensor_parallel,
        pipeline_parallel=spec.pipeline_parallel,
    )


def predicted_size(job_id: str, iterations: float, source: str, at: float) -> SizePredicted:
    """What the scheduler is told of a job's prediction at submission: the forest's
    figure (source ``forest``), or anything else as the job's declared figure."""
    return SizePredicted(
        job_id=job_id,
        iterations=max(1.0, iterations),
        source="forest" if source == SOURCE_FOREST else "declared",
        at=at,
    )


def predicted_size_msg_id(job_id: str) -> str:
    """The jobs stream's deduplication id of a job's predicted size."""
    return f"{job_id}-predicted_size"


def truth_of(record: JobRecord) -> int:
    """The iterations a finished job ran: its last progress, else its planned total."""
    return record.progress.iteration or record.total_iterations


class SizeLearner:
    """The forest, the predictions remembered at submission and their scores. No I/O:
    the service feeds it; `train` is the only coroutine (the fit runs in a thread)."""

    def __init__(
        self,
        config: ForestConfig | None = None,
        *,
        window: int = SCORE_WINDOW,
        max_pending: int = MAX_PENDING,
    ) -> None:
        for name, value in (("window", window), ("max_pending", max_pending)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.forest = SizePredictor(config)
        self.window = window
        self.max_pending = max_pending
        self.errors = SizeErrors()
        self.pending: OrderedDict[str, tuple[float, str]] = OrderedDict()
        #: jobs learned from, so that a repeated SUCCEEDED event adds no second row
        self._learned: OrderedDict[str, None] = OrderedDict()
        self._training: asyncio.Task[None] | None = None
        #: bumped by every change to what is stored (to know when to save it)
        self.changes = 0

    # ---- questions ------------------------------------------------------------------
    def predict(self, req: PredictRequest) -> float | None:
        """The forest's iterations for the request's job; None where the forest has
        seen no job of its template (or has not been trained)."""
        guess = self.forest.predict(spec_of(req))
        return guess.iterations if guess.source == SOURCE_FOREST else None

    @property
    def training(self) -> bool:
        return self._training is not None

    def report(self) -> SizeErrorReport:
        figures = self.errors.summary()
        jobs = int(figures["jobs"])

        def ratio(key: str) -> float | None:
            return float(figures[key]) / 100 if jobs else None

        return SizeErrorReport(
            scored_jobs=jobs,
            fallback_jobs=int(figures.get("fallback_jobs", 0)),
            mape=ratio("mape_pct"),
            within_10=ratio("within_10_pct"),
            within_25=ratio("within_25_pct"),
            within_50=ratio("within_50_pct"),
            pending_jobs=len(self.pending),
            training_rows=len(self.forest.rows),
            retrains=self.forest.retrains,
            window=self.window,
        )

    # ---- learning -------------------------------------------------------------------
    def submitted(self, job_id: str, predicted: float, source: str) -> None:
        """Remember a job's prediction at submission (the first one stands)."""
        if job_id in self.pending or job_id in self._learned:
            return
        self.pending[job_id] = (predicted, source)
        _trim(self.pending, self.max_pending)
        self.changes += 1

    def completed(self, job_id: str, record: JobRecord) -> bool:
        """Learn a SUCCEEDED job: a training row, and its prediction scored when one
        was remembered. True when it was new."""
        if job_id in self._learned:
            return False
        truth = truth_of(record)
        self.forest.rows.append(SizeRow.of(spec_of(request_of(record)), float(truth)))
        self._learned[job_id] = None
        _trim(self._learned, self.max_pending)
        guess = self.pending.pop(job_id, None)
        if guess is not None:
            self.errors.add(job_id, guess[0], float(truth), guess[1])
            while len(self.errors.predictions) > self.window:
                del self.errors.predictions[next(iter(self.errors.predictions))]
        self.changes += 1
        return True

    def forget(self, job_id: str) -> None:
        """A job that ended without succeeding is never scored."""
        if self.pending.pop(job_id, None) is not None:
            self.changes += 1

    def retrain_soon(self) -> None:
        """Start retraining beside the event loop if that is due and none runs."""
        if self._training is None and self._due():
            self._training = asyncio.create_task(self.train(), name="size-forest-training")
            self._training.add_done_callback(self._trained)

    def _trained(self, _: asyncio.Task[None]) -> None:
        self._training = None

    async def train(self) -> None:
        """Fit new forests in a thread while one is due, each on the newest ``max_rows``
        rows, and answer with each once it is fitted."""
        while self._due():
            current = self.forest
            taken = len(current.rows)
            fresh = SizePredictor(current.config)
            fresh.rows = current.rows[-current.config.max_rows :]
            await asyncio.to_thread(fresh.train)
            fresh.rows.extend(current.rows[taken:])  # learned while it was fitted
            fresh.retrains += current.retrains
            self.forest = fresh

    def _due(self) -> bool:
        return bool(self.forest.rows) and self.forest.retrain_due()

    async def wait_trained(self) -> None:
        """Return once no training runs."""
        while self._training is not None:
            await asyncio.shield(self._training)

    async def stop(self) -> None:
        if self._training is not None:
            await cancel_and_wait(self._training)
            self._training = None

    # ---- stored form ----------------------------------------------------------------
    def stored(self, limit_bytes: int | None = None) -> StoredSizes:
        """What to keep; with ``limit_bytes``, the oldest entries of the longest list
        are dropped until its MessagePack fits."""
        rows = [StoredRow(**asdict(r)) for r in self.forest.rows]
        pending = [StoredGuess(j, p, s) for j, (p, s) in self.pending.items()]
        scored = [StoredScore(j, p, t, s) for j, (p, t, s) in self.errors.predictions.items()]
        config = asdict(self.forest.config)
        while True:
            stored = StoredSizes(config=config, rows=rows, pending=pending, scored=scored)
            if limit_bytes is None or len(msgspec.msgpack.encode(stored)) <= limit_bytes:
                return stored
            lists: tuple[list[Any], ...] = (rows, pending, scored)
            longest = max(lists, key=len)
            if not longest:
                return StoredSizes(config=config)
            del longest[: max(1, len(longest) // 4)]

    @classmethod
    def restore(cls, stored: StoredSizes, **kwargs: Any) -> SizeLearner:
        """A learner from its stored form, its forest retrained on the rows (a blocking
        fit: run it in a thread). Raises ValueError naming a bad field."""
        try:
            forest = SizePredictor.from_dict(
                {
                    "version": stored.version,
                    "config": stored.config,
                    "rows": [msgspec.structs.asdict(r) for r in stored.rows],
                }
            )
        except TypeError as exc:  # a config field this version does not know
            raise ValueError(f"config: {exc}") from None
        learner = cls(forest.config, **kwargs)
        learner.forest = forest
        for guess in stored.pending:
            learner.pending[guess.job_id] = (guess.predicted, guess.source)
        for score in stored.scored:
            learner.errors.add(score.job_id, score.predicted, score.truth, score.source)
            learner._learned[score.job_id] = None
        _trim(learner.pending, learner.max_pending)
        while len(learner.errors.predictions) > learner.window:
            del learner.errors.predictions[next(iter(learner.errors.predictions))]
        learner.changes = 0
        return learner


def _trim(table: OrderedDict[str, Any], most: int) -> None:
    while len(table) > most:
        table.popitem(last=False)
