"""Priorities and deadlines through the front door: `gpusched up`'s LocalCluster (real
nats-server, admission, scheduler, predictor, an emulated node of one GPU) over HTTP."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from gpusched.libs.common.embedded import wait_until
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.cli.up import LocalCluster, UpConfig
from tests.test_live_http import record_when, submit

TIME_SCALE = 0.01
MODEL, BATCH = "resnet50", 64
#: a job that holds the GPU until it is cancelled (about half an hour of wall time)
BLOCKER_ITERATIONS = 1_000_000
SHORT_ITERATIONS = 500
#: wall seconds a short job runs: its profiled iterations, sped up by the time scale
SHORT_RUN_S = (
    SHORT_ITERATIONS * load_performance_model(None).iteration_time(MODEL, BATCH, 1, 1)
    * TIME_SCALE
)
#: how long a step may take: starting services and a round trip through the scheduler
#: take a few seconds on a busy machine, and a short job runs SHORT_RUN_S (about 1 s)
STEP_S = 30.0 + 20 * SHORT_RUN_S


@asynccontextmanager
async def one_gpu(
    nats_server, tmp_path, monkeypatch, policy: str
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=1, gpus_per_node=1, policy=policy, port=0, nats_url=nats_server.url,
        state_dir=tmp_path / "state", time_scale=TIME_SCALE, heartbeat_s=0.2,
    )
    async with LocalCluster(config) as cluster:
        headers = {"Authorization": f"Bearer {cluster.token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            yield session, cluster.url


def job(name: str, iterations: int = SHORT_ITERATIONS, **fields: Any) -> dict[str, Any]:
    return {"name": name, "model": MODEL, "batch_size": BATCH, "iterations": iterations,
            **fields}


def first_run(record: dict[str, Any]) -> float:
    return min(h["at"] for h in record["history"] if h["state"] == "RUNNING")


def in_state(*states: str) -> Callable[[dict[str, Any]], bool]:
    return lambda record: record["state"] in states


async def cancel(session: aiohttp.ClientSession, url: str, job_id: str) -> None:
    async with session.delete(f"{url}/v1/jobs/{job_id}") as response:
        assert response.status == 202, await response.text()


async def test_under_genie_a_deadline_job_overtakes_earlier_work_and_shows_its_prospects(
    nats_server, tmp_path, monkeypatch
):
    async with one_gpu(nats_server, tmp_path, monkeypatch, "genie") as (session, url):
        blocker = await submit(session, url, job("blocker", BLOCKER_ITERATIONS))
        await record_when(session, url, blocker, in_state("RUNNING"), timeout_s=STEP_S)
        now = time.time()
        plain = await submit(session, url, job("plain"))
        # the blocker is predicted to hold the GPU for about half an hour: a job queued
        # behind it cannot finish within 10 minutes, but can within 2 hours
        tight = await submit(session, url, job("tight", deadline=now + 600))
        loose = await submit(session, url, job("loose", deadline=now + 7_200))

        tight_view = await record_when(
            session, url, tight, lambda r: r["deadline_likely_met"] is not None,
            timeout_s=STEP_S,
        )
        loose_view = await record_when(
            session, url, loose, lambda r: r["deadline_likely_met"] is not None,
            timeout_s=STEP_S,
        )
        assert tight_view["deadline"] == now + 600 and tight_view["state"] == "QUEUED"
        assert tight_view["deadline_likely_met"] is False
        assert loose_view["deadline_likely_met"] is True
        async with session.get(f"{url}/v1/jobs") as response:
            listed = {j["id"]: j for j in (await response.json())["jobs"]}
        assert listed[plain]["deadline"] is None
        assert listed[plain]["deadline_likely_met"] is None
        assert listed[loose]["deadline_likely_met"] is True

        await cancel(session, url, blocker)
        done = {
            job_id: await record_when(
                session, url, job_id, in_state("SUCCEEDED"), timeout_s=3 * STEP_S
            )
            for job_id in (tight, loose, plain)
        }

        # both deadline jobs before the earlier job without one, the tighter first
        assert first_run(done[tight]) < first_run(done[loose]) < first_run(done[plain])
        assert done[tight]["deadline_likely_met"] is True  # met, once the GPU was free
        assert done[loose]["deadline_likely_met"] is True


async def test_under_fifo_a_tenants_high_priority_job_starts_before_its_earlier_one(
    nats_server, tmp_path, monkeypatch
):
    async with one_gpu(nats_server, tmp_path, monkeypatch, "fifo") as (session, url):
        blocker = await submit(session, url, job("blocker", BLOCKER_ITERATIONS))
        await record_when(session, url, blocker, in_state("RUNNING"), timeout_s=STEP_S)
        low = await submit(session, url, job("low"))
        high = await submit(session, url, job("high", priority=5))
        async with session.get(f"{url}/v1/jobs/{high}") as response:
            assert (await response.json())["spec"]["priority"] == 5

        await cancel(session, url, blocker)
        high_done = await record_when(
            session, url, high, in_state("SUCCEEDED"), timeout_s=2 * STEP_S
        )
        low_done = await record_when(session, url, low, in_state("SUCCEEDED"), timeout_s=STEP_S)

        assert first_run(high_done) < first_run(low_done)
        # fifo runs one at a time here: the earlier job waited for the whole later one
        assert first_run(low_done) >= high_done["history"][-1]["at"]
        assert high_done["deadline_likely_met"] is None  # no deadline


async def test_a_deadline_already_past_is_refused_naming_the_field(
    nats_server, tmp_path, monkeypatch
):
    async with one_gpu(nats_server, tmp_path, monkeypatch, "fifo") as (session, url):
        past = time.time() - 60
        async with session.post(f"{url}/v1/jobs", json=job("late", deadline=past)) as response:
            problem = await response.json()
            assert response.status == 422, problem
        assert problem["field"] == "deadline"
        assert problem["detail"].startswith("deadline:") and "past" in problem["detail"]
        async with session.get(f"{url}/v1/jobs") as response:
            assert (await response.json())["jobs"] == []


async def test_a_priority_the_leading_policy_cannot_honour_is_refused_naming_the_field(
    nats_server, tmp_path, monkeypatch
):
    async with one_gpu(nats_server, tmp_path, monkeypatch, "ones") as (session, url):

        async def leading() -> bool:
            async with session.get(f"{url}/v1/dashboard/scheduler") as response:
                return (await response.json()).get("policy") == "ones"

        # admission asks the leading scheduler; before one leads, a job is taken
        await wait_until(leading, timeout_s=STEP_S, every_s=0.1)
        async with session.post(f"{url}/v1/jobs", json=job("urgent", priority=5)) as response:
            problem = await response.json()
            assert response.status == 422, problem
        assert problem["field"] == "priority"
        assert "ones does not honour priorities" in problem["detail"]
        async with session.post(f"{url}/v1/jobs", json=job("plain")) as response:
            assert response.status == 201, await response.text()
        async with session.get(f"{url}/v1/jobs") as response:
            assert [j["spec"]["name"] for j in (await response.json())["jobs"]] == ["plain"]


async def test_under_auto_a_long_running_job_makes_way_for_a_short_one_and_runs_again(
    nats_server, tmp_path, monkeypatch
):
    async with one_gpu(nats_server, tmp_path, monkeypatch, "auto") as (session, url):
        blocker = await submit(session, url, job("blocker", BLOCKER_ITERATIONS))
        await record_when(session, url, blocker, in_state("RUNNING"), timeout_s=STEP_S)
        short = await submit(session, url, job("short"))
        done = await record_when(session, url, short, in_state("SUCCEEDED"),
                                 timeout_s=3 * STEP_S)
        # the blocker (about half an hour left) was preempted for the short job (about a
        # second), and starts again once the GPU is free
        again = await record_when(
            session, url, blocker,
            lambda r: r["state"] == "RUNNING"
            and any(h["state"] == "PREEMPTED" for h in r["history"]),
            timeout_s=3 * STEP_S,
        )
        preempted_at = min(h["at"] for h in again["history"] if h["state"] == "PREEMPTED")
        finished_at = max(h["at"] for h in done["history"] if h["state"] == "SUCCEEDED")
        assert first_run(again) < first_run(done) < finished_at
        assert preempted_at < finished_at  # it made way, rather than the short job waiting
        await cancel(session, url, blocker)
