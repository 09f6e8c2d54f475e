"""The live scheduler driving node agents over a real nats-server: emulated GPUs,
simulated jobs and real torch processes on the CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.schemas import CancelRequest, JobState
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler, record, spec, store_job, wait_state

ROOT = Path(__file__).resolve().parents[1]


def nodes(url: str, tmp_path: Path, count: int = 2, gpus: int = 4, **settings: object
          ) -> EmulatedCluster:
    values: dict[str, object] = {
        "work_dir": tmp_path / "work", "heartbeat_s": 0.2, "telemetry_s": 0.5,
        "progress_s": 0.2, "time_scale": 0.01,
    }
    values.update(settings)
    return EmulatedCluster.of(url, count, gpus, **values)


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


async def test_cancelling_a_running_job_stops_it_and_ends_it_cancelled(
    nats_server, stores: Stores, tmp_path
):
    async with nodes(nats_server.url, tmp_path, count=1), SchedulerService(
        fast_scheduler(nats_server.url)
    ):
        job_id = await store_job(stores, spec(iterations=1_000_000))
        await wait_state(stores, job_id, JobState.RUNNING)
        await stores.js.publish(
            subjects.job_cancel(job_id),
            codec.encode(CancelRequest(job_id, "default", time.time())),
            headers=codec.headers(),
        )
        done = await wait_state(stores, job_id, JobState.CANCELLED)
        assert 0 < done.progress.iteration < 1_000_000


async def test_two_jobs_share_one_gpu_with_the_accumulation_steps_the_policy_chose(
    nats_server, stores: Stores, tmp_path
):
    async with nodes(nats_server.url, tmp_path, count=1, gpus=1), SchedulerService(
        fast_scheduler(nats_server.url, policy="sjf-ffs")
    ) as scheduler:
        first = await store_job(stores, spec(model="resnet18", iterations=1_000_000))
        await wait_state(stores, first, JobState.RUNNING)
        second = await store_job(stores, spec(model="ncf", batch_size=64, iterations=1_000_000))
        shared = await wait_state(stores, second, JobState.RUNNING)
        assert shared.placement == (await record(stores, first)).placement
        assert shared.shares_with == [first]
        assert shared.accum_steps >= 1
        # the resident names the job that joined it too
        assert (await record(stores, first)).shares_with == [second]
        assert scheduler.scheduler is not None
        views = scheduler.scheduler.jobs
        assert views[first].holds_gpus and views[second].holds_gpus
        await stores.js.publish(
            subjects.job_cancel(second),
            codec.encode(CancelRequest(second, "default", time.time())),
            headers=codec.headers(),
        )
        await wait_state(stores, second, JobState.CANCELLED)
        # the partner that left is no longer named by the one that stays
        assert (await record(stores, first)).shares_with == []


async def test_a_failing_command_is_retried_then_failed_with_its_stderr_tail(
    nats_server, stores: Stores, tmp_path
):
    script = "import sys; sys.stderr.write('boom: no such dataset'); sys.exit(3)"
    async with nodes(nats_server.url, tmp_path, count=1), SchedulerService(
        fast_scheduler(nats_server.url)
    ):
        job_id = await store_job(
            stores, spec(command=[sys.executable, "-c", script], max_retries=1)
        )
        failed = await wait_state(stores, job_id, JobState.FAILED, timeout_s=30)
        assert failed.attempts == 2
        assert failed.exit_code == 3
        assert "boom: no such dataset" in failed.error
        assert "exit code 3" in failed.history[-1].reason
        states = [c.state for c in failed.history]
        assert states.count(JobState.RUNNING) == 2


async def test_a_job_on_a_node_shut_down_is_preempted_and_resumes_from_its_checkpoint(
    nats_server, stores: Stores, tmp_path, monkeypatch
):
    executed = tmp_path / "iterations.log"
    monkeypatch.setenv("GPUSCHED_WORKER_ITERATION_LOG", str(executed))
    total = 300
    config = fast_scheduler(nats_server.url, missing_job_grace_s=30)
    async with SchedulerService(config):
        job_id = await store_job(stores, spec(model="ncf", batch_size=16, iterations=total,
                                              checkpoint_every=1000))
        first = nodes(nats_server.url, tmp_path, count=1, jobs_mode="process", prefix="a")
        async with first:
            await wait_state(stores, job_id, JobState.RUNNING, timeout_s=20)
            await wait_until(lambda: executed.exists() and executed.stat().st_size > 0,
                             timeout_s=30)
        # a clean agent shutdown preempts: the worker checkpoints where it stands
        preempted = await wait_state(stores, job_id, JobState.PREEMPTED, JobState.SUCCEEDED)
        assert preempted.state is JobState.PREEMPTED, "the job finished before the preemption"
        reached = preempted.progress.iteration
        assert 0 < reached < total
        async with nodes(nats_server.url, tmp_path, count=1, jobs_mode="process", prefix="b"):
            done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=60)
    assert done.progress.iteration == total
    assert done.placement[0].node.startswith("b-")
    lines = executed.read_text().split()
    assert len(lines) == total, "iterations were lost or repeated across the preemption"
    assert len(set(lines)) == total


async def test_a_node_agent_killed_with_sigkill_has_its_jobs_requeued_elsewhere(
    nats_server, stores: Stores, tmp_path
):
    env = {
        **os.environ, "NATS_URL": nats_server.url, "GPUSCHED_NODE_NAME": "doomed",
        "GPUSCHED_NODE_GPUS": "8", "GPUSCHED_NODEAGENT_HEARTBEAT_S": "0.2",
        "GPUSCHED_WORK_DIR": str(tmp_path / "doomed"), "GPUSCHED_TIME_SCALE": "0.01",
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpusched.services.nodeagent"], cwd=ROOT, env=env
    )
    try:
        async with SchedulerService(fast_scheduler(nats_server.url)):
            # 8 GPUs: only the doomed node (the others have 4) can take it at first
            job_id = await store_job(stores, spec(gpus=4, iterations=3000))
            running = await wait_state(stores, job_id, JobState.RUNNING, timeout_s=30)
            assert running.placement[0].node == "doomed"
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
            async with nodes(nats_server.url, tmp_path, count=1, gpus=4):
                requeued = await wait_state(stores, job_id, JobState.QUEUED, JobState.RUNNING,
                                            JobState.SUCCEEDED)
                done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=30)
        assert any("lost" in c.reason or "no longer reports" in c.reason for c in done.history)
        assert requeued.state is not None
        assert done.placement[0].node.startswith("node-")
        assert done.progress.iteration == 3000
    finally:
        if agent.poll() is None:
            agent.kill()


async def test_killing_the_leader_mid_run_loses_nothing_and_the_standby_finishes_the_work(
    nats_server, stores: Stores, tmp_path
):
    env = {
        **os.environ, "NATS_URL": nats_server.url, "GPUSCHED_POLICY": "fifo",
        "GPUSCHED_TIME_SCALE": "0.01",
    }
    leader = subprocess.Popen(
        [sys.executable, "-m", "gpusched.services.scheduler"], cwd=ROOT, env=env
    )
    try:
        async with nodes(nats_server.url, tmp_path, count=2, gpus=2):

            async def held() -> bool:
                try:
                    return (await stores.lease.get(subjects.SCHEDULER_LEASE_KEY)).value is not None
                except Exception:
                    return False

            await wait_until(held, timeout_s=30)
            async with SchedulerService(fast_scheduler(nats_server.url)) as standby:
                ids = [await store_job(stores, spec(iterations=400)) for _ in range(6)]
                await wait_state(stores, ids[0], JobState.RUNNING, timeout_s=20)
                assert not standby.is_leader
                leader.send_signal(signal.SIGKILL)
                leader.wait(timeout=10)
                late = [await store_job(stores, spec(iterations=50)) for _ in range(3)]
                await wait_until(lambda: standby.is_leader, timeout_s=15)
                for job_id in ids + late:
                    done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=60)
                    assert done.progress.iteration == done.total_iterations
    finally:
        if leader.poll() is None:
            leader.kill()


async def test_every_service_survives_a_nats_server_restart(nats_server, nc, tmp_path):
    async with nodes(nats_server.url, tmp_path, count=1), SchedulerService(
        fast_scheduler(nats_server.url)
    ) as scheduler:
        stores = await Stores.open(nc)
        before = await store_job(stores, spec(iterations=2000))
        await wait_state(stores, before, JobState.RUNNING)
        nats_server.restart()
        await wait_until(lambda: nc.is_connected, timeout_s=15)

        async def stored_after_restart() -> str | None:
            # JetStream recovers its streams a moment after the server accepts clients
            try:
                return await store_job(await Stores.open(nc), spec(iterations=30))
            except Exception:
                return None

        after = await wait_until(stored_after_restart, timeout_s=20, every_s=0.2)
        stores = await Stores.open(nc)
        for job_id in (before, after):
            done = await wait_state(stores, job_id, JobState.SUCCEEDED, timeout_s=60)
            assert done.progress.iteration == done.total_iterations
        assert scheduler.is_leader


async def test_a_torch_job_across_two_nodes_trains_with_one_rank_per_gpu_on_both(
    nats_server, stores: Stores, tmp_path
):
    async with nodes(nats_server.url, tmp_path, count=2, gpus=1, jobs_mode="process",
                     preempt_grace_s=30.0), SchedulerService(fast_scheduler(nats_server.url)):
        job_id = await store_job(stores, spec(model="resnet18", batch_size=8, gpus=2,
                                              iterations=6, checkpoint_every=2))
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, JobState.FAILED,
                                timeout_s=90)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.progress.iteration == 6
    logs = {
        "leader": (tmp_path / "work" / job_id / "run-1.log").read_text(),
        "follower": "".join(
            path.read_text() for path in (tmp_path / "work" / job_id).glob("run-1-node-*.log")
        ),
    }
    for part, rank in (("leader", 0), ("follower", 1)):
        lines = [json.loads(line) for line in logs[part].splitlines()
                 if line.startswith("{") and '"training"' in line]
        assert [(line["rank"], line["ranks"]) for line in lines] == [(rank, 2)], logs[part][-2000:]
