"""Deadlines: the deadline workload option, the `edf` baseline and the QoS figure."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.libs.core.workload import parse_slack_range, with_deadlines
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.base import Policy
from gpusched.services.scheduler.policies.genie import (
    TOO_LATE,
    Genie,
    capacity,
    defer,
    slack_key,
    swaf_key,
)
from gpusched.services.scheduler.simulation.results import (
    FINISHED,
    UNFINISHED,
    JobOutcome,
    SimResult,
)
from gpusched.services.scheduler.simulation.simulator import simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot

runner = CliRunner()
PERF = TablePerf(iter_s={"a": 1.0, "b": 2.0})


def test_every_deadline_lies_within_the_slack_range_of_the_run_time_alone():
    jobs = [job(f"j{i}", submit=10.0 * i, iterations=100 + i, model="ab"[i % 2]) for i in range(20)]
    dated = with_deadlines(jobs, PERF, cluster(1, 4), (1.5, 2.5), seed=3)
    for before, after in zip(jobs, dated, strict=True):
        alone = before.iterations * PERF.iter_s[before.model]
        assert after.deadline is not None
        start = before.submit_time
        assert start + 1.5 * alone <= after.deadline <= start + 2.5 * alone
        assert after.iterations == before.iterations  # nothing else changes
    assert dated == with_deadlines(jobs, PERF, cluster(1, 4), (1.5, 2.5), seed=3)
    assert dated != with_deadlines(jobs, PERF, cluster(1, 4), (1.5, 2.5), seed=4)


@pytest.mark.parametrize("spec", ["3-1.2", "0-2", "-1-2", "a-b", "2", "1.2-inf"])
def test_a_slack_range_out_of_order_or_not_a_range_is_refused(spec: str):
    with pytest.raises(ValueError, match="LO-HI"):
        parse_slack_range(spec)


def test_edf_starts_the_earliest_deadline_first_and_jobs_without_one_last():
    """One GPU; at time 0 it runs `first` (100 s). Waiting: `none` (no deadline, submitted
    first), `late` (deadline 900) and `soon` (deadline 400): soon, late, then none."""
    jobs = [
        job("first", iterations=100),
        job("none", submit=1.0, iterations=100),
        job("late", submit=2.0, iterations=100),
        job("soon", submit=3.0, iterations=100),
    ]
    deadlines = {"late": 900.0, "soon": 400.0}
    jobs = [j if j.job_id not in deadlines else _dated(j, deadlines[j.job_id]) for j in jobs]
    result = simulate(cluster(1, 1), jobs, make_policy("edf"), PERF)
    starts = {o.job_id: o.start_time for o in result.jobs}
    assert starts == {"first": 0.0, "soon": 100.0, "late": 200.0, "none": 300.0}
    met = {o.job_id: o.met_deadline for o in result.jobs}
    assert met == {"first": None, "none": None, "late": True, "soon": True}
    assert result.summary()["qos_pct"] == 100.0


def _dated(spec: JobSpec, deadline: float) -> JobSpec:
    return replace(spec, deadline=deadline)


def _outcome(job_id: str, finish: float | None, deadline: float | None) -> JobOutcome:
    return JobOutcome(
        job_id=job_id, model="a", gpus=1, submit_time=0.0, start_time=0.0,
        finish_time=finish, exclusive_s=10.0, queue_s=0.0, preemptions=0, shared=False,
        state=FINISHED if finish is not None else UNFINISHED, deadline=deadline,
    )  # fmt: skip


def test_qos_counts_the_jobs_with_a_deadline_that_finished_by_it():
    result = SimResult(
        policy="p", total_gpus=1, makespan_s=50.0, gpu_util=1.0, preemptions=0,
        shared_pairs=0, wall_s=0.0, decisions=1, timeline=(),
        jobs=(
            _outcome("met", 20.0, 20.0),
            _outcome("late", 40.0, 30.0),
            _outcome("never", None, 60.0),
            _outcome("free", 50.0, None),
        ),
    )  # fmt: skip
    assert result.summary()["qos_pct"] == pytest.approx(100 / 3)
    no_deadlines = SimResult(
        policy="p", total_gpus=1, makespan_s=50.0, gpu_util=1.0, preemptions=0,
        shared_pairs=0, wall_s=0.0, decisions=1, timeline=(), jobs=(_outcome("x", 5.0, None),),
    )  # fmt: skip
    assert "qos_pct" not in no_deadlines.summary()


def test_simulate_with_deadlines_reports_qos_per_policy(tmp_path: Path):
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["simulate", "--synthetic", "40", "--cluster", "1x4", "-p", "edf", "-p", "fifo",
              "--deadlines", "1.2-3", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "QoS" in result.output
    summary = json.loads((out / "summary.json").read_text())
    for name in ("edf", "fifo"):
        assert 0.0 <= summary["policies"][name]["qos_pct"] <= 100.0


def test_a_bad_deadlines_option_is_a_one_line_error_naming_it(tmp_path: Path):
    result = runner.invoke(
        app, ["simulate", "--synthetic", "4", "--cluster", "1x4", "-p", "edf",
              "--deadlines", "3-1", "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --deadlines")
    assert not (tmp_path / "out").exists()


def _deadline_race(policy: str) -> dict[str, JobOutcome]:
    """One GPU, `first` runs 0-100. Waiting, each 100 s: `hopeless` (deadline 150: at
    100 it can no longer make it), `tight` (250), `loose` (1000), and `free` (no deadline,
    10 s)."""
    jobs = [
        job("first", iterations=100),
        _dated(job("hopeless", submit=1.0, iterations=100), 150.0),
        _dated(job("tight", submit=2.0, iterations=100), 250.0),
        _dated(job("loose", submit=3.0, iterations=100), 1000.0),
        job("free", submit=4.0, iterations=10),
    ]
    result = simulate(cluster(1, 1), jobs, make_policy(policy), PERF)
    return {o.job_id: o for o in result.jobs}


def test_genie_runs_jobs_that_can_meet_their_deadline_first_and_hopeless_ones_last():
    # at 100: tight (allowance 50), loose (800), free (no deadline), hopeless (-50)
    outcomes = _deadline_race("genie")
    starts = {job_id: o.start_time for job_id, o in outcomes.items()}
    assert starts == {"first": 0.0, "tight": 100.0, "loose": 200.0, "free": 300.0,
                      "hopeless": 310.0}  # fmt: skip
    assert [o.met_deadline for o in outcomes.values()] == [None, False, True, True, None]


def test_edf_spends_the_gpu_on_a_hopeless_job_and_misses_one_genie_meets():
    outcomes = _deadline_race("edf")
    assert outcomes["hopeless"].start_time == 100.0
    assert outcomes["tight"].met_deadline is False
    assert sum(bool(o.met_deadline) for o in outcomes.values()) == 1
    assert sum(bool(o.met_deadline) for o in _deadline_race("genie").values()) == 2


def test_genie_says_why_a_job_past_hope_waits():
    snap = snapshot(
        cluster(1, 1),
        PERF,
        [replace(pending("late", 100.0), deadline=50.0), pending("other", 10.0)],
        [running("r", 500.0, (0,))],
        now=0.0,
    )
    decision = make_policy("genie").decide(snap)
    assert decision.starts == ()
    assert "can no longer meet its deadline" in decision.why("late")


def _genie_by_full_sort(snap: Snapshot) -> Decision:
    """GENIE as first written: the whole queue sorted by its SWAF key at the decision."""
    from gpusched.services.scheduler.policies.base import greedy_exclusive

    ordered = sorted(snap.pending, key=lambda j: swaf_key(j, snap.now))
    decision = greedy_exclusive(snap, ordered if snap.free_gpus else (), backfill=True)
    started = {s.job_id for s in decision.starts}
    late = {
        j.job_id: "can no longer meet its deadline: it waits behind every job that can"
        for j in ordered
        if swaf_key(j, snap.now)[0] == TOO_LATE
        and j.job_id not in started
        and j.job_id not in decision.reasons
    }
    return Decision(
        starts=decision.starts,
        reasons={**decision.reasons, **late},
        default_reason=decision.default_reason,
    )


_QUEUES = st.lists(
    st.tuples(
        st.integers(1, 4),  # GPUs
        st.integers(1, 400),  # run time, s
        st.one_of(st.none(), st.integers(0, 800)),  # deadline
    ),
    max_size=12,
)


def _queue(specs: list[tuple[int, int, int | None]], now: int, busy: int) -> Snapshot:
    jobs = [
        replace(pending(f"j{i}", float(run), gpus=gpus, submit=float(i)), deadline=deadline)
        for i, (gpus, run, deadline) in enumerate(specs)
    ]
    blockers = [running("r", 1000.0, tuple(range(busy)))] if busy else []
    # PERF runs a job as fast across nodes as on one, so genie's placement over time
    # never waits here: these tests check the order and the admission
    return snapshot(cluster(2, 4), PERF, jobs, blockers, now=float(now))


def _same(decision: Decision, reference: Decision, snap: Snapshot) -> None:
    assert decision.starts == reference.starts
    for view in snap.pending:
        assert decision.why(view.job_id) == reference.why(view.job_id)


@settings(max_examples=150, deadline=None)
@given(_QUEUES, st.integers(0, 300), st.integers(0, 3))
def test_genie_from_its_fixed_slack_order_decides_as_sorting_the_queue_by_swaf(
    specs: list[tuple[int, int, int | None]], now: int, busy: int
):
    # the rule without the admission; with it, see the next test
    snap = _queue(specs, now, busy)
    _same(Genie(admission=False).decide(snap), _genie_by_full_sort(snap), snap)


@settings(max_examples=300, deadline=None)
@given(_QUEUES, st.integers(0, 300), st.integers(0, 3))
def test_when_the_virtual_machine_shows_no_miss_the_admission_changes_nothing(
    specs: list[tuple[int, int, int | None]], now: int, busy: int
):
    snap = _queue(specs, now, busy)
    fixed = sorted(snap.pending, key=slack_key)
    late = sum(1 for j in fixed if j.deadline is not None and swaf_key(j, snap.now)[0] == TOO_LATE)
    deferred = defer(fixed, late, snap)
    decision = make_policy("genie").decide(snap)
    if not deferred:
        _same(decision, _genie_by_full_sort(snap), snap)
    else:  # each deferred job that did not start says why
        started = {s.job_id for s in decision.starts}
        for job_id in deferred.keys() - started:
            why = decision.why(job_id)
            assert why.startswith("deferred:") or "GPU" in why


def _virtual_on_time(kept: list[JobView], snap: Snapshot) -> bool:
    """Whether every kept job starts on the virtual machine by deadline - run time, in
    the order of their due dates (brute force over the capacity step function)."""
    times, gpu_s, rate = capacity(snap)

    def cap(t: float) -> float:
        k = max(i for i, at in enumerate(times) if at <= t)
        return gpu_s[k] + rate[k] * (t - times[k])

    due = sorted(
        (cap(j.deadline - j.remaining_s(snap.now)) + j.gpus * j.remaining_s(snap.now),
         j.gpus * j.remaining_s(snap.now))
        for j in kept if j.deadline is not None
    )  # fmt: skip
    total = 0.0
    for end, work in due:
        total += work
        if total > end + 1e-6:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 400), st.integers(0, 900)), max_size=7),
    st.integers(0, 300),
    st.integers(0, 3),
)
def test_the_admission_defers_the_fewest_jobs_that_leave_the_virtual_machine_on_time(
    specs: list[tuple[int, int, int]], now: int, busy: int
):
    snap = _queue(list(specs), now, busy)
    fixed = sorted(snap.pending, key=slack_key)
    late = sum(1 for j in fixed if swaf_key(j, snap.now)[0] == TOO_LATE)
    hopeful = fixed[late:]
    deferred = defer(fixed, late, snap)
    assert set(deferred) <= {j.job_id for j in hopeful}
    assert _virtual_on_time([j for j in hopeful if j.job_id not in deferred], snap)
    fewest = next(
        n for n in range(len(hopeful) + 1)
        if any(_virtual_on_time([j for j in hopeful if j not in out], snap)
               for out in combinations(hopeful, n))
    )  # fmt: skip
    assert len(deferred) == fewest


def _crowding_race(policy: Policy) -> dict[str, JobOutcome]:
    """One GPU, `first` (no deadline) runs 0-100. Waiting: `big` (300 s, deadline 420),
    `a` (50 s, deadline 430) and `b` (50 s, deadline 440). Whoever starts big at 100 ends
    it at 400 and then a at 450 and b at 500, both late; a and b first end at 150 and 200,
    and big at 500, late."""
    jobs = [
        job("first", iterations=100),
        _dated(job("big", submit=1.0, iterations=300), 420.0),
        _dated(job("a", submit=2.0, iterations=50), 430.0),
        _dated(job("b", submit=3.0, iterations=50), 440.0),
    ]
    return {o.job_id: o for o in simulate(cluster(1, 1), jobs, policy, PERF).jobs}


def test_genie_defers_a_big_job_and_saves_two_deadlines_that_swaf_and_edf_miss():
    # at 0, virtual machine (1 GPU from 100 on): due dates D = capacity(deadline - run)
    # + run: big 20 + 300 = 320, a 280 + 50 = 330, b 290 + 50 = 340. Walking by D: big
    # (300 <= 320), a (350 > 330: defer the biggest, big; 50), b (100 <= 340). Kept
    # slacks: a 330 - 50 = 280, b 340 - 100 = 240, both below big's 300: it crowds out 2
    genie = _crowding_race(make_policy("genie"))
    assert {k: o.start_time for k, o in genie.items()} == {
        "first": 0.0, "a": 100.0, "b": 150.0, "big": 200.0}  # fmt: skip
    assert [genie[k].met_deadline for k in ("a", "b", "big")] == [True, True, False]
    for rival in (Genie(admission=False), make_policy("edf")):
        outcomes = _crowding_race(rival)
        assert outcomes["big"].start_time == 100.0
        assert [outcomes[k].met_deadline for k in ("a", "b", "big")] == [False, False, True]
    snap = snapshot(
        cluster(1, 1),
        PERF,
        [replace(pending("big", 300.0, submit=1.0), deadline=420.0),
         replace(pending("a", 50.0, submit=2.0), deadline=430.0),
         replace(pending("b", 50.0, submit=3.0), deadline=440.0)],
        [running("first", 100.0, (0,))],
    )  # fmt: skip
    assert defer(sorted(snap.pending, key=slack_key), 0, snap) == {"big": 2}
    assert make_policy("genie").decide(snap).why("big") == (
        "deferred: running it now would make 2 jobs that can meet theirs miss"
    )


def test_under_overload_genie_holds_gpus_for_a_wide_deadline_job_past_shorter_backfill():
    """Two GPUs; `r1` ends at 100, `r2` at 400. At 100 one GPU is idle. Queue: `wide`
    (2 GPUs, 100 s, deadline 520: it can start when r2 ends), `huge` (1 GPU, 1000 s,
    deadline 1150: deferred, it crowds out wide) and `quick` (1 GPU, 50 s, no deadline).
    Plain SWAF backfills huge onto the idle GPU; genie starts quick (it ends by 400) and
    keeps huge off the GPU wide needs at 400."""
    snap = snapshot(
        cluster(1, 2),
        PERF,
        [replace(pending("wide", 100.0, gpus=2, submit=1.0), deadline=520.0),
         replace(pending("huge", 1000.0, submit=2.0), deadline=1150.0),
         pending("quick", 50.0, submit=3.0)],
        [running("r1", 0.0, (0,)), running("r2", 300.0, (1,))],
        now=100.0,
    )  # fmt: skip
    # r1 has nothing left: its GPU is as good as idle, so build the snapshot without it
    snap = replace(snap, running=snap.running[1:], gpu_load=(0, 1), node_free=(1,))
    fixed = sorted(snap.pending, key=slack_key)
    assert defer(fixed, 0, snap) == {"huge": 1}
    decision = make_policy("genie").decide(snap)
    assert [s.job_id for s in decision.starts] == ["quick"]
    assert decision.why("huge") == (
        "deferred: running it now would make 1 job that can meet its deadline miss"
    )
    plain = Genie(admission=False).decide(snap)
    assert [s.job_id for s in plain.starts] == ["huge"]


#: a placement over two nodes runs 1.5 times longer than on one
SPREAD = TablePerf(iter_s={"a": 1.0}, spread_penalty=1.5)


def _spread_race(r1_s: float, policy: Policy) -> dict[str, JobOutcome]:
    """Two nodes of 4 GPUs. At 0, `r1` (3 GPUs, ``r1_s``) takes GPUs 0-2 and `r2` (3 GPUs,
    1000 s) GPUs 4-6. At 1, `wide` (2 GPUs, 400 s on one node) finds GPUs 3 and 7 idle,
    one on each node: 600 s there, or 400 s on node 0 once r1 ends."""
    jobs = [
        job("r1", iterations=int(r1_s), gpus=3),
        job("r2", iterations=1000, gpus=3),
        job("wide", submit=1.0, iterations=400, gpus=2),
    ]
    return {o.job_id: o for o in simulate(cluster(2, 4), jobs, policy, SPREAD).jobs}


def test_genie_waits_for_one_node_when_that_finishes_sooner_than_starting_across_two():
    # at 1: across two nodes it ends at 1 + 400 x 1.5 = 601; node 0 is free at 100 (r1's
    # end), and 100 + 400 = 500 < 601, so it waits and ends at 500
    outcomes = _spread_race(100.0, make_policy("genie"))
    assert (outcomes["wide"].start_time, outcomes["wide"].finish_time) == (100.0, 500.0)
    spread = _spread_race(100.0, Genie(placement_over_time=False))["wide"]
    assert (spread.start_time, spread.finish_time) == (1.0, 601.0)


def test_genie_starts_across_two_nodes_when_waiting_for_one_would_finish_later():
    # r1 runs 500 s: one node at 500 ends wide at 900, after 601 across two nodes
    outcomes = _spread_race(500.0, make_policy("genie"))
    assert (outcomes["wide"].start_time, outcomes["wide"].finish_time) == (1.0, 601.0)


def _spread_snapshot(wide_deadline: float | None, r1_s: float = 100.0) -> Snapshot:
    """The race above at 0 as a snapshot, `wide` queued with ``wide_deadline`` and behind
    it three 1-GPU jobs without one: `quick` (50 s), `quick2` (60 s), `long` (500 s)."""
    return snapshot(
        cluster(2, 4),
        SPREAD,
        [replace(pending("wide", 400.0, gpus=2), deadline=wide_deadline),
         pending("quick", 50.0, submit=1.0), pending("quick2", 60.0, submit=2.0),
         pending("long", 500.0, submit=3.0)],
        [running("r1", r1_s, (0, 1, 2)), running("r2", 1000.0, (4, 5, 6))],
    )  # fmt: skip


def test_a_waiting_job_holds_its_node_for_jobs_that_end_before_it_is_due():
    # wide (deadline 700) meets it both ways: across two nodes at 600 (1.5 x 400 GPU-s
    # more), on node 0 at 500. It waits and holds GPU 3; quick takes GPU 7, quick2 (ends
    # at 60, before 100) GPU 3, and long (ends at 500) is kept off it
    snap = _spread_snapshot(700.0)
    decision = make_policy("genie").decide(snap)
    assert {s.job_id: s.gpu_ids for s in decision.starts} == {"quick": (7,), "quick2": (3,)}
    assert decision.why("wide") == (
        "waits for 2 GPUs on one node in ~2 min: meets its deadline with less GPU-time "
        "than starting now across 2 nodes"
    )
    assert decision.why("long") == "all GPUs are busy or held for wide, which waits for fewer nodes"
    plain = Genie(placement_over_time=False).decide(snap)
    assert {s.job_id: s.gpu_ids for s in plain.starts} == {"wide": (3, 7)}


@pytest.mark.parametrize(
    ("deadline", "r1_s", "waits"),
    [
        (None, 100.0, True),  # 500 against 600: sooner
        (None, 250.0, False),  # 650 against 600
        (550.0, 250.0, False),  # both miss it (600, 650): the sooner finish
        (620.0, 250.0, False),  # only starting now meets it
        (650.0, 250.0, True),  # both meet it: one node costs less GPU-time
    ],
)
def test_genie_picks_between_starting_spread_and_waiting_by_deadline_then_finish(
    deadline: float | None, r1_s: float, waits: bool
):
    snap = _spread_snapshot(deadline, r1_s)
    snap = replace(snap, pending=snap.pending[:1])  # wide alone
    decision = make_policy("genie").decide(snap)
    started = {s.job_id for s in decision.starts}
    assert ("wide" not in started) is waits
    if waits:
        assert decision.why("wide").startswith("waits for 2 GPUs on one node")


@st.composite
def _crowded_spread_snapshots(draw: st.DrawFn) -> Snapshot:
    """Three nodes of 4 GPUs partly held by running jobs, a queue of 1- to 8-GPU jobs
    with and without deadlines, on a model that runs slower spread: jobs wait for fewer
    nodes, hold GPUs and are passed over."""
    now = draw(st.integers(0, 300))
    free = list(range(12))
    held = []
    for i in range(draw(st.integers(0, 5))):
        size = draw(st.sampled_from([1, 2, 3]))
        if size > len(free):
            break
        gpus = tuple(free[:size]) if draw(st.booleans()) else tuple(free[-size:])
        free = [g for g in free if g not in gpus]
        held.append(running(f"r{i}", float(draw(st.integers(10, 900))), gpus))
    queue = [
        replace(
            pending(f"j{i}", float(run), gpus=gpus, submit=float(i)),
            deadline=None if deadline is None else float(now + deadline),
        )
        for i, (gpus, run, deadline) in enumerate(
            draw(
                st.lists(
                    st.tuples(
                        st.sampled_from([1, 1, 2, 3, 4, 6, 8]),
                        st.integers(1, 900),
                        st.one_of(st.none(), st.integers(1, 2_000)),
                    ),
                    max_size=14,
                )
            )
        )
    ]
    return snapshot(cluster(3, 4), SPREAD, queue, held, now=float(now))


@settings(max_examples=200, deadline=None)
@given(_crowded_spread_snapshots(), st.booleans())
def test_passing_over_jobs_that_cannot_start_early_changes_no_outcome_or_reason(
    snap: Snapshot, hold: bool
):
    from gpusched.libs.core.placement import ShapeCache
    from gpusched.services.scheduler.policies.genie import SpreadCost, placing

    def decide(skip_early: bool) -> Decision:
        return placing(
            snap, sorted(snap.pending, key=slack_key), ShapeCache(), hold=hold,
            spread=SpreadCost(), skip_early=skip_early,
        )  # fmt: skip

    fast, plain = decide(True), decide(False)
    _same(fast, plain, snap)
    assert fast.default_reason == plain.default_reason


def test_a_job_waiting_for_one_node_keeps_its_gpus_held_at_later_decisions():
    # at 0, wide (2 GPUs, 400 s) finds GPUs 3 and 7 idle, one per node, and waits for
    # node 0, free at 100 when r1 ends; at 10 another job has taken GPU 7, so wide could
    # not start spread any more, and long (1 GPU, 500 s) arrives: it must not take GPU 3,
    # which wide's plan holds (long would end at 510, after wide is due)
    genie = make_policy("genie")
    first = _spread_snapshot(None)
    first = replace(first, pending=first.pending[:1])  # wide alone
    assert genie.decide(first).why("wide").startswith("waits for 2 GPUs on one node")
    later = snapshot(
        cluster(2, 4),
        SPREAD,
        [pending("wide", 400.0, gpus=2), pending("long", 500.0, submit=10.0)],
        [running("r1", 90.0, (0, 1, 2), as_of=10.0), running("r2", 990.0, (4, 5, 6), as_of=10.0),
         running("r3", 2000.0, (7,), as_of=10.0)],
        now=10.0,
    )  # fmt: skip
    kept = genie.decide(later)
    assert kept.starts == ()
    assert kept.why("wide").startswith("waits for 2 GPUs on one node")
    assert "held for wide" in kept.why("long")
    # a policy that never planned for wide lets long take the GPU
    fresh = make_policy("genie").decide(later)
    assert {s.job_id: s.gpu_ids for s in fresh.starts} == {"long": (3,)}
