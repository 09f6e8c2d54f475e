"""The progress predictor: what it answers before and after learning, its determinism, when
it retrains, and how the simulator sizes converging jobs with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.progress import MIN_EPOCHS, PRIOR_JOBS, EpochRecord, ProgressPredictor
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.simulation.simulator import Simulator
from tests.builders import ConvergingPerf, cluster, job

EPOCH = 1_000.0


def history(epochs: int, data_set: float = EPOCH) -> list[EpochRecord]:
    """A job that took ``epochs`` epochs, its metric climbing towards 1."""
    first = 0.5
    return [EpochRecord(data_set, float(k), 1 - 0.5 / k, first) for k in range(1, epochs + 1)]


def trained(epochs: int = 20, jobs: int = 4) -> ProgressPredictor:
    predictor = ProgressPredictor(seed=1)
    for _ in range(jobs):
        predictor.add_finished(history(epochs))
    predictor.train()
    return predictor


def test_it_predicts_nothing_before_training_before_two_epochs_or_for_an_unseen_data_set():
    assert ProgressPredictor().fraction_done(history(5)[-1]) is None
    predictor = trained()
    assert predictor.fraction_done(history(1)[-1]) is None
    assert MIN_EPOCHS == 2
    assert predictor.fraction_done(history(5, data_set=77.0)[-1]) is None
    assert predictor.trust(history(5, data_set=77.0)[-1]) == 0.0


def test_learned_from_jobs_of_twenty_epochs_it_calls_epoch_ten_about_half_done():
    predictor = trained()
    halfway = predictor.fraction_done(history(10)[-1])
    assert halfway is not None and 0.35 < halfway < 0.65
    fractions = [predictor.fraction_done(r) for r in history(19)[1:]]
    assert all(f is not None for f in fractions)
    assert fractions == sorted(fractions)  # type: ignore[type-var]


def test_the_same_data_and_seed_give_the_same_predictions():
    record = history(7)[-1]
    assert trained().fraction_done(record) == trained().fraction_done(record)


def test_it_retrains_as_finished_jobs_grow_by_half():
    predictor = ProgressPredictor()
    due = []
    for n in range(1, 13):
        predictor.add_finished(history(5))
        if predictor.retrain_due():
            due.append(n)
            predictor.train()
    assert due == [3, 5, 8, 12]


def test_total_epochs_stays_between_one_more_epoch_and_twice_the_longest_seen():
    predictor = trained(epochs=10)
    near_end = predictor.total_epochs(history(10)[-1])
    assert near_end is not None and near_end >= 11
    far_past = predictor.total_epochs(history(40)[-1])
    assert far_past is not None and far_past <= 41
    early = predictor.total_epochs(history(2)[-1])
    assert early is not None and 3 <= early <= 20


def test_trust_grows_with_the_finished_jobs_of_the_data_set():
    record = history(5)[-1]
    assert trained(jobs=3).trust(record) == pytest.approx(3 / (3 + PRIOR_JOBS))
    assert trained(jobs=9).trust(record) == pytest.approx(9 / (9 + PRIOR_JOBS))


# ---------------------------------------------------------------- in the simulator

#: ten epochs of 1,000 samples at batch 8 (125 iterations each), metric rising
CURVE = Convergence(
    knots=tuple(float(k) * 125 for k in range(11)),
    batches=(8.0,),
    iterations=(tuple(float(k) * 125 for k in range(11)),),
    epoch_samples=EPOCH,
    metric=(0.1, *(1 - 0.9 / k for k in range(1, 11))),
)


@dataclass
class OneAtATime:
    """Starts the oldest pending job on GPU 0 whenever it is free, and records the
    views it was shown."""

    name: str = "one-at-a-time"
    preemptive: bool = False
    queue_sort: None = None
    capabilities = Capabilities(predicts_progress=True)
    seen: list[Snapshot] = field(default_factory=list)

    def decide(self, snap: Snapshot) -> Decision:
        self.seen.append(snap)
        if snap.running or not snap.pending:
            return Decision(wake_at=snap.now + 100.0)
        oldest = min(snap.pending, key=lambda v: (v.submit_time, v.job_id))
        return Decision(starts=(Start(oldest.job_id, (0,)),), wake_at=snap.now + 100.0)


def test_the_simulator_records_each_epoch_with_the_metric_its_curve_reaches():
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": CURVE})
    sim = Simulator(cluster(1, 1), [job("j", iterations=1250, batch=8)], OneAtATime(), perf)
    sim.run()
    records = sim.jobs["j"].history
    assert [r.epochs for r in records] == [float(k) for k in range(1, 11)]
    assert [r.metric for r in records] == pytest.approx(list(CURVE.metric[1:]))  # type: ignore[index]
    assert all(r.first_metric == pytest.approx(CURVE.metric[1]) for r in records)  # type: ignore[index]


def test_after_identical_jobs_finish_the_next_one_is_sized_by_its_predicted_progress():
    """Five identical jobs in a row; once three finished, the predictor trains and the
    fifth job's remaining time, seen mid-run, is close to the truth."""
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": CURVE})
    jobs = [job(f"j{i}", submit=float(i), iterations=1250, batch=8) for i in range(5)]
    policy = OneAtATime()
    sim = Simulator(cluster(1, 1), jobs, policy, perf)
    sim.run()
    assert sim._progress is not None and sim._progress.trained
    views = [
        (snap.now, view)
        for snap in policy.seen
        for view in snap.running
        if view.job_id == "j4" and view.as_of > 0
    ]
    checked = 0
    for now, view in views:
        job_state = sim.jobs["j4"]
        started = job_state.finish_time - 1250  # type: ignore[operator]
        true_left = 1250 - (now - started)
        if now - started >= 3 * 125:  # past two whole epochs: a prediction exists
            assert view.remaining_s(now) == pytest.approx(true_left, rel=0.3)
            checked += 1
    assert checked > 0
