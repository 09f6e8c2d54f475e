"""Sweeps: several runs at once, in processes of this machine or on Dask, give the
results of the same runs one after another, in the same order; a run that fails is
named and ends the sweep."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import (
    Interrupted,
    build_cluster,
    build_models,
    load_workload,
    run_policies,
)
from gpusched.services.scheduler.simulation.sweep import (
    Executor,
    RunFailed,
    SimRun,
    sweep,
)

POLICIES = ("fifo", "tiresias")
SEEDS = (1, 2)


@functools.cache
def runs() -> list[SimRun]:
    """2 policies x 2 seeds on 200 generated jobs crowding 2x4 GPUs; tiresias preempts,
    so the runs exercise more than a queue in order."""
    truth, estimates = build_models(None, prediction_error=0.3, seed=5)
    cluster = build_cluster("2x4", None)
    made = []
    for seed in SEEDS:
        jobs = load_workload("synthetic:200", None, truth, seed=seed, cluster=cluster).jobs
        made += [SimRun(f"{name} seed {seed}", cluster, jobs, name, truth, estimates)
                 for name in POLICIES]  # fmt: skip
    return made


@functools.cache
def one_after_another() -> list[SimResult]:
    return sweep(runs(), workers=1)


def same_outcome(results: list[SimResult]) -> list[SimResult]:
    """Everything but the wall time, which is the one thing a run measures of the machine."""
    return [replace(result, wall_s=0.0) for result in results]


def check_identical(results: list[SimResult]) -> None:
    serial = one_after_another()
    assert [r.policy for r in results] == [r.policy for r in serial] == list(POLICIES) * 2
    for got, want in zip(results, serial, strict=True):
        assert {**got.summary(), "wall_s": 0} == {**want.summary(), "wall_s": 0}
        assert got.jobs == want.jobs  # every job's outcome, times and reasons
    assert same_outcome(results) == same_outcome(serial)


def test_two_policies_on_two_seeds_in_two_processes_give_the_results_of_one_after_another():
    heard: list[str] = []
    results = sweep(runs(), workers=2, on_finished=lambda r: heard.append(r.policy))
    check_identical(results)
    assert heard == list(POLICIES) * 2  # in the order of the runs, as one after another


def test_progress_of_runs_in_other_processes_reaches_the_callbacks_up_to_the_last_job():
    seen: dict[str, tuple[int, int]] = {}

    def factory(label: str, total: int):
        def update(done: int, of: int) -> None:
            seen[label] = (done, of)

        return update

    sweep(runs(), workers=2, progress_factory=factory)
    assert seen == {run.label: (200, 200) for run in runs()}


def test_a_dask_local_cluster_of_two_worker_processes_gives_the_results_of_one_after_another():
    if importlib.util.find_spec("distributed") is None:
        pytest.skip("dask distributed is not installed: pip install 'gpusched[dask]'")
    results = sweep(runs(), workers=2, executor=Executor("dask"))
    check_identical(results)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_with_a_bad_policy_parameter_is_named_and_ends_the_sweep(workers: int):
    good = runs()[0]
    capped = functools.partial(SjfBsbf, max_resident_slowdown=0.5)
    bad = replace(good, label="bsbf capped below 1", policy=capped)
    with pytest.raises(RunFailed) as caught:
        sweep([good, bad, *runs()[1:]], workers=workers)
    assert caught.value.label == "bsbf capped below 1"
    assert str(caught.value).startswith("run 'bsbf capped below 1' failed: ValueError: ")
    assert "max_resident_slowdown" in str(caught.value)
    assert isinstance(caught.value.error, ValueError)


def test_run_policies_on_two_processes_raises_what_the_run_raised_as_one_after_another_does():
    truth, _ = build_models(None)
    cluster = build_cluster("2x4", None)
    # a model no performance model knows: the simulator refuses it when the run starts
    jobs = [replace(job, model="no-such-model") for job in runs()[0].jobs[:5]]
    errors = []
    for workers in (1, 2):
        with pytest.raises(Exception) as caught:
            run_policies(jobs, cluster, list(POLICIES), truth, workers=workers)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


def test_an_executor_is_local_dask_or_dask_at_an_address_and_a_mistake_names_the_field():
    assert Executor.parse("local") == Executor()
    with pytest.raises(ValueError, match=r"^kind must be one of local, dask, got 'ray'"):
        Executor.parse("ray")
    with pytest.raises(ValueError, match=r"^address applies to kind dask alone"):
        Executor("local", "tcp://10.0.0.5:8786")
    with pytest.raises(ValueError, match=r"^label must be"):
        replace(runs()[0], label="")
    with pytest.raises(ValueError, match=r"^workers must be >= 1"):
        sweep(runs(), workers=0)
    if importlib.util.find_spec("distributed") is not None:
        address = "tcp://10.0.0.5:8786"
        assert Executor.parse(f"dask:{address}") == Executor("dask", address)
        with pytest.raises(ValueError, match=r"^address applies to kind dask alone, and must"):
            Executor.parse("dask:")


def test_simulate_with_one_or_two_jobs_writes_the_same_summary(tmp_path: Path):
    summaries = []
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        result = CliRunner().invoke(app, [
            "simulate", "--synthetic", "60", "--cluster", "2x4", "-p", "fifo,sjf,tiresias",
            "--jobs", jobs, "--out", str(out)])  # fmt: skip
        assert result.exit_code == 0, result.output
        policies = json.loads((out / "summary.json").read_text())["policies"]
        summaries.append({name: {**figures, "wall_s": 0} for name, figures in policies.items()})
        jobs_csv = (out / "jobs.csv").read_text()
        summaries.append(jobs_csv)
    assert summaries[0] == summaries[2] and summaries[1] == summaries[3]
    assert list(summaries[0]) == ["fifo", "sjf", "tiresias"]


def test_simulate_refuses_an_unknown_executor_naming_the_option():
    result = CliRunner().invoke(app, [
        "simulate", "--synthetic", "5", "--executor", "ray", "--out", "unused"])  # fmt: skip
    assert result.exit_code == 2
    assert "--executor 'ray': kind must be one of local, dask" in result.output


def test_ctrl_c_in_a_parallel_sweep_keeps_the_finished_runs_and_stops_the_running_one():
    truth, _ = build_models(None)
    cluster = build_cluster("1x8", None)
    short = load_workload("synthetic:20", None, truth, seed=1, cluster=cluster).jobs
    # minutes of work for synergy-las (12,000 jobs crowding one node): the sweep only
    # ends in time if its worker is stopped
    crowd = load_workload(
        "synthetic:12000", None, truth, seed=1, rate_per_h=200, cluster=cluster
    ).jobs
    runs = [SimRun("fifo", cluster, short, "fifo", truth),
            SimRun("synergy-las", cluster, crowd, "synergy-las", truth)]  # fmt: skip

    def finished(result: SimResult) -> None:
        if result.policy == "fifo":
            raise KeyboardInterrupt  # what Ctrl-C raises while fifo's line is printed

    with pytest.raises(Interrupted) as caught:
        sweep(runs, workers=2, on_finished=finished)
    assert [r.policy for r in caught.value.finished] == ["fifo"]
    assert caught.value.running in (None, "synergy-las")  # None: it had not reported yet


@dataclass(frozen=True)
class Square:
    """A run of anything: the sweep asks only for a label, a total and a call."""

    n: int
    total: int = 1

    @property
    def label(self) -> str:
        return f"square of {self.n}"

    def __call__(self, progress: object = None) -> tuple[int, int]:
        return self.n, self.n * self.n


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_of_runs_of_any_kind_keeps_their_order_and_names_the_last_on_ctrl_c(workers: int):
    squares = [Square(n) for n in range(5)]
    assert sweep(squares, workers=workers) == [(n, n * n) for n in range(5)]

    def finished(result: tuple[int, int]) -> None:
        if result[0] == 0:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted) as caught:
        sweep(squares[:1], workers=workers, on_finished=finished)
    assert str(caught.value) == "interrupted after policy square of 0"
    assert caught.value.finished == [(0, 0)]
