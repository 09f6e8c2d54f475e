"""The worker as the node agent runs it: a real process, its exit code, its progress file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusched.libs.common.embedded import wait_until
from gpusched.libs.sdk import ENV_VARIABLES, JobContext
from gpusched.services.nodeagent.worker.catalog import ModelSpec
from gpusched.services.nodeagent.worker.cli import HOLD_AT_ITERATION_ENV, ITERATION_LOG_ENV
from gpusched.services.nodeagent.worker.training import TrainingOptions, run_job
from tests.limits import process_limit_s

REPOSITORY = Path(__file__).resolve().parents[1]
#: one worker process, bounded by what starting torch measures here (it only bounds a
#: hung process); tests with several processes at once take process_limit_s(n)
PROCESS_TIMEOUT_S = process_limit_s(1)


def job_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ENV_VARIABLES}
    env.update(
        {
            "GPUSCHED_JOB_ID": "job-1",
            "GPUSCHED_RUN_ID": "0",
            "GPUSCHED_MODEL": "bert",
            "GPUSCHED_BATCH_SIZE": "8",
            "GPUSCHED_ACCUM_STEPS": "2",
            "GPUSCHED_GPUS": "",
            "GPUSCHED_DEVICE": "cpu",
            "GPUSCHED_TOTAL_ITERATIONS": "20",
            "GPUSCHED_START_ITERATION": "0",
            "GPUSCHED_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            "GPUSCHED_CHECKPOINT_EVERY": "4",
            "GPUSCHED_PROGRESS_FILE": str(tmp_path / "progress.jsonl"),
            ITERATION_LOG_ENV: str(tmp_path / "iterations.log"),
        }
    )
    env.update(overrides)
    return env


class Worker:
    """One worker process; stderr goes to a file so that a chatty process never blocks."""

    def __init__(self, env: dict[str, str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpusched.services.nodeagent.worker"],
                cwd=REPOSITORY,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    async def exit_code(self) -> int:
        await wait_until(lambda: self.process.poll() is not None, timeout_s=PROCESS_TIMEOUT_S)
        return self.process.returncode

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # the last line may still be half written while the process runs
    return [
        json.loads(line)
        for line in path.read_text().splitlines(keepends=True)
        if line.endswith("\n")
    ]


def executed_iterations(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


async def test_a_job_run_to_completion_exits_0_with_a_done_line(
    tmp_path: Path, workers: list[Worker]
) -> None:
    env = job_env(tmp_path, GPUSCHED_MODEL="resnet50", GPUSCHED_TOTAL_ITERATIONS="10")
    worker = Worker(env, tmp_path / "stderr.txt")
    workers.append(worker)

    assert await worker.exit_code() == 0, worker.stderr

    lines = progress(tmp_path / "progress.jsonl")
    assert lines[-1]["event"] == "done"
    assert lines[-1]["iteration"] == 10
    assert [line["iteration"] for line in lines if line["event"] == "checkpoint"] == [4, 8, 10]
    iterations = [line["iteration"] for line in lines if line["event"] == "progress"]
    assert iterations == sorted(iterations) and iterations[-1] == 10
    assert all(line["samples_per_s"] > 0 and line["gpu_mem_mb"] > 0 for line in lines)
    assert all(isinstance(line["loss"], float) and isinstance(line["at"], float) for line in lines)
    assert executed_iterations(tmp_path / "iterations.log") == list(range(1, 11))


async def test_a_preempted_job_resumes_without_losing_or_repeating_work(
    tmp_path: Path, workers: list[Worker]
) -> None:
    env = job_env(tmp_path, **{HOLD_AT_ITERATION_ENV: "10"})
    progress_file = tmp_path / "progress.jsonl"
    first = Worker(env, tmp_path / "first.txt")
    workers.append(first)

    await wait_until(
        lambda: any(
            line["event"] == "checkpoint" and line["iteration"] >= 8
            for line in progress(progress_file)
        ),
        timeout_s=PROCESS_TIMEOUT_S,
    )
    first.process.send_signal(signal.SIGTERM)

    assert await first.exit_code() == 0, first.stderr
    first_lines = progress(progress_file)
    stopped_at = first_lines[-1]["iteration"]
    assert first_lines[-1]["event"] == "checkpoint"
    # the periodic checkpoint at 8 was seen; iteration 10 holds until SIGTERM and completes
    assert 8 <= stopped_at <= 10
    assert "done" not in {line["event"] for line in first_lines}
    assert executed_iterations(tmp_path / "iterations.log") == list(range(1, stopped_at + 1))

    del env[HOLD_AT_ITERATION_ENV]
    second = Worker(env, tmp_path / "second.txt")
    workers.append(second)

    assert await second.exit_code() == 0, second.stderr
    second_lines = progress(progress_file)[len(first_lines) :]
    assert (second_lines[-1]["event"], second_lines[-1]["iteration"]) == ("done", 20)
    assert min(line["iteration"] for line in second_lines) > stopped_at
    # every iteration ran exactly once across both runs: none redone after the preemption
    assert executed_iterations(tmp_path / "iterations.log") == list(range(1, 21))

    uninterrupted = uninterrupted_parameters(tmp_path / "reference")
    resumed = torch.load(tmp_path / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert resumed["iteration"] == 20
    assert resumed["model"].keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed["model"][name], tensor), name


def uninterrupted_parameters(directory: Path, **overrides: str) -> dict[str, torch.Tensor]:
    """The same job trained in one go in this process (one thread, like the worker)."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = JobContext.from_env(job_env(directory, **overrides))
        with ctx:
            assert run_job(ctx, ModelSpec.for_model("bert"), TrainingOptions()) == "done"
        state = ctx.load_checkpoint()
    finally:
        torch.set_num_threads(saved_threads)
    assert state is not None
    parameters: dict[str, torch.Tensor] = state["model"]
    return parameters


@pytest.mark.parametrize(
    ("overrides", "removed", "named"),
    [
        pytest.param(
            {"GPUSCHED_BATCH_SIZE": "10", "GPUSCHED_ACCUM_STEPS": "4"},
            None,
            "GPUSCHED_BATCH_SIZE",
            id="batch-not-divisible",
        ),
        pytest.param({}, "GPUSCHED_TOTAL_ITERATIONS", "GPUSCHED_TOTAL_ITERATIONS", id="missing"),
        pytest.param({"GPUSCHED_RUN_ID": "latest"}, None, "GPUSCHED_RUN_ID", id="not-a-number"),
        pytest.param({"GPUSCHED_MODEL": "alexnet"}, None, "GPUSCHED_MODEL", id="unknown-model"),
    ],
)
async def test_a_bad_environment_exits_non_zero_naming_the_variable(
    tmp_path: Path,
    workers: list[Worker],
    overrides: dict[str, str],
    removed: str | None,
    named: str,
) -> None:
    env = job_env(tmp_path, **overrides)
    if removed is not None:
        del env[removed]
    worker = Worker(env, tmp_path / "stderr.txt")
    workers.append(worker)

    assert await worker.exit_code() == 2
    assert named in worker.stderr
    assert not (tmp_path / "progress.jsonl").exists()


async def test_a_failure_during_training_exits_non_zero_with_a_traceback(
    tmp_path: Path, workers: list[Worker]
) -> None:
    checkpoint = tmp_path / "checkpoints" / "checkpoint.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"not a checkpoint")
    worker = Worker(job_env(tmp_path), tmp_path / "stderr.txt")
    workers.append(worker)

    assert await worker.exit_code() == 1
    assert "Traceback" in worker.stderr
    assert "done" not in {line["event"] for line in progress(tmp_path / "progress.jsonl")}
