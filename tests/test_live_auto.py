"""`auto` through the front door, in one cluster: `gpusched up`'s LocalCluster (real
nats-server, admission, scheduler, predictor, one emulated node of four GPUs) over HTTP.
An elastic job is grown, a deadline job meets its deadline, and a job left waiting
joins a running job's GPU."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from gpusched.services.cli.up import LocalCluster, UpConfig
from tests.test_live_http import record_when, submit
from tests.test_live_priority_deadline import (
    BLOCKER_ITERATIONS,
    STEP_S,
    TIME_SCALE,
    cancel,
    in_state,
    job,
)

#: the most a resident may be slowed by a job joining it: sharing is off in `auto`
#: without a cap
CAP = 3.0


@asynccontextmanager
async def four_gpus(
    nats_server, tmp_path, monkeypatch
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=1, gpus_per_node=4, policy="auto", max_resident_slowdown=CAP, port=0,
        nats_url=nats_server.url, state_dir=tmp_path / "state", time_scale=TIME_SCALE,
        heartbeat_s=0.2,
    )
    async with LocalCluster(config) as cluster:
        headers = {"Authorization": f"Bearer {cluster.token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            yield session, cluster.url


def gpus_of(record: dict[str, Any]) -> int:
    return record["gpus"] or record["spec"]["gpus"]


async def test_auto_resizes_an_elastic_job_keeps_a_deadline_and_shares_a_gpu_in_one_cluster(
    nats_server, tmp_path, monkeypatch
):
    async with four_gpus(nats_server, tmp_path, monkeypatch) as (session, url):
        # alone on four GPUs, a long elastic job is grown past the one GPU it asked for
        elastic = await submit(session, url, job(
            "elastic", BLOCKER_ITERATIONS, min_batch_size=32, max_batch_size=1024,
        ))  # fmt: skip
        grown = await record_when(
            session, url, elastic, lambda r: r["state"] == "RUNNING" and gpus_of(r) > 1,
            timeout_s=3 * STEP_S,
        )
        assert grown["spec"]["gpus"] == 1 and gpus_of(grown) > 1
        assert 32 <= grown["batch_size"] <= 1024  # within its bounds
        # a job with a deadline it can meet takes GPUs the elastic job gives back
        deadline = time.time() + 3 * STEP_S
        tight = await submit(session, url, job("tight", gpus=2, deadline=deadline))
        done = await record_when(session, url, tight, in_state("SUCCEEDED"),
                                 timeout_s=3 * STEP_S)
        ended = max(h["at"] for h in done["history"] if h["state"] == "SUCCEEDED")
        assert ended <= deadline and done["deadline_likely_met"] is True
        # jobs that do not give way to one another (each has as much work left as the
        # next), half as long as the elastic job (which no job preempts): once every GPU
        # is taken, the next one joins a running job's GPU
        fillers: list[str] = []
        shared: dict[str, Any] | None = None
        for i in range(4):
            fillers.append(await submit(session, url, job(f"filler{i}", BLOCKER_ITERATIONS // 2)))
            running = await record_when(session, url, fillers[-1], in_state("RUNNING"),
                                        timeout_s=STEP_S)
            if running["shares_with"]:
                shared = running
                break
        assert shared is not None, "no job joined a running job's GPU"
        assert set(shared["shares_with"]) <= {elastic, *fillers}
        for job_id in (elastic, *fillers):
            await cancel(session, url, job_id)
