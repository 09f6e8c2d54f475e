"""Priorities: a tenant's higher-priority jobs take the places its own lower-priority jobs
hold in every non-elastic policy's order; other tenants' jobs do not move; with every
priority 0 each policy decides exactly as it did without the priority pass."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.libs.core.traces import TraceJob, load_trace, write_native
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.base import by_priority, by_priority_ranked
from gpusched.services.scheduler.policies.preemptive import Tiresias
from gpusched.services.scheduler.simulation.simulator import simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot

#: the policies that honour priorities (``ones`` is elastic and ignores them)
ORDERED = [
    "fifo", "fifo-backfill", "sjf", "edf", "genie", "srtf", "tiresias", "asrpt", "sjf-ffs",
    "sjf-bsbf", "synergy-fifo", "synergy-srtf", "synergy-las",
]


def queued(
    job_id: str, user: str, priority: int, submit: float, remaining_s: float
) -> JobView:
    view = pending(job_id, remaining_s, submit=submit, share=False)
    return replace(view, user=user, priority=priority)


def started(decision: Decision) -> list[str]:
    return [s.job_id for s in decision.starts]


def one_gpu(pending_jobs: list[JobView], running_jobs: list[JobView] = ()) -> Snapshot:  # type: ignore[assignment]
    return snapshot(cluster(1, 1), TablePerf(), pending_jobs, list(running_jobs))


@pytest.mark.parametrize("name", ORDERED)
def test_a_tenants_later_high_priority_job_takes_its_own_earlier_jobs_place(name: str):
    # every policy reads these in the same order: by submission, by size, by service
    # (all 0) and by deadline (none) alike: a-low, b, a-high
    jobs = [
        queued("a-low", "A", 0, submit=0, remaining_s=100),
        queued("b", "B", 0, submit=1, remaining_s=200),
        queued("a-high", "A", 5, submit=2, remaining_s=300),
    ]
    plain = [replace(j, priority=0) for j in jobs]

    assert started(make_policy(name).decide(one_gpu(plain))) == ["a-low"]
    assert started(make_policy(name).decide(one_gpu(jobs))) == ["a-high"]


@pytest.mark.parametrize("name", ORDERED)
def test_a_high_priority_of_one_tenant_does_not_move_another_tenants_job(name: str):
    jobs = [
        queued("b", "B", 0, submit=0, remaining_s=100),
        queued("a-low", "A", 0, submit=1, remaining_s=200),
        queued("a-high", "A", 1000, submit=2, remaining_s=300),
    ]

    assert started(make_policy(name).decide(one_gpu(jobs))) == ["b"]


def test_under_genie_a_tenant_may_put_its_job_without_deadline_before_its_deadline_job():
    # genie alone would start the deadline job (it can still meet it); the tenant says
    # its other job matters more, and only its own place changes hands
    urgent = replace(queued("a-deadline", "A", 0, 0, 100), deadline=500.0)
    mine = queued("a-other", "A", 10, 1, 50)
    other = replace(queued("b-deadline", "B", 0, 2, 100), deadline=400.0)
    decision = make_policy("genie").decide(
        snapshot(cluster(1, 2), TablePerf(), [urgent, mine, other])
    )
    # genie's order: b-deadline (allowance 300), a-deadline (400), a-other (no deadline)
    assert started(decision) == ["b-deadline", "a-other"]


@pytest.mark.parametrize("policy", [make_policy("srtf"), Tiresias()], ids=["srtf", "tiresias"])
def test_a_tenants_queued_high_priority_job_preempts_its_own_running_low_priority_job(policy):
    low = replace(running("a-low", 50, (0,)), user="A")
    high = queued("a-high", "A", 5, submit=1, remaining_s=500)

    decision = policy.decide(one_gpu([high], [low]))

    assert [p.job_id for p in decision.preemptions] == ["a-low"]
    assert started(decision) == ["a-high"]


@pytest.mark.parametrize(
    ("name", "attained"), [("srtf", 0.0), ("tiresias", 7_200.0)], ids=["srtf", "tiresias"]
)
def test_a_queued_low_priority_job_never_preempts_its_tenants_running_higher_priority_job(
    name: str, attained: float
):
    # without priorities the queued job outranks the running one: shorter (srtf), or in
    # a higher queue than one past the first threshold (tiresias)
    high = replace(running("a-high", 500, (0,), attained=attained), user="A", priority=5)
    low = queued("a-low", "A", 0, submit=1, remaining_s=50)

    plain = make_policy(name).decide(one_gpu([low], [replace(high, priority=0)]))
    assert [p.job_id for p in plain.preemptions] == ["a-high"]

    decision = make_policy(name).decide(one_gpu([low], [high]))
    assert decision.preemptions == () and decision.starts == ()


def test_the_simulator_gives_policies_the_priority_a_trace_states(tmp_path):
    trace = tmp_path / "trace.csv"
    write_native(trace, [
        TraceJob("blocker", 0.0, 1, model="a", duration_s=10.0, user="B"),
        TraceJob("a-low", 1.0, 1, model="a", duration_s=100.0, user="A"),
        TraceJob("a-high", 2.0, 1, model="a", duration_s=100.0, user="A", priority=7),
    ])
    loaded = load_trace(trace, "native").jobs
    assert {j.job_id: j.priority for j in loaded} == {"blocker": 0, "a-low": 0, "a-high": 7}
    specs = [
        replace(job(j.job_id, j.submit_time, iterations=int(j.duration_s or 0)),
                user=j.user, priority=j.priority)
        for j in loaded
    ]

    def first_starts(jobs: list) -> dict[str, float | None]:
        result = simulate(cluster(1, 1), jobs, make_policy("fifo"), TablePerf())
        return {o.job_id: o.start_time for o in result.jobs}

    # one GPU, fifo: when the blocker ends at t=10 both of A's jobs wait
    assert first_starts([replace(s, priority=0) for s in specs]) == {
        "blocker": 0.0, "a-low": 10.0, "a-high": 110.0
    }
    assert first_starts(specs) == {"blocker": 0.0, "a-high": 10.0, "a-low": 110.0}


# ---- invariants ------------------------------------------------------------------------

views = st.builds(
    lambda i, user, priority, submit, remaining, gpus, attained: replace(
        pending(f"j{i}", remaining, gpus=gpus, submit=submit, attained=attained),
        user=user, priority=priority,
    ),
    st.integers(0, 10**6),
    st.sampled_from(["", "A", "B", "C"]),
    st.integers(-3, 3),
    st.floats(0, 100),
    st.floats(1, 1000),
    st.sampled_from([1, 1, 2, 4]),
    st.sampled_from([0.0, 0.0, 5_000.0, 50_000.0]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(views, max_size=30, unique_by=lambda v: v.job_id))
def test_by_priority_keeps_every_tenants_places_and_orders_its_jobs_by_priority(jobs):
    out = by_priority(jobs)

    assert sorted(v.job_id for v in out) == sorted(v.job_id for v in jobs)
    for user in {v.user for v in jobs}:
        places = [i for i, v in enumerate(jobs) if v.user == user]
        assert [i for i, v in enumerate(out) if v.user == user] == places
        mine = [out[i] for i in places]
        # highest priority first; among equals, the order they came in
        expected = sorted((jobs[i] for i in places), key=lambda v: -v.priority)
        assert mine == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(views, max_size=20, unique_by=lambda v: v.job_id))
def test_by_priority_ranked_keeps_the_ranks_in_place_and_running_jobs_running(jobs):
    half = len(jobs) // 2
    as_running = [replace(v, state=running("x", 1, (0,)).state) for v in jobs[:half]]
    ranked = sorted(((v.submit_time, v.job_id), v) for v in [*as_running, *jobs[half:]])
    run = [r for r in ranked if r[1].running]
    wait = [r for r in ranked if not r[1].running]

    new_run, new_wait = by_priority_ranked(run, wait)

    assert [k for k, _ in new_run] == sorted(k for k, _ in new_run)
    assert [k for k, _ in new_wait] == sorted(k for k, _ in new_wait)
    assert sorted(k for k, _ in [*new_run, *new_wait]) == [k for k, _ in ranked]
    assert {v.job_id for _, v in new_run} == {v.job_id for v in as_running}


def _same_decision(a: Decision, b: Decision, snap: Snapshot) -> None:
    assert a.starts == b.starts
    assert a.preemptions == b.preemptions
    assert a.resizes == b.resizes
    assert a.reallocations == b.reallocations
    assert a.wake_at == b.wake_at
    for view in snap.pending:
        assert a.why(view.job_id) == b.why(view.job_id)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    queue=st.lists(views, max_size=16, unique_by=lambda v: v.job_id),
    busy=st.lists(st.tuples(st.floats(1, 1000), st.sampled_from([0.0, 5_000.0])), max_size=6),
    name=st.sampled_from(ORDERED),
    now=st.floats(0, 200),
)
def test_with_every_priority_0_every_policy_decides_as_without_the_priority_pass(
    queue, busy, name, now
):
    queue = [replace(v, priority=0) for v in queue]
    cl = cluster(2, 4)
    runs = [
        replace(running(f"r{i}", remaining, (i,), attained=attained), user="AB"[i % 2])
        for i, (remaining, attained) in enumerate(busy)
    ]
    snap = snapshot(cl, TablePerf(), queue, runs, now=now)

    without = make_policy(name).decide(replace(snap, prioritized=False))
    forced = make_policy(name).decide(replace(snap, prioritized=True))

    _same_decision(without, forced, snap)


def test_simulate_refuses_a_priority_the_named_policy_cannot_honour_and_leaves_it_out_otherwise(
    tmp_path,
):
    from typer.testing import CliRunner

    from gpusched.services.cli.main import app

    trace = tmp_path / "trace.csv"
    write_native(trace, [
        TraceJob("a", 0.0, 1, model="resnet50", duration_s=60.0, user="A"),
        TraceJob("b", 1.0, 1, model="resnet50", duration_s=60.0, user="A", priority=3),
    ])  # fmt: skip
    common = ["simulate", "--trace", str(trace), "--format", "native", "--cluster", "1x2"]
    refused = CliRunner().invoke(app, [*common, "--policy", "ones", "--out", str(tmp_path / "o")])
    assert refused.exit_code == 2, refused.output
    assert "priority: policy ones does not honour priorities" in refused.output
    assert not (tmp_path / "o" / "summary.json").exists()

    out = tmp_path / "all"
    ran = CliRunner().invoke(app, [*common, "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert "left out: priority: policy ones" in ran.output
    ran_policies = set(json.loads((out / "summary.json").read_text())["policies"])
    assert "ones" not in ran_policies and {"fifo", "asrpt", "genie"} <= ran_policies
