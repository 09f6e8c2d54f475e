"""The resize command: a node agent checkpoints a run and restarts it with a new batch
and GPUs from where it saved, reporting one exit for the job."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    CommandReply,
    JobExit,
    JobProgressEvent,
    JobSpec,
    ResizeJob,
    StartJob,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import discover
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.nodeagent.resize import resized
from tests.test_nodeagent_service import (
    NODE,
    PROCESS_TIMINGS,
    agent_config,
    exits_stored,
    listen,
    start,
    stored_exit,
)

TRUTH = ProfilePerformanceModel.builtin()


@pytest.fixture
def config(nats_server: NatsServer, tmp_path: Path) -> NodeAgentConfig:
    return agent_config(nats_server.url, tmp_path / "work", **PROCESS_TIMINGS)


@pytest.fixture
async def agent(config: NodeAgentConfig) -> AsyncIterator[NodeAgent]:
    async with NodeAgent(config) as running:
        yield running


async def send(nc: Client, command: StartJob | ResizeJob) -> CommandReply:
    reply = await nc.request(
        subjects.node_command(NODE), codec.encode(command), timeout=5, headers=codec.headers()
    )
    return codec.decode(reply.data, CommandReply)


def resize(job_id: str, gpus: tuple[int, ...], batch_size: int, **changes: int) -> ResizeJob:
    return ResizeJob(
        job_id=job_id,
        run_id=changes.pop("run_id", 1),
        new_run_id=changes.pop("new_run_id", 2),
        gpus=list(gpus),
        batch_size=batch_size,
        **changes,
    )


async def test_a_resized_simulated_job_continues_with_the_new_shape_and_exits_once(
    config: NodeAgentConfig, nc: Client, stores: Stores
):
    progress = await listen(nc, subjects.job_progress(NODE, "grow"), JobProgressEvent)
    async with NodeAgent(dataclasses.replace(config, time_scale=0.002)) as agent:
        assert (await send(nc, start("grow", total_iterations=3000))).ok
        await wait_until(lambda: any(e.progress.iteration >= 20 for e in progress.items))
        reached = max(e.progress.iteration for e in progress.items)

        assert (await send(nc, resize("grow", (1, 2), 128))).ok
        assert (await agent.snapshot()).running == {"grow": 2}
        # a retried resize is harmless
        assert (await send(nc, resize("grow", (1, 2), 128))).ok

        exit = await stored_exit(stores, "grow", timeout_s=30)
    assert (exit.outcome, exit.run_id, exit.iteration) == ("succeeded", 2, 3000)
    assert await exits_stored(stores, "grow") == 1
    second = [e for e in progress.items if e.run_id == 2]
    assert second, "the new run reported no progress"
    assert (second[0].batch_size, second[0].gpus) == (128, 2)
    assert second[0].progress.iteration >= reached
    measured = [e.iteration_s for e in second if e.iteration_s is not None]
    assert measured[0] == pytest.approx(TRUTH.iteration_time("resnet50", 128, 2, 1), rel=1e-6)


async def test_a_resize_that_cannot_apply_is_refused_and_the_run_goes_on(
    agent: NodeAgent, nc: Client
):
    assert (await send(nc, start("keep", gpus=(0,)))).ok
    refusals = {
        "run_id": resize("keep", (1,), 64, run_id=7, new_run_id=8),
        "new_run_id": resize("keep", (1,), 64, new_run_id=1),
        "gpus": resize("keep", (9,), 64),
        "batch_size": resize("keep", (0, 1), 1, accum_steps=2),
    }
    for field, command in refusals.items():
        reply = await send(nc, command)
        assert not reply.ok and reply.error.startswith(f"{field}:"), (field, reply.error)
    held = start("wide", gpus=(2,), nodes=2, leader=False)
    assert (await send(nc, held)).ok
    spanning = await send(nc, resize("wide", (2, 3), 64))
    assert not spanning.ok and "spans 2 nodes" in spanning.error
    assert (await agent.snapshot()).running == {"keep": 1, "wide": 1}


async def test_the_real_worker_resumes_from_its_checkpoint_with_the_new_batch(
    config: NodeAgentConfig,
    nc: Client,
    stores: Stores,
    monkeypatch: pytest.MonkeyPatch,
):
    progress = await listen(nc, subjects.job_progress(NODE, "elastic"), JobProgressEvent)
    spec = JobSpec(name="elastic", model="resnet18", batch_size=8, iterations=6,
                   checkpoint_every=2)
    first = StartJob(job_id="elastic", run_id=1, spec=spec, total_iterations=6, gpus=[0])
    work = config.work_dir
    async with NodeAgent(dataclasses.replace(config, jobs_mode="process")):
        # the worker waits inside iteration 4 until it is told to stop
        monkeypatch.setenv("GPUSCHED_WORKER_HOLD_AT_ITERATION", "4")
        assert (await send(nc, first)).ok
        await wait_until(lambda: any(e.progress.iteration >= 2 for e in progress.items),
                         timeout_s=60)
        monkeypatch.delenv("GPUSCHED_WORKER_HOLD_AT_ITERATION")
        assert (await send(nc, resize("elastic", (0, 1), 16, accum_steps=2))).ok
        finished: JobExit = await stored_exit(stores, "elastic", timeout_s=90)
    assert (finished.outcome, finished.run_id, finished.iteration) == ("succeeded", 2, 6)
    assert await exits_stored(stores, "elastic") == 1
    resumed = [e for e in progress.items if e.run_id == 2]
    assert resumed and {(e.batch_size, e.gpus, e.accum_steps) for e in resumed} == {(16, 2, 2)}
    # the first run was stopped inside iteration 4 and saved it; nothing repeats
    log_text = (work / "elastic" / "run-2.log").read_text()
    assert '"batch_size": 16' in log_text or "batch_size=16" in log_text, log_text[-2000:]
    # the new run trains data-parallel: one rank per GPU
    assert log_text.count('"ranks": 2') >= 2 or log_text.count("ranks=2") >= 2, log_text[-2000:]
    steps = [e.progress.iteration for e in resumed]
    assert min(steps) >= 4 and steps == sorted(steps)


def test_a_resized_run_keeps_the_batch_its_learning_rate_was_given_for(
    config: NodeAgentConfig,
):
    original = start("lr", batch_size=32)
    options = {"base_lr": 0.1, "max_lr": 0.4, "dataset_size": 1000}
    original = msgspec.structs.replace(
        original, spec=msgspec.structs.replace(original.spec, **options)
    )
    grown = resized(original, resize("lr", (0, 1), 128), frozenset())
    shrunk = resized(grown, resize("lr", (0,), 64, run_id=2, new_run_id=3), frozenset())
    plan = process_plan(shrunk, config, discover(config.name, 4, "V100-32GB", 32768))

    assert (grown.spec.batch_size, grown.spec.base_batch_size) == (128, 32)
    assert (shrunk.spec.batch_size, shrunk.spec.base_batch_size) == (64, 32)
    assert plan.env["GPUSCHED_BATCH_SIZE"] == "64"
    assert plan.env["GPUSCHED_BASE_BATCH_SIZE"] == "32"
    assert (plan.env["GPUSCHED_BASE_LR"], plan.env["GPUSCHED_MAX_LR"]) == ("0.1", "0.4")
    assert plan.env["GPUSCHED_DATASET_SIZE"] == "1000"
