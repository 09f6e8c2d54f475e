"""``gpusched simulate`` on a long run: it says up front what it will run and about how
long, prints a line as each policy finishes (on a terminal or not), and Ctrl-C writes the
policies that finished."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import (
    Interrupted,
    build_cluster,
    build_models,
    estimate_s,
    load_workload,
    run_policies,
)

ROOT = Path(__file__).resolve().parents[1]


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gpusched.services.cli.main", "simulate", *args,
            "--out", str(out)]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_without_a_terminal_it_announces_the_run_and_prints_a_line_per_finished_policy(
    tmp_path: Path,
):
    done = subprocess.run(
        command(tmp_path / "out", "--synthetic", "30", "--cluster", "2x4", "-p", "fifo,sjf"),
        capture_output=True, text=True, env=env(), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    announce = [i for i, line in enumerate(lines) if line.startswith("running 2 policies")]
    finished = [i for i, line in enumerate(lines) if line.startswith("finished ")]
    assert len(announce) == 1 and "30 jobs" in lines[announce[0]] and "about" in lines[announce[0]]
    assert [lines[i].split()[1] for i in finished] == ["fifo", "sjf"]
    assert lines[finished[0]].endswith("(1 of 2)") and lines[finished[1]].endswith("(2 of 2)")
    assert announce[0] < finished[0]


def _sigint_as_a_terminal_gives_it() -> None:
    """A process started in the background of a shell (`cmd &`, as a CI runner may start
    the suite) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler: the child gets SIGINT's default, as a command typed at a terminal does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_writes_the_policies_that_finished_and_exits_130(tmp_path: Path):
    out = tmp_path / "out"
    # fifo finishes in seconds; synergy-las, which looks at the whole queue each decision,
    # takes minutes on 12,000 jobs crowding one node, so the signal always comes during it
    args = ("--synthetic", "12000", "--rate", "200", "--cluster", "1x8", "-p",
            "fifo,synergy-las")
    process = subprocess.Popen(
        command(out, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env(), cwd=tmp_path, preexec_fn=_sigint_as_a_terminal_gives_it,
    )  # fmt: skip
    assert process.stderr is not None and process.stdout is not None
    seen = []
    while line := process.stderr.readline():
        seen.append(line)
        if line.startswith("finished fifo"):
            process.send_signal(signal.SIGINT)
            break
    # read through the same buffered files (communicate() would skip what they hold)
    stderr = "".join(seen) + process.stderr.read()
    stdout = process.stdout.read()
    process.wait()
    assert process.returncode == 130, stderr
    # during synergy-las, or while fifo's line was still being written
    assert (
        "interrupted during policy synergy-las" in stderr
        or "interrupted after policy fifo" in stderr
    )
    assert "Traceback" not in stderr
    assert json.loads((out / "summary.json").read_text())["policies"].keys() == {"fifo"}
    with (out / "jobs.csv").open(newline="") as handle:
        assert {row["policy"] for row in csv.DictReader(handle)} == {"fifo"}
    assert (out / "report.html").exists() and (out / "queue_length.png").exists()
    assert "fifo" in stdout and str(out) in stdout  # the table, and where it went


def test_an_interrupted_run_hands_back_the_results_of_the_policies_that_finished():
    truth, _ = build_models(None)
    cluster = build_cluster("2x4", None)
    jobs = load_workload("synthetic:20", None, truth, seed=1, cluster=cluster).jobs

    def progress(name: str, total: int):
        def update(done: int, _total: int) -> None:
            if name == "tiresias" and done > 0:
                raise KeyboardInterrupt  # what Ctrl-C raises, in the middle of tiresias

        return update

    heard: list[SimResult] = []
    with pytest.raises(Interrupted) as caught:
        run_policies(
            jobs, cluster, ["fifo", "sjf", "tiresias", "srtf"], truth,
            progress_factory=progress, on_finished=heard.append,
        )  # fmt: skip
    assert caught.value.running == "tiresias"
    assert [r.policy for r in caught.value.finished] == ["fifo", "sjf"]
    assert caught.value.finished == heard  # each heard of as it ended
    assert all(len(r.jobs) == 20 for r in caught.value.finished)
    assert isinstance(caught.value, KeyboardInterrupt)  # callers not looking see Ctrl-C


def test_ctrl_c_between_two_runs_keeps_the_run_that_had_just_ended():
    truth, _ = build_models(None)
    cluster = build_cluster("2x4", None)
    jobs = load_workload("synthetic:10", None, truth, seed=2, cluster=cluster).jobs

    def finished(result: SimResult) -> None:
        if result.policy == "sjf":
            raise KeyboardInterrupt  # while the line for sjf is being printed

    with pytest.raises(Interrupted) as caught:
        run_policies(jobs, cluster, ["fifo", "sjf", "srtf"], truth, on_finished=finished)
    assert caught.value.running is None
    assert [r.policy for r in caught.value.finished] == ["fifo", "sjf"]
    assert str(caught.value) == "interrupted after policy sjf"


def test_the_estimate_grows_with_jobs_and_policies_and_counts_ones_at_its_own_rate():
    others = [name for name in POLICIES if name != "ones"]
    assert 0 < estimate_s(["fifo"], 1_000) < estimate_s(["fifo"], 10_000)
    assert estimate_s(others, 10_000) > estimate_s(["fifo"], 10_000)
    # ones's search makes it slower than all the others together
    assert estimate_s(["ones"], 1_000) > estimate_s(others, 1_000)


def test_every_policy_has_a_measured_rate_for_the_estimate():
    from gpusched.services.scheduler.simulation.runner import POLICY_RATES

    assert set(POLICY_RATES) == set(POLICIES)
    assert all(rate > 0 for rate in POLICY_RATES.values())
