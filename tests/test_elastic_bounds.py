"""Elastic bounds (min_gpus/max_gpus, min_batch_size/max_batch_size): checked where a
job is declared (job spec, native trace), carried into the policy's view, and kept by
ONES, which sizes a job that declares bounds only within them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.decision import Decision, decision_problems
from gpusched.libs.core.elastic import BOUND_FIELDS, Elastic, bounds_problem
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.snapshot import Snapshot
from gpusched.libs.core.traces import TraceError, TraceJob, load_trace, write_native
from gpusched.libs.core.workload import materialize
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.policies.ones import Ones
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import TablePerf, cluster, pending, snapshot

PERF = TablePerf(
    iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
    mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
    spread_penalty=1.3,
)


# ------------------------------------------------------------------ declaring bounds


def test_a_job_that_declares_no_bound_is_not_elastic():
    assert JobSpec("j", 0.0, "a", 2, 64, 10.0).elastic is None


def test_a_job_that_declares_one_bound_is_elastic_with_the_others_open():
    spec = JobSpec("j", 0.0, "a", 2, 64, 10.0, max_gpus=8)
    assert spec.elastic == Elastic(min_gpus=1, max_gpus=8, min_batch_size=1)
    assert spec.elastic.allows(8, 4096) and not spec.elastic.allows(16, 64)


@pytest.mark.parametrize(
    ("bounds", "field_name", "words"),
    [
        ({"min_gpus": 0}, "min_gpus", "min_gpus must be >= 1"),
        ({"min_gpus": 4, "max_gpus": 2}, "min_gpus", "min_gpus 4 is above max_gpus 2"),
        ({"min_gpus": 4}, "min_gpus", "min_gpus 4 is above gpus 2"),
        ({"max_gpus": 1}, "max_gpus", "max_gpus 1 is below gpus 2"),
        ({"min_batch_size": 128}, "min_batch_size", "min_batch_size 128 is above batch_size 64"),
        ({"max_batch_size": 32}, "max_batch_size", "max_batch_size 32 is below batch_size 64"),
    ],
)
def test_bad_bounds_give_an_error_naming_the_field(bounds, field_name, words):
    named, problem = bounds_problem(2, 64, *(bounds.get(name) for name in BOUND_FIELDS)) or ("", "")
    assert named == field_name and problem.startswith(words)
    with pytest.raises(ValueError, match=words):
        JobSpec("j", 0.0, "a", 2, 64, 10.0, **bounds)


def test_a_native_trace_reads_and_writes_the_gpu_bounds(tmp_path: Path):
    jobs = [
        TraceJob("e", 0.0, 2, "a", 64, iterations=10, min_gpus=1, max_gpus=8),
        TraceJob("f", 1.0, 1, "a", 32, iterations=10),
    ]
    for name in ("t.csv", "t.jsonl"):
        write_native(tmp_path / name, jobs)
        back = load_trace(tmp_path / name, "native").jobs
        assert [(j.min_gpus, j.max_gpus) for j in back] == [(1, 8), (None, None)]


def test_a_native_row_with_crossed_gpu_bounds_names_the_field_and_line(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_time,gpus,iterations,min_gpus,max_gpus\nx,0,2,5,4,8\n")
    with pytest.raises(TraceError, match=r"t.csv:2: field 'min_gpus': min_gpus 4 is above gpus 2"):
        load_trace(path, "native")


def test_materialize_carries_the_bounds_and_moves_a_default_batch_into_them():
    trace = [TraceJob("e", 0.0, 2, "a", None, iterations=10, max_gpus=4, min_batch_size=100)]
    (spec,) = materialize(trace, PERF, seed=0)
    assert spec.elastic == Elastic(1, 4, 100, None)
    assert spec.batch_size == 100  # the model's default (32) is below the declared minimum


# ------------------------------------------------------------------ the policy's view


def test_the_simulator_gives_a_policy_the_bounds_a_job_declares():
    seen: dict[str, Elastic | None] = {}

    @dataclass
    class Looking:
        name = "looking"
        preemptive = False
        queue_sort = None
        capabilities = Capabilities()

        def decide(self, snap: Snapshot) -> Decision:
            for view in snap.pending:
                seen[view.job_id] = view.elastic
            return Decision()

    jobs = [JobSpec("e", 0.0, "a", 1, 32, 5.0, max_gpus=4), JobSpec("f", 0.0, "a", 1, 32, 5.0)]
    simulate(cluster(1, 4), jobs, Looking(), PERF)  # type: ignore[arg-type]
    assert seen == {"e": Elastic(1, 4, 1, None), "f": None}


# ------------------------------------------------------------------ ONES keeps them


@dataclass
class Bounded:
    """ONES, with every decision checked: each start and resize of a job that declares
    bounds is within them."""

    inner: Ones
    bounds: dict[str, Elastic] = field(default_factory=dict)
    sized: int = 0

    @property
    def name(self) -> str:
        return self.inner.name

    preemptive = True
    queue_sort = None
    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        decision = self.inner.decide(snap)
        assert decision_problems(snap, decision) == []
        for start in decision.starts:
            view = snap.job(start.job_id)
            batch = view.batch_size if start.batch_size is None else start.batch_size
            self._check(start.job_id, len(start.gpu_ids), batch)
        for resize in decision.resizes:
            self._check(resize.job_id, len(resize.gpu_ids), resize.batch_size)
        return decision

    def _check(self, job_id: str, gpus: int, batch: int) -> None:
        bounds = self.bounds.get(job_id)
        if bounds is not None:
            self.sized += 1
            assert bounds.allows(gpus, batch), (job_id, gpus, batch, bounds)


@st.composite
def elastic_jobs(draw: st.DrawFn) -> list[JobSpec]:
    jobs = []
    for i in range(draw(st.integers(1, 14))):
        gpus = draw(st.sampled_from([1, 1, 2, 4]))
        batch = draw(st.sampled_from([8, 32, 64])) * gpus
        declared: dict[str, int | None] = {}
        if draw(st.booleans()):
            declared = {
                "min_gpus": draw(st.none() | st.integers(1, gpus)),
                "max_gpus": draw(st.none() | st.integers(gpus, 8)),
                "min_batch_size": draw(st.none() | st.integers(max(1, batch // 4), batch)),
                "max_batch_size": draw(st.none() | st.integers(batch, batch * 4)),
            }
        jobs.append(
            JobSpec(
                f"j{i}",
                draw(st.floats(0, 1500, allow_nan=False)),
                draw(st.sampled_from(["a", "b", "c"])),
                gpus,
                batch,
                float(draw(st.integers(50, 2000))),
                **declared,
            )
        )
    return jobs


@pytest.mark.parametrize("start_on_one_gpu", [True, False])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=elastic_jobs(), nodes=st.integers(1, 2), seed=st.integers(0, 3))
def test_ones_never_sizes_a_job_outside_the_bounds_it_declares(
    jobs: list[JobSpec], nodes: int, seed: int, start_on_one_gpu: bool
):
    policy = Bounded(Ones(seed=seed, min_run_s=30.0, start_on_one_gpu=start_on_one_gpu))
    policy.bounds = {j.job_id: j.elastic for j in jobs if j.elastic is not None}
    result = simulate(
        cluster(nodes, 4, gpu_mem_mb=16_000),
        jobs,
        policy,  # type: ignore[arg-type]
        PERF,
        config=SimConfig(restart_overhead_s=5.0),
    )
    assert all(o.state == "finished" for o in result.jobs)


def test_ones_starts_a_job_at_its_declared_minimum_rather_than_on_one_gpu():
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    view = pending("p0", 300.0, gpus=4, model="b", batch=64)
    bounded = snapshot(cl, PERF, [_with(view, Elastic(min_gpus=2))], [])
    free = snapshot(cl, PERF, [view], [])
    assert [len(s.gpu_ids) for s in Ones().decide(free).starts] == [1]
    assert [(len(s.gpu_ids), s.batch_size) for s in Ones().decide(bounded).starts] == [(2, 32)]


def test_ones_keeps_a_new_job_batch_within_its_declared_batch_bounds():
    cl = cluster(1, 4, gpu_mem_mb=16_000)
    view = pending("p0", 300.0, gpus=4, model="b", batch=64)
    bounded = snapshot(cl, PERF, [_with(view, Elastic(min_batch_size=48))], [])
    # ONES would start it on one GPU at its per-GPU batch, 16; 48 is the least it allows
    assert [(len(s.gpu_ids), s.batch_size) for s in Ones().decide(bounded).starts] == [(1, 48)]


def _with(view, bounds: Elastic):
    from dataclasses import replace

    return replace(view, elastic=bounds)
