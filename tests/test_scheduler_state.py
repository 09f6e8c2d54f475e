"""The live scheduler's state and settings: views of jobs are kept across rounds
exactly while nothing they are built from changes; a resident slowdown cap is read from
the environment."""

from __future__ import annotations

from dataclasses import replace as replace_dataclass

import msgspec
import pytest

from gpusched.libs.common.schemas import GpuInfo, JobRecord, JobSpec, NodeInfo, Placement
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.state import (
    Layout,
    LiveJob,
    Phase,
    build_snapshot,
    waiting_view,
)
from gpusched.services.scheduler.policies import make_policy

PERF = load_performance_model(None)


def live_job(job_id: str, gpus: int = 1, iterations: int = 1_000) -> LiveJob:
    spec = JobSpec(
        name=job_id, model="resnet18", gpus=gpus, batch_size=64 * gpus, iterations=iterations
    )
    record = JobRecord(
        id=job_id, tenant="t", spec=spec, total_iterations=iterations, submitted_at=1.0
    )
    return LiveJob(record=record, revision=1, est_iteration_s=0.1, queued_since=1.0)


def layout(nodes: int = 1, gpus: int = 2) -> Layout:
    infos = [
        NodeInfo(
            name=f"n{i}",
            gpus=[
                GpuInfo(index=g, uuid=f"u{i}-{g}", model="emu", memory_mb=40_000)
                for g in range(gpus)
            ],
            cpus=16,
            host_mem_gb=64,
        )
        for i in range(nodes)
    ]
    found = Layout.of(infos)
    assert found is not None
    return found


def test_a_waiting_jobs_view_is_the_same_object_while_nothing_it_reads_changes():
    job = live_job("a")
    first = waiting_view(job, now=10.0)
    assert waiting_view(job, now=500.0) is first
    assert first.remaining_s(500.0) == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (lambda j: setattr(j, "est_iteration_s", 0.2), "est_remaining_s", 200.0),
        (lambda j: setattr(j, "iteration", 400), "est_remaining_s", 60.0),
        (lambda j: setattr(j, "attained_gpu_s", 30.0), "attained_gpu_s", 30.0),
        (lambda j: setattr(j, "queued_since", 7.0), "queued_since", 7.0),
        (
            lambda j: setattr(j, "record", msgspec.structs.replace(j.record, preemptions=2)),
            "preemptions",
            2,
        ),
        (
            lambda j: setattr(j, "record", msgspec.structs.replace(j.record, batch_size=32)),
            "batch_size",
            32,
        ),
    ],
    ids=["estimate", "progress", "service", "requeued", "preempted", "resized"],
)
def test_a_waiting_jobs_view_follows_every_change_it_is_built_from(change, field, expected):
    job = live_job("a")
    before = waiting_view(job, now=10.0)
    change(job)
    after = waiting_view(job, now=20.0)
    assert after is not before
    assert getattr(after, field) == pytest.approx(expected)
    assert waiting_view(job, now=30.0) is after


def test_a_job_whose_run_is_not_settled_gets_a_new_view_every_round():
    job = live_job("a")
    job.running_since = 5.0  # its service still grows with time
    first = waiting_view(job, now=10.0)
    second = waiting_view(job, now=20.0)
    assert second is not first
    assert second.attained_gpu_s == pytest.approx(first.attained_gpu_s + 10.0)


def test_rounds_over_an_unchanged_queue_offer_the_same_views_and_decide_as_a_fresh_policy():
    jobs = {j.id: j for j in (live_job("a", 2), live_job("b", 1), live_job("c", 1))}
    policy = make_policy("sjf-bsbf")
    where = layout(1, 2)
    first = build_snapshot(100.0, where, jobs, PERF, policy)
    second = build_snapshot(200.0, where, jobs, PERF, policy)
    assert [v is w for v, w in zip(first.pending, second.pending, strict=True)] == [True] * 3
    policy.decide(first)
    assert policy.decide(second).starts == make_policy("sjf-bsbf").decide(second).starts


def test_a_job_that_starts_leaves_the_queue_and_comes_back_with_a_new_view():
    job = live_job("a")
    jobs = {"a": job}
    where = layout()
    policy = make_policy("fifo")
    queued = build_snapshot(100.0, where, jobs, PERF, policy).pending[0]
    job.phase = Phase.RUNNING
    job.record = msgspec.structs.replace(job.record, placement=[Placement(node="n0", gpus=[0])])
    assert build_snapshot(150.0, where, jobs, PERF, policy).pending == ()
    job.phase = Phase.WAITING
    job.record = msgspec.structs.replace(job.record, placement=[], preemptions=1)
    requeued = build_snapshot(200.0, where, jobs, PERF, policy).pending[0]
    assert requeued is not queued
    assert requeued.preemptions == 1


def test_a_live_job_compares_without_its_kept_view():
    job = live_job("a")
    twin = replace_dataclass(job)
    waiting_view(job, now=1.0)
    assert job == twin


def test_the_scheduler_reads_a_resident_slowdown_cap_from_its_environment(monkeypatch):
    monkeypatch.setenv("GPUSCHED_MAX_RESIDENT_SLOWDOWN", "1.5")
    config = SchedulerConfig.from_env()
    assert config.max_resident_slowdown == 1.5
    policy = make_policy(config.policy, config.time_scale, config.max_resident_slowdown)
    assert policy.max_resident_slowdown == 1.5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        (
            "GPUSCHED_MAX_RESIDENT_SLOWDOWN", "fast",
            "GPUSCHED_MAX_RESIDENT_SLOWDOWN: expected a number",
        ),
        ("GPUSCHED_MAX_RESIDENT_SLOWDOWN", "0.9", "max_resident_slowdown"),
        ("GPUSCHED_TIME_SCALE", "quick", "GPUSCHED_TIME_SCALE: expected a number"),
    ],
)
def test_a_bad_scheduler_setting_is_refused_naming_it(monkeypatch, variable, raw, expected):
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match=expected):
        SchedulerConfig.from_env()


def running_job(job_id: str, iteration: int, iteration_at: float) -> LiveJob:
    job = live_job(job_id)
    job.phase = Phase.RUNNING
    job.record = msgspec.structs.replace(job.record, placement=[Placement(node="n0", gpus=[0])])
    job.running_since = 10.0
    job.iteration, job.iteration_at = iteration, iteration_at
    return job


def test_a_running_jobs_view_is_kept_between_progress_reports_and_renewed_by_one():
    job = running_job("r", iteration=100, iteration_at=50.0)
    jobs = {"r": job}
    where, policy = layout(1, 1), make_policy("sjf-bsbf")
    (first,) = build_snapshot(60.0, where, jobs, PERF, policy).running
    (again,) = build_snapshot(70.0, where, jobs, PERF, policy).running
    assert again is first
    assert (first.as_of, first.est_remaining_s) == (50.0, pytest.approx(90.0))
    assert first.attained_gpu_s == pytest.approx(40.0)  # 1 GPU since 10.0, as of 50.0
    job.iteration, job.iteration_at = 300, 65.0
    (later,) = build_snapshot(70.0, where, jobs, PERF, policy).running
    assert later is not first
    assert (later.as_of, later.est_remaining_s) == (65.0, pytest.approx(70.0))
    job.phase = Phase.STOPPING
    (stopping,) = build_snapshot(75.0, where, jobs, PERF, policy).running
    assert stopping is not later and stopping.progress_rate == 0.0


def test_a_running_job_without_a_progress_report_gets_a_view_as_of_now_every_round():
    jobs = {"r": running_job("r", iteration=0, iteration_at=0.0)}
    where, policy = layout(1, 1), make_policy("sjf-bsbf")
    (first,) = build_snapshot(60.0, where, jobs, PERF, policy).running
    (second,) = build_snapshot(70.0, where, jobs, PERF, policy).running
    assert (first.as_of, second.as_of) == (60.0, 70.0)


def test_rounds_with_kept_running_views_decide_as_a_fresh_policy():
    # one GPU held by a long job; queued jobs can only share it, or wait
    jobs = {"r": running_job("r", iteration=10, iteration_at=50.0)}
    jobs["r"].record = msgspec.structs.replace(jobs["r"].record, total_iterations=10**6)
    for name, gpus in (("a", 1), ("b", 1), ("c", 2)):
        jobs[name] = live_job(name, gpus)
    where = layout(1, 1)
    kept = make_policy("sjf-bsbf")
    for now in (60.0, 61.0, 62.0):
        snapshot = build_snapshot(now, where, jobs, PERF, kept)
        got = kept.decide(snapshot)
        want = make_policy("sjf-bsbf").decide(snapshot)
        assert got.starts == want.starts
        assert {j.job_id: got.why(j.job_id) for j in snapshot.pending} == {
            j.job_id: want.why(j.job_id) for j in snapshot.pending
        }


def test_a_running_jobs_view_gives_its_epoch_length_where_the_spec_names_a_data_set():
    job = running_job("r", iteration=100, iteration_at=50.0)
    where, policy = layout(1, 1), make_policy("ones")
    (unknown,) = build_snapshot(60.0, where, {"r": job}, PERF, policy).running
    assert unknown.epoch_s is None
    spec = msgspec.structs.replace(job.record.spec, dataset_size=6_400)
    job.record = msgspec.structs.replace(job.record, spec=spec)
    (known,) = build_snapshot(60.0, where, {"r": job}, PERF, policy).running
    # 6,400 samples at batch 64 is 100 iterations of 0.1 s
    assert known.epoch_s == pytest.approx(10.0)
