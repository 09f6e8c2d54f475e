"""The whole system through its front door: HTTP and the CLI against `gpusched up`'s
LocalCluster (real nats-server, admission, scheduler, predictor, emulated nodes)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gpusched.libs.common.embedded import wait_until
from gpusched.services.cli.up import LocalCluster, UpConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def cluster(nats_server, tmp_path, monkeypatch) -> AsyncIterator[LocalCluster]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=2, gpus_per_node=4, policy="sjf-bsbf", port=0, nats_url=nats_server.url,
        state_dir=tmp_path / "state", time_scale=0.01, heartbeat_s=0.2,
    )
    async with LocalCluster(config) as running:
        yield running


async def events_until_done(session: aiohttp.ClientSession, url: str) -> list[dict]:
    seen: list[dict] = []
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=60)) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        kind = ""
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                seen.append({"event": kind, **json.loads(line.split(":", 1)[1])})
    return seen


async def submit(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with session.post(f"{url}/v1/jobs", json=body) as response:
        assert response.status == 201, await response.text()
        return str((await response.json())["id"])


async def job_record(session: aiohttp.ClientSession, url: str, job_id: str) -> dict:
    async with session.get(f"{url}/v1/jobs/{job_id}") as response:
        return dict(await response.json())


async def record_when(
    session: aiohttp.ClientSession, url: str, job_id: str, check, timeout_s: float = 20.0
) -> dict:
    async def matching() -> dict | None:
        job = await job_record(session, url, job_id)
        return job if check(job) else None

    return await wait_until(matching, timeout_s=timeout_s, every_s=0.05)


async def test_a_job_submitted_over_http_comes_back_running_then_succeeded(cluster):
    headers = {"Authorization": f"Bearer {cluster.token}"}
    body = {"name": "http-e2e", "model": "resnet50", "batch_size": 64, "iterations": 300}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            created = await response.json()
            location = response.headers["Location"]
        job_id = created["id"]
        assert location.endswith(job_id)
        events = await events_until_done(session, f"{cluster.url}/v1/jobs/{job_id}/events")
        states = [e["state"] for e in events if e.get("event") == "state" and "state" in e]
        assert "RUNNING" in states and states[-1] == "SUCCEEDED"
        assert states.index("RUNNING") < states.index("SUCCEEDED")
        async with session.get(f"{cluster.url}{location}") as response:
            job = await response.json()
        assert job["state"] == "SUCCEEDED"
        assert job["progress"]["iteration"] == 300
        assert [h["state"] for h in job["history"]] == ["QUEUED", "RUNNING", "SUCCEEDED"]
        async with session.get(f"{cluster.url}/v1/cluster") as response:
            assert response.status == 200
            text = await response.text()
        assert "node-0" in text and "node-1" in text


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    # the cluster lives on this event loop, so the CLI must not block it
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_the_cli_submits_lists_and_shows_a_job_of_a_running_cluster(cluster):
    env = {**os.environ, "GPUSCHED_URL": cluster.url, "GPUSCHED_TOKEN": cluster.token}
    code, out, err = await run_cli(
        env, "submit", "--model", "bert", "--batch-size", "32", "--iterations", "50"
    )
    assert code == 0, err
    job_id = out.strip()
    code, out, err = await run_cli(env, "job", job_id, "--json")
    assert json.loads(out)["spec"]["model"] == "bert"
    code, out, err = await run_cli(env, "job", job_id)
    assert out.startswith(f"job        {job_id}") and "shape      bert, batch 32" in out
    code, out, err = await run_cli(env, "jobs", "--json")
    assert job_id in [j["id"] for j in json.loads(out)["jobs"]]
    code, out, err = await run_cli(
        env, "submit", "--model", "bert", "--batch-size", "32", "--iterations", "50",
        "--gpus", "-1",
    )
    assert code == 2 and "gpus" in err


async def test_a_real_torch_job_runs_to_succeeded_through_a_process_mode_cluster(
    nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=1, gpus_per_node=2, policy="fifo", port=0, nats_url=nats_server.url,
        state_dir=tmp_path / "state", jobs_mode="process", heartbeat_s=0.2,
    )
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"}
    ) as session:
        body = {"name": "torch", "model": "ncf", "batch_size": 32, "iterations": 40,
                "checkpoint_every": 10}
        async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            job_id = (await response.json())["id"]
        events = await events_until_done(session, f"{cluster.url}/v1/jobs/{job_id}/events")
        assert [e["state"] for e in events if e.get("event") == "state"][-1] == "SUCCEEDED"
        async with session.get(f"{cluster.url}/v1/jobs/{job_id}") as response:
            job = await response.json()
    assert job["progress"]["iteration"] == 40
    log = (tmp_path / "state" / "work" / job_id / "run-1.log").read_text()
    assert "Traceback" not in log
    progress = (tmp_path / "state" / "work" / job_id / "progress-1.jsonl").read_text()
    assert '"event": "done"' in progress or '"event":"done"' in progress


async def test_two_torch_jobs_share_one_gpu_as_two_processes_with_the_chosen_accumulation(
    nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=1, gpus_per_node=1, policy="sjf-ffs", port=0, nats_url=nats_server.url,
        state_dir=tmp_path / "state", jobs_mode="process", heartbeat_s=0.2,
    )
    work = tmp_path / "state" / "work"
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"}
    ) as session:

        async def job(job_id: str) -> dict:
            return await job_record(session, cluster.url, job_id)

        async def running(job_id: str) -> dict:
            for _ in range(600):
                current = await job(job_id)
                if current["state"] == "RUNNING":
                    return current
                await asyncio.sleep(0.1)
            raise AssertionError(f"{job_id} stayed {current['state']}: {current['pending_reason']}")

        resident_body = {"name": "resident", "model": "resnet18", "batch_size": 32,
                         "iterations": 1_000_000}
        first = await submit(session, cluster.url, resident_body)
        await running(first)
        guest_body = {"name": "guest", "model": "ncf", "batch_size": 64, "iterations": 1_000_000}
        second = await submit(session, cluster.url, guest_body)
        guest = await running(second)
        resident = await job(first)
        assert guest["placement"] == resident["placement"] == [{"node": "node-0", "gpus": [0]}]
        assert guest["shares_with"] == [first]

        def training_line(job_id: str) -> dict | None:
            log = work / job_id / "run-1.log"
            for line in log.read_text().splitlines() if log.exists() else []:
                if line.startswith("{") and '"training"' in line:
                    return dict(json.loads(line))
            return None

        for _ in range(600):
            if training_line(first) and training_line(second):
                break
            await asyncio.sleep(0.1)
        lines = {job_id: training_line(job_id) for job_id in (first, second)}
        assert all(lines.values()), lines
        # two worker processes, each with the accumulation steps the scheduler recorded
        for job_id, record in ((first, resident), (second, guest)):
            assert lines[job_id]["accum_steps"] == record["accum_steps"]
            assert lines[job_id]["job_id"] == job_id
        for job_id in (first, second):
            async with session.delete(f"{cluster.url}/v1/jobs/{job_id}") as response:
                assert response.status in (200, 202), await response.text()
        for job_id in (first, second):
            for _ in range(600):
                if (await job(job_id))["state"] == "CANCELLED":
                    break
                await asyncio.sleep(0.1)
            assert (await job(job_id))["state"] == "CANCELLED"


@pytest.mark.parametrize("cap", [None, 1.0])
async def test_a_resident_slowdown_cap_given_to_up_reaches_the_live_scheduler(
    nats_server, tmp_path, monkeypatch, cap
):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=1, gpus_per_node=1, policy="sjf-bsbf", port=0, nats_url=nats_server.url,
        state_dir=tmp_path / "state", time_scale=0.01, heartbeat_s=0.2,
        max_resident_slowdown=cap,
    )  # fmt: skip
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"}
    ) as session:
        long = {"name": "long", "model": "resnet18", "batch_size": 32, "iterations": 10**6}
        resident = await submit(session, cluster.url, long)
        await record_when(session, cluster.url, resident, lambda j: j["state"] == "RUNNING")
        short = {"name": "short", "model": "resnet18", "batch_size": 32, "iterations": 10}
        job_id = await submit(session, cluster.url, short)
        if cap is None:  # the rule as specified: the short job shares the resident's GPU
            job = await record_when(session, cluster.url, job_id, lambda j: j["shares_with"])
            assert job["shares_with"] == [resident]
        else:  # every slowdown is above 1.0: it waits, saying why
            job = await record_when(
                session, cluster.url, job_id, lambda j: "slowdown" in j["pending_reason"]
            )
            assert job["state"] == "QUEUED"
            assert "by more than 1x (max_resident_slowdown)" in job["pending_reason"]
