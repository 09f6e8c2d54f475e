"""The worker's zoo, its training step and its training loop, in-process on the CPU."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.sdk import JobContext
from gpusched.services.nodeagent.worker.catalog import (
    ZOO_MODELS,
    CpuCost,
    ModelSpec,
    UnknownModelNameError,
    cpu_cost_for,
    zoo_model_for,
)
from gpusched.services.nodeagent.worker.pipeline import (
    ENTRY_OVERHEAD_BYTES,
    GIB,
    RECORD_BYTES,
    DataSet,
    DecodedCache,
    InputPipeline,
    cache_budget_bytes,
)
from gpusched.services.nodeagent.worker.profiling import profile
from gpusched.services.nodeagent.worker.schedule import LearningRateRule, Ramp
from gpusched.services.nodeagent.worker.training import (
    CheckpointMismatchError,
    Resources,
    Trainer,
    TrainingOptions,
    make_optimizer,
    run_job,
    train_step,
)
from gpusched.services.nodeagent.worker.zoo import SyntheticData, build_model, loss_of

EXPECTED_ZOO_BY_CATEGORY = {"image": "cnn", "language": "transformer"}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def job(tmp_path: Path, **fields: Any) -> JobContext:
    values: dict[str, Any] = {
        "job_id": "job-1",
        "model": "mlp",
        "batch_size": 8,
        "accum_steps": 2,
        "total_iterations": 12,
        "checkpoint_every": 5,
        "checkpoint_dir": tmp_path / "checkpoints",
        "progress_file": tmp_path / "progress.jsonl",
    }
    values.update(fields)
    return JobContext(**values)


def saved(ctx: JobContext) -> dict[str, Any]:
    state = ctx.load_checkpoint()
    assert isinstance(state, dict)
    return state


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def events(path: Path) -> list[tuple[str, int]]:
    return [(line["event"], line["iteration"]) for line in lines_of(path)]


# ---------------------------------------------------------------------- catalog


def test_every_profile_of_the_ground_truth_maps_to_the_zoo_model_of_its_kind() -> None:
    ground_truth = ProfilePerformanceModel.builtin()

    for name in ground_truth.models():
        category = ground_truth.profile(name).category
        assert zoo_model_for(name) == EXPECTED_ZOO_BY_CATEGORY.get(category, "mlp"), name


def test_zoo_names_map_to_themselves_and_unknown_names_are_refused() -> None:
    assert [zoo_model_for(name.upper()) for name in ZOO_MODELS] == list(ZOO_MODELS)
    with pytest.raises(UnknownModelNameError, match="'alexnet'"):
        zoo_model_for("alexnet")


def test_a_transformer_width_must_split_over_the_attention_heads() -> None:
    with pytest.raises(ValueError, match="width"):
        ModelSpec.for_model("bert", width=30)
    assert ModelSpec.for_model("bert", width=32, depth=1) == ModelSpec("transformer", 32, 1)


# ---------------------------------------------------------------------- data


@pytest.mark.parametrize("zoo", ZOO_MODELS)
def test_synthetic_data_is_a_function_of_seed_and_iteration(zoo: str) -> None:
    spec = ModelSpec.for_model(zoo)
    first, again = SyntheticData(spec, seed=3), SyntheticData(spec, seed=3)

    inputs, targets = first.batch(5, 8)
    same_inputs, same_targets = again.batch(5, 8)
    next_inputs, _ = first.batch(6, 8)
    other_seed_inputs, _ = SyntheticData(spec, seed=4).batch(5, 8)

    assert torch.equal(inputs, same_inputs)
    assert torch.equal(targets, same_targets)
    assert not torch.equal(inputs, next_inputs)
    assert not torch.equal(inputs, other_seed_inputs)
    assert targets.unique().numel() > 1


def test_a_sample_is_the_same_whatever_the_batches_and_workers_around_it() -> None:
    data = DataSet(seed=2, size=40, cost=cpu_cost_for("resnet18"))
    inline = InputPipeline(data, DecodedCache(0))
    parallel = InputPipeline(data, DecodedCache(0), workers=2)
    try:
        whole = inline.images(range(30, 60))
        parallel.prefetch(range(30, 45))
        halves = torch.cat([parallel.images(range(30, 45)), parallel.images(range(45, 60))])
    finally:
        parallel.close()

    assert whole.shape == (30, 3, 16, 16)
    assert torch.equal(halves, whole)


def test_every_epoch_reads_every_sample_once_in_its_own_order() -> None:
    data = DataSet(seed=0, size=50)

    first_epochs, first = data.locate(range(0, 50))
    second_epochs, second = data.locate(range(50, 100))

    assert set(first_epochs) == {0} and set(second_epochs) == {1}
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second


def test_cpu_sensitive_models_do_more_work_per_sample_than_insensitive_ones() -> None:
    hungry, medium, light = (cpu_cost_for(m) for m in ("resnet18", "resnet50", "vgg16"))

    assert hungry.decode_passes > medium.decode_passes > light.decode_passes == 0
    assert hungry.augment_passes > medium.augment_passes > light.augment_passes == 0
    assert cpu_cost_for("cnn") == CpuCost()


def test_the_cache_holds_what_the_memory_allows_and_more_memory_saves_decoding() -> None:
    record_cost = RECORD_BYTES + ENTRY_OVERHEAD_BYTES
    data = DataSet(seed=0, size=64, cost=CpuCost(decode_passes=1))
    decodes = []
    for entries in (0, 16, 64):
        pipeline = InputPipeline(data, DecodedCache(entries * record_cost))
        for start in range(0, 128, 16):  # two epochs
            pipeline.images(range(start, start + 16))
        assert len(pipeline.cache) == entries
        assert pipeline.cache.nbytes <= entries * record_cost
        decodes.append(pipeline.decoded)

    assert decodes == [128, 112, 64]


def test_a_smaller_bound_drops_cached_samples_and_the_process_keeps_its_own_memory() -> None:
    record_cost = RECORD_BYTES + ENTRY_OVERHEAD_BYTES
    pipeline = InputPipeline(DataSet(seed=0, size=32), DecodedCache(32 * record_cost))
    pipeline.images(range(32))
    pipeline.cache.resize(10 * record_cost)

    assert len(pipeline.cache) == 10
    assert cache_budget_bytes(1.0, GIB / 4) == 3 * GIB // 4
    assert cache_budget_bytes(0.5, GIB) == 0


def test_pipeline_workers_and_torch_threads_follow_the_allocation() -> None:
    trainer = Trainer(
        ModelSpec.for_model("resnet18"),
        batch_size=8,
        accum_steps=1,
        device="cpu",
        options=TrainingOptions(dataset_size=16, cpu_cost=cpu_cost_for("resnet18")),
        resources=Resources(cores=2, mem_gb=None),
    )
    try:
        trainer.step(0)
        assert (trainer.pipeline.workers, torch.get_num_threads()) == (2, 2)
        assert len(trainer.pipeline.cache) == 8
        trainer.allocate(Resources(cores=1, mem_gb=0.0))
        trainer.step(1)
        assert (trainer.pipeline.workers, torch.get_num_threads()) == (0, 1)
        assert len(trainer.pipeline.cache) == 0 and trainer.pipeline.decoded == 16
    finally:
        trainer.close()


# ---------------------------------------------------------------------- learning rate


def test_the_learning_rate_grows_linearly_with_the_batch_up_to_its_cap() -> None:
    rule = LearningRateRule(base_lr=0.1, base_batch=32, max_lr=0.3)

    assert [rule.rate(b) for b in (16, 32, 64, 96, 128)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.3, 0.3]
    )
    assert LearningRateRule(0.1, 32).rate(128) == pytest.approx(0.4)


def test_a_new_rate_is_reached_linearly_over_the_ramp_and_a_change_midway_starts_from_there():
    ramp = Ramp.constant(0.1).towards(0.3, start=10, iterations=4)

    assert [ramp.at(i) for i in range(9, 16)] == pytest.approx(
        [0.1, 0.15, 0.2, 0.25, 0.3, 0.3, 0.3]
    )
    assert ramp.towards(0.3, start=12, iterations=8) is ramp
    down = ramp.towards(0.1, start=12, iterations=2)
    assert [down.at(i) for i in (11, 12, 13, 14)] == pytest.approx([0.2, 0.15, 0.1, 0.1])
    assert Ramp.from_state(down.to_state()) == down


def test_a_run_with_a_larger_batch_ramps_to_the_scaled_rate_over_an_epoch(
    tmp_path: Path,
) -> None:
    options = TrainingOptions(learning_rate=0.01, max_lr=0.03, dataset_size=128)
    spec = ModelSpec.for_model("mlp")
    first = job(tmp_path, batch_size=8, accum_steps=1, total_iterations=6, progress_interval_s=0.0)
    run_job(first, spec, options)
    first.close()
    before = lines_of(tmp_path / "progress.jsonl")
    grown = job(
        tmp_path,
        batch_size=32,
        accum_steps=1,
        total_iterations=14,
        progress_interval_s=0.0,
        progress_file=tmp_path / "grown.jsonl",
    )
    run_job(grown, spec, dataclasses.replace(options, base_batch_size=8))
    grown.close()
    after = [line for line in lines_of(tmp_path / "grown.jsonl") if line["event"] == "progress"]

    assert before and [line["lr"] for line in before] == pytest.approx([0.01] * len(before))
    # 4x the batch would be 0.04, capped at 0.03, reached over 128 / 32 = 4 iterations
    assert [line["iteration"] for line in after] == list(range(7, 15))
    assert [line["lr"] for line in after] == pytest.approx(
        [0.015, 0.02, 0.025, 0.03, 0.03, 0.03, 0.03, 0.03]
    )
    assert after[-1]["epoch"] == pytest.approx((6 * 8 + 8 * 32) / 128)
    assert 0 <= after[-1]["accuracy"] <= 1


def test_the_rate_keeps_scaling_from_the_batch_of_the_first_checkpoint(tmp_path: Path) -> None:
    options = TrainingOptions(learning_rate=0.01, dataset_size=64)
    spec = ModelSpec.for_model("mlp")
    run_job(job(tmp_path, batch_size=8, accum_steps=1, total_iterations=2), spec, options)
    grown = job(tmp_path, batch_size=16, accum_steps=1, total_iterations=20)
    run_job(grown, spec, options)

    state = saved(grown)
    assert state["base_batch_size"] == 8
    assert state["lr_ramp"] == pytest.approx([0.01, 0.02, 2, 4])


# ---------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("zoo", ZOO_MODELS)
def test_accumulation_steps_give_the_same_update_as_the_whole_batch(zoo: str) -> None:
    spec = ModelSpec.for_model(zoo)
    torch.manual_seed(0)
    whole = build_model(spec)
    accumulated = copy.deepcopy(whole)
    inputs, targets = SyntheticData(spec, seed=0).batch(0, 16)

    def loss_function(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(spec, outputs, labels)

    whole_loss = train_step(
        whole, make_optimizer(whole, 0.1), loss_function, inputs, targets, accum_steps=1
    )
    steps: list[int] = []
    accumulated_loss = train_step(
        accumulated,
        make_optimizer(accumulated, 0.1),
        loss_function,
        inputs,
        targets,
        accum_steps=4,
        after_accumulation_step=steps.append,
    )

    assert steps == [0, 1, 2, 3]
    assert accumulated_loss == pytest.approx(whole_loss, rel=1e-5)
    for (name, p_whole), p_accumulated in zip(
        whole.named_parameters(), accumulated.parameters(), strict=True
    ):
        assert p_whole.grad is not None and p_accumulated.grad is not None
        torch.testing.assert_close(p_accumulated.grad, p_whole.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(p_accumulated, p_whole, rtol=1e-5, atol=1e-6, msg=name)
    assert any(p.grad.abs().sum() > 0 for p in whole.parameters() if p.grad is not None)


def test_uneven_accumulation_steps_still_give_the_whole_batch_gradient() -> None:
    spec = ModelSpec.for_model("mlp")
    torch.manual_seed(0)
    whole = build_model(spec)
    uneven = copy.deepcopy(whole)
    # 10 samples in 4 steps: 3, 3, 2 and 2, each weighted by its share of the batch
    inputs, targets = SyntheticData(spec, seed=0).batch(0, 10)

    def loss_function(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(spec, outputs, labels)

    whole_loss = train_step(whole, make_optimizer(whole, 0.1), loss_function, inputs, targets, 1)
    uneven_loss = train_step(uneven, make_optimizer(uneven, 0.1), loss_function, inputs,
                             targets, 4)

    assert uneven_loss == pytest.approx(whole_loss, rel=1e-5)
    for p_whole, p_uneven in zip(whole.parameters(), uneven.parameters(), strict=True):
        assert p_whole.grad is not None and p_uneven.grad is not None
        torch.testing.assert_close(p_uneven.grad, p_whole.grad, rtol=1e-4, atol=1e-6)


def test_a_step_with_fewer_samples_than_accumulation_steps_is_refused() -> None:
    spec = ModelSpec.for_model("mlp")
    model = build_model(spec)
    inputs, targets = SyntheticData(spec, seed=0).batch(0, 3)

    with pytest.raises(ValueError, match="below accum_steps 4"):
        train_step(
            model,
            make_optimizer(model, 0.1),
            lambda o, t: loss_of(spec, o, t),
            inputs,
            targets,
            accum_steps=4,
        )


def test_training_lowers_the_loss() -> None:
    trainer = Trainer(
        ModelSpec.for_model("mlp"),
        batch_size=32,
        accum_steps=1,
        device="cpu",
        options=TrainingOptions(learning_rate=0.05),
    )
    losses = [trainer.step(iteration) for iteration in range(60)]

    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])


# ---------------------------------------------------------------------- the loop


def test_a_run_checkpoints_periodically_and_at_the_end(tmp_path: Path) -> None:
    ctx = job(tmp_path)

    assert run_job(ctx, ModelSpec.for_model("mlp"), TrainingOptions()) == "done"
    ctx.close()

    recorded = events(tmp_path / "progress.jsonl")
    checkpoints = [iteration for event, iteration in recorded if event == "checkpoint"]
    assert checkpoints == [5, 10, 12]
    assert recorded[-1] == ("done", 12)
    assert saved(ctx)["iteration"] == 12


def test_a_run_with_a_different_accumulation_continues_the_same_training(
    tmp_path: Path,
) -> None:
    spec = ModelSpec.for_model("cnn")
    straight = job(tmp_path / "straight", accum_steps=1)
    run_job(straight, spec, TrainingOptions())
    first_half = job(tmp_path / "split", accum_steps=1, total_iterations=6)
    run_job(first_half, spec, TrainingOptions())
    second_half = job(tmp_path / "split", accum_steps=4)
    run_job(second_half, spec, TrainingOptions())

    expected = saved(straight)["model"]
    resumed = saved(second_half)["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_a_stop_before_the_first_iteration_still_leaves_a_checkpoint(tmp_path: Path) -> None:
    ctx = job(tmp_path)
    ctx.request_stop()

    assert run_job(ctx, ModelSpec.for_model("mlp"), TrainingOptions()) == "stopped"
    ctx.close()

    assert events(tmp_path / "progress.jsonl") == [("checkpoint", 0)]
    assert saved(ctx)["iteration"] == 0


def test_a_finished_job_started_again_is_done_at_once(tmp_path: Path) -> None:
    spec = ModelSpec.for_model("mlp")
    run_job(job(tmp_path), spec, TrainingOptions())
    again = job(tmp_path, progress_file=tmp_path / "again.jsonl")

    assert run_job(again, spec, TrainingOptions()) == "done"
    again.close()

    assert events(tmp_path / "again.jsonl") == [("done", 12)]


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    run_job(job(tmp_path), ModelSpec.for_model("mlp"), TrainingOptions())

    with pytest.raises(CheckpointMismatchError, match="zoo, width, depth, seed"):
        run_job(job(tmp_path), ModelSpec.for_model("mlp", width=16), TrainingOptions())


# ---------------------------------------------------------------------- profile mode


def test_profiling_measures_every_batch_size() -> None:
    report = profile(
        ModelSpec.for_model("transformer"),
        [4, 8],
        model_name="bert",
        device="cpu",
        accum_steps=2,
        warmup=1,
        repeats=2,
    )

    assert (report["model"], report["zoo"], report["device"]) == ("bert", "transformer", "cpu")
    assert [row["batch_size"] for row in report["results"]] == [4, 8]
    for row in report["results"]:
        assert row["mean_iteration_s"] > 0
        assert row["samples_per_s"] == pytest.approx(row["batch_size"] / row["mean_iteration_s"])
        assert row["gpu_mem_mb"] > 0
    json.dumps(report)


def test_profiling_refuses_a_batch_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="batch_sizes: 6"):
        profile(ModelSpec.for_model("mlp"), [8, 6], model_name="mlp", device="cpu", accum_steps=4)
