"""A finished job's record keeps the progress its run ended with, not the last one the
scheduler happened to store while it ran: the live scheduler and a node agent on a real
nats-server, the job a real process writing the progress file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.schemas import JobState
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler, spec, store_job, wait_state

#: reports iteration 1 (loss 1.0) and waits long enough for that to be streamed and
#: stored; then runs the other iterations at once (loss 1/i) and ends with a "done" line
#: that, like many a script's, repeats no loss
SHORT_RUN = r"""
import json, os, time
path = os.environ["GPUSCHED_PROGRESS_FILE"]
total = int(os.environ["GPUSCHED_TOTAL_ITERATIONS"])
def line(**fields):
    with open(path, "a") as f:
        f.write(json.dumps({"at": time.time(), **fields}) + "\n")
line(event="progress", iteration=1, loss=1.0, samples_per_s=50.0)
time.sleep(1.0)
for i in range(2, total + 1):
    line(event="progress", iteration=i, loss=1.0 / i, samples_per_s=80.0)
line(event="done", iteration=total)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "short_run.py"
    path.write_text(SHORT_RUN)
    return path


async def test_a_short_job_that_succeeds_keeps_its_final_iteration_and_loss(
    nats_server: NatsServer, stores: Stores, tmp_path: Path, script: Path
):
    node = EmulatedCluster.of(
        nats_server.url, 1, 1, work_dir=tmp_path / "work", heartbeat_s=0.2,
        telemetry_s=0.5, progress_s=0.1, progress_poll_s=0.05,
    )  # fmt: skip
    # the scheduler stores streamed progress once an hour here: only the first report
    # lands in the record while the job runs
    scheduler = SchedulerService(fast_scheduler(nats_server.url, progress_write_s=3600.0))
    async with node, scheduler:
        job_id = await store_job(
            stores, spec(iterations=10, command=[sys.executable, str(script)])
        )
        running = await wait_state(stores, job_id, JobState.RUNNING, JobState.SUCCEEDED)
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=60)

    assert running.run_id == done.run_id == 1
    assert done.progress.iteration == 10
    assert done.progress.loss == pytest.approx(0.1)
    assert done.progress.samples_per_s == pytest.approx(80.0)
