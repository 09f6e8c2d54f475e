"""`gpusched history whatif`: an exported history replayed under each policy, beside
what the live cluster really did (the export's live columns). A small export written by
hand; the export of a live cluster is in tests/test_history_export.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.libs.common.schemas import JobRecord, JobSpec, JobState, Progress, StateChange
from gpusched.libs.core.traces import LIVE_FIELDS, TraceError, load_trace, write_native
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies import POLICIES

runner = CliRunner()

HEADER = ("job_id,submit_time,gpus,model,batch_size,iterations,user,"
          "live_jct_s,live_queue_s,live_state,live_policy")
ROWS = [
    "ja,0,2,resnet50,64,2000,alpha,900,0,SUCCEEDED,fifo",
    "jb,10,4,bert,32,1500,alpha,1500,600,SUCCEEDED,fifo",
    "jc,20,1,resnet18,64,3000,alpha,700,500,SUCCEEDED,fifo",
    "jd,30,2,resnet50,64,500,alpha,1200,1000,CANCELLED,fifo",
]
CLUSTER = {"nodes": [{"name": "node-0", "gpus": 4, "gpu_model": "V100-32GB",
                      "gpu_mem_mb": 32768, "cpus": 16, "host_mem_gb": 256.0,
                      "net_gbps": 100.0}]}
#: a table row: name, jobs ended, mean JCT, p99 JCT, mean queue, GPU-hours
ROW = re.compile(r"^\s*(live(?: \(\w[\w-]*\))?|[a-z][\w-]*)\s+(?:(\d+)/(\d+)|-)"
                 r"\s+([\d,.]+|missing|-)\s+([\d,.]+|missing|-)\s+([\d,.]+|missing|-)\s+([\d.]+|missing)\s*$")


def export(tmp_path: Path, header: str = HEADER, rows: list[str] = ROWS,
           cluster: bool = True) -> Path:
    path = tmp_path / "history.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    if cluster:
        Path(f"{path}.cluster.json").write_text(json.dumps(CLUSTER))
    return path


def whatif(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["history", "whatif", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def table(said: str) -> list[tuple[str, int, int, float]]:
    """(name, jobs ended, jobs, mean JCT) of each row of the table, in order."""
    rows = []
    for line in said.splitlines():
        match = ROW.match(line)
        if match:
            name, ended, jobs, mean = match.group(1, 2, 3, 4)
            value = float(mean.replace(",", "")) if mean[0].isdigit() else float("nan")
            rows.append((name, int(ended or 0), int(jobs or 0), value))
    return rows


def test_the_live_row_comes_first_then_every_policy_and_the_best_beats_it(tmp_path):
    trace = export(tmp_path)
    code, said, err = whatif(str(trace), "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = table(said)
    assert rows[0][0] == "live (fifo)"
    # the live figures are the export's columns: mean of the four JCTs
    assert rows[0][1:] == (4, 4, pytest.approx((900 + 1500 + 700 + 1200) / 4))
    expected = list(POLICIES)
    if "left out: " in err and "ones" in err:  # no torch: ones is left out, saying why
        expected.remove("ones")
    assert [r[0] for r in rows[1:]] == expected
    assert all(ended == jobs == 4 for _, ended, jobs, _ in rows[1:]), said
    best_name, _, _, best_jct = min(rows[1:], key=lambda r: r[3])
    best = re.search(r"^best: ([\w-]+), mean JCT .*shorter than live \(fifo\)'s", said,
                     re.MULTILINE)
    assert best is not None, said
    # equal means are possible: the named policy has the lowest mean in the table
    assert [r[3] for r in rows if r[0] == best.group(1)] == [best_jct], (best_name, said)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["whatif"]["live"]["name"] == "live (fifo)"
    assert summary["whatif"]["best"]["policy"] == best.group(1)
    assert summary["whatif"]["best"]["saved_s"] > 0
    assert set(summary["policies"]) == set(expected)
    assert (tmp_path / "out" / "report.html").is_file()


def test_named_policies_only(tmp_path):
    code, said, err = whatif(str(export(tmp_path)), "--policy", "fifo,sjf", "--policy", "srtf")
    assert code == 0, err
    assert [r[0] for r in table(said)] == ["live (fifo)", "fifo", "sjf", "srtf"]


def test_an_export_without_live_columns_still_replays_and_says_they_are_missing(tmp_path):
    header = ",".join(HEADER.split(",")[:7])
    rows = [",".join(row.split(",")[:7]) for row in ROWS]
    code, said, err = whatif(str(export(tmp_path, header, rows)), "--policy", "fifo,sjf")
    assert code == 0, err
    rows_seen = table(said)
    assert [r[0] for r in rows_seen] == ["live", "fifo", "sjf"]
    assert "missing" in said.splitlines()[next(
        i for i, line in enumerate(said.splitlines()) if line.strip().startswith("live"))]
    assert "live figures missing" in said
    assert "no live figures to compare with" in said


def test_a_missing_cluster_file_names_it_and_cluster(tmp_path):
    trace = export(tmp_path, cluster=False)
    code, _, err = whatif(str(trace), "--policy", "fifo")
    assert code == 2
    assert f"{trace}.cluster.json" in err and "--cluster" in err, err
    code, _, err = whatif(str(trace), "--policy", "fifo", "--cluster",
                          str(tmp_path / "nope.json"))
    assert code == 2 and "--cluster" in err and "nope.json" in err, err
    # a cluster shape replaces the file
    code, said, err = whatif(str(trace), "--policy", "fifo", "--cluster", "1x4")
    assert code == 0, err
    assert [r[0] for r in table(said)] == ["live (fifo)", "fifo"]


def test_an_unknown_policy_names_the_option(tmp_path):
    code, _, err = whatif(str(export(tmp_path)), "--policy", "fastest")
    assert code == 2 and "--policy" in err and "fastest" in err, err


def test_a_missing_trace_names_it(tmp_path):
    code, _, err = whatif(str(tmp_path / "none.csv"))
    assert code == 2 and "none.csv" in err, err


def test_the_native_format_keeps_the_live_columns(tmp_path):
    trace = load_trace(export(tmp_path), "native")
    job = trace.jobs[1]
    assert (job.live_jct_s, job.live_queue_s, job.live_state, job.live_policy) == (
        1500.0, 600.0, "SUCCEEDED", "fifo")
    again = tmp_path / "again.jsonl"
    write_native(again, trace.jobs)
    back = load_trace(again, "native").jobs
    assert [(j.live_jct_s, j.live_queue_s, j.live_state) for j in back] == [
        (j.live_jct_s, j.live_queue_s, j.live_state) for j in trace.jobs]
    assert "live_jct_s" in LIVE_FIELDS
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(TraceError, match="live_queue_s"):
        load_trace(export(bad, rows=["ja,0,2,resnet50,64,2000,alpha,100,200,SUCCEEDED,"]),
                   "native")


def test_the_export_counts_waits_from_the_records_history():
    from gpusched.services.admission.history import export as history_export

    t0 = 1000.0
    spec = JobSpec(name="a", model="resnet50", batch_size=64, iterations=100)
    history = [
        StateChange(JobState.QUEUED, t0, "submitted"),
        StateChange(JobState.RUNNING, t0 + 5, "started"),
        StateChange(JobState.PREEMPTED, t0 + 20, "preempted"),
        StateChange(JobState.QUEUED, t0 + 21, "requeued"),
        StateChange(JobState.RUNNING, t0 + 30, "started"),
        StateChange(JobState.SUCCEEDED, t0 + 50, "finished"),
    ]
    record = JobRecord(id="ja", tenant="alpha", spec=spec, total_iterations=100,
                       state=JobState.SUCCEEDED, submitted_at=t0, history=history,
                       progress=Progress(iteration=100))
    row = history_export([record], [], None, None, all_tenants=False, tenant="alpha",
                         policy="sjf").jobs[0]
    assert (row.live_jct_s, row.live_queue_s, row.live_state, row.live_policy) == (
        50.0, 15.0, "SUCCEEDED", "sjf")
