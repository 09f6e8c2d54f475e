"""The worker's real architectures: each builds with the parameter count `gpusched models`
prints (within 2 % of the published figure), trains two iterations at batch 2 on the CPU
through the same Trainer as the stand-ins, checkpoints and resumes, trains data-parallel;
the worker chooses real or stand-in by flag, variable or device; unknown names are refused
in one line naming the field."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gpusched.libs.common.schemas import JobSpec, StartJob
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.sdk import JobContext
from gpusched.services.cli.main import app
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import discover
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.nodeagent.worker.architectures import RealData, count_parameters
from gpusched.services.nodeagent.worker.catalog import ModelSpec
from gpusched.services.nodeagent.worker.cli import (
    UsageError,
    build_parser,
    main,
    training_spec,
)
from gpusched.services.nodeagent.worker.profiling import profile
from gpusched.services.nodeagent.worker.registry import (
    ARCHITECTURE_ENV,
    ARCHITECTURES,
    MODEL_ARCHITECTURES,
    RealSpec,
)
from gpusched.services.nodeagent.worker.training import (
    CheckpointMismatchError,
    Trainer,
    TrainingOptions,
    run_job,
)
from tests.test_worker_parallel import Job, assert_same_weights
from tests.test_worker_process import job_env

runner = CliRunner()

#: input sizes of the two-iteration test where the real one takes many seconds per
#: iteration on one CPU thread (measured at batch 2: gpt2 at 1024 tokens 140-180 s,
#: deepspeech2 at 1000 frames 75-93 s, yolov3 at 416 23 s, bert at 128 tokens 11 s,
#: vgg16 at 224 7-12 s, resnet50 at 224 4 s, transformer at 128 tokens 4 s); every other
#: architecture trains at its real input
TEST_SIZES = {
    "gpt2_small": 16,
    "bert_base": 16,
    "transformer_base": 16,
    "deepspeech2": 16,
    "yolov3": 64,
    "vgg16": 32,
    "vgg19": 32,
    "resnet50": 112,
}
#: one model name per architecture (imagenet trains resnet50 too)
ONE_NAME_PER_ARCHITECTURE = {key: name for name, key in reversed(MODEL_ARCHITECTURES.items())}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def models_json(*args: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, ["models", "--json", *args])
    assert result.exit_code == 0, result.output
    listed: list[dict[str, Any]] = json.loads(result.output)
    return listed


# ---------------------------------------------------------------------- parameter counts


def linear(cin: int, cout: int) -> int:
    return cin * cout + cout


def lstm(cin: int, width: int, directions: int = 1) -> int:
    return directions * (4 * width * (cin + width) + 8 * width)


def encoder_layer(width: int, ff: int) -> int:
    return 4 * linear(width, width) + linear(width, ff) + linear(ff, width) + 2 * 2 * width


def decoder_layer(width: int, ff: int) -> int:
    return 8 * linear(width, width) + linear(width, ff) + linear(ff, width) + 3 * 2 * width


def nature_trunk() -> int:
    convs = (4 * 32 * 64 + 32) + (32 * 64 * 16 + 64) + (64 * 64 * 9 + 64)
    return convs + linear(64 * 7 * 7, 512)


#: published parameter counts (torchvision, Hugging Face, ultralytics, papers), and for
#: architectures whose papers give none, the count of their published layer sizes
PUBLISHED = {
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet18_cifar": 11_173_962,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "shufflenet_v2": 2_278_604,
    "googlenet": 13_004_888,
    "inception_v3": 27_161_264,
    "yolov3": 61_949_149,
    "bert_base": 110_000_000,
    "gpt2_small": 124_439_808,
    "transformer_base": 6 * encoder_layer(512, 2048)
    + 6 * decoder_layer(512, 2048)
    + 2 * 2 * 512
    + 37_000 * 512,
    "lstm_lm": 33_278 * 200 + lstm(200, 200) * 2 + linear(200, 33_278),
    "deepspeech2": (32 * 41 * 11 + 32) + 64 + (32 * 32 * 21 * 11 + 32) + 64
    + lstm(32 * 41, 1024, 2) + 4 * (2 * 1024 + lstm(1024, 1024, 2)) + 2 * 1024 + 1024 * 29,
    "ncf": 9746 * (64 + 256) + linear(512, 256) + linear(256, 128) + linear(128, 64)
    + linear(128, 1),
    "ncf_ml20m": 165_237 * (64 + 128) + linear(256, 256) + linear(256, 128) + linear(128, 64)
    + linear(128, 1),
    "dqn": nature_trunk() + linear(512, 18),
    "a2c": nature_trunk() + linear(512, 18) + linear(512, 1),
}  # fmt: skip


def test_every_profile_and_extra_name_has_a_real_architecture_and_a_stand_in() -> None:
    profiles = set(ProfilePerformanceModel.builtin().models())
    listed = models_json()

    assert {entry["name"] for entry in listed} == {*profiles, "googlenet", "inception_v3"}
    assert {entry["name"] for entry in listed if entry["profile"]} == profiles
    assert {entry["architecture_key"] for entry in listed} == set(ARCHITECTURES)
    assert all(entry["stand_in"].split()[0] in ("mlp", "cnn", "transformer") for entry in listed)


@pytest.mark.parametrize("key", sorted(ARCHITECTURES))
def test_the_parameter_count_gpusched_models_prints_is_what_the_architecture_builds(
    key: str,
) -> None:
    name = ONE_NAME_PER_ARCHITECTURE[key]
    (entry,) = models_json(name)

    assert count_parameters(RealSpec.for_model(name)) == entry["parameters"]
    assert entry["parameters"] == pytest.approx(PUBLISHED[key], rel=0.02)


def test_the_published_counts_of_the_best_known_architectures_are_matched_exactly() -> None:
    listed = {entry["name"]: entry["parameters"] for entry in models_json()}

    assert listed["resnet50"] == 25_557_032
    assert listed["imagenet"] == listed["resnet50"]
    assert listed["bert"] == 109_514_298  # Hugging Face's BertForMaskedLM
    assert round(listed["bert"] / 1e6) == 110
    assert listed["gpt2"] == 124_439_808


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("key", sorted(ARCHITECTURES))
def test_each_real_architecture_trains_two_iterations_at_batch_2_on_the_cpu(key: str) -> None:
    spec = RealSpec.for_model(ONE_NAME_PER_ARCHITECTURE[key], input_size=TEST_SIZES.get(key))
    trainer = Trainer(spec, batch_size=2, accum_steps=1, device="cpu", options=TrainingOptions())
    try:
        before = {name: p.detach().clone() for name, p in trainer.net.named_parameters()}
        losses = [trainer.step(0), trainer.step(1)]
    finally:
        trainer.close()

    assert sum(p.numel() for p in trainer.net.parameters()) == spec.info.parameters
    assert all(math.isfinite(loss) for loss in losses), losses
    assert trainer.samples_seen == 4
    changed = [not torch.equal(p, before[name]) for name, p in trainer.net.named_parameters()]
    assert sum(changed) > len(changed) // 2


@pytest.mark.parametrize("name", ["cifar10", "bert", "ncf", "yolov3", "deepspeech2", "a2c"])
def test_real_synthetic_data_is_a_function_of_seed_and_sample_position(name: str) -> None:
    spec = RealSpec.for_model(name, input_size=TEST_SIZES.get(MODEL_ARCHITECTURES[name]))
    first, again, other = RealData(spec, seed=3), RealData(spec, seed=3), RealData(spec, seed=4)

    inputs, targets = first.batch(5, 8)
    same_inputs, same_targets = again.batch(5, 8)
    other_inputs, other_targets = other.batch(5, 8)

    assert torch.equal(inputs, same_inputs) and torch.equal(targets, same_targets)
    assert not (torch.equal(inputs, other_inputs) and torch.equal(targets, other_targets))
    assert targets.unique().numel() > 1


def job(tmp_path: Path, **fields: Any) -> JobContext:
    values: dict[str, Any] = {
        "job_id": "job-1",
        "model": "cifar10",
        "batch_size": 4,
        "accum_steps": 2,
        "total_iterations": 2,
        "checkpoint_every": 1,
        "checkpoint_dir": tmp_path / "checkpoints",
        "progress_file": tmp_path / "progress.jsonl",
    }
    values.update(fields)
    return JobContext(**values)


def trained(ctx: JobContext, spec: ModelSpec | RealSpec) -> dict[str, Any]:
    with ctx:
        assert run_job(ctx, spec, TrainingOptions()) == "done"
    state = ctx.load_checkpoint()
    assert state is not None
    return state


def test_a_real_model_resumed_from_its_checkpoint_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    spec = RealSpec.for_model("cifar10")
    uninterrupted = trained(job(tmp_path / "one-go"), spec)

    first = trained(job(tmp_path / "resumed", total_iterations=1), spec)
    resumed = trained(job(tmp_path / "resumed"), spec)

    assert (first["iteration"], resumed["iteration"]) == (1, 2)
    assert resumed["network"] == "resnet18_cifar" and "zoo" not in resumed
    # batch normalisation's running statistics travel in the checkpoint too
    assert any("running_mean" in name for name in resumed["model"])
    for name, tensor in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name


def test_a_stand_in_checkpoint_is_refused_by_a_run_of_the_real_architecture(
    tmp_path: Path,
) -> None:
    trained(job(tmp_path, model="ncf", total_iterations=1), ModelSpec.for_model("ncf"))

    with pytest.raises(CheckpointMismatchError, match=r"\(format, network, input_size, seed\)"):
        trained(job(tmp_path, model="ncf"), RealSpec.for_model("ncf"))


async def test_two_ranks_train_a_real_architecture_to_the_weights_of_one_process(
    tmp_path: Path,
) -> None:
    # NCF has no batch normalisation or dropout: two ranks compute the full batch's gradient
    variables = {"GPUSCHED_MODEL": "ncf", ARCHITECTURE_ENV: "real",
                 "GPUSCHED_TOTAL_ITERATIONS": "4"}  # fmt: skip
    ranks = Job(job_env(tmp_path, GPUSCHED_GPUS="0,1", **variables), tmp_path / "output.txt")
    try:
        assert await ranks.exit_code() == 0, ranks.output
    finally:
        ranks.kill()
    assert ranks.output.count('"ranks": 2') == 2, ranks.output
    assert ranks.output.count('"network": "ncf"') == 2, ranks.output

    saved = torch.load(tmp_path / "checkpoints" / "checkpoint.pt", weights_only=True)
    one = JobContext.from_env(job_env(tmp_path / "one", **variables))
    assert_same_weights(saved["model"], trained(one, RealSpec.for_model("ncf"))["model"])


def test_profiling_measures_a_real_architecture_and_names_it_in_the_report() -> None:
    report = profile(
        RealSpec.for_model("dqn"), [4], model_name="dqn", device="cpu", warmup=1, repeats=2
    )

    assert (report["architecture"], report["network"]) == ("real", "dqn")
    assert report["parameters"] == PUBLISHED["dqn"]
    (row,) = report["results"]
    assert row["parameter_bytes"] == 4 * PUBLISHED["dqn"]
    assert row["median_iteration_s"] > 0


# ---------------------------------------------------------------------- choosing


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_auto_trains_the_real_architecture_on_cuda_and_the_stand_in_on_the_cpu() -> None:
    on_gpu = training_spec("resnet50", "--model", args(), "auto", "cuda:0")
    on_cpu = training_spec("resnet50", "--model", args(), "auto", "cpu")

    assert on_gpu == RealSpec("resnet50", "resnet50", 224)
    assert on_cpu == ModelSpec.for_model("resnet50")
    assert training_spec("bert", "--model", args(), "real", "cpu") == RealSpec(
        "bert", "bert_base", 128
    )
    assert training_spec("bert", "--model", args(), "stand-in", "cuda") == ModelSpec.for_model(
        "bert"
    )
    # the zoo's own names, and a stand-in sized by --width, stay stand-ins
    assert training_spec("mlp", "--model", args(), "real", "cuda") == ModelSpec.for_model("mlp")
    sized = training_spec("vgg16", "--model", args("--width", "8"), "auto", "cuda")
    assert sized == ModelSpec("cnn", 8, 2)
    # an architecture name that is no profile has a stand-in too
    assert training_spec("inception_v3", "--model", args(), "auto", "cpu") == ModelSpec.for_model(
        "cnn"
    )


@pytest.mark.parametrize(
    ("argv", "name", "choice", "named"),
    [
        ((), "alexnet", "real", "GPUSCHED_MODEL: unknown model 'alexnet'; known models: a2c"),
        ((), "alexnet", "stand-in", "GPUSCHED_MODEL: unknown model 'alexnet'"),
        (("--width", "8"), "vgg16", "real", "--width/--depth"),
        (("--input-size", "300"), "yolov3", "real", "--input-size: the image side"),
        (("--input-size", "64"), "dqn", "real", "--input-size: dqn has a fixed input"),
        (("--input-size", "64"), "bert", "auto", "--input-size: sizes a real architecture"),
    ],
)
def test_a_choice_the_worker_cannot_train_is_refused_naming_the_field(
    argv: tuple[str, ...], name: str, choice: Any, named: str
) -> None:
    with pytest.raises(UsageError) as refused:
        training_spec(name, "GPUSCHED_MODEL", args(*argv), choice, "cpu")

    assert str(refused.value).startswith(named)
    assert "\n" not in str(refused.value)


def test_the_worker_refuses_an_unknown_model_or_choice_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    profile_args = ["--profile", "--batch-sizes", "2"]

    assert main([*profile_args, "--model", "foo"]) == 2
    unknown_model = capsys.readouterr().err
    monkeypatch.setenv(ARCHITECTURE_ENV, "huge")
    assert main([*profile_args, "--model", "bert"]) == 2
    unknown_choice = capsys.readouterr().err

    assert unknown_model.startswith("gpusched worker: error: --model: unknown model 'foo';")
    assert unknown_choice == (
        f"gpusched worker: error: {ARCHITECTURE_ENV}: must be one of auto, real, stand-in, "
        "got 'huge'\n"
    )
    assert unknown_model.count("\n") == 1


def test_a_node_agent_setting_passes_the_choice_to_its_workers(tmp_path: Path) -> None:
    job_spec = JobSpec(name="t", model="resnet50", batch_size=8, iterations=1, gpus=1)
    start = StartJob(job_id="j", run_id=1, spec=job_spec, total_iterations=1, gpus=[0])

    def plan_env(**settings: Any) -> dict[str, str]:
        config = NodeAgentConfig(name="node-1", gpus=1, work_dir=tmp_path, **settings)
        inventory = discover("node-1", 1, config.gpu_model, config.emulated_gpu_mem_mb, None)
        return process_plan(start, config, inventory).env

    assert plan_env(worker_architecture="real")[ARCHITECTURE_ENV] == "real"
    assert ARCHITECTURE_ENV not in plan_env()
    assert (
        NodeAgentConfig.from_env(
            {"GPUSCHED_NODEAGENT_ARCHITECTURE": "stand-in"}, name="n", work_dir=tmp_path
        ).worker_architecture
        == "stand-in"
    )
    with pytest.raises(ValueError, match=r"^worker_architecture: must be one of auto"):
        NodeAgentConfig(name="node-1", work_dir=tmp_path, worker_architecture="huge")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- gpusched models


def test_gpusched_models_shows_architecture_parameters_input_and_stand_in() -> None:
    result = runner.invoke(app, ["models"], env={"COLUMNS": "240"})

    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert "ResNet-50" in rows["resnet50"] and "25.6 M" in rows["resnet50"]
    assert "3x224x224 image" in rows["resnet50"] and "cnn 16/2" in rows["resnet50"]
    assert "109.5 M" in rows["bert"] and "128 tokens" in rows["bert"]
    assert "2.28 M" in rows["shufflenet_v2"]
    assert "inception_v3 *" in result.output


def test_gpusched_models_refuses_an_unknown_name_in_one_line_naming_the_field() -> None:
    result = runner.invoke(app, ["models", "alexnet"])

    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: model: unknown model 'alexnet'; known models: a2c, bert")
    assert "mlp" not in line  # the zoo's names are stand-ins, no built-in model
