"""The live scheduler driving emulated node agents over a real nats-server."""

from __future__ import annotations

import contextlib
from pathlib import Path

from libs.common.bus import Stores
from libs.common.schemas import JobState
from services.nodeagent.cluster import EmulatedCluster
from services.scheduler.live import SchedulerService
from tests.live import fast_scheduler, record, spec, store_job, wait_state


def nodes(url: str, tmp_path: Path, count: int = 2, gpus: int = 4) -> EmulatedCluster:
    return EmulatedCluster.of(
        url, count, gpus, work_dir=tmp_path / "work", heartbeat_s=0.2, telemetry_s=0.5,
        progress_s=0.2, time_scale=0.01,
    )


async def test_a_stored_job_runs_on_an_emulated_node_and_succeeds(nats_server, stores, tmp_path):
    async with nodes(nats_server.url, tmp_path), SchedulerService(
        fast_scheduler(nats_server.url)
    ):
        job_id = await store_job(stores, spec(iterations=20))
        running = await wait_state(stores, job_id, JobState.RUNNING, JobState.SUCCEEDED)
        assert running.placement and running.placement[0].node.startswith("node-")
        done = await wait_state(stores, job_id, JobState.SUCCEEDED)
        assert done.progress.iteration == 20
        states = [c.state for c in done.history]
        assert states == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
