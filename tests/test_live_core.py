"""The live scheduler's core driven without NATS: inputs in, the picture and the listed
effects checked (services/scheduler/live/core.py, effects.py)."""

from __future__ import annotations

import time

from msgspec.structs import replace

from gpusched.libs.common.schemas import (
    GpuInfo,
    Heartbeat,
    JobExit,
    JobRecord,
    JobSpec,
    JobState,
    NodeInfo,
    Placement,
    RunningJob,
)
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.core import SchedulerCore
from gpusched.services.scheduler.live.effects import (
    AskEstimate,
    Effect,
    PublishDecision,
    PublishState,
    RequestRound,
    StartRun,
    StopRun,
    UnmarkLive,
    WriteRecord,
    job_of,
)
from gpusched.services.scheduler.live.messages import StartResult
from gpusched.services.scheduler.live.state import Phase, build_snapshot


def core_with_node(policy: str = "fifo", gpus: int = 2, **settings: object) -> SchedulerCore:
    """A core whose one node ``n1`` has ``gpus`` GPUs, joined by its first heartbeat."""
    config = SchedulerConfig(nats_url="nats://unused:4222", policy=policy, **settings)
    core = SchedulerCore(config)
    info = NodeInfo(
        name="n1",
        gpus=[GpuInfo(i, f"uuid-{i}", "Tesla V100-SXM2-16GB", 16_000) for i in range(gpus)],
        cpus=8 * gpus,
        host_mem_gb=64.0 * gpus,
    )
    core.beat(Heartbeat(node="n1", at=time.time()), registration=info)
    core.take_effects()
    return core


def queued(job_id: str, gpus: int = 1, submitted_at: float | None = None) -> JobRecord:
    spec = JobSpec(name=job_id, model="resnet50", batch_size=32, iterations=100, gpus=gpus)
    return JobRecord(
        id=job_id, tenant="alpha", spec=spec, total_iterations=100,
        submitted_at=time.time() if submitted_at is None else submitted_at,
    )


def of_kind(effects: list[Effect], kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def started(core: SchedulerCore, job_id: str) -> None:
    """The job's start command went out and its node answered that it runs."""
    run_id = core.jobs[job_id].record.run_id
    core.start_result(StartResult(job_id, run_id, error=""))


def test_a_round_writes_a_started_jobs_record_before_it_sends_the_start_command() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    assert of_kind(core.take_effects(), AskEstimate)
    core.round()
    effects = core.take_effects()
    write = next(i for i, e in enumerate(effects) if isinstance(e, WriteRecord))
    start = next(i for i, e in enumerate(effects) if isinstance(e, StartRun))
    assert write < start
    command = effects[start]
    assert isinstance(command, StartRun)
    assert command.placement == [Placement(node="n1", gpus=[0])]
    assert command.record.run_id == 1
    job = core.jobs["a"]
    assert job.phase == Phase.STARTING
    assert job.record is command.record  # the picture is already what was written
    decision = of_kind(effects, PublishDecision)
    assert [d.summary.started for d in decision] == [["a"]]


def test_a_job_that_does_not_fit_is_told_why_it_waits_and_gets_no_command() -> None:
    core = core_with_node(gpus=2)
    core.take("big", queued("big", gpus=4), revision=1)
    core.take_effects()
    core.round()
    effects = core.take_effects()
    assert not of_kind(effects, StartRun)
    writes = of_kind(effects, WriteRecord)
    assert [w.job.id for w in writes] == ["big"]
    assert writes[0].record.pending_reason != ""
    assert core.jobs["big"].phase == Phase.WAITING


def test_the_nodes_answer_makes_a_started_job_running_and_announces_it() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    core.take_effects()
    started(core, "a")
    effects = core.take_effects()
    assert core.jobs["a"].phase == Phase.RUNNING
    assert core.jobs["a"].record.state is JobState.RUNNING
    [announced] = of_kind(effects, PublishState)
    assert (announced.job_id, announced.state) == ("a", JobState.RUNNING)
    assert announced.placement == [Placement(node="n1", gpus=[0])]


def test_a_failed_start_puts_the_job_back_in_the_queue_and_asks_for_a_round() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    core.take_effects()
    core.start_result(StartResult("a", 1, error="no such GPU"))
    effects = core.take_effects()
    job = core.jobs["a"]
    assert job.phase == Phase.WAITING
    assert job.record.placement == []
    assert "start failed" in job.record.pending_reason
    assert of_kind(effects, RequestRound)


def test_a_successful_exit_settles_the_job_and_takes_it_out_of_the_index() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    core.exit(JobExit(job_id="a", run_id=1, node="n1", outcome="succeeded", exit_code=0,
                      iteration=100, at=time.time()))
    effects = core.take_effects()
    assert "a" not in core.jobs and "a" in core.settled
    [write] = of_kind(effects, WriteRecord)
    assert write.record.state is JobState.SUCCEEDED
    assert write.record.progress.iteration == 100
    assert [u.job_id for u in of_kind(effects, UnmarkLive)] == ["a"]
    assert effects.index(write) < effects.index(of_kind(effects, UnmarkLive)[0])


def test_an_exit_reported_by_a_node_that_does_not_lead_the_run_changes_nothing() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    before = core.jobs["a"].record
    core.exit(JobExit(job_id="a", run_id=1, node="n2", outcome="succeeded", at=time.time()))
    assert core.take_effects() == []
    assert core.jobs["a"].record is before
    assert core.jobs["a"].phase == Phase.RUNNING


def test_an_exit_of_an_earlier_run_changes_nothing() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    core.exit(JobExit(job_id="a", run_id=0, node="n1", outcome="failed", at=time.time()))
    assert core.take_effects() == []
    assert core.jobs["a"].phase == Phase.RUNNING


def test_a_cancel_of_a_running_job_is_written_before_its_run_is_stopped() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    core.cancel(core.jobs["a"])
    effects = core.take_effects()
    assert [type(e) for e in effects] == [WriteRecord, StopRun]
    assert effects[0].record.cancel_requested  # type: ignore[union-attr]
    assert effects[1] == StopRun("n1", "a", 1, "cancel")
    assert core.jobs["a"].phase == Phase.STOPPING
    core.cancel(core.jobs["a"])
    assert core.take_effects() == []  # asked twice, stopped once


def test_a_cancel_of_a_waiting_job_ends_it_at_once() -> None:
    core = core_with_node(gpus=1)
    core.take("a", queued("a", gpus=4), revision=1)
    core.take_effects()
    core.cancel(core.jobs["a"])
    effects = core.take_effects()
    assert "a" not in core.jobs
    assert of_kind(effects, WriteRecord)[0].record.state is JobState.CANCELLED
    assert not of_kind(effects, StopRun)


def test_a_node_that_stops_beating_loses_its_job_to_the_queue() -> None:
    core = core_with_node(node_timeout_s=1.0)
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    core.nodes["n1"].last_beat = time.time() - 10  # heartbeats stopped 10 s ago
    [(job, why)] = core.sweep(registered={"n1"})
    assert job.id == "a" and "n1 lost" in why
    assert "n1" not in core.nodes
    core.lost(job, why, stored_exit=None)
    effects = core.take_effects()
    assert core.jobs["a"].phase == Phase.WAITING
    assert core.jobs["a"].record.state is JobState.QUEUED
    assert not of_kind(effects, StopRun)  # its node is gone: nothing to tell it


def test_a_lost_job_whose_exit_was_stored_ends_by_that_exit_not_a_requeue() -> None:
    core = core_with_node(node_timeout_s=1.0)
    core.take("a", queued("a"), revision=1)
    core.round()
    started(core, "a")
    core.take_effects()
    core.nodes["n1"].last_beat = time.time() - 10
    [(job, why)] = core.sweep(registered={"n1"})
    exit = JobExit(job_id="a", run_id=1, node="n1", outcome="succeeded", iteration=100,
                   at=time.time())
    core.lost(job, why, stored_exit=exit)
    assert "a" in core.settled and "a" not in core.jobs


def test_a_heartbeat_listing_a_run_the_scheduler_did_not_start_stops_that_run() -> None:
    core = core_with_node()
    stray = RunningJob(job_id="stray", run_id=3, progress=queued("x").progress)
    core.beat(Heartbeat(node="n1", at=time.time(), running=[stray]))
    assert core.take_effects() == [StopRun("n1", "stray", 3, "lost")]


def test_a_stored_record_of_a_finished_job_is_only_taken_out_of_the_index() -> None:
    core = core_with_node()
    done = replace(queued("a"), state=JobState.SUCCEEDED)
    assert core.take("a", done, revision=4) is None
    assert core.take_effects() == [UnmarkLive("a")]
    assert "a" in core.settled


def test_every_effect_of_a_start_names_the_job_it_belongs_to() -> None:
    core = core_with_node()
    core.take("a", queued("a"), revision=1)
    core.round()
    effects = core.take_effects()
    kinds = {type(e): job_of(e) for e in effects if not isinstance(e, PublishDecision)}
    assert kinds[WriteRecord] == "a" and kinds[StartRun] == "a"
    assert job_of(RequestRound()) is None


def test_a_jobs_batch_bounds_reach_the_policy_as_its_elastic_bounds() -> None:
    core = core_with_node(policy="ones", gpus=4)
    spec = JobSpec(name="b", model="resnet50", batch_size=64, iterations=100,
                   min_batch_size=32, max_batch_size=64)
    record = JobRecord(id="b", tenant="alpha", spec=spec, total_iterations=100,
                       submitted_at=time.time())
    core.take("b", record, revision=1)
    core.take("plain", queued("plain"), revision=1)
    assert core.layout is not None
    snapshot = build_snapshot(time.time(), core.layout, core.jobs, core.estimates, core.policy)
    views = {v.job_id: v for v in snapshot.pending}
    bounds = views["b"].elastic
    assert bounds is not None
    assert (bounds.min_batch_size, bounds.max_batch_size) == (32, 64)
    assert bounds.max_gpus is None  # a live job declares no GPU bounds
    assert views["plain"].elastic is None
    core.round()
    starts = [e for e in core.take_effects() if isinstance(e, StartRun)]
    started = {s.record.id: s.record for s in starts}
    assert "b" in started  # an elastic start within its bounds, not one it refuses
    assert 32 <= started["b"].current_spec.batch_size <= 64
