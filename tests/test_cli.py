"""The ``gpusched`` command line, run for real on tiny traces and clusters."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.libs.core.traces import FORMATS
from gpusched.services.cli.main import TraceFormat, app
from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.simulation.report import human_duration, summary_json
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import build_cluster

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "jobs",
    "avg_jct_s",
    "p50_jct_s",
    "p99_jct_s",
    "avg_queue_s",
    "makespan_s",
    "gpu_util",
    "preemptions",
    "shared_pairs",
    "wall_s",
}
HEADER = "job_id,submit_time,gpus,model,batch_size,duration_s"
GOOD_ROWS = [
    "j1,0,1,resnet50,64,600",
    "j2,30,2,bert,32,1200",
    "j3,60,4,resnet18,128,300",
    "j4,90,1,vgg16,64,900",
    "j5,120,8,bert,64,1800",
    "j6,150,1,resnet50,64,60",
]

runner = CliRunner()


def write_trace(tmp_path: Path, rows: list[str], name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def simulate(tmp_path: Path, trace: Path, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--format",
            "native",
            "--cluster",
            "2x4",
            "--out",
            str(out),
            *args,
        ],
    )
    return result.exit_code, result.output, out


def read_jobs(out: Path) -> list[dict[str, str]]:
    with (out / "jobs.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def assert_one_line_error(exit_code: int, output: str) -> str:
    assert exit_code == 2, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


# ------------------------------------------------------------------------ happy paths


def test_a_run_with_no_policy_named_reports_every_policy_with_consistent_numbers(
    tmp_path: Path,
) -> None:
    code, output, out = simulate(tmp_path, write_trace(tmp_path, GOOD_ROWS))
    assert code == 0, output
    policies = json.loads((out / "summary.json").read_text())["policies"]
    assert set(policies) == set(POLICIES)
    jobs = read_jobs(out)
    for name, summary in policies.items():
        assert set(summary) >= SUMMARY_KEYS
        assert summary["jobs"] == len(GOOD_ROWS)
        assert summary["p50_jct_s"] <= summary["p99_jct_s"]
        exclusive = [float(j["exclusive_s"]) for j in jobs if j["policy"] == name]
        # no job can finish faster than it runs alone, so neither can the average
        assert summary["avg_jct_s"] >= sum(exclusive) / len(exclusive) - 1e-6
        assert 0 < summary["gpu_util"] <= 1
    for name in POLICIES:
        assert name in output  # the table has a row per policy


def test_jobs_csv_has_one_row_per_job_per_policy(tmp_path: Path) -> None:
    code, output, out = simulate(
        tmp_path, write_trace(tmp_path, GOOD_ROWS), "-p", "fifo", "-p", "sjf-bsbf"
    )
    assert code == 0, output
    jobs = read_jobs(out)
    assert list(jobs[0]) == [
        "policy",
        "job_id",
        "model",
        "gpus",
        "submit_time",
        "start_time",
        "finish_time",
        "jct_s",
        "queue_s",
        "exclusive_s",
        "preemptions",
        "shared",
        "state",
        "reason",
    ]
    pairs = {(j["policy"], j["job_id"]) for j in jobs}
    assert len(jobs) == len(pairs) == 2 * len(GOOD_ROWS)
    assert {p for p, _ in pairs} == {"fifo", "sjf-bsbf"}


def test_the_plots_are_png_files(tmp_path: Path) -> None:
    code, output, out = simulate(tmp_path, write_trace(tmp_path, GOOD_ROWS), "-p", "sjf")
    assert code == 0, output
    for name in ("jct_cdf.png", "gpu_util.png", "queue_length.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert str(out) in output  # says where it wrote them


def test_the_gpusched_module_runs_as_a_program_on_synthetic_jobs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpusched.services.cli.main",
            "simulate",
            "--synthetic",
            "12",
            "--rate",
            "30",
            "--cluster",
            "2x4",
            "-p",
            "sjf,tiresias",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    policies = json.loads((out / "summary.json").read_text())["policies"]
    assert set(policies) == {"sjf", "tiresias"}
    assert policies["sjf"]["jobs"] == 12


def test_prediction_error_and_restart_overhead_are_accepted(tmp_path: Path) -> None:
    code, output, _ = simulate(
        tmp_path,
        write_trace(tmp_path, GOOD_ROWS),
        "-p",
        "tiresias",
        "--prediction-error",
        "0.5",
        "--restart-overhead",
        "0",
        "--seed",
        "7",
    )
    assert code == 0, output


def test_a_job_bigger_than_the_cluster_is_unschedulable_and_the_run_ends(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path, [*GOOD_ROWS, "huge,10,64,bert,64,600"])
    code, output, out = simulate(tmp_path, trace, "-p", "fifo", "-p", "sjf-bsbf")
    assert code == 0, output
    huge = [j for j in read_jobs(out) if j["job_id"] == "huge"]
    assert [j["state"] for j in huge] == ["unschedulable", "unschedulable"]
    assert all("64 GPUs" in j["reason"] for j in huge)
    summary = json.loads((out / "summary.json").read_text())["policies"]["fifo"]
    assert summary["jobs"] == len(GOOD_ROWS) + 1
    assert summary["finished"] == len(GOOD_ROWS)


def test_skip_bad_rows_runs_the_good_rows_and_reports_the_skipped_count(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path, [*GOOD_ROWS, "bad,200,two,bert,64,600"])
    code, output, out = simulate(tmp_path, trace, "--skip-bad-rows", "-p", "fifo")
    assert code == 0, output
    assert "skipped 1 malformed row" in output
    assert json.loads((out / "summary.json").read_text())["policies"]["fifo"]["jobs"] == 6


# ------------------------------------------------------------------------ user errors


def test_an_unknown_policy_exits_2_listing_the_valid_policies(tmp_path: Path) -> None:
    code, output, out = simulate(tmp_path, write_trace(tmp_path, GOOD_ROWS), "-p", "lottery")
    line = assert_one_line_error(code, output)
    assert "lottery" in line
    assert all(name in line for name in POLICIES)
    assert not out.exists()  # nothing ran, nothing written


def test_a_malformed_trace_row_exits_2_naming_file_line_and_field(tmp_path: Path) -> None:
    trace = write_trace(tmp_path, [*GOOD_ROWS[:2], "bad,200,two,bert,64,600"])
    line = assert_one_line_error(*simulate(tmp_path, trace)[:2])
    assert f"{trace}:4" in line
    assert "'gpus'" in line


def test_an_unknown_model_in_the_trace_exits_2_listing_the_valid_models(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path, ["j1,0,1,alexnet,64,600"])
    line = assert_one_line_error(*simulate(tmp_path, trace)[:2])
    assert "alexnet" in line
    assert "resnet50" in line


def test_a_missing_trace_file_exits_2(tmp_path: Path) -> None:
    line = assert_one_line_error(*simulate(tmp_path, tmp_path / "nowhere.csv")[:2])
    assert "nowhere.csv" in line


@pytest.mark.parametrize("spec", ["2y4", "0x4", "lots"])
def test_a_bad_cluster_spec_exits_2(tmp_path: Path, spec: str) -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--synthetic",
            "3",
            "--cluster",
            spec,
            "--out",
            str(tmp_path / "o"),
        ],
    )
    line = assert_one_line_error(result.exit_code, result.output)
    assert spec in line


def test_an_unknown_format_exits_2_listing_the_valid_formats(tmp_path: Path) -> None:
    trace = write_trace(tmp_path, GOOD_ROWS)
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--format",
            "excel",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert all(fmt in result.output for fmt in FORMATS)


def test_a_trace_file_without_a_format_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(write_trace(tmp_path, GOOD_ROWS)),
            "--out",
            str(tmp_path),
        ],
    )
    assert "--format" in assert_one_line_error(result.exit_code, result.output)


def test_the_format_choices_are_the_trace_loaders_formats() -> None:
    assert tuple(f.value for f in TraceFormat) == FORMATS


# ------------------------------------------------------------------------ other commands


def test_policies_lists_every_policy_with_a_description() -> None:
    result = runner.invoke(app, ["policies"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for name in POLICIES:
        assert len(lines[name].split()) > 2, lines[name]


def test_cluster_alibaba_needs_a_data_dir() -> None:
    with pytest.raises(ValueError, match="--data-dir"):
        build_cluster("alibaba", None)


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="research data not available")
def test_cluster_alibaba_reads_the_node_list_from_the_data_dir() -> None:
    cluster = build_cluster("alibaba", DATA_DIR)
    assert len(cluster.nodes) > 1000
    assert cluster.total_gpus > len(cluster.nodes)


# ------------------------------------------------------------------------ report pieces


def test_a_summary_with_no_finished_job_writes_null_not_nan() -> None:
    empty = SimResult(
        policy="fifo",
        total_gpus=8,
        jobs=(),
        makespan_s=0.0,
        gpu_util=0.0,
        preemptions=0,
        shared_pairs=0,
        wall_s=0.0,
        decisions=0,
        timeline=(),
    )
    summary = summary_json([empty])
    assert summary["policies"]["fifo"]["avg_jct_s"] is None
    assert "NaN" not in json.dumps(summary)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0 s"),
        (0.25, "250 ms"),
        (35.0, "35 s"),
        (12.4 * 60, "12 min"),
        (1.2 * 3600, "1.2 h"),
        (2.3 * 86400, "2.3 d"),
        (math.nan, "-"),
    ],
)
def test_durations_read_like_a_person_would_say_them(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


# ------------------------------------------------------------- resident slowdown cap


def synthetic_run(tmp_path: Path, name: str, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / name
    result = runner.invoke(
        app,
        [
            "simulate",
            "--synthetic",
            "300",
            "--rate",
            "60",
            "--cluster",
            "1x4",
            "--out",
            str(out),
            *args,
        ],
    )
    return result.exit_code, result.output, out


def test_a_resident_slowdown_cap_reaches_the_sharing_policies_and_no_other(tmp_path: Path):
    policies = ("-p", "sjf-bsbf", "-p", "sjf-ffs", "-p", "sjf")
    code, output, out = synthetic_run(tmp_path, "spec", *policies)
    assert code == 0, output
    spec = json.loads((out / "summary.json").read_text())["policies"]
    # the built-in slowdowns are all above 1.0, so a cap of 1.0 forbids every pair
    code, output, out = synthetic_run(
        tmp_path, "capped", *policies, "--max-resident-slowdown", "1.0"
    )
    assert code == 0, output
    capped = json.loads((out / "summary.json").read_text())["policies"]
    assert spec["sjf-bsbf"]["shared_pairs"] > 0 and spec["sjf-ffs"]["shared_pairs"] > 0
    assert capped["sjf-bsbf"]["shared_pairs"] == capped["sjf-ffs"]["shared_pairs"] == 0
    assert capped["sjf"]["avg_jct_s"] == spec["sjf"]["avg_jct_s"]
    # the summary says which runs had a cap
    assert capped["sjf-bsbf"]["max_resident_slowdown"] == 1.0
    assert "max_resident_slowdown" not in capped["sjf"]
    assert "max_resident_slowdown" not in spec["sjf-bsbf"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("-p", "fifo", "--max-resident-slowdown", "1.5"), "sjf-ffs, sjf-bsbf"),
        (("-p", "sjf-bsbf", "--max-resident-slowdown", "0.5"), "at least 1.0"),
    ],
    ids=["no sharing policy selected", "below one"],
)
def test_a_resident_slowdown_cap_that_cannot_apply_exits_2(tmp_path: Path, args, expected):
    line = assert_one_line_error(*synthetic_run(tmp_path, "bad", *args)[:2])
    assert "max resident slowdown" in line
    assert expected in line


def test_up_refuses_a_resident_slowdown_cap_below_one_before_starting_anything(tmp_path: Path):
    result = runner.invoke(
        app, ["up", "--max-resident-slowdown", "0.5", "--state-dir", str(tmp_path / "state")]
    )
    assert result.exit_code == 2, result.output
    assert "max_resident_slowdown" in result.output
    assert not (tmp_path / "state").exists()
