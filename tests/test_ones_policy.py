"""ONES: the population, caps, contiguous placement, elitism and determinism."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.decision import Decision, decision_problems
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.policies.ones import POPULATION, Ones
from gpusched.services.scheduler.simulator import SimConfig, simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot

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

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def preemptive(self) -> bool:
        return True

    queue_sort = None

    def decide(self, snap: Snapshot) -> Decision:
        for view in snap.pending:
            self.asked.setdefault(view.job_id, view.gpus)
        decision = self.inner.decide(snap)
        assert decision_problems(snap, decision) == []
        assert len(self.inner.population) == POPULATION
        for start in decision.starts:
            view = snap.job(start.job_id)
            # a new job starts on one GPU, a preempted one at half its last size
            half = max(1, view.gpus // 2)
            expected = 1 << (half.bit_length() - 1) if view.preemptions else 1
            assert len(start.gpu_ids) == expected
            assert _contiguous(start.gpu_ids)
            if start.batch_size is None:  # not an elastic start: the shape it asked for
                assert expected == view.gpus
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


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, nodes=st.integers(1, 2))
def test_every_decision_is_valid_capped_and_contiguous(rows, nodes):
    recorded = Recorded(Ones(min_run_s=30.0))
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


def test_every_new_job_starts_on_exactly_one_gpu_with_its_per_gpu_batch():
    snap = _busy_snapshot()
    policy = Ones()
    decision = policy.decide(snap)
    best = policy.population[0]
    # both new jobs hold one GPU in the best schedule; a start waits a decision when
    # its GPU is still let go by a job that changes size
    assert best.count("p0") == 1 and best.count("p1") == 1
    for job_id in ("p0", "p1"):
        started = [s for s in decision.starts if s.job_id == job_id]
        assert started or "changes size" in decision.why(job_id)
        for start in started:
            assert len(start.gpu_ids) == 1
            view = snap.job(job_id)
            per_gpu = view.batch_size // view.gpus
            assert start.batch_size == (None if view.gpus == 1 else per_gpu)


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
    """One job holds both nodes; spanning them costs it 1.3x per iteration. Counting the
    waiting jobs at one GPU, a schedule that shrinks it to one node and admits them is
    cheaper, so the search finds it; summing placed jobs only, it never would."""
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


def test_a_job_may_change_after_one_epoch_where_its_length_is_known():
    cl = cluster(1, 4)
    slow_epoch = replace(running("slow", 5000.0, (0,)), started_at=0.0, epoch_s=500.0)
    quick_epoch = replace(running("quick", 5000.0, (2,)), started_at=0.0, epoch_s=30.0)
    snap = snapshot(cl, PERF, [], [slow_epoch, quick_epoch], now=100.0)
    jobs, _, _ = Ones(min_run_s=60.0)._jobs(snap)
    kinds = {job.view.job_id: job.kind for job in jobs}
    assert kinds == {"slow": "frozen", "quick": "running"}


def test_a_search_that_changes_nothing_wakes_less_and_less_often():
    cl = cluster(1, 1)
    alone = replace(running("alone", 5000.0, (0,)), started_at=0.0)
    snap = snapshot(cl, PERF, [], [alone], now=1000.0)
    policy = Ones(min_run_s=10.0)
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
