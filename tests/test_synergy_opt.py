"""Synergy-OPT: the integer program against brute force, its bound per decision beside
the policy's own throughput (``OptBounded``), and ``simulate --opt-bound``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from gpusched.services.scheduler.simulation.synergy_opt import (
    OptBounded,
    OptJob,
    opt_jobs,
    synergy_opt,
)
from tests.test_synergy_policy import PERF, synergy_cluster
from tests.test_synergy_sim import simulate_cli

CPU_AXIS, MEM_AXIS = (1.0, 3.0, 6.0), (20.0, 62.5, 100.0)


def brute_force(jobs: list[OptJob], total_cpus: float, total_mem: float) -> float | None:
    best = None
    for choice in product(*(sorted(j.throughput) for j in jobs)):
        cpus = sum(c * j.gpus for (c, _), j in zip(choice, jobs, strict=True))
        mem = sum(m * j.gpus for (_, m), j in zip(choice, jobs, strict=True))
        gains = [j.throughput[cell] for cell, j in zip(choice, jobs, strict=True)]
        if cpus <= total_cpus and mem <= total_mem and min(gains) >= 1.0:
            best = max(best or 0.0, sum(gains))
    return best


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from((1, 2))), min_size=1, max_size=5
    ),
    total_cpus=st.sampled_from((8.0, 14.0, 20.0, 40.0)),
    total_mem=st.sampled_from((250.0, 400.0, 1000.0)),
)
def test_opt_with_alike_jobs_counted_together_matches_brute_force(
    kinds: list[tuple[str, int]], total_cpus: float, total_mem: float
) -> None:
    jobs = opt_jobs(
        PERF, [(f"j{i}", model, g) for i, (model, g) in enumerate(kinds)], CPU_AXIS, MEM_AXIS
    )
    best = brute_force(jobs, total_cpus, total_mem)
    if best is None:
        with pytest.raises(ValueError):
            synergy_opt(jobs, total_cpus, total_mem)
        return
    result = synergy_opt(jobs, total_cpus, total_mem)
    assert result.total_throughput == pytest.approx(best)
    # every job got one cell; together they fit and give the total
    assert set(result.cells) == {j.job_id for j in jobs}
    assert sum(result.cells[j.job_id][0] * j.gpus for j in jobs) <= total_cpus + 1e-9
    assert sum(result.cells[j.job_id][1] * j.gpus for j in jobs) <= total_mem + 1e-9
    assert sum(j.throughput[result.cells[j.job_id]] for j in jobs) == pytest.approx(best)


# ------------------------------------------------------------------ per decision


@dataclass
class AtFair:
    """Starts every queued job on the next idle GPU at the fair share (3 CPUs, 62.5 GB)."""

    name: str = "at-fair"
    preemptive: bool = False
    queue_sort: None = None
    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        idle = [g for g, load in enumerate(snap.gpu_load) if load == 0]
        return Decision(
            starts=tuple(
                Start(job.job_id, (gpu,), cpus=3.0, mem_gb=62.5)
                for job, gpu in zip(snap.pending, idle, strict=False)
            )
        )


def test_four_jobs_at_fair_reach_two_thirds_of_what_their_best_case_would_give() -> None:
    """One server (8 GPUs, 24 CPUs, 500 GB), four 1-GPU jobs of model a, whose best case
    (6 CPUs, 100 GB) runs 1.5x its fair share's speed. The policy leaves them at fair:
    4 x 1.0 = 4.0. OPT's cheapest cell at 1.5 on the grid is (6 CPUs, 125 GB): four of
    them take exactly 24 CPUs and 500 GB, so the bound is 4 x 1.5 = 6.0 and the policy
    has 4/6 of it."""
    jobs = [JobSpec(f"j{i}", 0.0, "a", 1, 32, 100) for i in range(4)]
    bounded = OptBounded(AtFair())
    simulate(synergy_cluster(1), jobs, bounded, PERF)
    first = bounded.rounds[0]
    assert (first.jobs, first.policy, first.opt) == (4, 4.0, pytest.approx(6.0))
    summary = bounded.summary()
    assert summary["opt_throughput_mean"] == pytest.approx(6.0)
    assert summary["policy_throughput_mean"] == pytest.approx(4.0)
    assert summary["policy_to_opt_min"] == pytest.approx(4 / 6)
    assert summary["unbounded"] == 0


def test_the_bound_changes_no_decision_and_lies_at_or_above_tune_every_round() -> None:
    rows = [(30.0 * i, (1, 2, 4, 8)[i % 4], "abc"[i % 3], 300 + 97 * i) for i in range(40)]
    jobs = [
        JobSpec(f"j{i}", submit, model, g, 32 * g, iterations)
        for i, (submit, g, model, iterations) in enumerate(rows)
    ]
    config = SimConfig(round_s=120.0)
    plain = simulate(synergy_cluster(), jobs, make_policy("synergy-fifo"), PERF, config=config)
    bounded = OptBounded(make_policy("synergy-fifo"))
    wrapped = simulate(synergy_cluster(), jobs, bounded, PERF, config=config)
    assert wrapped.policy == "synergy-fifo"
    assert [(j.start_time, j.finish_time) for j in wrapped.jobs] == [
        (j.start_time, j.finish_time) for j in plain.jobs
    ]
    bounds = [r for r in bounded.rounds if r.opt is not None]
    assert bounds and all(r.opt >= r.policy - 1e-9 for r in bounds)  # type: ignore[operator]
    assert any(r.opt > r.policy + 1e-6 for r in bounds)  # type: ignore[operator]


# ------------------------------------------------------------------ simulate --opt-bound


def test_simulate_reports_the_bound_per_policy_in_the_summary(tmp_path: Path) -> None:
    result = simulate_cli(tmp_path, "--opt-bound", "-p", "synergy-fifo")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["opt_bound"] is True
    for name in ("fifo", "synergy-fifo"):
        bound = summary["policies"][name]["opt_bound"]
        assert bound["decisions"] > 0
        assert 0 < bound["policy_to_opt_min"] <= bound["policy_to_opt_mean"] <= 1 + 1e-9
        assert bound["opt_throughput_mean"] >= bound["policy_throughput_mean"] - 1e-9


def test_without_the_option_the_summary_has_no_bound(tmp_path: Path) -> None:
    result = simulate_cli(tmp_path)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "opt_bound" not in summary["policies"]["fifo"]
    assert "opt_bound" not in summary["settings"]


def test_the_bound_on_a_cluster_without_cpus_is_a_one_line_error_naming_the_option(
    tmp_path: Path,
) -> None:
    nodes = tmp_path / "nodes.csv"
    # 0.5 of a CPU a node counts as none
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,500,65536,8,V100M32\n")
    result = CliRunner().invoke(
        app,
        ["simulate", "--synthetic", "4", "--nodes-file", str(nodes), "-p", "fifo",
         "--out", str(tmp_path / "out"), "--opt-bound"],
    )  # fmt: skip
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("error: --opt-bound")
    assert not (tmp_path / "out").exists()
