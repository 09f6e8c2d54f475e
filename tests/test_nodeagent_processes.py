"""Process runs: a user's command (small Python scripts here) and the real torch worker,
supervised by a node agent on a real nats-server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobSpec,
    NodeInfo,
    StartJob,
    StopJob,
)
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.runs import STDERR_TAIL_BYTES
from tests.limits import process_limit_s
from tests.test_nodeagent_service import (
    NODE,
    PROCESS_TIMINGS,
    agent_config,
    exits_stored,
    listen,
    send,
    stored_exit,
)

#: appends its progress and a "done" line, after saving its environment beside its
#: checkpoints (one file per rank: a job on several GPUs runs one process on each) and
#: saying hello on stdout
FINISHES = r"""
import json, os, time
env = {k: v for k, v in os.environ.items() if k.startswith("GPUSCHED_")}
env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
rank = os.environ.get("RANK", "0")
with open(os.path.join(os.environ["GPUSCHED_CHECKPOINT_DIR"], f"env-{rank}.json"), "w") as f:
    json.dump(env, f)
print("hello from the job", flush=True)
total = int(os.environ["GPUSCHED_TOTAL_ITERATIONS"])
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    for i in range(int(os.environ["GPUSCHED_START_ITERATION"]) + 1, total + 1):
        f.write(json.dumps({"event": "progress", "iteration": i, "samples_per_s": 8.0,
                            "loss": 1.0 / i, "gpu_mem_mb": 100.0, "at": time.time()}) + "\n")
    f.write(json.dumps({"event": "done", "iteration": total, "at": time.time()}) + "\n")
"""

#: iterates until SIGTERM, then checkpoints and exits 0; its clock says 0.25 s per
#: iteration, whatever the wall clock does
ITERATES_UNTIL_TERMINATED = r"""
import json, os, signal, sys, time
path = os.environ["GPUSCHED_PROGRESS_FILE"]
i = int(os.environ["GPUSCHED_START_ITERATION"])
def line(event):
    with open(path, "a") as f:
        f.write(json.dumps({"event": event, "iteration": i, "samples_per_s": 100.0,
                            "at": 1000.0 + 0.25 * i}) + "\n")
def stop(*_):
    line("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.005)
    i += 1
    line("progress")
"""

#: ignores SIGTERM after saying it runs
IGNORES_SIGTERM = r"""
import json, os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    f.write(json.dumps({"event": "progress", "iteration": 1}) + "\n")
while True:
    time.sleep(1)
"""

FAILS = r"""
import sys
sys.stderr.write("x" * 5000 + "\n")
sys.stderr.write("boom: CUDA out of memory\n")
sys.exit(3)
"""

STOPS_EARLY = r"""
import json, os
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    f.write(json.dumps({"event": "progress", "iteration": 1}) + "\n")
"""


@pytest.fixture
def config(nats_server: NatsServer, tmp_path: Path) -> NodeAgentConfig:
    return agent_config(nats_server.url, tmp_path / "work", **PROCESS_TIMINGS)


@pytest.fixture
async def agent(config: NodeAgentConfig) -> AsyncIterator[NodeAgent]:
    async with NodeAgent(config) as running:
        yield running


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    """The scripts above as files (a command's arguments are at most 256 characters)."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    for name, text in SCRIPTS.items():
        (folder / f"{name}.py").write_text(text)
    return folder


SCRIPTS = {
    "finishes": FINISHES,
    "iterates_until_terminated": ITERATES_UNTIL_TERMINATED,
    "ignores_sigterm": IGNORES_SIGTERM,
    "fails": FAILS,
    "stops_early": STOPS_EARLY,
}


def command_start(
    job_id: str, script: Path, *, total: int = 10, gpus: tuple[int, ...] = (0,), **changes: int
) -> StartJob:
    spec = JobSpec(
        name=job_id, model="my-net", batch_size=16, gpus=len(gpus), iterations=total,
        command=[sys.executable, str(script)], checkpoint_every=7,
    )
    return StartJob(
        job_id=job_id, run_id=changes.pop("run_id", 1), spec=spec, total_iterations=total,
        gpus=list(gpus), **changes,
    )


async def test_a_command_gets_the_job_environment_and_succeeds(
    agent: NodeAgent, scripts: Path, config: NodeAgentConfig, nc: Client, stores: Stores
):
    start = command_start("envjob", scripts / "finishes.py", total=6, gpus=(1, 3),
                          accum_steps=2, resume_iteration=2, run_id=4)
    assert (await send(nc, start)).ok
    exit = await stored_exit(stores, "envjob")
    assert (exit.outcome, exit.exit_code, exit.iteration, exit.run_id) == ("succeeded", 0, 6, 4)
    job_dir = config.work_dir / "envjob"
    env = json.loads((job_dir / "ckpt" / "env-0.json").read_text())
    # the second GPU's process: the same contract, but only rank 0 reports progress
    second = json.loads((job_dir / "ckpt" / "env-1.json").read_text())
    assert second == {**env, "GPUSCHED_PROGRESS_FILE": os.devnull}
    assert env == {
        "GPUSCHED_JOB_ID": "envjob",
        "GPUSCHED_RUN_ID": "4",
        "GPUSCHED_MODEL": "my-net",
        "GPUSCHED_BATCH_SIZE": "16",
        "GPUSCHED_ACCUM_STEPS": "2",
        "GPUSCHED_GPUS": "1,3",
        "GPUSCHED_DEVICE": "cpu",
        "GPUSCHED_TOTAL_ITERATIONS": "6",
        "GPUSCHED_START_ITERATION": "2",
        "GPUSCHED_CHECKPOINT_DIR": str(job_dir / "ckpt"),
        "GPUSCHED_CHECKPOINT_EVERY": "7",
        "GPUSCHED_PROGRESS_FILE": str(job_dir / "progress-4.jsonl"),
        "GPUSCHED_NODE": NODE,
        # a plain data-parallel job: one replica per GPU
        "GPUSCHED_DATA_PARALLEL": "2",
        "GPUSCHED_TENSOR_PARALLEL": "1",
        "GPUSCHED_PIPELINE_PARALLEL": "1",
        # emulated GPUs: the agent makes none visible, the job sees what the agent saw
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    assert "hello from the job" in (job_dir / "run-4.log").read_text()


async def test_a_failing_command_reports_its_exit_code_and_the_tail_of_its_stderr(
    agent: NodeAgent, scripts: Path, config: NodeAgentConfig, nc: Client, stores: Stores
):
    assert (await send(nc, command_start("failing", scripts / "fails.py"))).ok
    exit = await stored_exit(stores, "failing")
    assert (exit.outcome, exit.exit_code, exit.iteration) == ("failed", 3, 0)
    assert exit.stderr_tail.endswith("boom: CUDA out of memory\n")
    assert len(exit.stderr_tail.encode()) <= STDERR_TAIL_BYTES
    # the whole stderr stays in the run's log
    assert "x" * 5000 in (config.work_dir / "failing" / "run-1.log").read_text()


async def test_a_command_that_ends_early_without_being_asked_fails(
    agent: NodeAgent, scripts: Path, nc: Client, stores: Stores
):
    assert (await send(nc, command_start("early", scripts / "stops_early.py", total=10))).ok
    exit = await stored_exit(stores, "early")
    assert (exit.outcome, exit.exit_code) == ("failed", 0)
    assert "after 1 of 10 iterations" in exit.stderr_tail


async def test_a_command_that_cannot_start_fails_saying_why(
    agent: NodeAgent, scripts: Path, nc: Client, stores: Stores
):
    start = StartJob(
        job_id="missing", run_id=1, total_iterations=5, gpus=[0],
        spec=JobSpec(name="m", model="my-net", batch_size=1, command=["/nonexistent/train"]),
    )
    assert (await send(nc, start)).ok
    exit = await stored_exit(stores, "missing")
    assert (exit.outcome, exit.exit_code) == ("failed", None)
    assert "cannot start '/nonexistent/train'" in exit.stderr_tail


async def test_a_preempted_command_checkpoints_and_exits_stopped_where_it_saved(
    agent: NodeAgent, scripts: Path, config: NodeAgentConfig, nc: Client, stores: Stores
):
    progress = await listen(nc, subjects.job_progress(NODE, "loop"), JobProgressEvent)
    start = command_start("loop", scripts / "iterates_until_terminated.py", total=10**6)
    assert (await send(nc, start)).ok
    await wait_until(lambda: any(e.progress.iteration >= 3 for e in progress.items))
    # the speed comes from the job's own timestamps
    assert any(e.iteration_s == pytest.approx(0.25) for e in progress.items)
    assert (await send(nc, StopJob(job_id="loop", run_id=1, reason="preempt"))).ok
    exit = await stored_exit(stores, "loop")
    assert (exit.outcome, exit.exit_code) == ("stopped", 0)
    lines = (config.work_dir / "loop" / "progress-1.jsonl").read_text().splitlines()
    checkpoint = json.loads(lines[-1])
    assert checkpoint["event"] == "checkpoint" and exit.iteration == checkpoint["iteration"] >= 3
    assert await exits_stored(stores, "loop") == 1


async def test_a_command_that_ignores_sigterm_is_killed_after_the_grace_period(
    agent: NodeAgent, scripts: Path, nc: Client, stores: Stores
):
    beats = await listen(nc, subjects.node_heartbeat(NODE), dict)
    assert (await send(nc, command_start("stubborn", scripts / "ignores_sigterm.py"))).ok
    await wait_until(lambda: any(
        r["progress"]["iteration"] == 1 for b in beats.raw for r in b["running"]
    ))
    assert (await send(nc, StopJob(job_id="stubborn", run_id=1, reason="cancel"))).ok
    exit = await stored_exit(stores, "stubborn")
    assert (exit.outcome, exit.exit_code, exit.iteration) == ("stopped", -9, 0)


async def test_the_real_worker_is_preempted_and_resumes_from_its_checkpoint(
    config: NodeAgentConfig, nc: Client, stores: Stores, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("gpusched.services.nodeagent.worker.cli")
    progress = await listen(nc, subjects.job_progress(NODE, "real"), JobProgressEvent)
    spec = JobSpec(name="real", model="resnet18", batch_size=8, iterations=6, checkpoint_every=2)

    def run(run_id: int, resume: int) -> StartJob:
        return StartJob(job_id="real", run_id=run_id, spec=spec, total_iterations=6,
                        gpus=[0], resume_iteration=resume)

    async with NodeAgent(dataclasses.replace(config, jobs_mode="process")):
        # the worker waits inside iteration 4 until it is told to stop
        monkeypatch.setenv("GPUSCHED_WORKER_HOLD_AT_ITERATION", "4")
        assert (await send(nc, run(1, 0))).ok
        await wait_until(lambda: any(e.progress.iteration >= 2 for e in progress.items),
                         timeout_s=process_limit_s(1))
        assert (await send(nc, StopJob(job_id="real", run_id=1, reason="preempt"))).ok
        stopped = await stored_exit(stores, "real", timeout_s=process_limit_s(1))
        assert (stopped.outcome, stopped.exit_code) == ("stopped", 0)
        assert stopped.iteration >= 2
        monkeypatch.delenv("GPUSCHED_WORKER_HOLD_AT_ITERATION")
        assert (await send(nc, run(2, stopped.iteration))).ok

        async def second_exit() -> JobExit | None:
            exit = await stored_exit(stores, "real", timeout_s=process_limit_s(1))
            return exit if exit.run_id == 2 else None

        finished: JobExit = await wait_until(second_exit, timeout_s=process_limit_s(1))
    assert (finished.outcome, finished.iteration) == ("succeeded", 6)


async def test_the_agent_process_preempts_its_jobs_and_deregisters_on_sigterm(
    nats_server: NatsServer, nc: Client, stores: Stores, tmp_path: Path
):
    env = {
        **os.environ,
        "NATS_URL": nats_server.url,
        "GPUSCHED_NODE_NAME": "standalone",
        "GPUSCHED_NODE_GPUS": "2",
        "GPUSCHED_WORK_DIR": str(tmp_path / "work"),
        "GPUSCHED_NODEAGENT_HEARTBEAT_S": "0.05",
    }
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.nodeagent", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        beats = await listen(nc, subjects.node_heartbeat("standalone"), Heartbeat)
        await wait_until(lambda: beats.items, timeout_s=20)
        info = codec.decode((await stores.nodes.get("standalone")).value or b"", NodeInfo)
        assert len(info.gpus) == 2
        spec = JobSpec(name="j", model="resnet50", batch_size=64, iterations=10**9)
        start = StartJob(job_id="resident", run_id=1, spec=spec, total_iterations=10**9,
                         gpus=[1])
        assert (await send(nc, start, node="standalone")).ok
        agent.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(agent.communicate(), 20)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    assert agent.returncode == 0, stderr.decode()[-2000:]
    exit = await stored_exit(stores, "resident", timeout_s=1, node="standalone")
    assert (exit.outcome, exit.node) == ("stopped", "standalone")
    with pytest.raises(KeyNotFoundError):
        await stores.nodes.get("standalone")
