"""bench/fidelity.py's arithmetic: a replay's job completion times set beside the live
ones of an export, job by job (``whatif.fidelity``), and the replay timing the shapes
the live cluster measured by what it measured (``whatif.measured_over``), with the
model left alone where the export measured nothing or what the model says already.
Exports written by hand; one tiny real replay through the simulator."""

from __future__ import annotations

import pytest

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.traces import TraceJob
from gpusched.libs.core.workload import materialize
from gpusched.services.scheduler.simulation import whatif
from gpusched.services.scheduler.simulation.results import FINISHED, JobOutcome, SimResult
from gpusched.services.scheduler.simulation.runner import run_policies

TRUTH = ProfilePerformanceModel.builtin()
CLUSTER = Cluster.parse("1x4")


def outcome(job_id: str, jct: float | None) -> JobOutcome:
    return JobOutcome(job_id=job_id, model="resnet50", gpus=1, submit_time=0.0,
                      start_time=0.0, finish_time=jct, exclusive_s=jct or 1.0, queue_s=0.0,
                      preemptions=0, shared=False,
                      state=FINISHED if jct is not None else "unfinished")


def result(jcts: dict[str, float | None]) -> SimResult:
    return SimResult(policy="fifo", total_gpus=4,
                     jobs=tuple(outcome(j, jct) for j, jct in jcts.items()),
                     makespan_s=0.0, gpu_util=0.0, preemptions=0, shared_pairs=0, wall_s=0.0,
                     decisions=0, timeline=())


def exported(job_id: str, live_jct: float | None, measured: float | None = None,
             model: str = "resnet50", batch: int = 64, gpus: int = 1,
             policy: str | None = None) -> TraceJob:
    return TraceJob(job_id=job_id, submit_time=0.0, gpus=gpus, model=model, batch_size=batch,
                    iterations=100, live_jct_s=live_jct,
                    live_queue_s=None if live_jct is None else 0.0,
                    measured_iteration_s=measured, live_policy=policy)


def test_each_job_is_compared_with_itself_and_the_figures_follow_by_hand():
    jobs = [exported(f"j{i}", live) for i, live in enumerate([100, 200, 400, 1000, 50])]
    # differences: +5 %, -10 %, +25 %, 0 %, job j4 unfinished in the replay
    replay = result({"j0": 105, "j1": 180, "j2": 500, "j3": 1000, "j4": None})
    fid = whatif.fidelity(jobs, replay, within_pct=10.0)
    assert (fid.policy, fid.compared, fid.left_out) == ("fifo", 4, 1)
    assert fid.live_mean_jct_s == pytest.approx((100 + 200 + 400 + 1000) / 4)
    assert fid.replay_mean_jct_s == pytest.approx((105 + 180 + 500 + 1000) / 4)
    assert fid.mean_diff_pct == pytest.approx(100 * (1785 - 1700) / 1700)
    # 5 %, 10 % (at the bound: within) and 0 % of four
    assert fid.jobs_within_pct == pytest.approx(75.0)
    # |differences| sorted 0, 5, 10, 25: nearest rank p50 the 2nd, p90 the 4th
    assert fid.diff_p50_pct == pytest.approx(5.0)
    assert fid.diff_p90_pct == pytest.approx(25.0)
    assert fid.diff_mean_signed_pct == pytest.approx((5 - 10 + 25 + 0) / 4)


def test_jobs_without_a_live_end_or_a_zero_one_are_left_out_and_none_compared_is_nan():
    jobs = [exported("a", None), exported("b", 0.0), exported("c", 10.0)]
    fid = whatif.fidelity(jobs, result({"a": 5.0, "b": 5.0}))
    assert (fid.compared, fid.left_out) == (0, 3)
    assert fid.as_dict()["mean_diff_pct"] is None
    assert fid.as_dict()["jobs_within_pct"] is None


def test_an_export_measured_as_the_model_times_it_replays_on_the_model_itself():
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    jobs = [exported("a", 10.0, measured=float(f"{alone:.6g}")), exported("b", 10.0)]
    timed, note = whatif.measured_over(jobs, TRUTH, CLUSTER)
    assert timed is TRUTH
    assert "agrees with the model" in note
    unmeasured, note = whatif.measured_over([exported("b", 10.0)], TRUTH, CLUSTER)
    assert unmeasured is TRUTH and "no job has a measured iteration time" in note


def test_a_model_measured_slower_is_timed_by_its_fastest_figure_and_others_by_the_model():
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    two = TRUTH.iteration_time("resnet50", 128, 2, 1)
    # one job alone at 2x the model, two slowed further by a partner, one of them on
    # two GPUs: the model's figures are the lowest ratio, 2x
    jobs = [exported("a", 10.0, measured=2 * alone), exported("b", 10.0, measured=3 * alone),
            exported("c", 10.0, measured=2.5 * two, batch=128, gpus=2),
            exported("d", 10.0, model="bert", batch=32)]
    timed, note = whatif.measured_over(jobs, TRUTH, CLUSTER)
    assert isinstance(timed, whatif.MeasuredModels)
    assert timed.factors == {"resnet50": pytest.approx(2.0)}
    assert "3 of 4 jobs" in note and "resnet50 2x" in note
    assert timed.iteration_time("resnet50", 256, 4, 1, 2) == pytest.approx(
        2 * TRUTH.iteration_time("resnet50", 256, 4, 1, 2))
    assert timed.iteration_time("bert", 32, 1, 1) == TRUTH.iteration_time("bert", 32, 1, 1)
    assert timed.convergence("bert") == TRUTH.convergence("bert")


def test_a_replay_of_a_lone_measured_job_takes_its_iterations_at_the_measured_speed():
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    live_jct = 100 * 2 * alone
    job = exported("a", live_jct, measured=2 * alone)
    timed, _ = whatif.measured_over([job], TRUTH, CLUSTER)
    specs = materialize([job], timed, seed=0, cluster=CLUSTER)
    measured_run = run_policies(specs, CLUSTER, ["fifo"], timed)[0]
    fid = whatif.fidelity([job], measured_run)
    assert fid.replay_mean_jct_s == pytest.approx(live_jct)
    assert fid.jobs_within_pct == 100.0
    # on the model alone the replay is twice as fast: half the live JCT, 50 % off
    model_run = run_policies(materialize([job], TRUTH, seed=0, cluster=CLUSTER), CLUSTER,
                             ["fifo"], TRUTH)[0]
    assert whatif.fidelity([job], model_run).mean_diff_pct == pytest.approx(-50.0)


def test_the_figures_of_a_live_policy_that_resizes_jobs_are_used_too():
    # the export keeps only a speed of a run in the row's own shape, so a resizing
    # policy's figures time the replay like any other's
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    for policy in ("ones", "fifo"):
        jobs = [exported("a", 10.0, measured=2 * alone, policy=policy)]
        timed, note = whatif.measured_over(jobs, TRUTH, CLUSTER)
        assert isinstance(timed, whatif.MeasuredModels), note
        assert timed.iteration_time("resnet50", 64, 1, 1) == pytest.approx(2 * alone)


def test_a_decision_delay_moves_arrivals_and_the_times_count_from_the_submission():
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    jobs = [exported("a", 100 * alone + 7.0), exported("b", 100 * alone + 7.0)]
    specs = materialize(jobs, TRUTH, seed=0, cluster=CLUSTER)
    arriving = whatif.delayed(specs, 7.0)
    assert [s.submit_time for s in arriving] == [7.0, 7.0]
    assert whatif.delayed(specs, 0.0) == specs
    replay = whatif.from_submission(run_policies(arriving, CLUSTER, ["fifo"], TRUTH)[0], specs)
    for job in replay.jobs:
        assert job.submit_time == 0.0
        assert job.queue_s == pytest.approx(7.0)
        assert job.jct_s == pytest.approx(100 * alone + 7.0)
    fid = whatif.fidelity(jobs, replay)
    assert fid.jobs_within_pct == 100.0 and fid.mean_diff_pct == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="decision delay"):
        whatif.delayed(specs, -1.0)
