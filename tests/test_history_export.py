"""`gpusched history export` and GET /v1/history/export: a live cluster's finished jobs
become a native trace and a cluster file that `gpusched simulate` replays. A real
nats-server, the real admission API over HTTP; where jobs must run, the live scheduler
and emulated node agents run them (simulated jobs, 100 times faster than profiled)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    JobRecord,
    JobSpec,
    JobState,
    Placement,
    Progress,
    StateChange,
)
from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.cluster_file import (
    ClusterFileError,
    cluster_from_document,
    load_cluster_file,
    write_cluster_file,
)
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.traces import TraceError, TraceJob, load_trace, native_job, write_native
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService
from tests import limits
from tests.live import fast_scheduler

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta", "tok-ops": "ops"}
OPERATORS = frozenset({"ops"})
EXPORT = "/v1/history/export"
#: a limit for one step of a live test: starting services, a round trip through the
#: scheduler, a job of a few hundred simulated iterations (well under a second of wall
#: time at the time scale below); it only bounds a hang
STEP_S = limits.FLOOR_S
TIME_SCALE = 0.01
#: the emulated nodes' GPUs: 2 nodes of 2
NODES, GPUS_PER_NODE = 2, 2


@dataclass
class Api:
    session: aiohttp.ClientSession
    url: str

    async def get(self, path: str, token: str = "tok-alpha", **params: str
                  ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"}
        async with self.session.get(self.url + path, params=params or None,
                                    headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def submit(self, body: dict[str, Any], token: str = "tok-alpha") -> str:
        headers = {"Authorization": f"Bearer {token}"}
        async with self.session.post(f"{self.url}/v1/jobs", json=body,
                                     headers=headers) as response:
            assert response.status == 201, await response.text()
            return str((await response.json())["id"])

    async def cancel(self, job_id: str, token: str = "tok-alpha") -> None:
        headers = {"Authorization": f"Bearer {token}"}
        async with self.session.delete(f"{self.url}/v1/jobs/{job_id}",
                                       headers=headers) as response:
            assert response.status == 202, await response.text()

    async def job_when(self, job_id: str, check: Callable[[dict[str, Any]], bool]
                       ) -> dict[str, Any]:
        async def matching() -> dict[str, Any] | None:
            status, job = await self.get(f"/v1/jobs/{job_id}")
            assert status == 200, job
            return job if check(job) else None

        result: dict[str, Any] = await wait_until(matching, timeout_s=STEP_S, every_s=0.05)
        return result


def admission_config(url: str) -> AdmissionConfig:
    return AdmissionConfig(nats_url=url, port=0, tokens=TOKENS, operators=OPERATORS)


@pytest.fixture
async def live(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Api]:
    """Admission, the live scheduler (fifo) and 2 emulated nodes of 2 GPUs."""
    url = nats_server.url
    agents = EmulatedCluster.of(
        url, NODES, GPUS_PER_NODE, work_dir=tmp_path / "work", heartbeat_s=0.2,
        telemetry_s=0.5, progress_s=0.2, time_scale=TIME_SCALE,
    )
    async with (
        agents,
        SchedulerService(fast_scheduler(url, policy="fifo")),
        AdmissionService(admission_config(url)) as admission,
        aiohttp.ClientSession() as session,
    ):
        yield Api(session, admission.url)


@pytest.fixture
async def api(nats_server: NatsServer) -> AsyncIterator[Api]:
    """Admission alone: tests store the records a scheduler would have written."""
    async with (
        AdmissionService(admission_config(nats_server.url)) as admission,
        aiohttp.ClientSession() as session,
    ):
        yield Api(session, admission.url)


def finished(job: dict[str, Any]) -> bool:
    return job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """The CLI in a process of its own; the services live on this event loop, so the
    wait must not block it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=STEP_S)
    return process.returncode or 0, out.decode(), err.decode()


def cli_env(api: Api, token: str = "tok-alpha") -> dict[str, str]:
    return {**os.environ, "GPUSCHED_URL": api.url, "GPUSCHED_TOKEN": token,
            "COLUMNS": "200"}


# ------------------------------------------------------------------ a live cluster


async def test_finished_jobs_export_as_a_trace_the_simulator_replays(live: Api, tmp_path):
    deadline = time.time() + 3600
    first = await live.submit(
        {"name": "first", "model": "resnet50", "batch_size": 64, "iterations": 200}
    )
    second = await live.submit(
        {"name": "second", "model": "bert", "batch_size": 32, "iterations": 100, "gpus": 2,
         "deadline": deadline, "min_batch_size": 16, "max_batch_size": 64, "priority": 5}
    )
    # a job that runs until it is cancelled, after its node reported a speed
    third = await live.submit(
        {"name": "third", "model": "resnet18", "batch_size": 64, "iterations": 10_000_000}
    )
    await live.job_when(third, lambda j: j["progress"]["samples_per_s"] > 0)
    await live.cancel(third)
    # larger than the cluster: never runs; one cancelled, one left waiting
    never = await live.submit(
        {"name": "never", "model": "resnet50", "batch_size": 64, "iterations": 10, "gpus": 8}
    )
    waiting = await live.submit(
        {"name": "waiting", "model": "resnet50", "batch_size": 64, "iterations": 10, "gpus": 8}
    )
    await live.cancel(never)
    records = {job_id: await live.job_when(job_id, finished)
               for job_id in (first, second, third, never)}
    assert [records[j]["state"] for j in (first, second, third, never)] == [
        "SUCCEEDED", "SUCCEEDED", "CANCELLED", "CANCELLED"]
    assert records[never]["progress"]["iteration"] == 0

    status, export = await live.get(EXPORT)
    assert status == 200, export
    rows = export["jobs"]
    assert [row["job_id"] for row in rows] == [first, second, third]
    assert [row["model"] for row in rows] == ["resnet50", "bert", "resnet18"]
    assert [row["gpus"] for row in rows] == [1, 2, 1]
    assert [row["batch_size"] for row in rows] == [64, 32, 64]
    ran = records[third]["progress"]["iteration"]
    assert 0 < ran < 10_000_000
    assert [row["iterations"] for row in rows] == [200, 100, ran]
    assert {row["user"] for row in rows} == {"alpha"}
    times = [row["submit_time"] for row in rows]
    assert times[0] == 0 and times == sorted(times)
    # the nodes ran at TIME_SCALE: the trace is in the jobs' own seconds
    assert export["time_scale"] == TIME_SCALE
    assert times[1] == pytest.approx(
        (records[second]["submitted_at"] - records[first]["submitted_at"]) / TIME_SCALE
    )
    assert export["first_submitted_at"] == records[first]["submitted_at"]
    assert rows[1]["deadline"] == pytest.approx(
        (deadline - records[second]["submitted_at"]) / TIME_SCALE
    )
    assert (rows[1]["min_batch_size"], rows[1]["max_batch_size"], rows[1]["priority"]) == (
        16, 64, 5)
    assert "deadline" not in rows[0] and "min_batch_size" not in rows[0]
    assert export["states"] == {"CANCELLED": 1, "SUCCEEDED": 2}
    assert export["left_out"] == {
        "failed or cancelled before reporting an iteration": 1,
        "not finished yet (queued, running or preempted)": 1,
    }
    assert export["tenants"] == ["alpha"] and export["all_tenants"] is False
    # the measured iteration time is the speed the job's record holds, on its GPUs'
    # model where the record still names its node (a cancelled job's is cleared)
    for row in rows:
        record = records[row["job_id"]]
        rate = record["progress"]["samples_per_s"]
        if rate > 0:
            assert row["measured_iteration_s"] == pytest.approx(
                row["batch_size"] / rate, rel=1e-5)
            # the node says which shape of run the speed is of
            progress = record["progress"]
            assert (progress["batch_size"], progress["gpus"]) == (row["batch_size"],
                                                                  row["gpus"])
        else:
            assert "measured_iteration_s" not in row
        if rate > 0 and record["placement"]:
            assert row["measured_gpu_model"] == "V100-32GB"
        else:
            assert "measured_gpu_model" not in row
    # emulated GPUs run a job at its profiled speed: that is what was measured
    profiled = load_performance_model(None).iteration_time("resnet18", 64, 1, 1)
    assert rows[2]["measured_iteration_s"] == pytest.approx(profiled, rel=1e-5)
    nodes = export["cluster"]["nodes"]
    assert [(n["name"], n["gpus"], n["gpu_model"]) for n in nodes] == [
        (f"node-{i}", GPUS_PER_NODE, "V100-32GB") for i in range(NODES)]
    assert export["cluster_spec"] == f"{NODES}x{GPUS_PER_NODE}"

    # another tenant sees none of it; an operator sees it all
    status, problem = await live.get(EXPORT, token="tok-beta")
    assert status == 404 and problem["type"] == "/problems/no-finished-jobs", problem
    status, everyone = await live.get(EXPORT, token="tok-ops")
    assert status == 200 and everyone["all_tenants"] is True
    assert [row["job_id"] for row in everyone["jobs"]] == [first, second, third]

    # the CLI writes the trace and the cluster file, and says what it wrote
    out = tmp_path / "history.csv"
    code, said, err = await run_cli(cli_env(live), "history", "export", "--out", str(out))
    assert code == 0, err
    assert said.startswith(
        f"wrote 3 finished jobs (1 CANCELLED, 2 SUCCEEDED) of tenant alpha to {out}")
    cluster_file = Path(f"{out}.cluster.json")
    assert f"to {cluster_file}" in said and "left out: 1 failed or cancelled before" in said
    await live.cancel(waiting)

    # the trace reader reads it back without research data, as exported
    trace = load_trace(out, "native")
    assert [j.job_id for j in trace.jobs] == [first, second, third]
    assert [j.iterations for j in trace.jobs] == [200, 100, ran]
    assert [(j.model, j.gpus, j.batch_size, j.user) for j in trace.jobs] == [
        ("resnet50", 1, 64, "alpha"), ("bert", 2, 32, "alpha"), ("resnet18", 1, 64, "alpha")]
    assert trace.jobs[1].deadline == pytest.approx(rows[1]["submit_time"] + rows[1]["deadline"])
    assert (trace.jobs[1].min_batch_size, trace.jobs[1].max_batch_size) == (16, 64)
    assert trace.jobs[2].measured_iteration_s == rows[2]["measured_iteration_s"]
    assert trace.jobs[1].priority == 5
    cluster = load_cluster_file(cluster_file)
    assert [(n.name, n.gpus, n.gpu_model, n.gpu_mem_mb) for n in cluster.nodes] == [
        (f"node-{i}", GPUS_PER_NODE, "V100-32GB", 32768) for i in range(NODES)]

    # and the simulator replays it on that cluster to the end
    sim = tmp_path / "sim"
    code, said, err = await run_cli(
        cli_env(live), "simulate", "--trace", str(out), "--format", "native",
        "--cluster", str(cluster_file), "--out", str(sim), "--policy", "fifo",
    )
    assert code == 0, err
    summary = json.loads((sim / "summary.json").read_text())["policies"]["fifo"]
    assert summary["jobs"] == summary["finished"] == 3
    # the deadline the bert job had is in the replay too
    assert summary["qos_pct"] == 100.0


async def test_the_export_as_json_lines_reads_back_the_same(live: Api, tmp_path):
    job_id = await live.submit(
        {"name": "one", "model": "resnet50", "batch_size": 64, "iterations": 50}
    )
    await live.job_when(job_id, finished)
    csv_out, jsonl_out = tmp_path / "h.csv", tmp_path / "h.jsonl"
    for out in (csv_out, jsonl_out):
        code, _, err = await run_cli(cli_env(live), "history", "export", "--out", str(out))
        assert code == 0, err
    from_csv = [_without_line(j) for j in load_trace(csv_out, "native").jobs]
    from_jsonl = [_without_line(j) for j in load_trace(jsonl_out, "native").jobs]
    assert from_csv == from_jsonl and [j.job_id for j in from_csv] == [job_id]


async def test_an_export_carries_the_live_outcome_and_whatif_compares_with_it(
    live: Api, tmp_path
):
    ids = [await live.submit({"name": f"w{i}", "model": "resnet50", "batch_size": 64,
                              "iterations": 100, "gpus": 2}) for i in range(3)]
    records = [await live.job_when(job_id, finished) for job_id in ids]
    out = tmp_path / "h.csv"
    code, _, err = await run_cli(cli_env(live), "history", "export", "--out", str(out))
    assert code == 0, err
    jobs = load_trace(out, "native").jobs
    for job, record in zip(jobs, records, strict=True):
        ended = [c["at"] for c in record["history"] if c["state"] == "SUCCEEDED"][-1]
        assert job.live_state == "SUCCEEDED"
        assert job.live_policy == "fifo"  # the policy the leader ran
        assert job.live_jct_s == pytest.approx(
            (ended - record["submitted_at"]) / TIME_SCALE, abs=0.2
        )
        assert job.live_queue_s is not None and 0 <= job.live_queue_s <= job.live_jct_s
    code, said, err = await run_cli(cli_env(live), "history", "whatif", str(out),
                                    "--policy", "fifo", "--policy", "sjf")
    assert code == 0, err
    # the table's rows: a name, then the jobs that ended
    names = [line.split(" 3/3")[0].strip() for line in said.splitlines() if " 3/3 " in line]
    assert names == ["live (fifo)", "fifo", "sjf"], said
    assert "best: " in said


def _without_line(job: TraceJob) -> TraceJob:
    from dataclasses import replace

    return replace(job, line=0)


# ------------------------------------------------------------------ stored records


def record(job_id: str, tenant: str, submitted_at: float, state: JobState,
           iterations: int, **spec_fields: Any) -> JobRecord:
    spec = JobSpec(**{"name": job_id, "model": "resnet50", "batch_size": 64,
                      "iterations": 1000, **spec_fields})
    history = [StateChange(JobState.QUEUED, submitted_at, "submitted")]
    if state is not JobState.QUEUED:
        history.append(StateChange(state, submitted_at + 10, "test"))
    return JobRecord(
        id=job_id, tenant=tenant, spec=spec, total_iterations=1000, state=state,
        submitted_at=submitted_at, history=history,
        progress=Progress(iteration=iterations, samples_per_s=320.0 if iterations else 0.0),
        placement=[Placement("node-0", [0])] if state is JobState.SUCCEEDED else [],
    )


async def store(stores: Stores, *records: JobRecord) -> None:
    for job in records:
        await stores.jobs.create(job.id, codec.encode(job))


async def exported_ids(api: Api, token: str = "tok-alpha", **params: str) -> list[str]:
    status, export = await api.get(EXPORT, token, **params)
    assert status == 200, export
    return [row["job_id"] for row in export["jobs"]]


async def test_the_window_takes_jobs_submitted_from_since_up_to_until(api: Api, stores):
    await store(
        stores,
        record("ja", "alpha", 1_000.0, JobState.SUCCEEDED, 1000),
        record("jb", "alpha", 2_000.0, JobState.FAILED, 40),
        record("jc", "alpha", 3_000.0, JobState.CANCELLED, 7),
        record("jd", "alpha", 4_000.0, JobState.SUCCEEDED, 1000),
    )
    # the mirror follows the store
    await wait_until(lambda: api_ids_ready(api, 4), timeout_s=STEP_S, every_s=0.05)
    assert await exported_ids(api) == ["ja", "jb", "jc", "jd"]
    assert await exported_ids(api, since="2000", until="4000") == ["jb", "jc"]
    # ISO 8601 with or without a zone (none: UTC), and unix seconds, mean the same
    assert await exported_ids(api, since="1970-01-01T00:33:20Z") == ["jb", "jc", "jd"]
    assert await exported_ids(api, since="1970-01-01 00:33:20") == ["jb", "jc", "jd"]
    assert await exported_ids(api, until="1970-01-01T01:50:00+01:00") == ["ja", "jb"]
    status, export = await api.get(EXPORT, since="2000", until="4000")
    assert status == 200, export
    assert export["since"] == 2000 and export["until"] == 4000
    assert [row["submit_time"] for row in export["jobs"]] == [0, 1000]
    assert [row["iterations"] for row in export["jobs"]] == [40, 7]
    assert export["states"] == {"CANCELLED": 1, "FAILED": 1}
    assert export["first_submitted_at"] == 2000 and export["last_submitted_at"] == 3000


async def api_ids_ready(api: Api, count: int) -> bool:
    status, export = await api.get(EXPORT, "tok-ops")
    return status == 200 and len(export["jobs"]) == count


async def test_a_tenant_exports_its_own_jobs_and_an_operator_every_tenants(
    api: Api, stores
):
    await store(
        stores,
        record("ja", "alpha", 1_000.0, JobState.SUCCEEDED, 1000),
        record("jb", "beta", 1_500.0, JobState.SUCCEEDED, 1000),
        record("jc", "alpha", 2_000.0, JobState.SUCCEEDED, 1000),
    )
    await wait_until(lambda: api_ids_ready(api, 3), timeout_s=STEP_S, every_s=0.05)
    assert await exported_ids(api, "tok-alpha") == ["ja", "jc"]
    assert await exported_ids(api, "tok-beta") == ["jb"]
    status, export = await api.get(EXPORT, "tok-ops")
    assert [row["job_id"] for row in export["jobs"]] == ["ja", "jb", "jc"]
    assert [row["user"] for row in export["jobs"]] == ["alpha", "beta", "alpha"]
    assert export["tenants"] == ["alpha", "beta"] and export["all_tenants"] is True
    # an operator is a tenant like any other everywhere else: its job list is its own
    async with api.session.get(f"{api.url}/v1/jobs",
                               headers={"Authorization": "Bearer tok-ops"}) as response:
        assert (await response.json())["jobs"] == []
    status, problem = await api.get(EXPORT, "tok-nobody")
    assert status == 401, problem


@pytest.mark.parametrize(
    ("params", "status", "field", "says"),
    [
        ({"since": "yesterday"}, 422, "since", "expected unix seconds or an ISO 8601"),
        ({"until": "2026-13-01"}, 422, "until", "not a valid time"),
        ({"since": "-5"}, 422, "since", "expected unix seconds"),
        ({"since": "2026-02-01", "until": "2026-01-01"}, 422, "since", "is not before until"),
        ({"since": "100", "until": "100"}, 422, "since", "is not before until"),
        ({"from": "100"}, 400, "from", "unknown query parameter"),
    ],
)
async def test_a_malformed_window_is_refused_naming_the_field(
    api: Api, params: dict[str, str], status: int, field: str, says: str
):
    answered, problem = await api.get(EXPORT, **params)
    assert answered == status, problem
    assert problem["field"] == field and says in problem["detail"], problem
    assert problem["detail"].startswith(f"{field}: ")


async def test_a_window_without_finished_jobs_is_a_404_saying_what_was_left_out(
    api: Api, stores
):
    status, problem = await api.get(EXPORT)
    assert status == 404 and problem["type"] == "/problems/no-finished-jobs", problem
    assert problem["detail"] == (
        "no job to export: tenant alpha has no finished job submitted so far")
    await store(
        stores,
        record("ja", "alpha", 1_000.0, JobState.RUNNING, 10),
        record("jb", "alpha", 1_100.0, JobState.CANCELLED, 0),
        record("jc", "alpha", 9_000.0, JobState.SUCCEEDED, 1000),
    )
    await wait_until(lambda: api_ids_ready(api, 1), timeout_s=STEP_S, every_s=0.05)
    status, problem = await api.get(EXPORT, until="5000")
    assert status == 404, problem
    assert "until 1970-01-01T01:23:20+00:00" in problem["detail"]
    assert "1 failed or cancelled before reporting an iteration" in problem["detail"]
    assert "1 not finished yet" in problem["detail"]


async def test_the_cli_names_the_option_of_a_bad_window_and_the_file(api: Api, stores,
                                                                      tmp_path):
    env = cli_env(api)
    out = str(tmp_path / "h.csv")
    code, _, err = await run_cli(env, "history", "export", "--out", out, "--since", "nope")
    assert code == 2 and "error: --since: 'nope': expected unix seconds" in err, err
    code, _, err = await run_cli(env, "history", "export", "--out", out,
                                 "--since", "2026-02-01", "--until", "2026-01-01")
    assert code == 2 and "error: --since:" in err and "is not before until" in err, err
    code, _, err = await run_cli(env, "history", "export", "--out", out)
    assert code == 2 and "error: no job to export" in err, err
    code, _, err = await run_cli(env, "history", "export", "--out", str(tmp_path / "h.txt"))
    assert code == 2 and "--out" in err and ".csv or .jsonl" in err, err
    assert not Path(out).exists()


# ------------------------------------------------------------------ formats and settings


def test_the_native_format_keeps_elastic_bounds_and_measured_speeds(tmp_path):
    job = TraceJob("j1", 0.0, 2, model="bert", batch_size=32, iterations=100,
                   min_batch_size=16, max_batch_size=64, measured_iteration_s=0.25,
                   measured_gpu_model="NVIDIA H100 80GB HBM3", user="alpha")
    for name in ("t.csv", "t.jsonl"):
        write_native(tmp_path / name, [job])
        assert _without_line(load_trace(tmp_path / name, "native").jobs[0]) == job
    for bad, field in (
        ({"min_batch_size": 64}, "min_batch_size"),
        ({"max_batch_size": 16}, "max_batch_size"),
        ({"measured_iteration_s": 0}, "measured_iteration_s"),
        ({"measured_iteration_s": "fast"}, "measured_iteration_s"),
        ({"speed": 1}, "speed"),
    ):
        row = {"job_id": "j1", "submit_time": 0, "gpus": 1, "batch_size": 32,
               "iterations": 10, **bad}
        with pytest.raises(TraceError, match=f"field '{field}'"):
            native_job(row)


def test_a_cluster_file_round_trips_and_names_what_is_wrong(tmp_path):
    cluster = Cluster((Node("a", 4, 32768, 16, 256.0, 100.0, "V100-32GB"),
                       Node("b", 8, 81559, 64, 1024.0, 400.0, "NVIDIA H100 80GB HBM3")))
    path = tmp_path / "c.cluster.json"
    write_cluster_file(path, cluster)
    assert load_cluster_file(path) == cluster
    document = json.loads(path.read_text())
    document["nodes"][1]["gpus"] = 0
    with pytest.raises(ClusterFileError, match=r"nodes\[1\]\.gpus"):
        cluster_from_document(document)
    del document["nodes"][0]["cpus"]
    with pytest.raises(ClusterFileError, match=r"nodes\[0\]: missing cpus"):
        cluster_from_document(document)
    with pytest.raises(ClusterFileError, match="'nodes'"):
        cluster_from_document({"nodes": []})


def test_operators_come_from_the_environment_or_the_tokens_file(tmp_path):
    config = AdmissionConfig.from_env(
        {"GPUSCHED_TOKENS": "t1=alpha,t2=ops", "GPUSCHED_OPERATORS": " ops ,"}
    )
    assert config.operators == {"ops"}
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text("tokens: {t1: alpha, t2: ops}\noperators: [ops]\n")
    assert AdmissionConfig.from_env(
        {"GPUSCHED_TOKENS_FILE": str(tokens_file)}).operators == {"ops"}
    with pytest.raises(ValueError, match="operators: tenant 'root' has no token"):
        AdmissionConfig.from_env({"GPUSCHED_TOKENS": "t1=alpha", "GPUSCHED_OPERATORS": "root"})


def test_the_measured_iteration_is_left_out_when_a_resize_changed_the_shape():
    from gpusched.services.admission.history import export

    resized = msgspec.structs.replace(
        record("ja", "alpha", 1_000.0, JobState.SUCCEEDED, 1000), batch_size=128
    )
    plain = record("jb", "alpha", 1_001.0, JobState.SUCCEEDED, 1000)
    rows = export([resized, plain], [], None, None, all_tenants=False, tenant="alpha").jobs
    assert rows[0].measured_iteration_s is None
    assert rows[1].measured_iteration_s == 64 / 320.0
    assert rows[1].measured_gpu_model is None  # node-0 is not registered
    assert math.isclose(rows[1].submit_time, 1.0)


def test_a_job_resized_and_back_exports_only_a_speed_of_its_own_shape():
    from gpusched.services.admission.history import export

    def resized(job_id: str, at: float, progress: Progress) -> JobRecord:
        # ones: 1 GPU, resized to 2 and back to 1; the last run ended before reporting,
        # so the record keeps the 2-GPU run's speed (twice the samples a second)
        base = record(job_id, "alpha", at, JobState.SUCCEEDED, 1000, gpus=1)
        history = [*base.history[:1],
                   StateChange(JobState.RUNNING, at + 1, "started"),
                   StateChange(JobState.RUNNING, at + 2, "resized to batch 64 on 2 GPUs"),
                   StateChange(JobState.RUNNING, at + 3, "resized to batch 64 on 1 GPUs"),
                   StateChange(JobState.SUCCEEDED, at + 4, "finished")]
        return msgspec.structs.replace(base, history=history, gpus=1, batch_size=64,
                                       progress=progress)

    two_gpu_run = Progress(iteration=1000, samples_per_s=640.0, batch_size=64, gpus=2)
    own_run = Progress(iteration=1000, samples_per_s=320.0, batch_size=64, gpus=1)
    unstamped = Progress(iteration=1000, samples_per_s=640.0)
    rows = export(
        [resized("ja", 1_000.0, two_gpu_run), resized("jb", 1_001.0, own_run),
         resized("jc", 1_002.0, unstamped)],
        [], None, None, all_tenants=False, tenant="alpha",
    ).jobs
    by_id = {row.job_id: row for row in rows}
    assert by_id["ja"].measured_iteration_s is None  # not 64 / 640: another shape's
    assert by_id["jb"].measured_iteration_s == 64 / 320.0
    # without the run's shape, a job that changed shape keeps no figure
    assert by_id["jc"].measured_iteration_s is None


def test_an_unstamped_speed_of_a_preempted_job_is_left_out_and_a_stamped_one_kept():
    from gpusched.services.admission.history import export

    base = record("ja", "alpha", 1_000.0, JobState.SUCCEEDED, 1000)
    preempted = msgspec.structs.replace(base, preemptions=1)
    stamped = msgspec.structs.replace(
        preempted, id="jb", progress=Progress(iteration=1000, samples_per_s=320.0,
                                              batch_size=64, gpus=1))
    rows = export([preempted, stamped], [], None, None, all_tenants=False,
                  tenant="alpha").jobs
    assert [row.measured_iteration_s for row in rows] == [None, 64 / 320.0]


def test_a_job_that_succeeded_without_reporting_progress_counts_its_declared_total():
    from gpusched.services.admission.history import NEVER_RAN, export

    silent = record("ja", "alpha", 1_000.0, JobState.SUCCEEDED, 0)
    failed = record("jb", "alpha", 1_001.0, JobState.FAILED, 0)
    result = export([silent, failed], [], None, None, all_tenants=False, tenant="alpha")
    assert [(row.job_id, row.iterations) for row in result.jobs] == [("ja", 1000)]
    assert result.left_out == {NEVER_RAN: 1}


def test_the_cli_gives_a_time_without_a_zone_this_machines_zone():
    from datetime import datetime

    from gpusched.services.cli.history import _zoned

    local = _zoned("2026-01-01T09:30")
    assert datetime.fromisoformat(local) == datetime(2026, 1, 1, 9, 30).astimezone()
    assert datetime.fromisoformat(local).tzinfo is not None
    for given in ("1767225600", "2026-01-01T09:30Z", "2026-01-01T09:30+01:00", "nope"):
        assert _zoned(given) == given
