"""The mixed workload (``--trace mixed:N[,load=L,...]``, ``gpusched.libs.core.mixed``):
its shares, its load arithmetic, its determinism and its errors."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.mixed import MixedConfig, mixed_jobs, mixed_spec, rate_for_load
from gpusched.libs.core.workload import MODEL_CATEGORIES
from gpusched.services.cli.main import app
from gpusched.services.scheduler.simulation.runner import InputError, build_models, load_workload

TRUTH, _ = build_models(None)
CLUSTER = Cluster.parse("16x4")


def _alone_s(job: JobSpec) -> float:
    nodes = CLUSTER.fewest_nodes(job.gpus)
    return job.iterations * TRUTH.iteration_time(job.model, job.batch_size, job.gpus, nodes, 1)


@pytest.fixture(scope="module")
def large() -> list[JobSpec]:
    jobs, _ = mixed_jobs(12_000, TRUTH, CLUSTER, seed=5, config=MixedConfig(load=0.9))
    return jobs


def test_the_same_seed_draws_the_same_jobs_and_another_seed_others():
    first, note = mixed_jobs(300, TRUTH, CLUSTER, seed=1, arrival_rate_per_h=20.0)
    again, note_again = mixed_jobs(300, TRUTH, CLUSTER, seed=1, arrival_rate_per_h=20.0)
    other, _ = mixed_jobs(300, TRUTH, CLUSTER, seed=2, arrival_rate_per_h=20.0)
    assert first == again and note == note_again
    assert first != other


def test_the_same_seed_draws_the_same_jobs_at_any_load_only_the_gaps_scale():
    low, _ = mixed_jobs(200, TRUTH, CLUSTER, seed=3, config=MixedConfig(load=0.6))
    high, _ = mixed_jobs(200, TRUTH, CLUSTER, seed=3, config=MixedConfig(load=1.2))
    for a, b in zip(low, high, strict=True):
        assert (a.model, a.gpus, a.batch_size, a.iterations, a.name) == (
            b.model, b.gpus, b.batch_size, b.iterations, b.name
        )  # fmt: skip
        assert a.submit_time == pytest.approx(2 * b.submit_time)


def test_the_shares_are_those_stated_within_tolerance_over_a_large_n(large: list[JobSpec]):
    n = len(large)
    dated = [j for j in large if j.deadline is not None]
    assert len(dated) / n == pytest.approx(0.2, abs=0.015)
    assert sum(j.elastic is not None for j in large) / n == pytest.approx(0.3, abs=0.015)
    recurring = [j for j in large if j.name]
    assert len(recurring) / n == pytest.approx(0.3, abs=0.015)
    tight = [j for j in dated if (j.deadline - j.submit_time) / _alone_s(j) < 2.0]
    assert len(tight) / len(dated) == pytest.approx(0.5, abs=0.04)
    one_off = [j for j in large if not j.name]
    gpus = Counter(j.gpus for j in one_off)
    for count, share in ((1, 0.7), (2, 0.1), (4, 0.1), (8, 0.1)):
        assert gpus[count] / len(one_off) == pytest.approx(share, abs=0.02)
    family = Counter(
        next(f for f, models in MODEL_CATEGORIES.items() if j.model in models) for j in one_off
    )
    for name, share in (("image", 0.2), ("language", 0.7), ("speech", 0.1)):
        assert family[name] / len(one_off) == pytest.approx(share, abs=0.02)


def test_run_times_are_heavy_tailed_lognormal_with_a_median_of_half_an_hour(
    large: list[JobSpec],
):
    runs = sorted(_alone_s(j) for j in large if not j.name)
    assert statistics.median(runs) == pytest.approx(1800.0, rel=0.08)
    # log-sigma 1.5: the 99th percentile is about e^(2.33 x 1.5) = 33 times the median
    assert runs[int(0.99 * len(runs))] / statistics.median(runs) == pytest.approx(33, rel=0.2)


def test_the_load_arithmetic_by_hand():
    # 0.9 of 64 GPUs is 57.6 GPU-seconds a second; jobs of 3.2 GPU-hours (11,520 GPU-s)
    # then arrive at 57.6 / 11,520 a second, 18 an hour
    assert rate_for_load(0.9, 64, 11_520.0) == pytest.approx(18.0)
    assert rate_for_load(1.2, 64, 11_520.0) == pytest.approx(24.0)


def test_the_drawn_jobs_offer_the_load_asked(large: list[JobSpec]):
    mean_gpu_s = sum(j.gpus * _alone_s(j) for j in large) / len(large)
    rate_per_s = rate_for_load(0.9, CLUSTER.total_gpus, mean_gpu_s) / 3600
    gaps = large[-1].submit_time / (len(large) - 1)
    assert gaps == pytest.approx(1 / rate_per_s, rel=0.03)
    offered = sum(j.gpus * _alone_s(j) for j in large) / (large[-1].submit_time * 64)
    assert offered == pytest.approx(0.9, rel=0.03)


def test_every_elastic_job_declares_half_to_twice_its_gpus_at_its_per_gpu_batch(
    large: list[JobSpec],
):
    for job in (j for j in large if j.elastic is not None):
        per_gpu = job.batch_size // job.gpus
        assert job.batch_size == per_gpu * job.gpus
        assert (job.min_gpus, job.max_gpus) == (max(1, job.gpus // 2), 2 * job.gpus)
        assert job.min_batch_size == per_gpu * job.min_gpus
        assert job.max_batch_size == per_gpu * job.max_gpus


def test_a_deadline_is_a_tight_or_loose_slack_times_the_run_alone(large: list[JobSpec]):
    for job in (j for j in large if j.deadline is not None):
        slack = (job.deadline - job.submit_time) / _alone_s(job)
        assert 1.2 - 1e-9 <= slack <= 4.0 + 1e-9


def test_recurring_jobs_resubmit_a_few_templates_and_over_declare_their_size(
    large: list[JobSpec],
):
    recurring = [j for j in large if j.name]
    templates = Counter(j.name.rsplit("-v", 1)[0] for j in recurring)
    assert len(templates) < len(recurring) / 10  # a few templates, resubmitted often
    assert all(j.declared_iterations is not None for j in recurring)
    assert all(j.declared_iterations >= j.iterations for j in recurring)
    assert all(j.declared_iterations is None for j in large if not j.name)


def test_the_trace_spec_reads_n_and_its_parameters():
    assert mixed_spec("philly.csv") is None
    assert mixed_spec("mixed:50") == (50, MixedConfig())
    assert mixed_spec("mixed:50,load=1.2,elastic=0.5") == (
        50, MixedConfig(load=1.2, elastic=0.5)
    )  # fmt: skip


def test_load_workload_draws_the_mixed_workload_for_the_cluster():
    workload = load_workload("mixed:40,load=0.6", None, TRUTH, seed=0, cluster=CLUSTER)
    assert len(workload.jobs) == 40 and workload.notes[0].startswith("mixed: 40 jobs")
    with pytest.raises(InputError, match="cluster"):
        load_workload("mixed:40", None, TRUTH, seed=0)


@pytest.mark.parametrize(
    ("trace", "words"),
    [
        ("mixed:0", "expected mixed:N with N >= 1"),
        ("mixed:10,load=0", "load must be a number in (0, 100]"),
        ("mixed:10,load=fast", "load must be a number, got 'fast'"),
        ("mixed:10,deadlines=1.5", "deadlines must be a share from 0 to 1"),
        ("mixed:10,elastic=-0.1", "elastic must be a share from 0 to 1"),
        ("mixed:10,recurring=2", "recurring must be a share from 0 to 1"),
        ("mixed:10,burst=3", "'burst=3' is not KEY=VALUE with KEY one of load"),
    ],
)
def test_bad_parameters_give_a_one_line_cli_error_naming_the_field(
    tmp_path: Path, trace: str, words: str
):
    result = CliRunner().invoke(
        app, ["simulate", "--out", str(tmp_path), "--trace", trace, "-p", "fifo"]
    )
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_simulate_runs_a_mixed_workload_at_a_load(tmp_path: Path):
    result = CliRunner().invoke(
        app,
        [
            "simulate", "--out", str(tmp_path), "--trace", "mixed:60,load=0.9",
            "--cluster", "4x4", "-p", "fifo", "-p", "genie",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())["policies"]
    assert summary["fifo"]["jobs"] == 60 and "qos_pct" in summary["genie"]
