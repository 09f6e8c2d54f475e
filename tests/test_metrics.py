"""Prometheus metrics: the pending-reason vocabulary, a real `gpusched up` scraped over
HTTP, the admission's quota gauges, and a scheduler run alone serving its own."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from typer.testing import CliRunner

from gpusched.libs.common.embedded import NatsServer, free_port, wait_until
from gpusched.libs.common.schemas import GpuInfo, GpuTelemetry
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.service import AdmissionService
from gpusched.services.cli.main import app
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.nodeagent.gpus import emulated_uuid
from gpusched.services.nodeagent.metrics import JobReading, NodeCollector, NodeView
from gpusched.services.scheduler.live.metrics import PENDING_REASONS, pending_reason_label

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "metrics.md"
NODES, GPUS_PER_NODE = 2, 4
DCGM = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE")
DCGM_LABELS = {"gpu", "UUID", "Hostname", "modelName"}
#: the node agents report every telemetry_s (1 s by default): 30 ticks of margin
TELEMETRY_WAIT_S = 30.0


# ---------------------------------------------------------------------- reasons


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("no nodes with GPUs have registered", "no_nodes"),
        ("retry 1/3 in 2 s after exit code 1: CUDA out of memory", "retry_backoff"),
        ("waiting for the scheduler", "pending_decision"),
        ("waiting for the next scheduling round", "pending_decision"),
        ("preempted", "pending_decision"),
        ("requeued: node node-1 lost", "pending_decision"),
        ("start failed (node-0: no answer (TimeoutError)); retrying", "pending_decision"),
        ("unschedulable: needs 16 GPUs; the cluster has 8", "unschedulable"),
        ("unschedulable: needs 40000 MiB per GPU even at a sub-batch of 1; the largest GPU "
         "has 32768 MiB", "unschedulable"),
        ("can no longer meet its deadline: it waits behind every job that can",
         "deadline_hopeless"),
        ("gpus: tenant 'a' holds 4 GPUs in unfinished jobs; over its quota", "quota"),
        ("needs 8 CPUs and 40 GB on node-0; 2 CPUs and 10 GB free, 0 CPUs and 0 GB more "
         "above others' fair share", "host_resources"),
        ("needs 2 GPUs, 0 idle; no GPU holding a single job has memory for it", "memory"),
        ("no GPU count fits its per-GPU batch in GPU memory", "memory"),
        ("behind j1 in queue order, which needs 4 GPUs", "policy_order"),
        ("120 s of work left; higher-ranked jobs hold the GPUs it needs (2)", "policy_order"),
        ("priority queue 1; higher-ranked jobs hold the GPUs it needs (2)", "policy_order"),
        ("needs 2 GPUs; the best schedule found gives the GPUs to jobs with less predicted "
         "remaining GPU time", "policy_order"),
        ("all GPUs are busy; this round looked for sharing partners for the 8 shortest "
         "queued jobs only", "policy_order"),
        ("needs 1 GPUs, 0 idle; sharing would slow every running job it fits beside by "
         "more than 1.5x (max_resident_slowdown)", "policy_order"),
        ("all 8 GPUs are busy; waiting for a job to finish", "waiting_for_gpus"),
        ("all GPUs are busy and every shareable GPU already holds two jobs",
         "waiting_for_gpus"),
        ("needs 4 GPUs; 2 idle, largest idle block on one node 2", "waiting_for_gpus"),
        ("needs 2 idle GPUs, 1 idle; it does not allow sharing", "waiting_for_gpus"),
        ("needs 1 GPU; 0 idle", "waiting_for_gpus"),
        ("needs 4 GPUs", "waiting_for_gpus"),
        ("needs 4 GPUs; 5 idle, largest idle block on one node 3", "gang_does_not_fit"),
        ("the moon is in the wrong phase", "other"),
    ],
)
def test_a_policys_free_text_reason_maps_to_its_label(reason: str, label: str) -> None:
    assert pending_reason_label(reason) == label


@given(st.text())
def test_any_reason_text_maps_into_the_fixed_vocabulary(reason: str) -> None:
    assert pending_reason_label(reason) in PENDING_REASONS


# ---------------------------------------------------------------------- gpusched up


def parse(text: str) -> dict[str, tuple[str, list[Sample]]]:
    """Family name as documented (counters with ``_total``) -> (type, samples); the
    ``_created`` series of counters and histograms (parsed as gauges of their own) left
    out."""
    families = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = (family.type, family.samples)
    return families


def documented() -> dict[str, str]:
    """Series name -> type, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `([A-Za-z_:][A-Za-z0-9_:]*)` \| (\w+) \|", DOCS.read_text(), re.M)
    return dict(rows)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse(await response.text())


def samples(families: dict, name: str, suffix: str = "") -> list[Sample]:
    """The samples of the documented series ``name`` named with ``suffix`` (``_total`` of
    a counter, ``_count`` of a histogram; none for a gauge)."""
    wanted = name.removesuffix("_total") + suffix if suffix else name
    return [s for s in families[name][1] if s.name == wanted]


@pytest.fixture
async def cluster(nats_server, tmp_path, monkeypatch) -> AsyncIterator[LocalCluster]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=NODES, gpus_per_node=GPUS_PER_NODE, policy="sjf-bsbf", port=0, metrics_port=0,
        nats_url=nats_server.url, state_dir=tmp_path / "state", time_scale=0.01,
        heartbeat_s=0.2,
    )
    async with LocalCluster(config) as running:
        yield running


async def test_gpusched_up_serves_every_services_metrics_on_one_address(cluster):
    assert cluster.metrics_url.endswith("/metrics")
    headers = {"Authorization": f"Bearer {cluster.token}"}
    # far more iterations than the test lasts: the job runs until it is cancelled
    body = {"name": "metrics", "model": "resnet50", "batch_size": 64, "iterations": 10**8}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            job_id = (await response.json())["id"]

        async def with_progress() -> dict | None:
            families = await scrape(session, cluster.metrics_url)
            jobs = [s.labels.get("job") for s in families["gpusched_job_progress_ratio"][1]]
            return families if job_id in jobs else None

        families = await wait_until(with_progress, timeout_s=TELEMETRY_WAIT_S, every_s=0.2)

        # the documentation lists exactly the series served, with their types
        assert {name: kind for name, (kind, _) in families.items()} == documented()

        # DCGM series for every emulated GPU, with dcgm-exporter's four labels
        for name in DCGM:
            kind, series = families[name]
            assert kind == "gauge"
            assert all(set(s.labels) == DCGM_LABELS for s in series)
            seen = {(s.labels["Hostname"], s.labels["gpu"], s.labels["UUID"]) for s in series}
            assert seen == {
                (f"node-{n}", str(i), emulated_uuid(f"node-{n}", i))
                for n in range(NODES) for i in range(GPUS_PER_NODE)
            }
            assert {s.labels["modelName"] for s in series} == {"Emulated V100-32GB"}
        busy = [s for s in families["DCGM_FI_DEV_GPU_UTIL"][1] if s.value == 100.0]
        assert len(busy) == 1  # one job of one GPU
        used = {s.labels["UUID"]: s.value for s in families["DCGM_FI_DEV_FB_USED"][1]}
        assert used[busy[0].labels["UUID"]] > 0

        decisions = samples(families, "gpusched_scheduler_decision_duration_seconds", "_count")
        assert sum(s.value for s in decisions) > 0
        assert {s.labels["policy"] for s in decisions} == {"sjf-bsbf"}
        pending = families["gpusched_scheduler_pending_jobs"][1]
        assert {s.labels["reason"] for s in pending} == set(PENDING_REASONS)
        assert sum(s.value for s in pending) == 0  # the only job runs
        submitted = samples(families, "gpusched_admission_jobs_submitted_total", "_total")
        assert [(s.labels, s.value) for s in submitted] == [({"tenant": "default"}, 1.0)]
        assert samples(families, "gpusched_scheduler_leader")[0].value == 1
        assert samples(families, "gpusched_scheduler_jobs_started_total", "_total")[0].value == 1
        gpus = {name: samples(families, name)[0].value for name in (
            "gpusched_scheduler_gpus", "gpusched_scheduler_gpus_allocated",
            "gpusched_scheduler_gpus_idle", "gpusched_scheduler_gpus_shared")}
        assert gpus == {
            "gpusched_scheduler_gpus": NODES * GPUS_PER_NODE,
            "gpusched_scheduler_gpus_allocated": 1,
            "gpusched_scheduler_gpus_idle": NODES * GPUS_PER_NODE - 1,
            "gpusched_scheduler_gpus_shared": 0,
        }
        lag = samples(families, "gpusched_scheduler_input_lag_seconds", "_count")
        assert {s.labels["input"] for s in lag if s.value > 0} >= {"heartbeat", "durable"}
        ratio = samples(families, "gpusched_job_progress_ratio")
        assert [s.labels for s in ratio] == [{"job": job_id}]
        assert 0 < ratio[0].value < 1
        done = samples(families, "gpusched_job_iterations_done")
        assert done[0].value > 0

        # a job's series go when it ends
        async with session.delete(f"{cluster.url}/v1/jobs/{job_id}") as response:
            assert response.status in (200, 202), await response.text()

        async def cancelled() -> dict | None:
            families = await scrape(session, cluster.metrics_url)
            finished = samples(families, "gpusched_scheduler_jobs_finished_total", "_total")
            by_state = {s.labels["state"]: s.value for s in finished}
            return families if by_state["cancelled"] == 1 else None

        await wait_until(cancelled, timeout_s=TELEMETRY_WAIT_S, every_s=0.2)
        families = await scrape(session, cluster.metrics_url)
        assert families["gpusched_job_progress_ratio"][1] == []
        assert families["gpusched_job_iterations_done"][1] == []


async def test_up_without_a_metrics_port_serves_no_metrics(nats_server, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(nodes=1, gpus_per_node=1, port=0, nats_url=nats_server.url,
                      state_dir=tmp_path / "state")
    async with LocalCluster(config) as running:
        assert running.metrics_url == ""


def test_up_refuses_a_metrics_port_out_of_range_naming_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["up", "--metrics-port", "70000", "--state-dir", str(tmp_path / "state")]
    )
    assert result.exit_code == 2, result.output
    assert "metrics_port" in result.output
    assert not (tmp_path / "state").exists()


# ---------------------------------------------------------------------- admission


async def test_admission_reports_submissions_and_quota_use_per_tenant(
    nats_server: NatsServer,
) -> None:
    config = AdmissionConfig(
        nats_url=nats_server.url, port=0,
        tokens={"tok-a": "alpha", "tok-c": "capped"}, quotas={"capped": 4},
    )
    async with AdmissionService(config) as service, aiohttp.ClientSession(
        headers={"Authorization": "Bearer tok-c"}
    ) as session:
        body = {"name": "q", "model": "resnet50", "batch_size": 64, "iterations": 10,
                "gpus": 2}
        async with session.post(f"{service.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()

        async def counted() -> dict | None:
            families = await scrape(session, f"{service.url}/metrics")
            used = samples(families, "gpusched_admission_quota_used_gpus")
            return families if used and used[0].value == 2 else None

        # the job's record reaches the admission's mirror through a KV watch
        families = await wait_until(counted, timeout_s=10.0, every_s=0.05)
    submitted = samples(families, "gpusched_admission_jobs_submitted_total", "_total")
    assert {s.labels["tenant"]: s.value for s in submitted} == {"alpha": 0, "capped": 1}
    assert [(s.labels, s.value) for s in samples(families, "gpusched_admission_quota_gpus")] \
        == [({"tenant": "capped"}, 4.0)]
    assert samples(families, "gpusched_admission_quota_used_ratio")[0].value == 0.5


# ---------------------------------------------------------------------- scheduler alone


async def test_a_scheduler_run_alone_serves_its_metrics_on_the_port_its_setting_names(
    nats_server: NatsServer,
) -> None:
    port = free_port()
    env = {**os.environ, "NATS_URL": nats_server.url, "GPUSCHED_POLICY": "fifo",
           "GPUSCHED_SCHEDULER_METRICS_PORT": str(port),
           "GPUSCHED_SCHEDULER_METRICS_HOST": "127.0.0.1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.scheduler", env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def leading() -> dict | None:
                try:
                    families = await scrape(session, f"http://127.0.0.1:{port}/metrics")
                except aiohttp.ClientConnectionError:
                    return None  # not listening yet
                return families if samples(families, "gpusched_scheduler_leader")[0].value \
                    else None

            # starting and taking the lease: 0.7 s measured; the limit is 80 times that
            families = await wait_until(leading, timeout_s=60.0, every_s=0.2)
    finally:
        process.terminate()
        await process.wait()
    assert all(name.startswith("gpusched_scheduler_") for name in families)
    assert "gpusched_scheduler_decision_duration_seconds" in families


def test_a_scheduler_with_a_bad_metrics_port_exits_2_naming_the_variable() -> None:
    env = {**os.environ, "GPUSCHED_SCHEDULER_METRICS_PORT": "abc"}
    # it exits before connecting to anything: 0.4-0.9 s measured; the limit is 60 s
    result = subprocess.run(
        [sys.executable, "-m", "gpusched.services.scheduler"], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "GPUSCHED_SCHEDULER_METRICS_PORT" in result.stderr


# ---------------------------------------------------------------------- node agents


def test_a_real_gpus_series_keep_nvmls_model_name_and_leave_out_unmeasured_power() -> None:
    view = NodeView("gpu-host")
    board = GpuInfo(index=0, uuid="GPU-1234", model="NVIDIA H100 80GB HBM3", memory_mb=81559)
    reading = GpuTelemetry(index=0, uuid="GPU-1234", util=37.0, fb_used_mib=1000.0,
                           fb_free_mib=80559.0, power_w=0.0, temp_c=51.0)
    view.update([board], False, [reading], {"j1": JobReading(50, 200, 1.0)})
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: [view]))
    families = parse(generate_latest(registry).decode())
    util = families["DCGM_FI_DEV_GPU_UTIL"][1]
    assert [(s.labels, s.value) for s in util] == [(
        {"gpu": "0", "UUID": "GPU-1234", "Hostname": "gpu-host",
         "modelName": "NVIDIA H100 80GB HBM3"}, 37.0,
    )]
    assert families["DCGM_FI_DEV_POWER_USAGE"][1] == []
    assert [s.value for s in families["gpusched_job_progress_ratio"][1]] == [0.25]
    view.forget_job("j1")
    families = parse(generate_latest(registry).decode())
    assert families["gpusched_job_progress_ratio"][1] == []


def test_a_job_reported_by_two_nodes_at_once_has_one_series_the_latest() -> None:
    old, new = NodeView("node-0"), NodeView("node-1")
    old.update([], True, [], {"j1": JobReading(10, 100, 1.0)})
    new.update([], True, [], {"j1": JobReading(20, 100, 2.0)})
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: [new, old]))
    done = parse(generate_latest(registry).decode())["gpusched_job_iterations_done"][1]
    assert [(s.labels, s.value) for s in done] == [({"job": "j1"}, 20.0)]


async def test_a_node_agent_run_alone_serves_dcgm_series_on_its_metrics_port(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "NATS_URL": nats_server.url, "GPUSCHED_NODE_NAME": "solo",
           "GPUSCHED_NODE_GPUS": "2", "GPUSCHED_NODEAGENT_METRICS_PORT": str(port),
           "GPUSCHED_WORK_DIR": str(tmp_path / "work")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.nodeagent", env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def reporting() -> dict | None:
                try:
                    families = await scrape(session, f"http://127.0.0.1:{port}/metrics")
                except aiohttp.ClientConnectionError:
                    return None  # not listening yet
                return families if families["DCGM_FI_DEV_FB_FREE"][1] else None

            # start, registration and a first telemetry tick: 0.7 s measured; the limit is
            # 80 times that
            families = await wait_until(reporting, timeout_s=60.0, every_s=0.2)
    finally:
        process.terminate()
        await process.wait()
    series = families["DCGM_FI_DEV_FB_FREE"][1]
    assert {(s.labels["Hostname"], s.labels["UUID"]) for s in series} == {
        ("solo", emulated_uuid("solo", 0)), ("solo", emulated_uuid("solo", 1))
    }
    assert "gpusched_nodeagent_commands_total" in families


async def test_the_gpusched_up_command_prints_its_metrics_address_and_serves_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUSCHED_STATE_DIR": str(state)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", "up", "--nodes", "1", "--gpus-per-node",
        "2", "--port", "0", "--metrics-port", "0", "--state-dir", str(state),
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:

        async def banner() -> str:
            assert process.stdout is not None
            # printed once everything is up; reading ends if the command dies first
            while line := (await process.stdout.readline()).decode():
                if line.strip().startswith("metrics "):
                    return line.split()[-1]
            return ""

        # up to the banner: 2 s measured; the limit is 60 times that
        url = await asyncio.wait_for(banner(), 120.0)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        async with aiohttp.ClientSession() as session:

            async def reporting() -> dict | None:
                families = await scrape(session, url)
                return families if families["DCGM_FI_DEV_GPU_UTIL"][1] else None

            # the first telemetry tick comes within telemetry_s (1 s) of the start
            families = await wait_until(reporting, timeout_s=TELEMETRY_WAIT_S, every_s=0.2)
    finally:
        process.send_signal(signal.SIGINT)
        await process.wait()
    assert process.returncode == 0
    assert {name: kind for name, (kind, _) in families.items()} == documented()
    assert len(families["DCGM_FI_DEV_GPU_UTIL"][1]) == 2
