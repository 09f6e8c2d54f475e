"""Notes under the results table: a policy whose feature had nothing to act on says so,
worked out from the run, in the printed table, summary.json and report.html."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from typer.testing import CliRunner

from gpusched.services.cli.main import app
from gpusched.services.scheduler.simulation.report_html import REPORT_FILE
from gpusched.services.scheduler.simulation.result_notes import WorkloadFacts, result_notes
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import build_cluster, build_models, run_policies
from tests.test_report_html import parse

HEADER = "job_id,submit_time,gpus,model,batch_size,duration_s"
#: jobs queue behind each other on one 4-GPU node, so orders and sharing matter
ROWS = [
    "j1,0,4,bert,32,3600",
    "j2,10,2,resnet18,128,600",
    "j3,20,1,vgg16,64,1800",
    "j4,30,2,resnet50,64,300",
    "j5,40,1,bert,32,900",
    "j6,50,4,resnet18,128,1200",
]

runner = CliRunner()


def simulate(tmp_path: Path, rows: list[str], *args: str) -> tuple[str, dict, str]:
    """Run ``gpusched simulate`` on a 1 x 4 cluster; its output, summary.json and
    report.html."""
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join([HEADER, *rows]) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["simulate", "--trace", str(trace), "--format", "native", "--cluster", "1x4",
         "--out", str(out), *args],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    return result.output, summary, (out / REPORT_FILE).read_text(encoding="utf-8")


def notes_of(output: str) -> list[str]:
    return [line.removeprefix("note: ") for line in output.splitlines() if line.startswith("note:")]


def test_edf_without_deadlines_says_it_ran_as_fifo_backfill_in_the_table_json_and_report(
    tmp_path: Path,
):
    output, summary, html = simulate(tmp_path, ROWS, "-p", "fifo-backfill,edf,genie")
    printed = notes_of(output)
    edf = [n for n in printed if n.startswith("edf: no job has a deadline")]
    assert len(edf) == 1 and "fifo-backfill" in edf[0]
    assert any(n.startswith("genie: no job has a deadline") for n in printed)
    assert "Same schedule, job for job: fifo-backfill = edf." in printed
    assert summary["notes"] == printed
    page = parse(html)
    assert all(note in page.notes for note in printed)
    # and the figures it explains are indeed equal
    policies = summary["policies"]
    assert policies["edf"]["avg_jct_s"] == policies["fifo-backfill"]["avg_jct_s"]


def test_with_deadlines_edf_and_genie_get_no_note_about_them(tmp_path: Path):
    output, summary, _ = simulate(
        tmp_path, ROWS, "-p", "fifo-backfill,edf,genie", "--deadlines", "1.2-3"
    )
    assert not any(n.startswith(("edf:", "genie:")) for n in notes_of(output))
    assert not any(n.startswith(("edf:", "genie:")) for n in summary.get("notes", []))


def test_a_sharing_policy_that_formed_no_pair_says_so_and_one_that_did_does_not(
    tmp_path: Path,
):
    alone = ["j1,0,1,resnet18,128,600"]  # one job: no one to share with
    output, summary, _ = simulate(tmp_path, alone, "-p", "sjf-bsbf")
    assert summary["policies"]["sjf-bsbf"]["shared_pairs"] == 0
    assert notes_of(output) == [
        "sjf-bsbf: formed no sharing pair; every job ran on GPUs of its own."
    ]

    crowded = [f"j{i},{i},4,resnet18,128,3600" for i in range(4)]  # each wants the whole node
    output, summary, _ = simulate(tmp_path, crowded, "-p", "sjf-ffs")
    assert summary["policies"]["sjf-ffs"]["shared_pairs"] > 0
    assert not any(n.startswith("sjf-ffs:") for n in notes_of(output))


def test_synergy_says_when_no_model_gains_from_more_cpu_or_memory():
    truth, _ = build_models(None)
    cluster = build_cluster("1x4", None)
    flat = _jobs(truth, cluster, ["bert", "vgg16"])
    sensitive = _jobs(truth, cluster, ["bert", "resnet18"])
    assert WorkloadFacts.of(flat, truth).cpu_mem_sensitive == 0
    assert WorkloadFacts.of(sensitive, truth).cpu_mem_sensitive == 2  # the resnet18 jobs

    for jobs, expected in ((flat, True), (sensitive, False)):
        results = run_policies(jobs, cluster, ["synergy-fifo"], truth)
        notes = result_notes(results, WorkloadFacts.of(jobs, truth))
        assert any(n.startswith("synergy-fifo: no job's model") for n in notes) is expected


def test_ones_and_the_preemptive_policies_say_when_they_never_resized_or_preempted():
    quiet = [
        _result(name, finish=3_600.0 + i)
        for i, name in enumerate(("ones", "srtf", "tiresias", "asrpt", "fifo"))
    ]
    notes = result_notes(quiet)
    assert [n.split(":")[0] for n in notes] == ["ones", "srtf", "tiresias", "asrpt"]
    busy = [_result("ones", resizes=2), _result("srtf", finish=4_000.0, preemptions=3)]
    assert result_notes(busy) == []


def test_auto_says_its_elastic_search_never_ran_when_no_job_declares_bounds():
    truth, _ = build_models(None)
    rigid = _jobs(truth, build_cluster("1x4", None), ["bert", "resnet18"])
    facts = WorkloadFacts.of(rigid, truth)
    assert facts.elastic == 0
    notes = result_notes([_result("auto", finish=3_600.0)], facts)
    assert "auto: no job declares elastic bounds, so its elastic search never ran." in notes
    assert not any("resized no running job" in n for n in notes)
    elastic = [replace(rigid[0], min_gpus=1), *rigid[1:]]
    assert WorkloadFacts.of(elastic, truth).elastic == 1
    notes = result_notes([_result("auto", finish=3_600.0)], WorkloadFacts.of(elastic, truth))
    assert "auto: resized no running job; its search only placed new ones." in notes


def test_only_policies_with_the_same_start_and_finish_for_every_job_are_called_the_same():
    a, b, c = _result("fifo"), _result("sjf"), _result("srtf", finish=7_200.0, preemptions=1)
    assert result_notes([a, b, c]) == ["Same schedule, job for job: fifo = sjf."]


def _jobs(truth, cluster, models: list[str]):
    from gpusched.libs.core.traces import TraceJob
    from gpusched.libs.core.workload import materialize

    jobs = [
        TraceJob(job_id=f"j{i}", submit_time=10.0 * i, gpus=1, duration_s=1800.0, model=model)
        for i, model in enumerate(models * 2)
    ]
    return materialize(jobs, truth, seed=0, cluster=cluster)


def _result(
    policy: str, *, finish: float = 3_600.0, preemptions: int = 0, resizes: int = 0
) -> SimResult:
    from gpusched.services.scheduler.simulation.results import FINISHED, JobOutcome

    job = JobOutcome(
        job_id="j1", model="bert", gpus=1, submit_time=0.0, start_time=0.0,
        finish_time=finish, exclusive_s=3_600.0, queue_s=0.0, preemptions=preemptions,
        shared=False, state=FINISHED,
    )  # fmt: skip
    return SimResult(
        policy=policy, total_gpus=4, jobs=(job,), makespan_s=finish, gpu_util=0.25,
        preemptions=preemptions, shared_pairs=0, wall_s=0.01, decisions=2, timeline=(),
        resizes=resizes,
    )  # fmt: skip
