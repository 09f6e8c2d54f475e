"""A snapshot's derived fields (``gpu_load``, ``gpu_mem_used``, ``node_free``, the nodes'
CPUs and memory, ``own_allocations``, ``prioritized``) have one definition,
``Snapshot.of_jobs``; the simulator keeps them job by job for speed, and must keep them
equal to it on every snapshot it gives a policy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import HostUse
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import POLICIES, make_policy
from gpusched.services.scheduler.simulation.simulator import SimConfig, Simulator
from tests.builders import TablePerf, cluster, pending, running

PERF = TablePerf(
    iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
    mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
    slowdown={("a", "b"): 1.2, ("b", "a"): 1.6, ("c", "c"): 2.5},
    spread_penalty=1.3,
    accum_exponent=0.5,
)


def assert_derived(snapshot: Snapshot, derived: Snapshot) -> None:
    assert snapshot.gpu_load == derived.gpu_load
    assert snapshot.node_free == derived.node_free
    assert snapshot.gpu_mem_used == pytest.approx(derived.gpu_mem_used, abs=1e-6)
    assert snapshot.node_cpus_used == pytest.approx(derived.node_cpus_used, abs=1e-6)
    assert snapshot.node_mem_used == pytest.approx(derived.node_mem_used, abs=1e-6)
    assert snapshot.own_allocations == derived.own_allocations
    # the simulator knows the whole trace: a priority among these jobs is one of it
    assert derived.prioritized is not None and snapshot.prioritized is not None
    assert snapshot.prioritized or not derived.prioritized


class CheckedSimulator(Simulator):
    """The simulator, checking every snapshot it builds against ``Snapshot.of_jobs``."""

    checked = 0

    def _snapshot(self, now: float) -> Snapshot:
        snapshot = super()._snapshot(now)
        derived = Snapshot.of_jobs(
            now, snapshot.cluster, snapshot.pending, snapshot.running, snapshot.estimates,
            memory=self.truth,  # the simulator sums memory with the ground truth
        )  # fmt: skip
        assert_derived(snapshot, derived)
        self.checked += 1
        return snapshot


job_strategy = st.tuples(
    st.floats(min_value=0, max_value=300, allow_nan=False),  # submit
    st.integers(min_value=1, max_value=200),  # iterations
    st.sampled_from([1, 1, 1, 2, 3, 4, 8]),  # gpus
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([8, 32, 64, 256]),
    st.booleans(),  # allow sharing
    st.sampled_from([0, 0, 0, 5, -5]),  # priority
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(job_strategy, min_size=1, max_size=16),
    nodes=st.integers(1, 3),
    policy_name=st.sampled_from(sorted(POLICIES)),
    round_s=st.sampled_from([None, 40.0]),
)
def test_the_simulators_incremental_fields_are_those_of_the_snapshot_constructor(
    rows, nodes, policy_name, round_s
):
    trace = [
        JobSpec(
            job_id=f"j{i}", submit_time=submit, model=model, gpus=gpus,
            batch_size=max(batch, gpus), iterations=iters, allow_sharing=share,
            priority=priority if policy_name != "ones" else 0, user=f"u{i % 2}",
        )
        for i, (submit, iters, gpus, model, batch, share, priority) in enumerate(rows)
    ]  # fmt: skip
    sim = CheckedSimulator(
        cluster(nodes, 4, gpu_mem_mb=16_000),
        trace,
        make_policy(policy_name),
        PERF,
        config=SimConfig(restart_overhead_s=5.0, round_s=round_s),
    )
    result = sim.run()
    assert len(result.jobs) == len(trace)
    assert sim.checked == result.decisions
    # and once every job has left, the upkeep is back to an idle cluster
    assert_derived(sim._snapshot(sim.clock), Snapshot.of_idle_cluster(sim.cluster, PERF))


def test_the_constructor_counts_residents_memory_idle_gpus_and_host_use_by_hand():
    cl = cluster(2, 2, gpu_mem_mb=16_000)  # GPUs 0, 1 on n0; 2, 3 on n1
    perf = TablePerf(mem_mb={"a": 1000.0, "b": 4000.0})
    shared_a = running("ra", 10.0, (0, 1), model="a", batch=128)  # 64 per GPU
    shared_b = running("rb", 10.0, (1,), model="b", batch=32, accum=4, cpus=3.0, mem_gb=7.0)
    queued = pending("q", 5.0, gpus=2)
    snap = Snapshot.of_jobs(12.0, cl, (queued,), (shared_a, shared_b), perf)
    a_mb = 1000.0 * (64 / 32) ** 0.5
    b_mb = 4000.0 * (8 / 32) ** 0.5
    assert snap.gpu_load == (1, 2, 0, 0)
    assert snap.gpu_mem_used == pytest.approx((a_mb, a_mb + b_mb, 0.0, 0.0))
    assert snap.node_free == (0, 2)
    assert snap.free_gpus == 2
    host = HostUse.of_jobs(cl, [((0, 1), None, None), ((1,), 3.0, 7.0)])
    assert snap.node_cpus_used == host.all_cpus()
    assert snap.node_mem_used == host.all_mem()
    assert snap.own_allocations is True
    assert snap.prioritized is False
    assert (snap.now, snap.pending, snap.running) == (12.0, (queued,), (shared_a, shared_b))


def test_prioritized_is_the_jobs_unless_the_driver_knows_more():
    cl = cluster(1, 2)
    urgent = Snapshot.of_jobs(0.0, cl, (pending("q", 5.0),), (), PERF, prioritized=True)
    assert urgent.prioritized is True
    view = pending("p", 5.0)
    ranked = replace(view, priority=3)
    assert Snapshot.of_jobs(0.0, cl, (ranked,), (), PERF).prioritized is True
    assert Snapshot.of_jobs(0.0, cl, (view,), (), PERF).prioritized is False


def test_an_idle_cluster_is_the_constructor_with_nothing_running():
    cl = cluster(2, 4)
    queue = (pending("q", 5.0),)
    idle = Snapshot.of_idle_cluster(cl, PERF, queue, now=3.0)
    assert idle == Snapshot.of_jobs(3.0, cl, queue, (), PERF)
    assert idle.gpu_load == (0,) * 8 and idle.node_free == (4, 4)
    assert idle.node_cpus_used == (0.0, 0.0) and idle.own_allocations is False


class UncachedComparingSimulator(Simulator):
    """The simulator, checking that every snapshot built from its kept tuples equals the
    one built with them dropped: a change of the queue, the running views or the GPUs'
    and nodes' figures that does not drop the tuple it touches shows up here."""

    checked = 0

    def _snapshot(self, now: float) -> Snapshot:
        kept = super()._snapshot(now)
        self._pending_tuples = self._running_tuple = self._cluster_tuples = None
        fresh = super()._snapshot(now)
        assert kept.pending == fresh.pending
        assert dict(kept.orders) == dict(fresh.orders)
        assert kept.running == fresh.running
        assert kept.running == tuple(self.running.values())
        assert kept.pending == self.queue.views(self.pending)
        assert (kept.gpu_load, kept.gpu_mem_used, kept.node_free) == (
            fresh.gpu_load, fresh.gpu_mem_used, fresh.node_free
        )
        assert (kept.node_cpus_used, kept.node_mem_used) == (
            fresh.node_cpus_used, fresh.node_mem_used
        )
        # each running job's kept shape (what its colocation slowdowns are looked up by)
        for job_id in self.running:
            job = self.jobs[job_id]
            assert job.shape == job.spec.shape(job.accum)
        self.checked += 1
        return kept


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(job_strategy, min_size=1, max_size=16),
    nodes=st.integers(1, 3),
    policy_name=st.sampled_from(sorted(POLICIES)),
    round_s=st.sampled_from([None, 40.0]),
)
def test_the_snapshot_tuples_kept_between_decisions_are_those_built_anew(
    rows, nodes, policy_name, round_s
):
    trace = [
        JobSpec(
            job_id=f"j{i}", submit_time=submit, model=model, gpus=gpus,
            batch_size=max(batch, gpus), iterations=iters, allow_sharing=share,
            priority=priority if policy_name != "ones" else 0, user=f"u{i % 2}",
        )
        for i, (submit, iters, gpus, model, batch, share, priority) in enumerate(rows)
    ]  # fmt: skip
    sim = UncachedComparingSimulator(
        cluster(nodes, 4, gpu_mem_mb=16_000),
        trace,
        make_policy(policy_name),
        PERF,
        config=SimConfig(restart_overhead_s=5.0, round_s=round_s),
    )
    result = sim.run()
    assert sim.checked == result.decisions
