"""The rules of a job's state that the simulator and the live scheduler share
(``gpusched.libs.core.job_state``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.libs.core.job_state import remaining_iterations
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.size_predictor import OVERRUN_SHARE, SubmissionSizes


@given(
    predicted=st.floats(1.0, 1e8),
    done_share=st.floats(0.0, 2.0),
)
def test_without_a_stop_the_rule_is_the_simulators_submission_sizes(
    predicted: float, done_share: float
):
    done = predicted * done_share
    sizes = SubmissionSizes("declared")
    sizes.at_submission(JobSpec("j", 0.0, "a", 1, 32, 1e9, declared_iterations=predicted))
    left = remaining_iterations(predicted, done)
    assert left == sizes.remaining("j", done)
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
