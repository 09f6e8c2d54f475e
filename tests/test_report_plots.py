"""The plots: every policy its own (colour, line style), and a queue-length scale that one
policy's spike does not flatten."""

from __future__ import annotations

import pytest

from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.simulation.report import (
    gpu_util_figure,
    jct_cdf_figure,
    policy_styles,
    queue_length_figure,
)
from gpusched.services.scheduler.simulation.results import (
    FINISHED,
    JobOutcome,
    SimResult,
    TimelinePoint,
)
from gpusched.services.scheduler.simulation.runner import (
    build_cluster,
    build_models,
    load_workload,
    run_policies,
)


@pytest.fixture(scope="module")
def every_policy() -> list[SimResult]:
    """A real run of every policy on a small generated workload."""
    truth, _ = build_models(None)
    cluster = build_cluster("2x4", None)
    jobs = load_workload("synthetic:12", None, truth, seed=3, rate_per_h=30, cluster=cluster).jobs
    return run_policies(jobs, cluster, list(POLICIES), truth)


@pytest.mark.parametrize("figure", [jct_cdf_figure, gpu_util_figure, queue_length_figure])
def test_every_policy_draws_in_a_colour_and_line_style_pair_of_its_own(every_policy, figure):
    lines = figure(every_policy).axes[0].get_lines()
    drawn = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in lines}
    assert set(drawn) == set(POLICIES)
    assert len(set(drawn.values())) == len(POLICIES)


def test_a_policy_keeps_its_style_whichever_policies_run_beside_it():
    everyone = policy_styles(list(POLICIES))
    assert policy_styles(["ones", "fifo"]) == {"ones": everyone["ones"], "fifo": everyone["fifo"]}
    # names outside POLICIES (a benchmark's labelled variants) still get pairs of their own
    extra = policy_styles([*POLICIES, "bsbf<=1.5", "bsbf<=2"])
    assert len(set(extra.values())) == len(POLICIES) + 2


def test_one_policys_queue_spike_leaves_the_others_queues_readable():
    calm = _queued("sjf", [0, 4, 10, 6, 0])
    spike = _queued("fifo", [0, 10_000, 20, 0, 0])
    ax = queue_length_figure([calm, spike]).axes[0]
    ax.figure.canvas.draw()  # settles the limits
    _, top = ax.get_ylim()
    assert top >= 10_000  # the spike is on the plot, not cut off
    to_axes = ax.transAxes.inverted()
    y_of_ten = to_axes.transform(ax.transData.transform((0, 10)))[1]
    # on a linear scale a queue of 10 sits at 0.1 % of the height beside a spike of 10,000
    assert y_of_ten > 0.25
    assert "log" in ax.get_ylabel()  # and the axis says how to read it


def _queued(policy: str, queue: list[int]) -> SimResult:
    hour = 3_600.0
    job = JobOutcome(
        job_id="j1", model="bert", gpus=1, submit_time=0.0, start_time=0.0,
        finish_time=hour * len(queue), exclusive_s=hour, queue_s=0.0, preemptions=0,
        shared=False, state=FINISHED,
    )  # fmt: skip
    timeline = tuple(
        TimelinePoint(time=i * hour, busy_gpus=1, queued_jobs=q, running_jobs=1)
        for i, q in enumerate(queue)
    )
    return SimResult(
        policy=policy, total_gpus=4, jobs=(job,), makespan_s=hour * len(queue), gpu_util=0.25,
        preemptions=0, shared_pairs=0, wall_s=0.01, decisions=len(queue), timeline=timeline,
    )  # fmt: skip
