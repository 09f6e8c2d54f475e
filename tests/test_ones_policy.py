"""ONES: the population, caps, contiguous placement, elitism and determinism."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.convergence import builtin_convergence
from gpusched.libs.core.decision import Decision, decision_problems
from gpusched.libs.core.placement import ContiguousGpus
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.policies.ones import POPULATION, Ones
from gpusched.services.scheduler.policies.ones_jobs import samples_at
from gpusched.services.scheduler.policies.ones_problem import NONE, SearchProblem
from gpusched.services.scheduler.policies.ones_repair import compacted
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import ConvergingPerf, TablePerf, cluster, job, pending, running, snapshot

PERF = TablePerf(
    iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
    mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
    spread_penalty=1.3,
)


@dataclass
class Recorded:
    """Checks every decision against its snapshot and keeps them."""

    inner: Ones
    asked: dict[str, int] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    #: the simulated time of every decision that ran a generation
    searched_at: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def preemptive(self) -> bool:
        return True

    queue_sort = None
    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        for view in snap.pending:
            self.asked.setdefault(view.job_id, view.gpus)
        generations = self.inner.generations
        decision = self.inner.decide(snap)
        if self.inner.generations > generations:
            self.searched_at.append(snap.now)
        assert decision_problems(snap, decision) == []
        assert len(self.inner.population) == POPULATION
        for start in decision.starts:
            view = snap.job(start.job_id)
            # a new job starts on exactly one GPU, a preempted one at half its last size
            # (without start_on_one_gpu: or on more, doubling, up to what it asked for)
            half = max(1, view.gpus // 2)
            smallest = 1 << (half.bit_length() - 1) if view.preemptions else 1
            n = len(start.gpu_ids)
            if self.inner.start_on_one_gpu:
                assert n == smallest
            assert n == smallest or smallest < n <= self.asked[start.job_id]
            assert n & (n - 1) == 0 or n == smallest
            assert _contiguous(start.gpu_ids)
            if start.batch_size is None:  # not an elastic start: the shape it asked for
                assert n == view.gpus
        for resize in decision.resizes:
            n, asked = len(resize.gpu_ids), self.asked[resize.job_id]
            assert _contiguous(resize.gpu_ids)
            assert n <= 4 * asked
            assert n & (n - 1) == 0  # on the doubling ladder from one GPU
        for job_id in (v.job_id for v in snap.pending):
            if job_id not in {s.job_id for s in decision.starts}:
                assert decision.why(job_id)
        self.decisions.append(decision)
        return decision


def _contiguous(ids: tuple[int, ...]) -> bool:
    return sorted(ids) == list(range(min(ids), max(ids) + 1))


rows = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=2000, allow_nan=False),
        st.integers(min_value=50, max_value=2000),
        st.sampled_from([1, 1, 1, 2, 4]),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([8, 32, 64]),
    ),
    min_size=1,
    max_size=20,
)


def _trace(rows):
    return [
        job(f"j{i}", submit, iters, gpus=gpus, model=model, batch=max(batch, gpus))
        for i, (submit, iters, gpus, model, batch) in enumerate(rows)
    ]


def test_ones_is_registered():
    assert isinstance(POLICIES["ones"](), Ones)


@pytest.mark.parametrize("start_on_one_gpu", [True, False])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, nodes=st.integers(1, 2))
def test_every_decision_is_valid_capped_and_contiguous(rows, nodes, start_on_one_gpu):
    recorded = Recorded(Ones(min_run_s=30.0, start_on_one_gpu=start_on_one_gpu))
    result = simulate(
        cluster(nodes, 4, gpu_mem_mb=16_000),
        _trace(rows),
        recorded,
        PERF,
        config=SimConfig(restart_overhead_s=5.0),
    )
    assert all(o.state == "finished" for o in result.jobs)
    assert result.shared_pairs == 0


@settings(max_examples=10, deadline=None)
@given(rows=rows, seed=st.integers(0, 3))
def test_the_same_seed_gives_the_same_decisions(rows, seed):
    runs = []
    for _ in range(2):
        recorded = Recorded(Ones(seed=seed, min_run_s=30.0))
        simulate(cluster(2, 4), _trace(rows), recorded, PERF)
        runs.append([(d.starts, d.preemptions, d.resizes) for d in recorded.decisions])
    assert runs[0] == runs[1]


def _busy_snapshot() -> Snapshot:
    cl = cluster(2, 4, gpu_mem_mb=16_000)
    run = [
        running("r0", 500.0, (0,), model="a"),
        running("r1", 80.0, (1, 2), model="b"),
        running("r2", 2000.0, (4,), model="c"),
    ]
    wait = [pending("p0", 300.0), pending("p1", 50.0, gpus=2, model="b")]
    return snapshot(cl, PERF, wait, run, now=1000.0)


def test_every_new_job_starts_on_exactly_one_gpu_at_its_per_gpu_batch():
    snap = _busy_snapshot()
    policy = Ones(seed=3)
    decision = policy.decide(snap)
    assert policy.population[0].count("p0") == 1 and policy.population[0].count("p1") == 1
    for job_id in ("p0", "p1"):
        started = [s for s in decision.starts if s.job_id == job_id]
        assert started or "changes size" in decision.why(job_id)
        for start in started:
            view = snap.job(job_id)
            assert len(start.gpu_ids) == 1
            per_gpu = view.batch_size // view.gpus
            assert start.batch_size == (None if view.gpus == 1 else per_gpu)


def test_starting_at_the_ask_a_new_job_gets_one_gpu_up_to_what_it_asked_for():
    snap = _busy_snapshot()
    policy = Ones(start_on_one_gpu=False)
    decision = policy.decide(snap)
    best = policy.population[0]
    # both new jobs are placed in the best schedule, on one GPU up to what they asked
    # for; a start waits a decision when its GPUs are still let go by a job that
    # changes size
    assert best.count("p0") == 1 and best.count("p1") in (1, 2)
    for job_id in ("p0", "p1"):
        started = [s for s in decision.starts if s.job_id == job_id]
        assert started or "changes size" in decision.why(job_id)
        for start in started:
            view = snap.job(job_id)
            n = len(start.gpu_ids)
            assert n in (1, 2) and n <= view.gpus
            per_gpu = view.batch_size // view.gpus
            assert start.batch_size == (None if n == view.gpus else per_gpu * n)


@pytest.mark.parametrize(("start_on_one_gpu", "gpus", "batch"), [(True, 1, 16), (False, 4, None)])
def test_a_new_job_asking_for_four_idle_gpus_starts_on_one_or_on_the_four(
    start_on_one_gpu: bool, gpus: int, batch: int | None
):
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    snap = snapshot(cl, PERF, [pending("p0", 300.0, gpus=4, model="b", batch=64)], [])
    decision = Ones(start_on_one_gpu=start_on_one_gpu).decide(snap)
    assert [(s.job_id, len(s.gpu_ids), s.batch_size) for s in decision.starts] == [
        ("p0", gpus, batch)
    ]


def test_the_best_fitness_never_gets_worse_on_a_fixed_snapshot():
    policy = Ones(seed=7)
    snap = _busy_snapshot()
    best = []
    for _ in range(15):
        assert decision_problems(snap, policy.decide(snap)) == []
        assert len(policy.population) == POPULATION
        best.append(policy.best_fitness)
    assert all(b <= a + 1e-9 for a, b in pairwise(best))


def test_a_job_that_changed_recently_is_left_alone():
    cl = cluster(1, 4)
    snap = snapshot(cl, PERF, [pending("p0", 100.0)], [running("r0", 500.0, (0,))], now=10.0)
    decision = Ones(min_run_s=60.0).decide(snap)
    assert decision.resizes == () and decision.preemptions == ()


def test_a_job_grown_over_the_whole_cluster_gives_way_to_new_jobs():
    """One job holds both nodes; spanning them costs it 1.3x per iteration. Admitting
    the waiting jobs adds their finishing rates, which outweighs what the big job loses
    on one node, so the search finds that schedule; summing placed jobs' remaining
    GPU-seconds, as ONES does, it never would."""
    cl = cluster(2, 4, gpu_mem_mb=16_000)
    big = running("big", 5000.0, tuple(range(8)), model="a", batch=256)
    waiting = [pending("p0", 6000.0), pending("p1", 6000.0)]
    snap = snapshot(cl, PERF, waiting, [big], now=1000.0)
    policy = Ones(seed=3)
    for _ in range(10):
        policy.decide(snap)
    best = policy.population[0]
    assert "p0" in best and "p1" in best
    assert best.count("big") == 4


def test_a_job_may_change_after_one_epoch_or_min_run_s_whichever_comes_first():
    cl = cluster(1, 4)
    slow_epoch = replace(running("slow", 5000.0, (0,)), started_at=0.0, epoch_s=500.0)
    quick_epoch = replace(running("quick", 5000.0, (2,)), started_at=0.0, epoch_s=30.0)
    snap = snapshot(cl, PERF, [], [slow_epoch, quick_epoch], now=100.0)
    jobs, _, _ = Ones(min_run_s=200.0)._jobs(snap)
    kinds = {job.view.job_id: job.kind for job in jobs}
    assert kinds == {"slow": "frozen", "quick": "running"}
    # an epoch longer than min_run_s waits min_run_s only
    jobs, _, _ = Ones(min_run_s=60.0)._jobs(snap)
    assert {job.kind for job in jobs} == {"running"}


def test_a_search_that_changes_nothing_wakes_less_and_less_often():
    cl = cluster(1, 1)
    alone = replace(running("alone", 5000.0, (0,)), started_at=0.0)
    snap = snapshot(cl, PERF, [], [alone], now=1000.0)
    # a generation at every decision: a search interval would space them out instead
    policy = Ones(min_run_s=10.0, search_interval_s=0)
    gaps = []
    for _ in range(8):
        decision = policy.decide(snap)
        assert decision.wake_at is not None
        gaps.append(decision.wake_at - snap.now)
    assert gaps[:3] == [10.0, 10.0, 10.0]
    assert gaps[3:] == [10.0 * 2**k for k in range(1, 6)]


def test_a_queued_job_beyond_the_window_waits_with_its_reason_and_starts_once_inside():
    cl = cluster(1, 4)
    busy = running("r0", 5000.0, (0,))
    queue = [pending(f"p{k}", 300.0, submit=float(k)) for k in range(6)]
    policy = Ones(min_run_s=600.0, queue_margin=1)
    # 3 idle GPUs + margin 1: the search sees p0-p3; p4 and p5 wait behind the window
    decision = policy.decide(snapshot(cl, PERF, queue, [busy], now=10.0))
    assert decision_problems(snapshot(cl, PERF, queue, [busy], now=10.0), decision) == []
    assert {s.job_id for s in decision.starts} == {"p0", "p1", "p2"}
    assert "waits behind the first 4 queued jobs" in decision.why("p4")
    assert "waits behind" not in decision.why("p3")
    # p0-p3 have gone; p4 enters the window and starts on one GPU
    later = snapshot(cl, PERF, queue[4:], [busy], now=20.0)
    decision = policy.decide(later)
    assert decision_problems(later, decision) == []
    assert [len(s.gpu_ids) for s in decision.starts if s.job_id == "p4"] == [1]


def test_every_job_finishes_when_the_queue_is_longer_than_the_window():
    trace = [job(f"j{k}", 0.0, 100 + 37 * k, gpus=1 + k % 2, model="ab"[k % 2]) for k in range(12)]
    recorded = Recorded(Ones(min_run_s=30.0, queue_margin=0))
    result = simulate(cluster(1, 2, gpu_mem_mb=16_000), trace, recorded, PERF)
    assert all(o.state == "finished" for o in result.jobs)
    assert any("waits behind the first" in d.default_reason for d in recorded.decisions)


def test_a_negative_queue_margin_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="queue_margin"):
        Ones(queue_margin=-1)


def test_a_long_job_grown_past_what_it_asked_for_gives_the_growth_to_a_short_one():
    """Fitness is the rate at which the placed jobs finish: a short job doubled
    finishes far sooner than the long one loses on the one GPU it asked for. Padding
    fills every job to what it asked for first, so the long job keeps that GPU."""
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    policy = Ones(seed=1)
    policy.decide(snapshot(cl, PERF, [pending("long", 10_000.0)], []))
    run = [
        running("long", 10_000.0, (0, 1), batch=64, as_of=1000.0),
        running("s1", 400.0, (2,), as_of=1000.0),
        running("s2", 400.0, (3,), as_of=1000.0),
    ]
    snap = snapshot(cl, PERF, [], run, now=1000.0)
    for _ in range(10):
        assert decision_problems(snap, policy.decide(snap)) == []
    best = policy.population[0]
    assert best.count("long") == 1
    assert sorted((best.count("s1"), best.count("s2"))) == [1, 2]


def test_a_job_with_less_left_than_a_restart_keeps_its_size():
    cl = cluster(1, 2, gpu_mem_mb=16_000)
    snap = snapshot(cl, PERF, [], [running("short", 20.0, (0,), as_of=1000.0)], now=1000.0)
    assert Ones(restart_s=30.0).decide(snap).resizes == ()
    grown = Ones(restart_s=0.0).decide(snap).resizes
    assert [(r.job_id, len(r.gpu_ids)) for r in grown] == [("short", 2)]


def test_a_larger_batch_needs_more_samples_where_the_convergence_curve_says_so():
    curve = builtin_convergence("cifar10")
    assert curve is not None
    view = running("c", 1000.0, (0,), model="cifar10", batch=128)
    samples = 1_000_000.0
    assert samples_at({}, curve, view, samples, 128) == samples
    larger = samples_at({}, curve, view, samples, 4096)
    smaller = samples_at({}, curve, view, samples, 64)
    assert larger > samples * 1.2
    assert smaller == pytest.approx(samples)  # below the smallest profiled batch
    # the job's own estimate scales what is left, the curve only the batch's cost
    assert samples_at({}, curve, view, 2 * samples, 4096) == pytest.approx(2 * larger)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_restart_cost_that_is_negative_or_not_finite_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="restart_s"):
        Ones(restart_s=bad)


def test_a_preempted_job_grown_past_what_it_asked_for_restarts_at_half_its_size():
    cl = cluster(1, 8, gpu_mem_mb=16_000)
    policy = Ones()
    policy.decide(snapshot(cl, PERF, [pending("p", 1000.0, gpus=2, batch=64)], []))
    # it grew to 8 GPUs and was preempted: it comes back on 4, more than the 2 it asked
    again = replace(pending("p", 1000.0, gpus=8, batch=256), preemptions=1)
    snap = snapshot(cl, PERF, [again], [])
    decision = policy.decide(snap)
    assert decision_problems(snap, decision) == []
    assert [(s.job_id, len(s.gpu_ids)) for s in decision.starts] == [("p", 4)]


def test_the_gpus_a_restart_leaves_idle_are_charged_against_the_whole_schedule():
    """A job with hundreds of hours left loses nothing by a 30 s restart of its own, so
    the fitness also takes off the share of the cluster's GPU time over ``min_run_s``
    that the restarting GPUs stand idle."""
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    run = [
        running("long", 1e6, (0, 1), batch=64, as_of=1000.0),
        running("short", 1000.0, (2,), as_of=1000.0),
    ]
    snap = snapshot(cl, PERF, [], run, now=1000.0)
    policy = Ones(restart_s=30.0, min_run_s=120.0)
    jobs, _, _ = policy._jobs(snap)
    problem = SearchProblem(snap, jobs, policy.restart_s)
    at = {job.view.job_id: job.cost for job in jobs}
    stay = problem.occupancy.copy()
    assert policy._fitness(problem, stay) == pytest.approx(
        -(1 / at["long"][2][0] + 1 / at["short"][1][0])
    )
    # the long job shrinks to one GPU, the short one grows onto it and the idle GPU:
    # both restart, 2 + 2 GPUs idle for 30 s of the 4 GPUs' 120 s
    moved = np.array([0, 1, 1, NONE])
    rate = 1 / (at["long"][1][0] + 30.0) + 1 / (at["short"][2][0] + 30.0)
    assert policy._fitness(problem, moved) == pytest.approx(-rate * (1 - 30.0 * 4 / (4 * 120.0)))


def test_a_job_starts_and_grows_at_the_batch_its_convergence_curve_makes_fastest():
    """Where the model's convergence curve is known, the batch at each GPU count is the
    one with the least predicted remaining time among per-GPU batches from a quarter to
    8x the asked one (here the iteration time does not grow with the batch, so the
    largest wins); a job keeps its batch while it keeps its size."""
    curve = builtin_convergence("cifar10")
    assert curve is not None
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": curve})
    cl = cluster(1, 2, gpu_mem_mb=64_000)
    new = snapshot(cl, perf, [pending("p", 5000.0, batch=128)], [])
    (start,) = Ones().decide(new).starts
    assert (len(start.gpu_ids), start.batch_size) == (1, 1024)
    (plain,) = Ones(batch_search=False).decide(new).starts
    assert (len(plain.gpu_ids), plain.batch_size) == (1, None)
    grown = snapshot(cl, perf, [], [running("r", 5000.0, (0,), batch=128)], now=1000.0)
    policy = Ones()
    policy.decide(snapshot(cl, perf, [pending("r", 5000.0, batch=128)], []))
    (resize,) = policy.decide(grown).resizes
    assert (len(resize.gpu_ids), resize.batch_size) == (2, 2048)
    jobs, _, _ = policy._jobs(grown)
    assert jobs[0].cost[1][2] == 128


def test_a_job_that_grows_where_no_free_block_holds_it_moves_a_job_that_keeps_its_size():
    """GPUs 0, 5, 6 and 7 are idle and "a" (on 2-3) grows to four: no free block of four
    holds it, so the jobs are laid out again, largest first, each as near its GPUs as
    it can be; "c" moves at its size, and the fitness charges it a restart."""
    cl = cluster(1, 8, gpu_mem_mb=16_000)
    run = [
        running("a", 1000.0, (2, 3), batch=64, as_of=1000.0),
        running("b", 1000.0, (4,), as_of=1000.0),
        running("c", 1000.0, (1,), as_of=1000.0),
    ]
    snap = snapshot(cl, PERF, [], run, now=1000.0)
    policy = Ones(restart_s=30.0)
    jobs, _, _ = policy._jobs(snap)
    assert [j.view.job_id for j in jobs] == ["a", "b", "c"] and 4 in jobs[0].sizes
    problem = SearchProblem(snap, jobs, policy.restart_s)
    laid = policy._layout(problem, np.array([4, 1, 1]))
    assert laid.tolist()[:4] == [0, 0, 0, 0]
    assert laid[4] == 1 and list(laid).count(2) == 1 and laid[1] != 2
    moved_only_c = problem.occupancy.copy()
    moved_only_c[1], moved_only_c[5] = NONE, 2
    at = {job.view.job_id: job.cost for job in jobs}
    rate = 1 / at["a"][2][0] + 1 / at["b"][1][0] + 1 / (at["c"][1][0] + 30.0)
    share = 1 - 30.0 * 1 / (8 * policy.min_run_s)
    assert policy._fitness(problem, moved_only_c) == pytest.approx(-rate * share)


def _compacted_block_by_block(
    policy: Ones, p: SearchProblem, size: np.ndarray
) -> np.ndarray | None:
    """``ones_repair.compacted`` as its rule reads: every job's block from
    ``ContiguousGpus.best_block``."""
    placed = np.flatnonzero((size > 0) & ~p.frozen)
    placed = placed[np.lexsort((p.id_rank[placed], -size[placed]))].tolist()
    for keep_own in (True, False):
        again = np.where(np.append(p.frozen, False)[p.occupancy], p.occupancy, NONE)
        line = ContiguousGpus(p.cluster, again, p.node_of)
        for i in placed:
            n = int(size[i])
            own = p.own(i) if keep_own and p.jobs[i].view.gpu_ids else None
            block = line.best_block(n, own)
            if block is None:
                break
            line.take_block(block, n, i)
        else:
            return again
    return None


@settings(max_examples=150, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1, 1, 2, 4])), max_size=10),
    queued=st.integers(0, 8),
    picks=st.lists(st.integers(0, 8), min_size=16, max_size=16),
)
def test_laying_every_job_out_again_takes_the_blocks_a_block_by_block_search_takes(
    layout, queued, picks
):
    """The re-layout's shortcuts (a job's own free block, one-GPU jobs from a heap of free
    runs) choose what ``ContiguousGpus.best_block`` chooses for every job in turn."""
    cl = cluster(2, 8, gpu_mem_mb=64_000)
    run, gpu = [], 0
    for k, (gap, n) in enumerate(layout):
        gpu += gap
        if gpu + n > cl.total_gpus:
            break
        run.append(running(f"r{k}", 1000.0 * (k + 1), tuple(range(gpu, gpu + n)),
                           batch=64, as_of=1000.0))  # fmt: skip
        gpu += n
    waiting = [pending(f"q{k}", 500.0 * (k + 1)) for k in range(queued)]
    snap = snapshot(cl, PERF, waiting, run, now=1000.0)
    policy = Ones(restart_s=30.0)
    jobs, _, _ = policy._jobs(snap)
    problem = SearchProblem(snap, jobs, policy.restart_s)
    size, free = np.zeros(len(jobs), dtype=np.int64), problem.total
    for i, seen in enumerate(jobs):
        options = [0] + [n for n in seen.sizes if n <= free]
        size[i] = seen.current if seen.kind == "frozen" else options[picks[i] % len(options)]
        free -= int(size[i])
    if free < 0:
        return  # frozen jobs alone hold more than the draw left: not a layout to check
    sentinel = problem.occupancy.copy()
    expected = _compacted_block_by_block(policy, problem, size)
    laid = compacted(policy, problem, size, sentinel)
    if expected is None:
        assert laid is sentinel
    else:
        assert laid.tolist() == expected.tolist()


# ---- the search interval ------------------------------------------------------------


@pytest.mark.parametrize("interval", [30.0, 120.0, 600.0])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows)
def test_with_an_interval_generations_run_at_most_once_per_interval_of_simulated_time(
    rows, interval
):
    recorded = Recorded(Ones(min_run_s=30.0, search_interval_s=interval))
    result = simulate(cluster(2, 4, gpu_mem_mb=16_000), _trace(rows), recorded, PERF)
    assert all(o.state == "finished" for o in result.jobs)
    assert recorded.searched_at  # the first decision runs one
    assert all(b >= a + interval for a, b in pairwise(recorded.searched_at))


def test_between_generations_a_new_job_goes_onto_an_idle_gpu_of_the_kept_best_individual():
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    policy = Ones(min_run_s=60.0, search_interval_s=600.0)
    first = policy.decide(snapshot(cl, PERF, [pending("a", 5000.0, gpus=2)], []))
    (start,) = first.starts
    assert policy.generations == 1
    on = replace(running("a", 5000.0, start.gpu_ids), started_at=0.0)
    later = snapshot(cl, PERF, [pending("b", 1000.0, submit=10.0)], [on], now=10.0)
    decision = policy.decide(later)
    assert policy.generations == 1  # padded, not searched
    assert decision_problems(later, decision) == []
    (placed,) = decision.starts
    assert placed.job_id == "b" and len(placed.gpu_ids) == 1
    assert set(placed.gpu_ids).isdisjoint(start.gpu_ids)
    assert not decision.resizes and not decision.preemptions
    best = policy.population[0]
    assert [best[g] for g in placed.gpu_ids] == ["b"]
    assert [best[g] for g in start.gpu_ids] == ["a"]
    # the next generation waits for the interval: a wake-up then, not before
    assert decision.wake_at is not None and decision.wake_at >= 600.0


def test_between_generations_an_idle_gpu_goes_to_the_running_jobs_in_padding_order():
    """Two running jobs past their gate and two idle GPUs: the one with less predicted
    remaining time on one GPU doubles first, onto the idle block beside it; the other
    finds nothing left."""
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    policy = Ones(min_run_s=60.0, search_interval_s=600.0)
    jobs = [pending("short", 1000.0), pending("long", 8000.0)]
    first = policy.decide(snapshot(cl, PERF, jobs, []))
    assert policy.generations == 1
    gpus = {s.job_id: s.gpu_ids for s in first.starts}
    assert len(gpus) == 2 and all(len(g) == 1 for g in gpus.values())
    views = [
        replace(running(j, r, gpus[j]), started_at=0.0)
        for j, r in (("short", 900.0), ("long", 7900.0))
    ]
    # the two idle GPUs are the ones the search left idle (repair pads them too, so
    # free two by hand: the jobs run on one GPU each at 100 s, past their 60 s gate)
    later = snapshot(cl, PERF, [], views, now=100.0)
    decision = policy.decide(later)
    assert policy.generations == 1
    assert decision_problems(later, decision) == []
    (grown,) = decision.resizes
    assert grown.job_id == "short" and len(grown.gpu_ids) == 2
    assert set(gpus["short"]) <= set(grown.gpu_ids)
    assert [policy.population[0][g] for g in grown.gpu_ids] == ["short", "short"]


def test_interval_zero_gives_the_decisions_of_a_generation_at_every_decision():
    """A small simulation's per-job outcomes with ``search_interval_s=0``, stored from
    the policy as it was before the interval existed."""
    curve = builtin_convergence("cifar10")
    perf = ConvergingPerf(
        iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
        mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
        spread_penalty=1.3,
        curves={"c": curve},
    )
    trace = [
        job(
            f"j{i:02d}",
            (i * 37) % 900 + i * 11.0,
            200 + (i * 131) % 1700,
            gpus=[1, 2, 4, 1, 8][i % 5],
            model=["a", "b", "c"][i % 3],
            batch=[32, 64, 128][i % 3],
        )
        for i in range(40)
    ]
    result = simulate(
        cluster(2, 8, gpu_mem_mb=16_000),
        trace,
        Ones(seed=1, min_run_s=60.0, search_interval_s=0),
        perf,
        config=SimConfig(restart_overhead_s=10.0),
    )
    got = {o.job_id: round(o.jct_s, 6) for o in result.jobs}
    assert got == STORED_JCT
    assert (result.resizes, result.preemptions) == (69, 6)


@pytest.mark.parametrize("name", ["search_interval_s", "search_s_per_gpu"])
@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_search_interval_that_is_negative_or_not_finite_is_refused_naming_the_field(name, bad):
    with pytest.raises(ValueError, match=name):
        Ones(**{name: bad})


def test_by_default_the_search_interval_is_one_second_per_gpu_of_the_cluster():
    assert Ones().interval_s(snapshot(cluster(16, 4), PERF)) == 64.0
    assert Ones(search_interval_s=0).interval_s(snapshot(cluster(16, 4), PERF)) == 0.0


def test_the_search_interval_scales_with_time():
    assert Ones(search_interval_s=300.0).scaled(0.01).search_interval_s == pytest.approx(3.0)
    assert Ones().scaled(0.01).search_s_per_gpu == pytest.approx(0.01)


STORED_JCT = {
    "j00": 220.0,
    "j01": 175.5,
    "j02": 218.800281,
    "j03": 613.0,
    "j04": 382.0,
    "j05": 176.4794,
    "j06": 996.0,
    "j07": 578.5,
    "j08": 358.375581,
    "j09": 3234.429307,
    "j10": 1010.5,
    "j11": 1936.562984,
    "j12": 3080.235733,
    "j13": 101.5,
    "j14": 651.665395,
    "j15": 487.375581,
    "j16": 319.0,
    "j17": 1405.541114,
    "j18": 938.0,
    "j19": 1093.0,
    "j20": 665.619111,
    "j21": 1627.138354,
    "j22": 986.71649,
    "j23": 744.138354,
    "j24": 3322.2071,
    "j25": 977.889505,
    "j26": 110.389505,
    "j27": 383.0,
    "j28": 248.389505,
    "j29": 2213.972754,
    "j30": 776.0,
    "j31": 609.5,
    "j32": 2030.0071,
    "j33": 1216.0,
    "j34": 672.0,
    "j35": 541.71649,
    "j36": 1945.375581,
    "j37": 1225.414042,
    "j38": 930.235733,
    "j39": 531.0,
}
