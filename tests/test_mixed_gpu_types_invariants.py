"""Invariants on random traces and random clusters of several GPU types, for every
policy: no GPU double-booked beyond two jobs, GPU memory never exceeded, every gang on
GPUs of one type, every job that fits one type finishes (the others are refused as
unschedulable), and no job finishes faster than the fastest type allows."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision
from gpusched.libs.core.gpu_types import OUR_RELATIVE_SPEEDS
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import POLICIES, make_policy
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import cluster, job
from tests.test_invariants import PERF, Audited, job_strategy, trace_of

TYPES = ("V100", "P100", "K80")


class AuditedTypes(Audited):
    """``Audited``, and every start and resize on GPUs of one type."""

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = super().decide(snapshot)
        kinds = snapshot.cluster.gpu_type
        for placed in (*decision.starts, *decision.resizes):
            assert len({kinds[g] for g in placed.gpu_ids}) == 1, f"{placed} spans GPU types"
        return decision


def mixed_cluster(groups: list[tuple[int, int, str]]) -> Cluster:
    nodes: list[Node] = []
    for count, gpus, model in groups:
        nodes.extend(
            Node(f"n{len(nodes)}", gpus, 16_000, 4 * gpus, 62.5 * gpus, gpu_model=model)
            for _ in range(count)
        )
    return Cluster(tuple(nodes))


group_strategy = st.tuples(
    st.integers(1, 2), st.sampled_from([1, 2, 4]), st.sampled_from(TYPES)
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(job_strategy, min_size=1, max_size=20),
    groups=st.lists(group_strategy, min_size=2, max_size=4).filter(
        lambda g: len({model for *_, model in g}) > 1
    ),
    policy_name=st.sampled_from(sorted(POLICIES)),
)
def test_every_policy_keeps_gangs_on_one_gpu_type_and_finishes_every_job_that_fits_one(
    rows, groups, policy_name
):
    trace = trace_of(rows)
    cl = mixed_cluster(groups)
    assert cl.mixed
    audited = AuditedTypes(make_policy(policy_name))
    result = simulate(cl, trace, audited, PERF, config=SimConfig(restart_overhead_s=5.0))
    most_of_one_type = max(cl.type_gpus)
    speeds = [OUR_RELATIVE_SPEEDS[t.lower()] for t in cl.gpu_types]
    fastest = max(speeds) / speeds[0]  # against the reference type, the first
    for outcome in result.jobs:
        if outcome.gpus > most_of_one_type:
            assert outcome.state == "unschedulable", outcome
            continue
        assert outcome.state == "finished", (outcome.job_id, outcome.reason)
        assert outcome.jct_s is not None
        if outcome.job_id not in audited.resized:
            assert outcome.jct_s >= outcome.exclusive_s / fastest * (1 - 1e-9)
    assert result.gpu_hours_by_type is not None
    assert set(result.gpu_hours_by_type) == set(cl.gpu_types)
    assert all(hours >= 0 for hours in result.gpu_hours_by_type.values())


def test_a_cluster_of_one_named_type_is_not_mixed_and_reports_no_hours_by_type() -> None:
    cl = mixed_cluster([(2, 4, "K80")])
    result = simulate(cl, [job("a", gpus=2)], make_policy("fifo"), PERF)
    assert not cl.mixed
    assert result.gpu_hours_by_type is None
    assert "gpu_hours_by_type" not in result.summary()
    # and a job runs there as fast as on GPUs of no named type: no speed factor
    plain = simulate(cluster(2, 4, 16_000), [job("a", gpus=2)], make_policy("fifo"), PERF)
    assert result.jobs == plain.jobs
