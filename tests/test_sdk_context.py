"""The job SDK: reading the job environment, progress lines, signals and checkpoints."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusched.libs.sdk import REQUIRED_UNDER_GPUSCHED, JobContext, JobEnvironmentError


def managed_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    env = {
        "GPUSCHED_JOB_ID": "job-7",
        "GPUSCHED_RUN_ID": "3",
        "GPUSCHED_MODEL": "resnet50",
        "GPUSCHED_BATCH_SIZE": "64",
        "GPUSCHED_ACCUM_STEPS": "4",
        "GPUSCHED_GPUS": "0,2",
        "GPUSCHED_DEVICE": "cuda",
        "GPUSCHED_TOTAL_ITERATIONS": "1000",
        "GPUSCHED_START_ITERATION": "200",
        "GPUSCHED_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "GPUSCHED_CHECKPOINT_EVERY": "50",
        "GPUSCHED_PROGRESS_FILE": str(tmp_path / "progress.jsonl"),
    }
    env.update(overrides)
    return env


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def context(tmp_path: Path, clock: FakeClock, **fields: Any) -> JobContext:
    values: dict[str, Any] = {
        "job_id": "job-1",
        "batch_size": 10,
        "total_iterations": 100,
        "checkpoint_dir": tmp_path / "checkpoints",
        "progress_file": tmp_path / "progress.jsonl",
        "monotonic": clock,
        "wall_clock": lambda: 1_700_000_000.0 + clock.now,
    }
    values.update(fields)
    return JobContext(**values)


def progress_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def restore_signal_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


# ---------------------------------------------------------------------- environment


def test_the_environment_of_a_job_is_read_into_typed_fields(tmp_path: Path) -> None:
    ctx = JobContext.from_env(managed_env(tmp_path))

    assert ctx.job_id == "job-7"
    assert ctx.run_id == 3
    assert ctx.model == "resnet50"
    assert (ctx.batch_size, ctx.accum_steps, ctx.micro_batch_size) == (64, 4, 16)
    assert ctx.gpus == (0, 2)
    assert ctx.device == "cuda"
    assert (ctx.total_iterations, ctx.start_iteration) == (1000, 200)
    assert ctx.checkpoint_dir == tmp_path / "checkpoints"
    assert ctx.checkpoint_path == tmp_path / "checkpoints" / "checkpoint.pt"
    assert ctx.checkpoint_every == 50
    assert ctx.progress_file == tmp_path / "progress.jsonl"
    # a job on one node: no rendezvous, its ranks are its GPUs
    assert (ctx.rendezvous, ctx.first_rank, ctx.world_size) == ("", 0, 0)


def test_the_ranks_of_a_job_across_nodes_are_read_from_the_environment(tmp_path: Path) -> None:
    ctx = JobContext.from_env(managed_env(
        tmp_path, GPUSCHED_RENDEZVOUS="tcp://node-a:29500", GPUSCHED_FIRST_RANK="2",
        GPUSCHED_WORLD_SIZE="4",
    ))

    assert (ctx.rendezvous, ctx.first_rank, ctx.world_size) == ("tcp://node-a:29500", 2, 4)


def test_the_jobs_data_set_and_learning_rate_options_are_read_when_given(tmp_path: Path) -> None:
    options = {
        "GPUSCHED_DATASET_SIZE": "50000",
        "GPUSCHED_BASE_LR": "0.1",
        "GPUSCHED_MAX_LR": "0.4",
        "GPUSCHED_BASE_BATCH_SIZE": "256",
    }
    given = JobContext.from_env(managed_env(tmp_path, **options))
    absent = JobContext.from_env(managed_env(tmp_path))

    fields = ("dataset_size", "base_lr", "max_lr", "base_batch_size")
    assert [getattr(given, name) for name in fields] == [50000, 0.1, 0.4, 256]
    assert [getattr(absent, name) for name in fields] == [None] * 4


@pytest.mark.parametrize("variable", REQUIRED_UNDER_GPUSCHED[1:])
def test_a_missing_variable_under_gpusched_is_named(tmp_path: Path, variable: str) -> None:
    env = managed_env(tmp_path)
    del env[variable]

    with pytest.raises(JobEnvironmentError, match=variable) as caught:
        JobContext.from_env(env)
    assert caught.value.variable == variable


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GPUSCHED_RUN_ID", "first"),
        ("GPUSCHED_BATCH_SIZE", "0"),
        ("GPUSCHED_BATCH_SIZE", "6.5"),
        ("GPUSCHED_ACCUM_STEPS", "0"),
        ("GPUSCHED_GPUS", "0,x"),
        ("GPUSCHED_GPUS", "-1"),
        ("GPUSCHED_DEVICE", "tpu"),
        ("GPUSCHED_TOTAL_ITERATIONS", "0"),
        ("GPUSCHED_START_ITERATION", "1001"),
        ("GPUSCHED_CHECKPOINT_EVERY", "0"),
        ("GPUSCHED_MODEL", " "),
        ("GPUSCHED_PROGRESS_FILE", ""),
        ("GPUSCHED_FIRST_RANK", "-2"),
        ("GPUSCHED_WORLD_SIZE", "four"),
        ("GPUSCHED_DATASET_SIZE", "0"),
        ("GPUSCHED_BASE_LR", "0"),
        ("GPUSCHED_MAX_LR", "nan"),
        ("GPUSCHED_BASE_BATCH_SIZE", "-8"),
    ],
)
def test_an_invalid_variable_is_named(tmp_path: Path, variable: str, value: str) -> None:
    with pytest.raises(JobEnvironmentError, match=variable) as caught:
        JobContext.from_env(managed_env(tmp_path, **{variable: value}))
    assert caught.value.variable == variable


def test_a_batch_that_does_not_split_into_the_accumulation_steps_is_refused(
    tmp_path: Path,
) -> None:
    env = managed_env(tmp_path, GPUSCHED_BATCH_SIZE="10", GPUSCHED_ACCUM_STEPS="4")

    with pytest.raises(JobEnvironmentError) as caught:
        JobContext.from_env(env)
    assert "GPUSCHED_BATCH_SIZE" in str(caught.value)
    assert "GPUSCHED_ACCUM_STEPS" in str(caught.value)


def test_a_script_run_by_hand_gets_defaults_and_writes_no_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ctx = JobContext.from_env({})

    assert ctx.job_id == "local"
    assert ctx.model is None
    assert ctx.progress_file is None
    assert ctx.device == "cpu"
    assert ctx.checkpoint_dir == Path("gpusched-checkpoints") / "local"
    assert ctx.report(1, loss=0.5) is True
    ctx.done(ctx.total_iterations)
    assert list(tmp_path.iterdir()) == []


def test_a_script_run_by_hand_may_still_set_single_variables(tmp_path: Path) -> None:
    ctx = JobContext.from_env({"GPUSCHED_BATCH_SIZE": "12", "GPUSCHED_GPUS": "1"})

    assert ctx.batch_size == 12
    assert ctx.device == "cuda"
    with pytest.raises(JobEnvironmentError, match="GPUSCHED_ACCUM_STEPS"):
        JobContext.from_env({"GPUSCHED_ACCUM_STEPS": "many"})


def test_the_device_falls_back_to_the_cpu_only_when_cuda_is_missing(tmp_path: Path) -> None:
    ctx = JobContext.from_env(managed_env(tmp_path))

    assert ctx.torch_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert JobContext.from_env(managed_env(tmp_path, GPUSCHED_DEVICE="cpu")).torch_device() == (
        "cpu"
    )


# ---------------------------------------------------------------------- progress


def test_progress_lines_are_rate_limited_and_carry_the_rate_since_the_last_line(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    ctx = context(tmp_path, clock, batch_size=10)
    ctx.start_clock()

    clock.now += 0.1
    assert ctx.report(1, loss=2.0) is True
    clock.now += 0.2
    assert ctx.report(2, loss=1.5) is False
    clock.now += 0.2
    assert ctx.report(3, loss=1.25) is False
    clock.now += 0.1
    assert ctx.report(4, loss=1.0, samples=20) is True

    lines = progress_lines(tmp_path / "progress.jsonl")
    assert [line["iteration"] for line in lines] == [1, 4]
    assert lines[0]["samples_per_s"] == pytest.approx(10 / 0.1)
    # iterations 2, 3 and 4 since the first line: 10 + 10 + 20 samples in 0.5 s
    assert lines[1]["samples_per_s"] == pytest.approx(40 / 0.5)
    assert lines[1]["loss"] == 1.0
    assert lines[1]["at"] == pytest.approx(1_700_000_000.0 + clock.now)
    assert all(line["event"] == "progress" for line in lines)
    assert all(line["gpu_mem_mb"] > 0 for line in lines)


def test_a_checkpoint_line_follows_the_latest_progress_and_done_ends_the_job(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    ctx = context(tmp_path, clock, total_iterations=3)
    ctx.report(1, loss=1.0)
    clock.now += 0.1
    ctx.report(2, loss=0.5)
    ctx.checkpointed(2)
    clock.now += 0.1
    ctx.report(3, loss=0.25)
    ctx.done()

    lines = progress_lines(tmp_path / "progress.jsonl")
    assert [(line["event"], line["iteration"]) for line in lines] == [
        ("progress", 1),
        ("progress", 2),
        ("checkpoint", 2),
        ("progress", 3),
        ("done", 3),
    ]
    assert lines[-1]["loss"] == 0.25


def test_a_loss_that_is_not_a_number_is_written_as_null(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.report(1, loss=math.nan, force=True)
    ctx.report(2, loss=math.inf, force=True)

    lines = progress_lines(tmp_path / "progress.jsonl")
    assert [line["loss"] for line in lines] == [None, None]


def test_training_metrics_go_into_every_line_until_replaced(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.report(1, force=True, metrics={"epoch": 0.5, "lr": 0.1, "accuracy": None})
    ctx.report(2, force=True)
    ctx.report(3, force=True, metrics={"epoch": 1.5, "lr": 0.2, "accuracy": math.nan})
    ctx.checkpointed(3)

    lines = progress_lines(tmp_path / "progress.jsonl")
    seen = [(line["epoch"], line["lr"], line["accuracy"]) for line in lines]
    assert seen == [(0.5, 0.1, None)] * 2 + [(1.5, 0.2, None)] * 2


def test_the_given_memory_overrides_the_measured_one(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.report(1, gpu_mem_mb=1234.5)

    assert progress_lines(tmp_path / "progress.jsonl")[0]["gpu_mem_mb"] == 1234.5
    assert ctx.memory_mb() > 1


# ---------------------------------------------------------------------- signals


def test_sigterm_asks_the_job_to_stop(tmp_path: Path, restore_signal_handlers: None) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.install_signal_handlers()
    assert ctx.should_stop is False

    os.kill(os.getpid(), signal.SIGTERM)

    assert ctx.should_stop is True


def test_a_second_sigint_interrupts_a_run_by_hand(
    tmp_path: Path, restore_signal_handlers: None
) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.install_signal_handlers()

    os.kill(os.getpid(), signal.SIGINT)
    assert ctx.should_stop is True
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


# ---------------------------------------------------------------------- checkpoints


def test_a_checkpoint_round_trips_tensors_and_numbers(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    assert ctx.load_checkpoint() is None
    state: dict[str, Any] = {
        "iteration": 7,
        "weights": torch.arange(6.0).reshape(2, 3),
        "rng": torch.get_rng_state(),
    }

    ctx.save_checkpoint(state)
    loaded = ctx.load_checkpoint()

    assert loaded is not None
    assert loaded["iteration"] == 7
    assert torch.equal(loaded["weights"], state["weights"])
    assert torch.equal(loaded["rng"], state["rng"])
    assert [path.name for path in ctx.checkpoint_dir.iterdir()] == ["checkpoint.pt"]


def test_a_failed_save_keeps_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.save_checkpoint({"iteration": 1})

    with pytest.raises(Exception, match=r"(?i)pickle|lambda"):
        ctx.save_checkpoint({"iteration": 2, "unsaveable": lambda: None})

    assert ctx.load_checkpoint() == {"iteration": 1}
    assert [path.name for path in ctx.checkpoint_dir.iterdir()] == ["checkpoint.pt"]


def test_loading_arbitrary_objects_needs_an_explicit_opt_out(tmp_path: Path) -> None:
    ctx = context(tmp_path, FakeClock())
    ctx.save_checkpoint({"when": Path("/somewhere")})

    with pytest.raises(Exception, match="weights_only"):
        ctx.load_checkpoint()
    assert ctx.load_checkpoint(weights_only=False) == {"when": Path("/somewhere")}
