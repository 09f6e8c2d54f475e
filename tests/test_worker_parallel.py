"""A job given several GPUs trains data-parallel: one worker process per GPU (gloo on the
CPU here), the same weights as one process with the full batch, one stop for all ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from gpusched.libs.common.embedded import wait_until
from gpusched.services.nodeagent.worker.cli import HOLD_AT_ITERATION_ENV
from tests.limits import process_limit_s
from tests.test_worker_process import (
    REPOSITORY,
    executed_iterations,
    job_env,
    progress,
    uninterrupted_parameters,
)

TWO_RANKS_S = process_limit_s(2)


class Job:
    """The worker in its own process group, as the node agent starts it."""

    def __init__(self, env: dict[str, str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpusched.services.nodeagent.worker"],
                cwd=REPOSITORY, env=env, stdout=stderr, stderr=stderr,
                start_new_session=True,
            )

    async def exit_code(self) -> int:
        # two ranks and their gloo group compete for the cores: two processes' worth
        await wait_until(lambda: self.process.poll() is not None, timeout_s=TWO_RANKS_S)
        return self.process.returncode

    def signal_group(self, number: signal.Signals) -> None:
        os.killpg(self.process.pid, number)

    @property
    def output(self) -> str:
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.signal_group(signal.SIGKILL)
            self.process.wait()


def assert_same_weights(saved: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        # summation order differs between one process and two ranks: close, not bitwise
        assert torch.allclose(saved[name], tensor, rtol=1e-4, atol=1e-6), name


async def test_two_ranks_train_the_same_weights_as_one_process_with_the_full_batch(
    tmp_path: Path,
):
    env = job_env(tmp_path, GPUSCHED_GPUS="0,1", GPUSCHED_TOTAL_ITERATIONS="6")
    job = Job(env, tmp_path / "output.txt")
    try:
        assert await job.exit_code() == 0, job.output
    finally:
        job.kill()
    assert job.output.count('"ranks": 2') + job.output.count("ranks=2") == 2, job.output
    lines = progress(tmp_path / "progress.jsonl")
    assert (lines[-1]["event"], lines[-1]["iteration"]) == ("done", 6)
    # only rank 0 reports and logs its iterations
    assert executed_iterations(tmp_path / "iterations.log") == list(range(1, 7))
    saved = torch.load(tmp_path / "checkpoints" / "checkpoint.pt", weights_only=True)
    reference = uninterrupted_parameters(
        tmp_path / "reference", GPUSCHED_TOTAL_ITERATIONS="6"
    )
    assert_same_weights(saved["model"], reference)


async def test_a_stopped_data_parallel_run_checkpoints_once_and_resumes_on_one_gpu(
    tmp_path: Path,
):
    env = job_env(tmp_path, GPUSCHED_GPUS="0,1", GPUSCHED_TOTAL_ITERATIONS="8",
                  **{HOLD_AT_ITERATION_ENV: "5"})
    progress_file = tmp_path / "progress.jsonl"
    first = Job(env, tmp_path / "first.txt")
    try:
        await wait_until(
            lambda: any(line["event"] == "checkpoint" and line["iteration"] == 4
                        for line in progress(progress_file)),
            timeout_s=TWO_RANKS_S,
        )
        # both ranks get the signal, as from the node agent; they agree on one iteration
        first.signal_group(signal.SIGTERM)
        assert await first.exit_code() == 0, first.output
    finally:
        first.kill()
    stopped = progress(progress_file)[-1]
    assert (stopped["event"], stopped["iteration"]) == ("checkpoint", 5)

    del env[HOLD_AT_ITERATION_ENV]
    second = Job({**env, "GPUSCHED_GPUS": "0"}, tmp_path / "second.txt")
    try:
        assert await second.exit_code() == 0, second.output
    finally:
        second.kill()
    assert progress(progress_file)[-1] == {**progress(progress_file)[-1], "event": "done",
                                           "iteration": 8}
    assert executed_iterations(tmp_path / "iterations.log") == list(range(1, 9))
    saved = torch.load(tmp_path / "checkpoints" / "checkpoint.pt", weights_only=True)
    reference = uninterrupted_parameters(
        tmp_path / "reference", GPUSCHED_TOTAL_ITERATIONS="8"
    )
    assert_same_weights(saved["model"], reference)
