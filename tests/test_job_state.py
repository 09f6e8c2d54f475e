"""The rules of a job's state that the simulator and the live scheduler share
(``gpusched.libs.core.job_state``): the iterations it is believed to have left, and
the view of it a policy gets."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.libs.core.job_state import Run, job_view, remaining_iterations
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.size_predictor import OVERRUN_SHARE, SubmissionSizes
from gpusched.libs.core.snapshot import JobView


@given(
    predicted=st.floats(1.0, 1e8),
    done_share=st.floats(0.0, 2.0),
)
def test_without_a_stop_the_rule_is_what_is_left_of_the_submission_size_with_a_floor(
    predicted: float, done_share: float
):
    done = predicted * done_share
    sizes = SubmissionSizes("declared")
    believed = sizes.at_submission(
        JobSpec("j", 0.0, "a", 1, 32, 1e9, declared_iterations=predicted)
    )
    left = remaining_iterations(believed, done)
    assert left >= OVERRUN_SHARE * predicted
    assert left == max(predicted - done, OVERRUN_SHARE * predicted)


@given(
    total=st.integers(1, 10**7),
    believed_share=st.floats(0.01, 2.0),
    done_share=st.floats(0.0, 1.5),
)
def test_with_a_stop_the_belief_stays_within_the_run(
    total: int, believed_share: float, done_share: float
):
    believed = min(total * believed_share, float(total))
    done = int(total * done_share)
    left = remaining_iterations(believed, done, total)
    run_left = max(0, total - done)
    assert isinstance(left, float)
    assert 0 <= left <= run_left
    if believed >= total or run_left == 0:
        assert left == run_left
    else:  # while it can run, never believed finished
        assert left == pytest.approx(min(run_left, max(believed - done, OVERRUN_SHARE * believed)))
        assert left >= min(run_left, OVERRUN_SHARE * believed)


def test_a_job_past_its_prediction_keeps_the_overrun_share():
    assert remaining_iterations(100.0, 150.0) == pytest.approx(5.0)
    assert remaining_iterations(100.0, 150.0, 1000) == pytest.approx(5.0)
    assert remaining_iterations(100.0, 999.0, 1000) == 1.0
    assert remaining_iterations(1000.0, 400.0, 1000) == 600.0
    assert remaining_iterations(100.0, 1000.0, 1000) == 0.0


def _fields(**extra: Any) -> dict[str, Any]:
    return {
        "job_id": "j", "submit_time": 3.0, "model": "a", "gpus": 2, "batch_size": 64,
        "allow_sharing": False, "deadline": 900.0, "user": "u", "priority": 7,
        "est_remaining_s": 120.0, "attained_gpu_s": 40.0, "as_of": 50.0,
        "queued_since": 10.0, "preemptions": 1, **extra,
    }  # fmt: skip


def test_a_job_without_a_run_is_queued_with_no_run_of_its_own():
    view = job_view(**_fields())
    assert view == JobView(
        job_id="j", submit_time=3.0, model="a", gpus=2, batch_size=64, est_remaining_s=120.0,
        attained_gpu_s=40.0, as_of=50.0, allow_sharing=False, deadline=900.0,
        queued_since=10.0, preemptions=1, user="u", priority=7,
    )  # fmt: skip
    assert view.state is JobState.QUEUED and not view.running
    assert (view.gpu_ids, view.accum_steps, view.progress_rate) == ((), 1, 0.0)
    assert view.started_at == 0.0
    assert (view.cpus, view.mem_gb, view.epoch_s, view.oracle_remaining_s) == (None,) * 4


def test_a_job_with_a_run_is_running_where_and_as_the_run_says():
    run = Run(gpu_ids=(4, 5), accum_steps=2, progress_rate=0.8, started_at=30.0,
              cpus=6.0, mem_gb=24.0, epoch_s=90.0)  # fmt: skip
    view = job_view(**_fields(run=run, oracle_remaining_s=100.0, tensor_parallel=2))
    assert view.state is JobState.RUNNING and view.running
    assert (view.gpu_ids, view.accum_steps, view.progress_rate, view.started_at) == (
        (4, 5), 2, 0.8, 30.0,
    )  # fmt: skip
    assert (view.cpus, view.mem_gb, view.epoch_s) == (6.0, 24.0, 90.0)
    assert (view.oracle_remaining_s, view.tensor_parallel, view.pipeline_parallel) == (100.0, 2, 1)
    assert view.remaining_s(60.0) == pytest.approx(120.0 - 10 * 0.8)
    assert view.attained_at(60.0) == pytest.approx(40.0 + 10 * 2)
