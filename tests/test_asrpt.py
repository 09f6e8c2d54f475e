"""A-SRPT: the policy, the recurring workload and the size predictor behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.decision import Decision
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.recurring import RecurringConfig, recurring_jobs
from gpusched.libs.core.size_predictor import SizePredictor, SizeRow, SubmissionSizes, template_of
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.asrpt import Asrpt
from gpusched.services.scheduler.policies.preemptive import Srtf
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import cluster, job
from tests.test_invariants import PERF, Audited

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = load_performance_model(None)


@dataclass
class Recorded(Audited):
    """An audited policy whose every decision is written down (starts and preemptions),
    the driver keeping its queue in the policy's own order."""

    log: list[tuple[float, tuple, tuple]] = field(default_factory=list)

    @property
    def queue_sort(self):  # type: ignore[no-untyped-def]
        return self.inner.queue_sort

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = super().decide(snapshot)
        starts = tuple((s.job_id, s.gpu_ids) for s in decision.starts)
        self.log.append((snapshot.now, starts, tuple(p.job_id for p in decision.preemptions)))
        return decision


one_gpu_jobs = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=400, allow_nan=False),  # submit
        st.integers(min_value=1, max_value=400),  # iterations
        st.sampled_from(["a", "b", "c"]),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=one_gpu_jobs, gpus=st.integers(1, 4))
def test_with_exact_sizes_and_one_gpu_jobs_on_one_node_asrpt_decides_exactly_as_srtf(rows, gpus):
    trace = [
        job(f"j{i}", submit, iters, gpus=1, model=model, batch=32, share=False)
        for i, (submit, iters, model) in enumerate(rows)
    ]
    # restart_s=0: SRTF charges no restart in its ranks and preempts whatever it outranks
    ours, theirs = Recorded(Asrpt(restart_s=0.0)), Recorded(Srtf())
    config = SimConfig(restart_overhead_s=5.0)
    mine = simulate(cluster(1, gpus, gpu_mem_mb=16_000), trace, ours, PERF, config=config)
    srtf = simulate(cluster(1, gpus, gpu_mem_mb=16_000), trace, theirs, PERF, config=config)
    assert ours.log == theirs.log and ours.decisions > 0
    assert mine.jobs == srtf.jobs
    assert mine.preemptions == srtf.preemptions


def test_asrpt_ranks_by_gpus_times_remaining_time_where_srtf_ranks_by_time_alone():
    # one 4-GPU job of 100 s against four 1-GPU jobs of 150 s: the GPU-time of the wide
    # job (400) is below nothing of theirs, so SRPT on the virtual machine runs the narrow
    # ones first (150 each); SRTF runs the wide one first (100 s < 150 s)
    trace = [job("wide", 0.0, 100, gpus=4, model="a", batch=32)]
    trace += [job(f"n{i}", 0.0, 150, gpus=1, model="a", batch=32) for i in range(4)]
    mine = simulate(cluster(1, 4, gpu_mem_mb=16_000), trace, Asrpt(), PERF)
    srtf = simulate(cluster(1, 4, gpu_mem_mb=16_000), trace, Srtf(), PERF)
    first = {o.job_id: o.start_time for o in mine.jobs}
    assert first["n0"] == 0.0 and first["wide"] == pytest.approx(150.0)
    assert {o.job_id: o.start_time for o in srtf.jobs}["wide"] == 0.0
    # mean JCT: (4 x 150 + 250) / 5 = 170 against (100 + 4 x 250) / 5 = 220
    assert mine.summary()["avg_jct_s"] < srtf.summary()["avg_jct_s"]


def test_asrpt_without_preemption_never_preempts_and_a_cheap_restart_bound_protects_jobs():
    trace = [job("long", 0.0, 1000, gpus=4, model="a", batch=32)]
    trace += [job(f"s{i}", 10.0 * (i + 1), 20, gpus=4, model="a", batch=32) for i in range(3)]
    base = cluster(1, 4, gpu_mem_mb=16_000)
    assert simulate(base, trace, Asrpt(), PERF).preemptions > 0
    assert simulate(base, trace, Asrpt(preemptive=False), PERF).preemptions == 0
    # a restart dearer than any share of the long job's remaining work: never a victim
    assert simulate(base, trace, Asrpt(max_restart_share=0.0), PERF).preemptions == 0


def test_asrpt_reports_lemma_ones_rho_from_spread_and_consolidated_iteration_times():
    # PERF slows a job spread over nodes by 1.3 (spread_penalty); a 1-GPU job spreads
    # over nothing, so only the 4-GPU job can raise rho above 1
    narrow = simulate(cluster(2, 4), [job("n", 0.0, 10, gpus=1)], Asrpt(), PERF)
    assert narrow.rho == 1.0
    wide = simulate(cluster(2, 4), [job("w", 0.0, 10, gpus=4)], Asrpt(), PERF)
    spread = PERF.iteration_time("a", 32, 4, 2) / PERF.iteration_time("a", 32, 4, 1)
    assert wide.rho == pytest.approx(spread) and wide.rho > 1.0
    assert wide.summary()["rho"] == pytest.approx(spread)


@pytest.mark.parametrize(
    ("field_name", "value"), [("restart_s", -1.0), ("max_restart_share", -0.5)]
)
def test_a_bad_asrpt_setting_is_refused_naming_the_field(field_name, value):
    with pytest.raises(ValueError, match=field_name):
        Asrpt(**{field_name: value})


# ------------------------------------------------------------------------ invariants

rows_strategy = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=500, allow_nan=False),
        st.integers(min_value=1, max_value=300),
        st.sampled_from([1, 1, 1, 2, 3, 4, 8]),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([8, 32, 64, 256]),
        st.floats(min_value=0.2, max_value=5.0),  # declared / true iterations
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=rows_strategy,
    nodes=st.integers(1, 3),
    predictor=st.sampled_from(["truth", "declared", "rf"]),
    settings_=st.sampled_from(
        [{}, {"preemptive": False}, {"restart_s": 0.0}, {"max_restart_share": 0.01}]
    ),
)
def test_asrpt_never_double_books_a_gpu_and_every_job_finishes(rows, nodes, predictor, settings_):
    trace = [
        replace(
            job(f"j{i}", submit, iters, gpus=gpus, model=model, batch=max(batch, gpus),
                share=False),
            declared_iterations=iters * ratio,
            name=f"u{i % 3}-{model}-v{i}",
            user=f"u{i % 3}",
        )
        for i, (submit, iters, gpus, model, batch, ratio) in enumerate(rows)
    ]  # fmt: skip
    audited = Audited(Asrpt(**settings_))
    cl = cluster(nodes, 4, gpu_mem_mb=16_000)
    config = SimConfig(restart_overhead_s=5.0, predictor=predictor)
    result = simulate(cl, trace, audited, PERF, config=config)
    for outcome in result.jobs:
        if outcome.gpus > cl.total_gpus:
            assert outcome.state == "unschedulable"
            continue
        assert outcome.state == "finished", (outcome.job_id, outcome.reason)
        assert outcome.jct_s is not None and outcome.jct_s >= outcome.exclusive_s * (1 - 1e-9)
    assert result.shared_pairs == 0
    assert audited.decisions > 0 or all(o.state == "unschedulable" for o in result.jobs)
    if predictor != "truth":
        assert result.summary()["prediction"]["jobs"] == len(trace)


# ------------------------------------------------------------------ size predictor


def test_the_forest_learns_a_recurring_workload_its_error_falls_as_jobs_complete():
    jobs, _ = recurring_jobs(300, BUILTIN, seed=1, arrival_rate_per_h=20,
                             cluster=Cluster.parse("8x8"))
    sizes = SubmissionSizes("rf")
    for spec in jobs:  # each job completes before the next is submitted
        sizes.at_submission(spec)
        sizes.completed(spec)
    ids = [spec.job_id for spec in jobs]
    third = len(ids) // 3
    first, last = sizes.errors.summary(ids[:third]), sizes.errors.summary(ids[-third:])
    print(f"MAPE first third {first['mape_pct']:.1f} %, last third {last['mape_pct']:.1f} %")
    assert last["mape_pct"] < first["mape_pct"]
    assert last["fallback_jobs"] < first["fallback_jobs"]
    # and it beats what the users declare
    declared = SubmissionSizes("declared")
    for spec in jobs:
        declared.at_submission(spec)
    assert sizes.report()["mape_pct"] < declared.report()["mape_pct"]


def test_a_job_of_a_template_the_forest_has_not_seen_falls_back_to_its_declared_size():
    jobs, _ = recurring_jobs(60, BUILTIN, seed=2, arrival_rate_per_h=20)
    forest = SizePredictor()
    seen = jobs[:40]
    for spec in seen:
        forest.observe(spec)
    forest.train()
    known = {template_of(SizeRow.of(s)) for s in seen}
    for spec in jobs[40:]:
        guess = forest.predict(spec)
        if template_of(SizeRow.of(spec)) in known:
            assert guess.source == "forest"
        else:
            assert guess.source == "declared"
            assert guess.iterations == spec.declared_iterations


def test_the_predictor_is_deterministic_and_restores_from_its_rows():
    jobs, _ = recurring_jobs(120, BUILTIN, seed=3, arrival_rate_per_h=20)
    seen, rest = jobs[:100], jobs[100:]
    one, two = SizePredictor(), SizePredictor()
    for spec in seen:
        one.observe(spec)
        two.observe(spec)
    assert [one.predict(s) for s in rest] == [two.predict(s) for s in rest]
    stored = json.loads(json.dumps(one.to_dict()))  # what a KV bucket would hold
    restored = SizePredictor.from_dict(stored)
    assert restored.rows == one.rows
    one.train()  # the restored one trained on every row; so does this one now
    guesses = [one.predict(s) for s in rest]
    assert [restored.predict(s) for s in rest] == guesses
    assert any(g.source == "forest" for g in guesses)


def test_the_recurring_workload_is_seeded_and_declares_at_least_the_truth():
    first, note = recurring_jobs(200, BUILTIN, seed=4, arrival_rate_per_h=10)
    again, _ = recurring_jobs(200, BUILTIN, seed=4, arrival_rate_per_h=10)
    other, _ = recurring_jobs(200, BUILTIN, seed=5, arrival_rate_per_h=10)
    assert first == again and first != other
    assert all(s.declared_iterations is not None and s.declared_iterations >= s.iterations
               for s in first)
    assert len({template_of(SizeRow.of(s)) for s in first}) < len(first) / 2  # they recur
    assert "200 jobs" in note
    with pytest.raises(ValueError, match="noise_sigma"):
        RecurringConfig(noise_sigma=-1)


# ------------------------------------------------------------------------ command line


def _gpusched(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gpusched.services.cli.main", "simulate", *args, "--out",
         str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip


def test_an_unknown_predictor_is_a_one_line_error_naming_the_option(tmp_path):
    done = _gpusched(tmp_path, "--trace", "recurring:10", "--predictor", "oracle", "-p", "asrpt")
    assert done.returncode == 2, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "--predictor" in lines[0] and "oracle" in lines[0] and "rf" in lines[0]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_simulate_with_the_forest_reports_prediction_error_and_rho(tmp_path):
    done = _gpusched(tmp_path, "--trace", "recurring:60", "--cluster", "2x8", "--rate", "20",
                     "--predictor", "rf", "-p", "asrpt", "-p", "sjf")
    assert done.returncode == 0, done.stderr
    policies = json.loads((tmp_path / "out" / "summary.json").read_text())["policies"]
    assert policies["asrpt"]["finished"] == 60
    error = policies["asrpt"]["prediction"]
    assert error["predictor"] == "rf" and error["jobs"] == 60
    assert 0 <= error["within_10_pct"] <= error["within_25_pct"] <= error["within_50_pct"] <= 100
    assert policies["asrpt"]["rho"] >= 1.0
    assert "rho" not in policies["sjf"]


def test_make_policy_knows_asrpt():
    assert isinstance(make_policy("asrpt"), Asrpt)
