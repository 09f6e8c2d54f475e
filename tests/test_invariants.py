"""Invariants on random traces, for every policy: no GPU double-booked beyond two jobs,
GPU memory never exceeded, gangs all-or-nothing, every schedulable job finishes, and
no job finishes faster than it would alone."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import POLICIES, RESIDENT_CAP_POLICIES, make_policy
from gpusched.services.scheduler.policies.base import Capabilities, Policy
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import TablePerf, cluster, job

PERF = TablePerf(
    iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
    mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
    slowdown={("a", "b"): 1.2, ("b", "a"): 1.6, ("c", "c"): 2.5},
    spread_penalty=1.3,
    accum_exponent=0.5,
)


@dataclass
class Audited:
    """Checks every decision against its snapshot, independently of the simulator."""

    inner: Policy
    decisions: int = 0
    #: jobs an elastic policy resized or started in a shape of its own: they may run on
    #: more GPUs than they asked for
    resized: set[str] = field(default_factory=set)
    #: the driver sees a plain policy: the queue in arrival order, nothing more declared
    queue_sort = None
    capabilities = Capabilities()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def preemptive(self) -> bool:
        return self.inner.preemptive

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.inner.decide(snapshot)
        self.decisions += 1
        self.resized.update(r.job_id for r in decision.resizes)
        load = list(snapshot.gpu_load)
        mem = list(snapshot.gpu_mem_used)
        jobs = {j.job_id: j for j in (*snapshot.running, *snapshot.pending)}
        for p in decision.preemptions:
            victim = jobs[p.job_id]
            assert victim.running
            per_gpu = PERF.gpu_memory_mb(
                victim.model, victim.batch_size / (victim.gpus * victim.accum_steps)
            )
            for g in victim.gpu_ids:
                load[g] -= 1
                mem[g] -= per_gpu
        for s in decision.starts:
            j = jobs[s.job_id]
            assert not j.running
            gpus, batch = j.gpus, j.batch_size
            if s.batch_size is not None:  # an elastic start: the shape the policy chose
                gpus, batch = len(s.gpu_ids), s.batch_size
                self.resized.add(s.job_id)
            assert len(set(s.gpu_ids)) == len(s.gpu_ids) == gpus, "gang is all-or-nothing"
            per_gpu = PERF.gpu_memory_mb(j.model, batch / (gpus * s.accum_steps))
            for g in s.gpu_ids:
                load[g] += 1
                mem[g] += per_gpu
                assert load[g] <= 2, f"GPU {g} holds {load[g]} jobs"
                assert mem[g] <= snapshot.cluster.gpu_mem_mb[g] + 1e-6, f"GPU {g} overcommitted"
                if load[g] == 2:
                    assert j.allow_sharing
        return decision


job_strategy = st.tuples(
    st.floats(min_value=0, max_value=500, allow_nan=False),  # submit
    st.integers(min_value=1, max_value=300),  # iterations
    st.sampled_from([1, 1, 1, 2, 3, 4, 8]),  # gpus
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([8, 32, 64, 256]),
    st.booleans(),
    st.sampled_from([False, False, True]),  # declares elastic bounds (1 GPU at least)
)


def trace_of(rows: list[tuple]) -> list[JobSpec]:
    """The jobs ``job_strategy``'s rows describe."""
    return [
        replace(
            job(f"j{i}", submit, iters, gpus=gpus, model=model, batch=max(batch, gpus),
                share=share),
            min_gpus=1 if elastic else None,
        )
        for i, (submit, iters, gpus, model, batch, share, elastic) in enumerate(rows)
    ]  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(job_strategy, min_size=1, max_size=25),
    nodes=st.integers(1, 3),
    policy_name=st.sampled_from(sorted(POLICIES)),
    cap=st.sampled_from([None, None, 1.3]),  # a resident slowdown cap (sharing policies)
)
def test_every_policy_keeps_the_cluster_invariants_and_finishes_every_schedulable_job(
    rows, nodes, policy_name, cap
):
    trace = trace_of(rows)
    audited = Audited(make_policy(policy_name, max_resident_slowdown=cap))
    cl = cluster(nodes, 4, gpu_mem_mb=16_000)
    result = simulate(cl, trace, audited, PERF, config=SimConfig(restart_overhead_s=5.0))
    assert len(result.jobs) == len(trace)
    for outcome in result.jobs:
        if outcome.gpus > cl.total_gpus:
            assert outcome.state == "unschedulable"
            continue
        assert outcome.state == "finished", (outcome.job_id, outcome.reason)
        assert outcome.jct_s is not None
        if outcome.job_id not in audited.resized:  # grown, it may beat its asked shape
            assert outcome.jct_s >= outcome.exclusive_s * (1 - 1e-9)
    assert 0.0 <= result.gpu_util <= 1.0 + 1e-9
    if not any(row[5] for row in rows) or policy_name not in RESIDENT_CAP_POLICIES:
        assert result.shared_pairs == 0


@settings(max_examples=10, deadline=None)
@given(
    rows=st.lists(job_strategy, min_size=1, max_size=20),
    seed_policy=st.sampled_from(sorted(POLICIES)),
)
def test_a_simulation_is_deterministic(rows, seed_policy):
    trace = trace_of(rows)
    first = simulate(cluster(2, 4), trace, make_policy(seed_policy), PERF)
    second = simulate(cluster(2, 4), trace, make_policy(seed_policy), PERF)
    assert first.jobs == second.jobs
