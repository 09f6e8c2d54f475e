"""``auto``: GENIE's order and placement, a bound on being passed over, and SJF-BSBF's
sharing where a cap is given (services/scheduler/policies/auto.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision, Resize, decision_problems
from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.perf import CpuMemDemand
from gpusched.libs.core.snapshot import JobView
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.auto import Auto
from gpusched.services.scheduler.policies.auto_resources import with_cpu_mem
from gpusched.services.scheduler.policies.genie import Genie
from gpusched.services.scheduler.policies.ones import Ones
from gpusched.services.scheduler.simulation.simulator import SimConfig, Simulator, simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot
from tests.test_invariants import job_strategy, trace_of

DAY = 24 * 3600.0
PERF = TablePerf()
# A (model a) beside B (model b): A runs 1.2x slower, B 2.0x slower
SHARING_PERF = TablePerf(slowdown={("a", "b"): 1.2, ("b", "a"): 2.0})


def test_with_nobody_past_the_bound_auto_decides_what_genie_decides() -> None:
    jobs = [pending("long", 10 * 3600, queued_since=0), pending("short", 60, queued_since=5)]
    snap = snapshot(cluster(1, 1), PERF, jobs, now=DAY)
    # GENIE's starts, with the CPUs and memory of rule 7 added
    assert Auto(tune_cpu_mem=False).decide(snap).starts == Genie().decide(snap).starts
    assert [(s.job_id, s.gpu_ids) for s in Auto().decide(snap).starts] == [
        (s.job_id, s.gpu_ids) for s in Genie().decide(snap).starts
    ]
    (start,) = Auto().decide(snap).starts
    assert start.job_id == "short"  # shortest predicted run time first


def test_a_job_waiting_past_its_bound_goes_before_a_shorter_one() -> None:
    # long: 10 h predicted, queued 4 days: past max(3 days, 10 x 10 h = 100 h)? 96 h < 100 h
    jobs = [pending("long", 10 * 3600, queued_since=0), pending("short", 60, queued_since=0)]
    at_4_days = snapshot(cluster(1, 1), PERF, jobs, now=4 * DAY)
    assert [s.job_id for s in Auto().decide(at_4_days).starts] == ["short"]
    # at 4.5 days it has waited 108 h > 100 h: it goes first
    at_4_5_days = snapshot(cluster(1, 1), PERF, jobs, now=4.5 * DAY)
    assert [s.job_id for s in Auto().decide(at_4_5_days).starts] == ["long"]


def test_the_floor_of_the_bound_holds_for_a_short_job() -> None:
    # tiny: 60 s predicted; 10 x 60 s has long passed, the 3-day floor has not
    jobs = [pending("tiny", 60, queued_since=0), pending("tinier", 30, queued_since=0)]
    snap = snapshot(cluster(1, 1), PERF, jobs, now=2 * DAY)
    assert [s.job_id for s in Auto().decide(snap).starts] == ["tinier"]
    later = snapshot(cluster(1, 1), PERF, jobs, now=3 * DAY + 1)
    # both past the floor now: longest waiting first, ties by id
    assert [s.job_id for s in Auto().decide(later).starts] == ["tinier"]
    jobs = [pending("tiny", 60, queued_since=0), pending("tinier", 30, queued_since=10)]
    later = snapshot(cluster(1, 1), PERF, jobs, now=3 * DAY + 20)
    assert [s.job_id for s in Auto().decide(later).starts] == ["tiny"]


def test_auto_shares_no_gpu_unless_a_cap_is_given() -> None:
    snap = snapshot(cluster(1, 1), SHARING_PERF, [pending("a", 5)], [running("r", 100, (0,), "b")])
    # t_seq = 100 + 5 = 105 against t_con = 100/2 + (1 - 1/4) * 1.2 * 5 = 54.5: it pays
    assert Auto(preempt=False).decide(snap).starts == ()
    assert not Auto().capabilities.shares_gpus
    assert make_policy("auto", max_resident_slowdown=2.0).capabilities.shares_gpus
    sharing = Auto(preempt=False, max_resident_slowdown=2.0)
    (start,) = sharing.decide(snap).starts
    assert start.shares_with == ("r",) and start.gpu_ids == (0,)
    # the resident would be slowed 2x: a cap of 1.5 refuses the pair
    assert Auto(preempt=False, max_resident_slowdown=1.5).decide(snap).starts == ()


def test_a_shared_start_never_takes_an_idle_gpu_nor_joins_a_job_started_with_it() -> None:
    # GPU 1 is idle: GENIE starts the shortest there; the other waits, and may only join
    # the job that was running before this decision, on GPU 0
    snap = snapshot(
        cluster(1, 2), SHARING_PERF, [pending("a", 5), pending("a2", 6)],
        [running("r", 100, (0,), "b")],
    )
    decision = Auto(preempt=False, max_resident_slowdown=2.0).decide(snap)
    by_id = {s.job_id: s for s in decision.starts}
    assert by_id["a"].gpu_ids == (1,) and by_id["a"].shares_with == ()
    assert by_id["a2"].gpu_ids == (0,) and by_id["a2"].shares_with == ("r",)


def test_a_long_running_job_is_preempted_for_a_short_one_that_then_takes_its_gpu() -> None:
    # virtual work: r 1,000 GPU-s against a's 10; r's 30 s restart is under half its 1,000 s
    snap = snapshot(cluster(1, 1), PERF, [pending("a", 10)], [running("r", 1000, (0,))])
    decision = Auto().decide(snap)
    assert [p.job_id for p in decision.preemptions] == ["r"]
    assert [(s.job_id, s.gpu_ids) for s in decision.starts] == [("a", (0,))]
    assert Auto().preemptive and not Auto(preempt=False).preemptive
    assert Auto(preempt=False).decide(snap).preemptions == ()


def test_a_job_near_its_end_is_not_preempted_since_its_restart_costs_too_much() -> None:
    # 40 s left: a 30 s restart is more than half of it
    snap = snapshot(cluster(1, 1), PERF, [pending("a", 10)], [running("r", 40, (0,))])
    decision = Auto().decide(snap)
    assert decision.preemptions == () and decision.starts == ()


def test_a_preempted_job_waits_its_turn_and_others_keep_running() -> None:
    # two GPUs: r (long) and s (short) run; a 1-GPU job arrives; only r is worth
    # preempting, and r does not start again in the same decision
    snap = snapshot(
        cluster(1, 2), PERF, [pending("a", 10)],
        [running("r", 5000, (0,)), running("s", 20, (1,))],
    )
    decision = Auto().decide(snap)
    assert [p.job_id for p in decision.preemptions] == ["r"]
    assert [(s.job_id, s.gpu_ids) for s in decision.starts] == [("a", (0,))]


def test_a_time_scaled_auto_scales_the_floor_of_its_bound() -> None:
    scaled = make_policy("auto", time_scale=0.01)
    assert isinstance(scaled, Auto)
    assert scaled.min_wait_s == pytest.approx(3 * DAY * 0.01)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_wait_factor", 0.0), ("max_wait_factor", float("inf")), ("min_wait_s", -1.0),
     ("max_resident_slowdown", 0.5)],
)
def test_a_bad_setting_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Auto(**{field: value})


def _elastic(view: JobView, least: int = 1, most: int | None = None) -> JobView:
    return replace(view, elastic=Elastic(min_gpus=least, max_gpus=most))


def test_an_elastic_job_is_started_by_the_search_on_gpus_no_rigid_job_takes() -> None:
    # r (rigid) and e (bounds declared) ask 2 of the 4 GPUs each: the search starts e
    # as ONES starts a new job, on one GPU at its per-GPU batch, on GPUs r does not hold
    snap = snapshot(
        cluster(1, 4), PERF,
        [pending("r", 100, gpus=2), _elastic(pending("e", 50, gpus=2, batch=64))],
    )  # fmt: skip
    decision = Auto().decide(snap)
    by_id = {s.job_id: s for s in decision.starts}
    assert len(by_id["r"].gpu_ids) == 2 and by_id["r"].batch_size is None
    assert len(by_id["e"].gpu_ids) == 1 and by_id["e"].batch_size == 32
    assert set(by_id["e"].gpu_ids).isdisjoint(by_id["r"].gpu_ids)
    # with the rule off, e starts at the size it asked for, as any job
    rigid = {s.job_id: s for s in Auto(elastic=False).decide(snap).starts}
    assert rigid["e"].batch_size is None and len(rigid["e"].gpu_ids) == 2


def test_an_elastic_job_grown_past_what_it_asked_is_shrunk_back_while_a_rigid_job_waits() -> (
    None
):
    policy = Auto(preempt=False)
    # the search first sees e queued, asking for 1 GPU
    policy.decide(snapshot(cluster(1, 4), PERF, [_elastic(pending("e", 5000))]))
    # e now runs on all 4 GPUs, long past the search's gate; r (rigid) needs 2
    grown = replace(_elastic(running("e", 5000, (0, 1, 2, 3))), started_at=0.0)
    waiting = snapshot(cluster(1, 4), PERF, [pending("r", 100, gpus=2)], [grown], now=3600.0)
    decision = policy.decide(waiting)
    (resize,) = decision.resizes
    assert resize.job_id == "e" and len(resize.gpu_ids) == 1
    # with nothing rigid waiting it may keep what it borrowed
    alone = snapshot(cluster(1, 4), PERF, [], [grown], now=3600.0)
    assert all(len(r.gpu_ids) > 1 for r in policy.decide(alone).resizes)


def test_a_workload_of_elastic_jobs_only_is_scheduled_as_ones_schedules_it() -> None:
    trace = [
        replace(job(f"j{i}", submit=20.0 * i, iterations=300 + 97 * i, gpus=1 + i % 2),
                min_gpus=1)
        for i in range(8)
    ]  # fmt: skip
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    by_auto = simulate(cl, trace, Auto(), PERF)
    by_ones = simulate(cl, trace, Ones(), PERF)
    assert [(o.job_id, o.jct_s) for o in by_auto.jobs] == [
        (o.job_id, o.jct_s) for o in by_ones.jobs
    ]
    assert by_auto.resizes == by_ones.resizes


def _two_types(fast_mem_mb: int = 10_000) -> Cluster:
    # K80 first (the reference), then V100: our relative speeds make the V100 faster
    return Cluster((
        Node("slow", 2, 10_000, gpu_model="K80"), Node("fast", 2, fast_mem_mb, gpu_model="V100"),
    ))  # fmt: skip


def test_on_mixed_gpu_types_a_start_goes_to_the_fastest_type_with_room() -> None:
    snap = snapshot(_two_types(), PERF, [pending("a", 100)])
    (blind,) = Auto(type_aware=False, tune_cpu_mem=False).decide(snap).starts
    assert blind == Genie().decide(snap).starts[0] and blind.gpu_ids[0] < 2  # the K80s
    (start,) = Auto().decide(snap).starts
    assert start.gpu_ids[0] in (2, 3)  # a V100
    # two 2-GPU gangs: one on each type, never across them
    two = snapshot(_two_types(), PERF, [pending("a", 100, gpus=2), pending("b", 200, gpus=2)])
    placed = {s.job_id: s.gpu_ids for s in Auto().decide(two).starts}
    assert sorted(placed.values()) == [(0, 1), (2, 3)]


def test_a_start_whose_memory_does_not_fit_the_faster_type_keeps_the_slower_one() -> None:
    # 1,000 MiB a GPU at its batch of 32, 177 MiB with the most accumulation (a sample
    # a step): the V100s here hold 100
    snap = snapshot(_two_types(fast_mem_mb=100), PERF, [pending("a", 100)])
    (start,) = Auto().decide(snap).starts
    assert start.gpu_ids[0] < 2


def test_a_start_keeps_its_gpus_on_a_cluster_of_one_type() -> None:
    snap = snapshot(cluster(2, 2), PERF, [pending("a", 100), pending("b", 50, gpus=2)])
    assert Auto().decide(snap).starts == Auto(type_aware=False).decide(snap).starts


def tuning() -> Auto:
    """``auto`` with its CPU and memory rule (rule 7, off by default)."""
    return Auto(tune_cpu_mem=True)


HUNGRY = TablePerf(demand={"a": CpuMemDemand(10.0, 100.0, 1.5)})


def test_a_start_gets_its_models_best_case_cpus_and_memory_where_the_node_has_room() -> None:
    # 24 CPUs and 500 GB for 4 GPUs: the share of one GPU is 6 CPUs and 125 GB
    node = cluster(1, 4, cpus=24, host_mem_gb=500)
    (start,) = Auto(tune_cpu_mem=True).decide(snapshot(node, HUNGRY, [pending("a", 100)])).starts
    assert (start.cpus, start.mem_gb) == (10.0, 100.0)
    # b's model gains nothing past 3 CPUs and 62.5 GB: it takes those, less than its share
    (small,) = tuning().decide(snapshot(node, HUNGRY, [pending("b", 100, model="b")])).starts
    assert (small.cpus, small.mem_gb) == (3.0, 62.5)
    assert Auto().decide(snapshot(node, HUNGRY, [pending("a", 100)])).starts[0].cpus is None


def test_a_running_job_above_its_share_drops_to_it_when_a_start_needs_the_room() -> None:
    node = cluster(1, 4, cpus=24, host_mem_gb=500)
    # r holds 20 CPUs on 3 GPUs (its share: 18); a new 1-GPU job needs its share of 6
    held = running("r", 5, (0, 1, 2), model="b", cpus=20.0, mem_gb=300.0)
    decision = Auto(preempt=False, tune_cpu_mem=True).decide(
        snapshot(node, HUNGRY, [pending("a", 100)], [held])
    )
    (lowered,) = decision.reallocations
    # at most its share in each dimension: its memory (300 GB, share 375) stays
    assert (lowered.job_id, lowered.cpus, lowered.mem_gb) == ("r", 18.0, 300.0)
    # 18 + a's best case of 10 = 28 > 24: a keeps its share (6 CPUs)
    (start,) = decision.starts
    assert start.gpu_ids == (3,) and start.cpus is None


def test_a_simulation_trains_a_progress_predictor_for_auto_only_when_some_job_is_elastic() -> (
    None
):
    rigid = [job("a"), job("b", submit=5.0)]
    elastic = [*rigid, replace(job("c", submit=9.0), min_gpus=1)]
    cl = cluster(1, 2)
    assert Simulator(cl, rigid, Auto(), PERF)._progress is None
    assert Simulator(cl, elastic, Auto(), PERF)._progress is not None
    assert Simulator(cl, rigid, Ones(), PERF)._progress is not None  # it sizes every job


def test_a_start_on_the_gpu_of_a_victim_with_its_own_allocation_is_counted_at_its_share() -> (
    None
):
    # 2 GPUs, 8 CPUs: a share of 4. r (long, 4 CPUs of its own) gives way to two short
    # jobs; a's best case (10, capped to 8) does not fit beside the other start's share
    node = cluster(1, 2, cpus=8, host_mem_gb=500)
    victim = running("r", 5000, (0,), model="b", cpus=4.0, mem_gb=100.0)
    snap = snapshot(node, HUNGRY, [pending("a", 10), pending("c", 20, model="b")], [victim])
    decision = Auto(tune_cpu_mem=True).decide(snap)
    assert [p.job_id for p in decision.preemptions] == ["r"]
    assert {s.job_id for s in decision.starts} == {"a", "c"}
    assert decision_problems(snap, decision) == []
    by_id = {s.job_id: s for s in decision.starts}
    assert by_id["a"].cpus is None  # its share: 4 + c's best case of 3 fit in 8
    assert by_id["c"].cpus == 3.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(job_strategy, min_size=2, max_size=16))
def test_auto_never_overcommits_a_nodes_cpus_or_memory_with_hungry_and_elastic_jobs(rows):
    # 16 CPUs and 250 GB for 4 GPUs (shares of 4 and 62.5); model a wants 9 and 80 a GPU,
    # so its best case leaves others less than their share unless someone gives way
    hungry = TablePerf(
        iter_s={"a": 1.0, "b": 1.0, "c": 2.0}, demand={"a": CpuMemDemand(9.0, 80.0, 1.5)}
    )
    cl = cluster(2, 4, gpu_mem_mb=16_000, cpus=16, host_mem_gb=250)
    # the simulator checks every decision and raises PolicyViolation on an overcommit
    result = simulate(cl, trace_of(rows), tuning(), hungry, config=SimConfig(restart_overhead_s=5))
    assert all(o.state in ("finished", "unschedulable") for o in result.jobs)


def test_an_elastic_job_grown_onto_a_node_makes_a_job_above_its_share_drop_to_it_first() -> (
    None
):
    # one node of 4 GPUs, 16 CPUs (a share of 4): h takes its best case of 9 CPUs; e
    # (elastic, on 1 GPU) is grown to 2 GPUs by the search, whose share (8) fits only
    # once h drops to its share: the drop is applied before the resize
    hungry = TablePerf(iter_s={"a": 1.0, "b": 1.0}, demand={"a": CpuMemDemand(9.0, 80.0, 1.5)})
    trace = [job("h", 0.0, 2000, model="a"), replace(job("e", 1.0, 1000, model="b"), min_gpus=1)]
    cl = cluster(1, 4, gpu_mem_mb=16_000, cpus=16, host_mem_gb=250)
    result = simulate(cl, trace, tuning(), hungry, config=SimConfig(restart_overhead_s=5))
    assert result.resizes == 1
    assert [(o.job_id, o.state) for o in result.jobs] == [("h", "finished"), ("e", "finished")]


def test_two_resizes_that_wait_on_each_other_fit_once_the_resized_jobs_drop_to_their_share() -> (
    None
):
    # j0 holds 9 of the node's 16 CPUs on GPU 0, j1 its share (4) on GPU 1. The search
    # grows j1 onto GPUs 2-3 and j0 onto GPUs 0-1: j0 must wait for j1 to leave GPU 1,
    # and j1's share of 8 fits only once j0 holds less than 9
    node = cluster(1, 4, cpus=16, host_mem_gb=250)
    j0 = _elastic(running("j0", 900, (0,), cpus=9.0, mem_gb=80.0))
    j1 = _elastic(running("j1", 900, (1,)))
    snap = replace(snapshot(node, HUNGRY, [], [j0, j1]), own_allocations=True)
    grown = Decision(resizes=(Resize("j1", (2, 3), 64), Resize("j0", (0, 1), 64)))
    assert decision_problems(snap, grown)  # as the search gave them
    tuned = with_cpu_mem(snap, grown)
    assert decision_problems(snap, tuned) == []
    assert [r.job_id for r in tuned.resizes] == ["j1", "j0"]
    assert [(r.job_id, r.cpus) for r in tuned.reallocations] == [("j0", 4.0)]
