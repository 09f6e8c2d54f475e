"""ONES's progress predictor in the predictor service: the epoch history of every
running job, a :class:`~gpusched.libs.core.progress.ProgressPredictor` taught the histories of
the jobs that finished, and the remaining iterations of a running job blended as the
simulator blends them (``blended_remaining_iterations``).

No I/O here: the service feeds :class:`ProgressLearner` progress and state events,
trains a snapshot of its predictor off the event loop when a retraining is due, and
stores :meth:`ProgressLearner.stored` in KV.

A job's history gets one :class:`~gpusched.libs.core.progress.EpochRecord` per progress event that
reports a new whole epoch (the built-in worker's ``epoch``, epochs done): the epochs
done (whole), the held-out accuracy as its metric and the training loss, each with the
job's first recorded value; the epoch's samples are the job's data set size
(``dataset_size`` of its spec, else the worker's default). Progress events come about
once a second, so a fast job's history may skip epochs; the records it has are still
exact. When a job succeeds its last record is carried to where it stopped (the epochs
its final iteration reached) and the history is learned from; a job that fails or is
cancelled is forgotten.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

import msgspec

from gpusched.libs.common.schemas import Prediction, Progress, RemainingRequest
from gpusched.libs.core.progress import EpochRecord, ProgressPredictor, blended_remaining_iterations

#: the built-in worker's data set when a job gives no ``dataset_size``
#: (services/nodeagent/worker/pipeline.py ``DEFAULT_DATASET_SIZE``)
DEFAULT_EPOCH_SAMPLES = 4096
#: finished histories kept for a restart (the newest; one KV value holds them all)
MAX_STORED_JOBS = 200
#: running histories kept: the oldest go first (a job whose end was never seen, say
#: while the predictor was down, would otherwise stay for ever)
MAX_RUNNING_JOBS = 10_000

SOURCE_PROGRESS = "progress"
SOURCE_PLANNED = "planned"


class StoredRecord(msgspec.Struct, frozen=True, array_like=True):
    epochs: float
    metric: float | None = None
    first_metric: float | None = None
    loss: float | None = None
    first_loss: float | None = None


class StoredHistory(msgspec.Struct, frozen=True, kw_only=True):
    epoch_samples: float
    records: list[StoredRecord]
    #: a running job's batch, epochs done and iteration at its last progress event
    batch_size: int = 1
    epoch: float = 0.0
    iteration: int = 0


class StoredHistories(msgspec.Struct, frozen=True, kw_only=True):
    """What the progress predictor learns from, as stored between restarts."""

    version: int = 1
    finished: list[StoredHistory] = []
    running: dict[str, StoredHistory] = {}


@dataclass
class _Running:
    epoch_samples: float
    batch_size: int
    records: list[EpochRecord]
    #: epochs done and the iteration at the last progress event
    epoch: float = 0.0
    iteration: int = 0


class ProgressLearner:
    """Epoch histories of running jobs, and the progress predictor taught the finished."""

    def __init__(
        self, predictor: ProgressPredictor | None = None, max_running: int = MAX_RUNNING_JOBS
    ) -> None:
        self.predictor = predictor or ProgressPredictor()
        self.max_running = max_running
        self.running: dict[str, _Running] = {}
        self.finished: deque[list[EpochRecord]] = deque(maxlen=MAX_STORED_JOBS)
        #: bumped by every change worth saving
        self.changes = 0

    def observe(
        self, job_id: str, epoch_samples: float, batch_size: int, progress: Progress
    ) -> bool:
        """A progress event of a running job; True when it recorded a new epoch."""
        epoch = progress.epoch
        if epoch is None or not math.isfinite(epoch) or epoch < 0:
            return False
        job = self.running.get(job_id)
        if job is None:
            job = self.running[job_id] = _Running(epoch_samples, batch_size, [])
            while len(self.running) > self.max_running:
                del self.running[next(iter(self.running))]
        job.epoch, job.iteration, job.batch_size = epoch, progress.iteration, batch_size
        whole = math.floor(epoch + 1e-9)
        if whole < 1 or (job.records and whole <= job.records[-1].epochs):
            return False
        first = job.records[0] if job.records else None
        job.records.append(
            EpochRecord(
                epoch_samples=job.epoch_samples,
                epochs=float(whole),
                metric=progress.accuracy,
                first_metric=first.metric if first else progress.accuracy,
                loss=progress.loss,
                first_loss=first.loss if first else progress.loss,
            )
        )
        self.changes += 1
        return True

    def finish(self, job_id: str, final_iteration: int) -> bool:
        """The job succeeded after ``final_iteration`` iterations: learn its history.
        True when it was learned from."""
        job = self.running.pop(job_id, None)
        if job is None or not job.records:
            return False
        records = job.records
        done = job.epoch + max(0, final_iteration - job.iteration) * job.batch_size / (
            job.epoch_samples
        )
        if done > records[-1].epochs:
            records.append(replace(records[-1], epochs=done))
        self.finished.append(records)
        self.predictor.add_finished(records)
        self.changes += 1
        return True

    def forget(self, job_id: str) -> None:
        """The job ended without finishing its training (failed, cancelled)."""
        if self.running.pop(job_id, None) is not None:
            self.changes += 1

    def remaining(self, req: RemainingRequest) -> Prediction:
        """Remaining iterations of a running job: ``req.planned`` pulled towards the
        progress predictor's as the simulator does; ``planned`` where the job has no
        history or the predictor no prediction for it."""
        job = self.running.get(req.job_id)
        value, source = req.planned, SOURCE_PLANNED
        if job is not None and job.records:
            last = job.records[-1]
            if self.predictor.total_epochs(last) is not None:
                extra = max(0, req.iteration - job.iteration) * req.batch_size
                samples_done = job.epoch * job.epoch_samples + extra
                value = blended_remaining_iterations(
                    self.predictor, last, samples_done, req.batch_size, req.planned
                )
                source = SOURCE_PROGRESS
        return Prediction(model=req.model, kind="remaining", value=value, source=source)

    # ----------------------------------------------------------------- persistence

    def stored(self) -> StoredHistories:
        return StoredHistories(
            finished=[_store(records, records[0].epoch_samples) for records in self.finished],
            running={
                job_id: _store(
                    job.records, job.epoch_samples, job.batch_size, job.epoch, job.iteration
                )
                for job_id, job in self.running.items()
            },
        )

    def restore(self, stored: StoredHistories) -> int:
        """Take back stored histories (the finished ones are learned from again; the
        caller retrains). Returns how many histories were taken."""
        taken = 0
        for history in stored.finished:
            records = _records(history)
            if records:
                self.finished.append(records)
                self.predictor.add_finished(records)
                taken += 1
        for job_id, history in stored.running.items():
            self.running[job_id] = _Running(
                history.epoch_samples, max(1, history.batch_size), _records(history),
                history.epoch, history.iteration,
            )  # fmt: skip
            taken += 1
        return taken


def _store(
    records: list[EpochRecord],
    epoch_samples: float,
    batch_size: int = 1,
    epoch: float = 0.0,
    iteration: int = 0,
) -> StoredHistory:
    return StoredHistory(
        epoch_samples=epoch_samples,
        records=[
            StoredRecord(r.epochs, r.metric, r.first_metric, r.loss, r.first_loss) for r in records
        ],
        batch_size=batch_size,
        epoch=epoch,
        iteration=iteration,
    )


def _records(history: StoredHistory) -> list[EpochRecord]:
    size = history.epoch_samples
    if not size > 0:
        return []
    return [
        EpochRecord(size, r.epochs, r.metric, r.first_metric, r.loss, r.first_loss)
        for r in history.records
        if math.isfinite(r.epochs) and r.epochs > 0
    ]
