"""The predictor service's part of ONES's progress predictor, without I/O: epoch
histories from progress events, learning from finished jobs, the blended remaining
iterations, and the stored form a restart reads back."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.libs.common import codec
from gpusched.libs.common.schemas import Progress, RemainingRequest
from gpusched.libs.core.progress import EpochRecord, ProgressPredictor, blended_remaining_iterations
from gpusched.services.predictor.progress import (
    SOURCE_PLANNED,
    SOURCE_PROGRESS,
    ProgressLearner,
    StoredHistories,
)

DATASET = 1000.0
BATCH = 100  # 10 iterations per epoch


def run_job(learner: ProgressLearner, job_id: str, epochs: int, finish: bool = True) -> None:
    """Progress events every 5 iterations of a job whose loss halves each epoch."""
    for iteration in range(5, epochs * 10 + 1, 5):
        epoch = iteration * BATCH / DATASET
        progress = Progress(
            iteration=iteration, loss=2.0 / (1 + epoch), epoch=epoch, accuracy=epoch / 20
        )
        learner.observe(job_id, DATASET, BATCH, progress)
    if finish:
        learner.finish(job_id, epochs * 10)


def ask(job_id: str, iteration: int, planned: float) -> RemainingRequest:
    return RemainingRequest(
        job_id=job_id, model="ncf", batch_size=BATCH, iteration=iteration, planned=planned
    )


def train(learner: ProgressLearner) -> None:
    trained = learner.predictor.snapshot()
    trained.train()
    learner.predictor.take_network(trained)


def test_a_history_gets_one_record_per_new_whole_epoch_with_its_first_values():
    learner = ProgressLearner()
    run_job(learner, "a", 3, finish=False)
    records = learner.running["a"].records
    assert [r.epochs for r in records] == [1.0, 2.0, 3.0]
    assert all(r.first_loss == records[0].loss and r.first_metric == 0.05 for r in records)
    assert records[2].loss == pytest.approx(0.5)
    # an event without an epoch (a worker that does not report one) records nothing
    assert not learner.observe("b", DATASET, BATCH, Progress(iteration=50))
    assert "b" not in learner.running


def test_a_finished_job_is_carried_to_where_it_stopped_and_learned_from():
    learner = ProgressLearner()
    run_job(learner, "a", 3, finish=False)
    learner.finish("a", 35)  # half an epoch past the last event
    assert "a" not in learner.running
    [history] = learner.finished
    assert history[-1].epochs == pytest.approx(3.5)
    assert learner.predictor.finished_jobs == 1
    learner.forget("nobody")
    run_job(learner, "b", 2, finish=False)
    learner.forget("b")  # failed or cancelled: not learned from
    assert learner.predictor.finished_jobs == 1 and "b" not in learner.running


def test_the_oldest_running_history_goes_first_beyond_the_bound():
    learner = ProgressLearner(max_running=2)
    for job_id in ("a", "b", "c"):
        run_job(learner, job_id, 1, finish=False)
    assert list(learner.running) == ["b", "c"]


def test_without_a_trained_predictor_the_plain_estimate_is_the_answer():
    learner = ProgressLearner()
    run_job(learner, "running", 3, finish=False)
    answer = learner.remaining(ask("running", 30, 970.0))
    assert (answer.value, answer.source, answer.kind) == (970.0, SOURCE_PLANNED, "remaining")
    assert learner.remaining(ask("unknown", 0, 5.0)).value == 5.0


def test_after_jobs_finish_a_long_running_job_is_predicted_shorter_as_the_simulator_blends():
    learner = ProgressLearner(ProgressPredictor(seed=0))
    for k in range(3):
        run_job(learner, f"done{k}", 6)
    assert learner.predictor.retrain_due()
    train(learner)
    run_job(learner, "running", 3, finish=False)
    planned = 100 * 10 - 30.0  # declared 100 epochs, 3 done
    answer = learner.remaining(ask("running", 32, planned))
    assert answer.source == SOURCE_PROGRESS
    last = learner.running["running"].records[-1]
    samples_done = 3.0 * DATASET + 2 * BATCH  # two iterations since the last event
    expected = blended_remaining_iterations(learner.predictor, last, samples_done, BATCH, planned)
    assert answer.value == pytest.approx(expected)
    # the simulator's formula, written out: trust-weighted towards the plain estimate
    epochs = learner.predictor.total_epochs(last)
    trust = learner.predictor.trust(last)
    assert epochs is not None and epochs <= 12  # at most twice the longest finished job
    assert trust == pytest.approx(3 / 6)
    predicted = max(0.0, epochs * DATASET - samples_done) / BATCH
    assert answer.value == pytest.approx(trust * predicted + (1 - trust) * planned)
    assert answer.value < planned


def test_stored_histories_retrained_after_a_restart_give_the_same_answer():
    learner = ProgressLearner(ProgressPredictor(seed=0))
    for k in range(3):
        run_job(learner, f"done{k}", 4 + k)
    train(learner)
    run_job(learner, "running", 3, finish=False)
    before = learner.remaining(ask("running", 30, 500.0))

    stored = codec.decode(codec.encode(learner.stored()), StoredHistories)
    again = ProgressLearner(ProgressPredictor(seed=0))
    assert again.restore(stored) == 4
    assert again.predictor.finished_jobs == 3 and "running" in again.running
    train(again)
    after = again.remaining(ask("running", 30, 500.0))
    assert after.source == SOURCE_PROGRESS
    assert after.value == pytest.approx(before.value, rel=1e-6)


def test_a_stored_history_with_impossible_values_is_skipped_on_restore():
    stored = msgspec.convert(
        {"finished": [{"epoch_samples": 0.0, "records": [[1.0]]}]}, StoredHistories
    )
    learner = ProgressLearner()
    assert learner.restore(stored) == 0
    assert learner.predictor.finished_jobs == 0


def test_blending_keeps_the_plain_estimate_where_the_predictor_has_no_prediction():
    untrained = ProgressPredictor()
    record = EpochRecord(DATASET, 3.0)
    assert blended_remaining_iterations(untrained, record, 3000.0, BATCH, 42.0) == 42.0
