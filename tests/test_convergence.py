"""Convergence: jobs of a model with a convergence curve end when they converge, so a
new batch changes the iterations they have left, and elastic starts and resizes keep the
progress a job made."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.libs.core.convergence import (
    BUILTIN,
    Convergence,
    builtin_convergence,
    read_convergence,
    remaining_after_resize,
)
from gpusched.libs.core.decision import Decision, Resize, Start, decision_problems
from gpusched.libs.core.snapshot import Snapshot
from gpusched.libs.core.traces import load_trace
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import ConvergingPerf, cluster, job, pending, snapshot

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
POLLUX = DATA / "profiles" / "pollux"

#: batch 8 needs 100 iterations to converge, batch 16 needs 60 (so 960 samples, not 800)
TOY = Convergence(
    knots=(0.0, 50.0, 100.0),
    batches=(8.0, 16.0),
    iterations=((0.0, 50.0, 100.0), (0.0, 30.0, 60.0)),
)


def test_a_profiled_batch_needs_exactly_the_iterations_it_was_measured_at():
    assert TOY.total_iterations(8) == 100
    assert TOY.total_iterations(16) == 60
    assert TOY.iterations_to(16, 50.0) == 30


def test_between_profiled_batches_iterations_fall_and_samples_grow():
    between = TOY.total_iterations(11.3)
    assert 60 < between < 100
    assert 8 * 100 < 11.3 * between < 16 * 60


def test_below_the_smallest_batch_every_sample_counts_fully():
    assert TOY.total_iterations(4) == pytest.approx(200.0)


def test_past_the_largest_batch_samples_keep_growing_at_most_as_fast_as_the_batch():
    beyond = TOY.total_iterations(32)
    assert beyond <= 60
    assert 32 * beyond >= 16 * 60


def test_progress_carries_over_a_resize():
    # 40 of 100 iterations done at batch 8 is progress 40, which batch 16 reaches at 24
    assert remaining_after_resize(TOY, 8, 60.0, 16) == pytest.approx(60 - 24)
    # a trace that fixes the job at twice the curve's length keeps that ratio
    assert remaining_after_resize(TOY, 8, 120.0, 16, scale=2.0) == pytest.approx(72.0)


@given(
    st.floats(min_value=1, max_value=4096),
    st.floats(min_value=1, max_value=4096),
    st.floats(min_value=0, max_value=1),
)
def test_resizing_there_and_back_leaves_what_was_left(old: float, new: float, done: float):
    curve = builtin_convergence("cifar10")
    assert curve is not None
    left = curve.total_iterations(old) * (1 - done)
    there = remaining_after_resize(curve, old, left, new)
    back = remaining_after_resize(curve, new, there, old)
    assert back == pytest.approx(left, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("model", sorted(BUILTIN))
def test_every_builtin_curve_needs_more_samples_and_fewer_iterations_at_larger_batches(model):
    curve = builtin_convergence(model)
    assert curve is not None
    batches = [curve.batches[0] * 2**k for k in range(12)]
    iterations = [curve.total_iterations(b) for b in batches]
    samples = [b * i for b, i in zip(batches, iterations, strict=True)]
    assert all(b <= a * (1 + 1e-12) for a, b in pairwise(iterations))
    assert all(b >= a * (1 - 1e-12) for a, b in pairwise(samples))
    assert samples[-1] > samples[0]


def test_the_measured_curves_take_each_traces_own_iteration_count():
    if not POLLUX.is_dir():
        pytest.skip(f"Pollux profiles not found at {POLLUX}")
    for folder in sorted(p for p in POLLUX.iterdir() if p.is_dir()):
        curve = read_convergence(folder)
        assert curve is not None, folder
        for path in folder.glob("validation-*.csv"):
            batch = int(path.stem.removeprefix("validation-"))
            with path.open() as f:
                rows = list(csv.DictReader(f))
            last = float(rows[-1]["iteration"])
            # the smallest batch sets the knots; other runs ended within a hair of them,
            # and traces whose noise broke monotonicity were clamped
            assert curve.total_iterations(batch) == pytest.approx(last, rel=0.05), path


def test_a_progress_trace_that_goes_backwards_is_refused_naming_the_line(tmp_path: Path):
    (tmp_path / "validation-8.csv").write_text(
        "progress,iteration,metric,grad_sqr,grad_var\n10,10,0.1,1,1\n5,20,0.2,1,1\n"
    )
    with pytest.raises(ValueError, match=r"validation-8\.csv, line 3"):
        read_convergence(tmp_path)


def test_a_pollux_job_runs_until_its_curve_converges_at_its_batch(tmp_path: Path):
    trace = tmp_path / "w.csv"
    trace.write_text(
        "name,time,application,num_replicas,batch_size\na,0,cifar10,1,128\nb,0,cifar10,4,1024\n"
    )
    loaded = load_trace(trace, "pollux")
    curve = builtin_convergence("cifar10")
    assert curve is not None
    by_id = {j.job_id: j for j in loaded.jobs}
    assert by_id["a"].iterations == round(curve.total_iterations(128))
    assert by_id["b"].iterations == round(curve.total_iterations(1024))
    assert by_id["b"].iterations * 1024 > by_id["a"].iterations * 128


@dataclass
class Scripted:
    """Plays one decision per call from a list, then nothing (waking as asked)."""

    script: list[Decision]
    name: str = "scripted"
    preemptive: bool = True
    queue_sort: None = None
    capabilities = Capabilities()
    wakes: list[float] = field(default_factory=list)

    def decide(self, snap: Snapshot) -> Decision:
        return self.script.pop(0) if self.script else Decision()


def test_a_resize_to_a_larger_batch_leaves_the_iterations_its_progress_needs_there():
    """Batch 8 on one GPU, 1 s an iteration: after 40 s (progress 40) the job moves to
    batch 16 on two GPUs, which needs 60 - 24 = 36 more iterations, after the restart."""
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": TOY})
    spec = job("j", iterations=100, batch=8)
    policy = Scripted(
        [
            Decision(starts=(Start("j", (0,)),), wake_at=40.0),
            Decision(resizes=(Resize("j", (0, 1), 16),)),
        ]
    )
    result = simulate(cluster(1, 2), [spec], policy, perf, config=SimConfig(restart_overhead_s=5))
    assert result.jobs[0].finish_time == pytest.approx(40 + 5 + 36)


def test_without_a_curve_a_resize_keeps_the_remaining_iterations():
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={})
    policy = Scripted(
        [
            Decision(starts=(Start("j", (0,)),), wake_at=40.0),
            Decision(resizes=(Resize("j", (0, 1), 16),)),
        ]
    )
    spec = job("j", iterations=100, batch=8)
    result = simulate(cluster(1, 2), [spec], policy, perf, config=SimConfig(restart_overhead_s=5))
    assert result.jobs[0].finish_time == pytest.approx(40 + 5 + 60)


def test_an_elastic_start_runs_the_job_at_the_shape_the_policy_chose():
    """Asked for batch 16 on two GPUs (60 iterations), started at batch 8 on one GPU:
    it needs the 100 iterations of batch 8, and keeps its exclusive time as asked."""
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": TOY})
    spec = job("j", iterations=60, gpus=2, batch=16)
    policy = Scripted([Decision(starts=(Start("j", (0,), batch_size=8),))])
    result = simulate(cluster(1, 2), [spec], policy, perf)
    outcome = result.jobs[0]
    assert outcome.finish_time == pytest.approx(100.0)
    assert outcome.exclusive_s == pytest.approx(60.0)


def test_the_policy_is_woken_when_it_asked_even_with_nothing_pending():
    perf = ConvergingPerf(iter_s={"a": 1.0}, curves={"a": TOY})
    calls: list[float] = []

    @dataclass
    class Waking(Scripted):
        def decide(self, snap: Snapshot) -> Decision:
            calls.append(snap.now)
            decision = super().decide(snap)
            return Decision(starts=decision.starts, wake_at=snap.now + 30.0)

    policy = Waking([Decision(starts=(Start("j", (0,)),))])
    simulate(cluster(1, 1), [job("j", iterations=100, batch=8)], policy, perf)
    assert calls == [0.0, 30.0, 60.0, 90.0]


def test_an_elastic_start_is_checked_at_its_own_shape():
    perf = ConvergingPerf(iter_s={"a": 1.0}, mem_mb={"a": 6000.0}, ref_batch=8.0, curves={"a": TOY})
    snap = snapshot(cluster(1, 2, gpu_mem_mb=10_000), perf, [pending("j", 60.0, gpus=2, batch=16)])
    assert decision_problems(snap, Decision(starts=(Start("j", (0,), batch_size=8),)), perf) == []
    # batch 32 on one GPU needs 6000 x 2 MB: more than the GPU has
    too_big = decision_problems(snap, Decision(starts=(Start("j", (0,), batch_size=32),)), perf)
    assert too_big
    assert decision_problems(snap, Decision(starts=(Start("j", (0,), batch_size=0),)), perf)
