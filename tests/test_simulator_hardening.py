"""The simulate path on inputs at its edges: cluster shapes other than 8-GPU nodes,
times where floats are coarse, jobs and clusters far too large, wild prediction errors,
an output folder that cannot be written."""

from __future__ import annotations

import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.libs.core.cluster import MAX_SPEC_GPUS, Cluster, Node
from gpusched.libs.core.groundtruth import NoisyEstimates, load_performance_model
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.traces import TraceError, TraceJob, load_trace, write_native
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.simulation.runner import (
    InputError,
    build_cluster,
    build_models,
    load_workload,
)
from gpusched.services.scheduler.simulation.simulator import Simulator, simulate
from tests import builders

TRUTH = load_performance_model(None)
cli = CliRunner()


def run_cli(*args: str) -> tuple[int, str]:
    result = cli.invoke(app, ["simulate", *args])
    return result.exit_code, result.output


# ------------------------------------------------------------------ run time on any cluster


@pytest.mark.parametrize("shape", ["1x512", "16x4", "64x8", "4x2"])
def test_a_job_alone_takes_exactly_its_trace_duration_on_every_cluster_shape(
    shape: str, tmp_path: Path
) -> None:
    cluster = build_cluster(shape, None)
    models = ("resnet50", "bert", "gpt2", "deepspeech2", "yolov3")
    sizes = [g for g in (1, 2, 3, 4, 8, 12, 16, 64, 512) if g <= cluster.total_gpus]
    # one job at a time: each arrives long after the previous one has finished
    jobs = [
        TraceJob(f"{m}-{g}", 1e6 * i, g, model=m, duration_s=3_600.0 + 7.3 * i)
        for i, (m, g) in enumerate((m, g) for m in models for g in sizes)
    ]
    trace = tmp_path / "trace.csv"
    write_native(trace, jobs)
    workload = load_workload(trace, "native", TRUTH, cluster=cluster)
    result = simulate(cluster, workload.jobs, make_policy("fifo"), TRUTH)
    for job, outcome in zip(jobs, result.jobs, strict=True):
        assert outcome.job_id == job.job_id and outcome.state == "finished"
        assert outcome.jct_s == pytest.approx(job.duration_s, rel=1e-12), job.job_id


def test_fewest_nodes_is_where_an_idle_cluster_places_a_job_alone() -> None:
    assert [Cluster.parse("16x4").fewest_nodes(g) for g in (1, 4, 5, 8, 64)] == [1, 1, 2, 2, 16]
    assert [Cluster.parse("1x512").fewest_nodes(g) for g in (1, 16, 512)] == [1, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        Cluster.parse("4x2").fewest_nodes(9)


def test_fewest_nodes_takes_the_largest_nodes_of_a_mixed_cluster_first() -> None:
    mixed = Cluster((Node("a", 2), Node("b", 8), Node("c", 4)))
    assert [mixed.fewest_nodes(g) for g in (1, 8, 9, 12, 13, 14)] == [1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------- float resolution of time


class CountingSimulator(Simulator):
    """Stops a run that handles one job's finish absurdly often (it would never end)."""

    finishes = 0

    def _finish(self, job_id: str, version: int) -> bool:
        self.finishes += 1
        if self.finishes > 1_000:
            raise AssertionError(f"finish of {job_id} handled {self.finishes} times")
        return super()._finish(job_id, version)


def test_a_job_whose_finish_rounds_to_its_start_finishes_instead_of_looping() -> None:
    # at 1e20 s neighbouring floats are 16,384 s apart: 10 s later is the same instant
    jobs = [
        JobSpec("a", 1e20, "bert", 1, 32, 10),
        JobSpec("b", 0.0, "bert", 1, 32, 10),
    ]
    for name in ("fifo", "sjf", "srtf", "tiresias", "sjf-bsbf"):
        sim = CountingSimulator(Cluster.parse("1x8"), jobs, make_policy(name), TRUTH)
        result = sim.run()
        by_id = {o.job_id: o for o in result.jobs}
        assert by_id["a"].state == by_id["b"].state == "finished", name
        assert by_id["a"].finish_time == 1e20
        assert by_id["b"].jct_s == pytest.approx(10 * TRUTH.iteration_time("bert", 32, 1, 1))


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ("a,1e20,1,10", "submit_time", "at most 1e+10 seconds"),
        ("a,0,1,1e300", "duration_s", "at most 1e+10 seconds"),
        ("a,0,1,inf", "duration_s", "a positive number"),
        ("a,0,1,0", "duration_s", "a positive number"),
        ("a,0,1,-5", "duration_s", "a positive number"),
        ("a,-1,1,10", "submit_time", "a number >= 0"),
        ("a,0,0,10", "gpus", "a positive integer"),
        ("a,0,-2,10", "gpus", "a positive integer"),
        ("a,0,1" + "0" * 20 + ",10", "gpus", "at most 1,000,000,000,000"),
    ],
)
def test_a_native_row_out_of_range_is_refused_naming_the_line_and_field(
    tmp_path: Path, row: str, field: str, problem: str
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(f"job_id,submit_time,gpus,duration_s\nb,0,1,10\n{row}\n")
    expected = re.escape(f"t.csv:3: field '{field}': expected {problem}")
    with pytest.raises(TraceError, match=expected):
        load_trace(trace, "native")


def test_a_huge_iteration_count_is_refused_naming_the_field(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"submit_time": 0, "gpus": 1, "iterations": ' + "9" * 400 + "}\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:1: field 'iterations': expected at most"):
        load_trace(trace, "native")


# ------------------------------------------------------------------------ too large


@dataclass
class NoHugePlacements:
    """The ground truth, refusing to be asked about a placement wider than ``most_nodes``
    (timing one node by one for 12.5 million nodes took 32 s and 2.7 GB)."""

    inner: PerformanceModel
    most_nodes: int

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        assert nodes <= self.most_nodes, f"asked to time {gpus} GPUs on {nodes} nodes"
        return self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)


@pytest.mark.parametrize("gpus", ["1e9", "100000000", "9"])
def test_a_job_larger_than_the_cluster_is_unschedulable_at_once_with_its_reason(
    tmp_path: Path, gpus: str
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        f"job_id,submit_time,gpus,model,duration_s\nbig,0,{gpus},bert,10\nok,0,1,bert,10\n"
    )
    cluster = Cluster.parse("1x8")
    truth = NoHugePlacements(TRUTH, most_nodes=cluster.total_gpus)
    workload = load_workload(trace, "native", truth, cluster=cluster)  # type: ignore[arg-type]
    for name in ("fifo", "sjf-bsbf"):
        result = simulate(cluster, workload.jobs, make_policy(name), truth)  # type: ignore[arg-type]
        big, ok = result.jobs
        assert big.state == "unschedulable"
        assert big.reason == f"unschedulable: needs {int(float(gpus))} GPUs; the cluster has 8"
        assert math.isnan(big.exclusive_s)
        assert ok.state == "finished"


def test_a_cluster_spec_beyond_the_bound_is_refused_naming_the_option(tmp_path: Path) -> None:
    for spec in ("99999999x8", "1x1000001", "1000001x1"):
        with pytest.raises(InputError, match=r"--cluster.*at most 1,000,000"):
            build_cluster(spec, None)
    with pytest.raises(InputError, match=r"--cluster.*per node; at most 16,384"):
        build_cluster("1x20000", None)
    assert build_cluster("125000x8", None).total_gpus == MAX_SPEC_GPUS
    code, output = run_cli(
        "--trace", "synthetic:3", "--cluster", "99999999x8", "--out", str(tmp_path)
    )
    assert code == 2
    assert "--cluster" in output and "at most 1,000,000" in output
    assert "Traceback" not in output


# ---------------------------------------------------------------------- prediction error


def test_a_prediction_error_out_of_range_is_a_cli_error_naming_the_option(tmp_path: Path) -> None:
    code, output = run_cli(
        "--trace",
        "synthetic:3",
        "--cluster",
        "1x8",
        "--prediction-error",
        "2000",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 2
    assert "--prediction-error 2000" in output and "from 0 to 10" in output
    assert "Traceback" not in output and not (tmp_path / "out").exists()
    for bad in (-1.0, 10.5, math.inf, math.nan):
        with pytest.raises(InputError, match="--prediction-error"):
            build_models(None, bad)
    build_models(None, 10.0)


def test_noisy_estimates_stay_finite_whatever_the_sigma() -> None:
    for sigma in (10.0, 2000.0, 1e300):
        noisy = NoisyEstimates(TRUTH, sigma=sigma, seed=3)
        for model in TRUTH.models():
            time = noisy.iteration_time(model, 32, 1, 1)
            assert 0 < time < math.inf and math.isfinite(time * 1e12)


# ----------------------------------------------------------------------------- --out


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any simulation fail the test: the output check must come first."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("simulated before checking --out")

    monkeypatch.setattr("gpusched.services.scheduler.simulation.runner.run_policies", refuse)


def test_an_out_path_under_a_regular_file_is_refused_before_simulating(
    tmp_path: Path, no_runs: None
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub" / "dir"):
        code, output = run_cli("--trace", "synthetic:3", "--cluster", "1x8", "--out", str(out))
        assert code == 2, output
        assert f"--out {out}" in output and "is not a folder" in output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_is_refused_before_simulating(tmp_path: Path, no_runs: None) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, output = run_cli(
            "--trace", "synthetic:3", "--cluster", "1x8", "--out", str(locked / "out")
        )
    finally:
        locked.chmod(stat.S_IRWXU)
    assert code == 2, output
    assert "--out" in output and "cannot write in" in output


def test_an_out_folder_on_a_read_only_file_system_is_refused_before_simulating(
    no_runs: None,
) -> None:
    # /sys is read-only even for root, so this runs where the chmod test cannot
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pytest.skip("/sys is writable here")
    except OSError:
        pass
    code, output = run_cli("--trace", "synthetic:3", "--cluster", "1x8", "--out", "/sys/gpusched")
    assert code == 2, output
    assert "--out /sys/gpusched" in output and "cannot write in /sys" in output


# ------------------------------------------------------------------- fifo-backfill


def test_fifo_backfill_passes_a_blocked_head_where_fifo_waits_behind_it() -> None:
    # 4 GPUs, one second per iteration: a holds 3 until 10; e needs all 4; d needs 1
    job = builders.job
    trace = [job("a", 0, 10, gpus=3), job("e", 1, 10, gpus=4), job("d", 2, 3, gpus=1)]
    finish = {}
    for name in ("fifo", "fifo-backfill"):
        one_node = builders.cluster(1, 4)
        result = simulate(one_node, trace, make_policy(name), builders.TablePerf())
        finish[name] = {o.job_id: o.finish_time for o in result.jobs}
    assert finish["fifo"] == {"a": 10, "e": 20, "d": 23}
    assert finish["fifo-backfill"] == {"a": 10, "d": 5, "e": 20}
    assert make_policy("fifo-backfill").name == "fifo-backfill"
    assert not make_policy("fifo-backfill").preemptive


# ------------------------------------------- FIFO with backfill against a reference loop

PHILLY = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces/philly/philly.csv"


@dataclass(frozen=True)
class RefJob:
    job_id: str
    arrival: float
    duration: float
    gpus: int


def reference_avg_jct(jobs: list[RefJob], capacity: int, order: str) -> float:
    """Average JCT of a non-preemptive scheduler with backfilling on one pool of GPUs.

    At every instant where jobs arrive or finish (all of them handled first), walk the
    queue in ``order`` (``fifo``: arrival; ``sjf``: trace duration, then arrival) and
    start every job whose GPUs are free now; a job that does not fit is skipped, never
    waited for. A started job runs exactly its trace duration. This is the scheduling
    loop of the published trace simulators (e.g. Tiresias' and Gavel's ``fifo`` and
    ``sjf`` with backfilling), written to be read, not to be fast.
    """
    key = {
        "fifo": lambda j: (j.arrival, j.job_id),
        "sjf": lambda j: (j.duration, j.arrival, j.job_id),
    }[order]
    arrivals = sorted(jobs, key=lambda j: (j.arrival, j.job_id))
    queue: list[RefJob] = []
    running: list[tuple[float, str, int]] = []  # (finish time, job id, GPUs)
    free, nxt, jct = capacity, 0, {}
    while nxt < len(arrivals) or queue or running:
        now = min(
            arrivals[nxt].arrival if nxt < len(arrivals) else math.inf,
            min(running)[0] if running else math.inf,
        )
        for done in [r for r in running if r[0] == now]:
            running.remove(done)
            free += done[2]
        while nxt < len(arrivals) and arrivals[nxt].arrival == now:
            queue.append(arrivals[nxt])
            nxt += 1
        waiting = []
        for job in sorted(queue, key=key):
            if job.gpus <= free:
                free -= job.gpus
                running.append((now + job.duration, job.job_id, job.gpus))
                jct[job.job_id] = now + job.duration - job.arrival
            else:
                waiting.append(job)
        queue = waiting
    assert len(jct) == len(jobs)
    return sum(jct.values()) / len(jct)


def test_the_reference_loop_backfills_and_orders_as_its_docstring_says() -> None:
    # 4 GPUs: a (4 GPUs, 10 s) runs; b (4 GPUs) then c (1 GPU, 5 s) wait; at 10 s b
    # starts under FIFO; under SJF c (shorter) starts first and b waits for all 4 GPUs
    jobs = [RefJob("a", 0, 10, 4), RefJob("b", 1, 20, 4), RefJob("c", 2, 5, 1)]
    assert reference_avg_jct(jobs, 4, "fifo") == pytest.approx((10 + 29 + 33) / 3)
    assert reference_avg_jct(jobs, 4, "sjf") == pytest.approx((10 + 34 + 13) / 3)
    # backfilling: d (1 GPU) passes the blocked e (4 GPUs) while a runs
    jobs = [RefJob("a", 0, 10, 3), RefJob("e", 1, 10, 4), RefJob("d", 2, 3, 1)]
    assert reference_avg_jct(jobs, 4, "fifo") == pytest.approx((10 + 19 + 3) / 3)


def test_fifo_backfill_and_sjf_on_philly_agree_with_a_reference_loop_within_1_percent(
    tmp_path: Path,
) -> None:
    """The first 2,000 Philly jobs on one 512-GPU node (``1x512``), every job running
    its trace duration. Compared semantics: FIFO with backfilling (``fifo-backfill``:
    arrival order, a job that does not fit is passed over) and non-preemptive SJF with
    backfilling (our ``sjf`` already skips a job that does not fit: shortest predicted
    job first, predictions exact here), each against `reference_avg_jct`."""
    if not PHILLY.exists():
        pytest.skip(f"Philly trace not found at {PHILLY}")
    trace = load_trace(PHILLY, "philly", limit=2_000).jobs
    cluster = build_cluster("1x512", None)
    workload = load_workload(PHILLY, "philly", TRUTH, limit=2_000, cluster=cluster)
    reference = [RefJob(j.job_id, j.submit_time, j.duration_s or 0.0, j.gpus) for j in trace]
    for ours, order in (("fifo-backfill", "fifo"), ("sjf", "sjf")):
        result = simulate(cluster, workload.jobs, make_policy(ours), TRUTH)
        assert all(o.state == "finished" for o in result.jobs)
        got = result.summary()["avg_jct_s"]
        expected = reference_avg_jct(reference, 512, order)
        print(
            f"{ours}: {got:.3f} s, reference {order}: {expected:.3f} s, {got / expected - 1:+.2e}"
        )
        assert got == pytest.approx(expected, rel=0.01), ours
