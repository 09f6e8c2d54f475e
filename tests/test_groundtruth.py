"""The ground-truth performance model: its contract, its facts and its data sources."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.core.estimates import NoisyEstimates
from gpusched.libs.core.groundtruth import ProfilePerformanceModel, load_performance_model
from gpusched.libs.core.perf import ConvergenceSource, PerformanceModel, UnknownModelError
from gpusched.libs.core.profiles.gavel import DOES_NOT_FIT_SLOWDOWN
from gpusched.libs.core.shape import JobShape

DATA_DIR = Path(__file__).parents[2] / "shared" / "data"
PROFILES = DATA_DIR / "profiles"

MODELS = (
    "resnet18", "resnet50", "vgg16", "vgg19", "shufflenet_v2", "cifar10", "imagenet",
    "bert", "gpt2", "transformer", "lm", "deepspeech2", "yolov3", "ncf", "recommendation",
    "dqn", "a2c",
)  # fmt: skip
#: GPU memory (MB) at the default batch on the SJF-BSBF testbed
SJF_BSBF_MEMORY_MB = {
    "resnet18": 6432, "shufflenet_v2": 5252, "vgg19": 4304, "vgg16": 4224,
    "dqn": 2230, "a2c": 2094, "bert": 8058, "gpt2": 10532,
}  # fmt: skip

BUILTIN = ProfilePerformanceModel.builtin()


def _data_model() -> ProfilePerformanceModel:
    if not DATA_DIR.is_dir():
        pytest.skip(f"research data not found at {DATA_DIR}; data-backed checks need it")
    return ProfilePerformanceModel.from_data_dir(DATA_DIR)


@pytest.fixture(scope="module")
def data_model() -> ProfilePerformanceModel:
    return _data_model()


@pytest.fixture(scope="module", params=["builtin", "data"])
def perf(request: pytest.FixtureRequest) -> ProfilePerformanceModel:
    """Every contract test runs on the built-in set and on the data-backed model."""
    return BUILTIN if request.param == "builtin" else _data_model()


models = st.sampled_from(MODELS)
batches = st.integers(min_value=1, max_value=100_000)
gpu_counts = st.integers(min_value=1, max_value=256)
accum_steps = st.integers(min_value=1, max_value=64)


# ------------------------------------------------------------------- the model set


def test_the_builtin_set_knows_every_workload_model() -> None:
    assert set(BUILTIN.models()) == set(MODELS)
    for model in MODELS:
        assert BUILTIN.default_batch_size(model) >= 1
        assert BUILTIN.profile(model).category in {
            "image", "language", "speech", "recommendation", "rl"
        }  # fmt: skip


@pytest.mark.parametrize(("model", "memory_mb"), sorted(SJF_BSBF_MEMORY_MB.items()))
def test_memory_at_the_default_batch_matches_the_sjf_bsbf_testbed(
    model: str, memory_mb: int
) -> None:
    default = BUILTIN.default_batch_size(model)
    assert BUILTIN.gpu_memory_mb(model, default) == pytest.approx(memory_mb)


def test_the_builtin_set_needs_no_data_and_says_so() -> None:
    assert load_performance_model(None).models() == BUILTIN.models()
    for model in MODELS:
        assert set(BUILTIN.data_sources(model).values()) == {"builtin"}
        assert BUILTIN.cpu_mem_speedup(model, 2, 1.0, 10.0) == 1.0


def test_the_builtin_profile_documents_its_origin() -> None:
    from importlib import resources

    text = resources.files("gpusched.libs.core").joinpath("builtin/profiles.json").read_text()
    assert "own analytic" in json.loads(text)["_about"]


# ------------------------------------------------------------------- the contract


@settings(max_examples=300, deadline=None)
@given(model=models, batch=batches, gpus=gpu_counts, accum=accum_steps, data=st.data())
def test_an_iteration_always_takes_a_positive_finite_time(
    perf: ProfilePerformanceModel,
    model: str,
    batch: int,
    gpus: int,
    accum: int,
    data: st.DataObject,
) -> None:
    nodes = data.draw(st.integers(min_value=1, max_value=gpus))
    value = perf.iteration_time(model, batch, gpus, nodes, accum)
    assert value > 0
    assert math.isfinite(value)


@settings(max_examples=150, deadline=None)
@given(model=models, batch=batches, gpus=st.integers(1, 64), accum=st.sampled_from([1, 2, 4, 8]))
def test_more_nodes_never_make_an_iteration_faster(
    perf: ProfilePerformanceModel, model: str, batch: int, gpus: int, accum: int
) -> None:
    times = [perf.iteration_time(model, batch, gpus, nodes, accum) for nodes in range(1, gpus + 1)]
    assert times == sorted(times)


@settings(max_examples=300, deadline=None)
@given(model=models, batch=batches, gpus=st.integers(1, 64), accum=accum_steps, data=st.data())
def test_gradient_accumulation_never_makes_an_iteration_faster(
    perf: ProfilePerformanceModel,
    model: str,
    batch: int,
    gpus: int,
    accum: int,
    data: st.DataObject,
) -> None:
    nodes = data.draw(st.integers(min_value=1, max_value=gpus))
    single_pass = perf.iteration_time(model, batch, gpus, nodes, 1)
    assert perf.iteration_time(model, batch, gpus, nodes, accum) >= single_pass


@settings(max_examples=300, deadline=None)
@given(
    model=models,
    batch=batches,
    gpus=st.integers(1, 16),
    accum=accum_steps,
    partner=models,
    partner_batch=batches,
    partner_gpus=st.integers(1, 16),
    partner_accum=accum_steps,
)
def test_a_colocated_job_is_never_faster_and_never_infinitely_slow(
    perf: ProfilePerformanceModel,
    model: str,
    batch: int,
    gpus: int,
    accum: int,
    partner: str,
    partner_batch: int,
    partner_gpus: int,
    partner_accum: int,
) -> None:
    slowdown = perf.colocation_slowdown(
        JobShape(model, batch, gpus, accum),
        JobShape(partner, partner_batch, partner_gpus, partner_accum),
    )
    assert slowdown >= 1.0
    assert math.isfinite(slowdown)


@settings(max_examples=200, deadline=None)
@given(
    model=models,
    small=st.floats(min_value=0, max_value=1e5),
    extra=st.floats(min_value=0, max_value=1e5),
)
def test_gpu_memory_is_positive_and_never_shrinks_as_the_batch_grows(
    perf: ProfilePerformanceModel, model: str, small: float, extra: float
) -> None:
    assert perf.gpu_memory_mb(model, small) > 0
    assert perf.gpu_memory_mb(model, small + extra) >= perf.gpu_memory_mb(model, small)


@settings(max_examples=200, deadline=None)
@given(
    model=models,
    gpus=st.integers(1, 64),
    cpus=st.floats(min_value=0, max_value=64),
    mem=st.floats(min_value=0, max_value=1000),
)
def test_cpu_and_memory_speedup_is_positive_and_one_at_the_fair_share(
    perf: ProfilePerformanceModel, model: str, gpus: int, cpus: float, mem: float
) -> None:
    speedup = perf.cpu_mem_speedup(model, gpus, cpus, mem)
    assert speedup > 0
    assert math.isfinite(speedup)
    assert perf.cpu_mem_speedup(model, gpus, 3.0, 62.5) == pytest.approx(1.0)


def test_the_model_satisfies_the_performance_model_protocol(
    perf: ProfilePerformanceModel,
) -> None:
    assert isinstance(perf, PerformanceModel)


# ------------------------------------------------------------------- the research data


def _placement_rows(model: str, placement: str) -> list[dict[str, str]]:
    with (PROFILES / "pollux" / model / "placements.csv").open(newline="") as handle:
        return [row for row in csv.DictReader(handle) if row["placement"] == placement]


@pytest.mark.parametrize(
    ("model", "placement", "gpus", "nodes"),
    [
        ("cifar10", "1", 1, 1),
        ("cifar10", "4", 4, 1),
        ("imagenet", "2", 2, 1),
        ("bert", "1", 1, 1),
        ("cifar10", "44", 8, 2),
        # 4 GPUs on 2 nodes: "13" is the most consolidated of "13" and "22"
        ("bert", "13", 4, 2),
    ],
)
def test_pollux_backed_iteration_time_is_the_measured_step_time_at_a_profiled_point(
    data_model: ProfilePerformanceModel, model: str, placement: str, gpus: int, nodes: int
) -> None:
    rows = _placement_rows(model, placement)
    assert rows, f"{model} has no rows for placement {placement}"
    for row in rows:
        local_bsz = int(row["local_bsz"])
        measured = float(row["step_time"])
        assert data_model.iteration_time(model, local_bsz * gpus, gpus, nodes) == measured


def test_pollux_backs_iteration_time_only_for_its_own_models(
    data_model: ProfilePerformanceModel,
) -> None:
    backed = {m for m in MODELS if data_model.data_sources(m)["iteration_time"] == "pollux"}
    assert backed == {"bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"}
    assert data_model.iteration_time("gpt2", 8, 1, 1) == BUILTIN.iteration_time("gpt2", 8, 1, 1)


def _gavel_v100() -> dict[str, Any]:
    path = PROFILES / "gavel" / "simulation_throughputs.json"
    table: dict[str, Any] = json.loads(path.read_text())["v100"]
    return table


def test_gavel_slowdown_is_the_ratio_of_measured_throughputs(
    data_model: ProfilePerformanceModel,
) -> None:
    row = _gavel_v100()["('ResNet-18 (batch size 32)', 1)"]
    alone, own = row["null"], row["('A3C', 1)"][0]
    slowdown = data_model.colocation_slowdown(
        JobShape("resnet18", 32, 1, 1), JobShape("a2c", 80, 1, 1)
    )
    assert slowdown == pytest.approx(max(1.0, alone / own))
    # the per-GPU sub-batch picks the Gavel batch size: 128 over 4 GPUs is 32 per GPU
    assert (
        data_model.colocation_slowdown(JobShape("resnet18", 128, 4, 1), JobShape("a2c", 80, 1, 1))
        == slowdown
    )


def test_a_pair_gavel_could_not_fit_together_gets_a_large_finite_slowdown(
    data_model: ProfilePerformanceModel,
) -> None:
    own = _gavel_v100()["('ResNet-50 (batch size 128)', 1)"]["('A3C', 1)"][0]
    assert own == 0.0
    slowdown = data_model.colocation_slowdown(
        JobShape("resnet50", 128, 1, 1), JobShape("dqn", 32, 1, 1)
    )
    assert slowdown == DOES_NOT_FIT_SLOWDOWN


def test_synergy_speedup_follows_the_measured_grid(data_model: ProfilePerformanceModel) -> None:
    synergy = json.loads((PROFILES / "synergy" / "models.json").read_text())
    grid = synergy["models"]["res18"]["1"]["normalized_throughput"]
    cpu_axis, mem_axis = synergy["cpu_per_gpu_axis"], synergy["mem_gb_per_gpu_axis"]
    for i, cpus in enumerate(cpu_axis):
        for j, mem in enumerate(mem_axis):
            if grid[i][j] > 0:
                assert data_model.cpu_mem_speedup("resnet18", 1, cpus, mem) == pytest.approx(
                    grid[i][j]
                )
    between = data_model.cpu_mem_speedup("resnet18", 1, 3.5, 62.5)
    assert between == pytest.approx((grid[2][1] + grid[3][1]) / 2)
    assert data_model.cpu_mem_speedup("ncf", 1, 1.0, 20.0) == 1.0  # no Synergy profile


# ------------------------------------------------------------------- errors


def test_an_unknown_model_error_lists_the_known_models() -> None:
    calls = [
        lambda: BUILTIN.iteration_time("alexnet9", 32, 1, 1),
        lambda: BUILTIN.default_batch_size("alexnet9"),
        lambda: BUILTIN.gpu_memory_mb("alexnet9", 32),
        lambda: BUILTIN.cpu_mem_speedup("alexnet9", 1, 3, 62.5),
        lambda: BUILTIN.colocation_slowdown(
            JobShape("resnet18", 32, 1, 1), JobShape("alexnet9", 32, 1, 1)
        ),
    ]
    for call in calls:
        with pytest.raises(UnknownModelError) as caught:
            call()
        assert "alexnet9" in str(caught.value)
        assert "resnet18" in str(caught.value) and "bert" in str(caught.value)


def test_impossible_arguments_are_rejected_with_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot span"):
        BUILTIN.iteration_time("bert", 32, 2, 3)
    with pytest.raises(ValueError, match="batch_size"):
        BUILTIN.iteration_time("bert", 0, 1, 1)
    with pytest.raises(ValueError, match="per_gpu_batch"):
        BUILTIN.gpu_memory_mb("bert", -1)


def _write_placements(root: Path, text: str) -> Path:
    path = root / "profiles" / "pollux" / "cifar10" / "placements.csv"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_a_malformed_placements_row_names_the_file_the_line_and_the_field(tmp_path: Path) -> None:
    path = _write_placements(
        tmp_path,
        "placement,local_bsz,step_time,sync_time\n1,32,0.04,0.001\n1,64,fast,0.001\n",
    )
    with pytest.raises(ValueError) as caught:
        ProfilePerformanceModel.from_data_dir(tmp_path)
    message = str(caught.value)
    assert str(path) in message and "line 3" in message and "step_time" in message


def test_a_placements_file_missing_a_column_is_rejected(tmp_path: Path) -> None:
    _write_placements(tmp_path, "placement,local_bsz,step_time\n1,32,0.04\n")
    with pytest.raises(ValueError, match="line 1, field 'sync_time'"):
        ProfilePerformanceModel.from_data_dir(tmp_path)


def test_a_malformed_gavel_table_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "profiles" / "gavel" / "simulation_throughputs.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"v100": {"(\'A3C\', 1)": {"null": "fast"}}}')
    with pytest.raises(ValueError, match=r"simulation_throughputs\.json"):
        ProfilePerformanceModel.from_data_dir(tmp_path)


def test_missing_research_files_keep_the_builtin_values(tmp_path: Path) -> None:
    _write_placements(tmp_path, "placement,local_bsz,step_time,sync_time\n4,32,0.05,0.01\n")
    partial = ProfilePerformanceModel.from_data_dir(tmp_path)
    for model in MODELS:
        assert partial.iteration_time(model, 64, 2, 1) == BUILTIN.iteration_time(model, 64, 2, 1)
        shape, bert = JobShape(model, 32, 1, 1), JobShape("bert", 32, 1, 1)
        assert partial.colocation_slowdown(shape, bert) == BUILTIN.colocation_slowdown(shape, bert)


def test_a_data_directory_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_performance_model(tmp_path / "nowhere")


# ------------------------------------------------------------------- estimates, speed


def test_noisy_estimates_mispredict_each_model_by_a_fixed_seeded_factor() -> None:
    noisy = NoisyEstimates(BUILTIN, sigma=0.3, seed=7)
    again = NoisyEstimates(BUILTIN, sigma=0.3, seed=7)
    other = NoisyEstimates(BUILTIN, sigma=0.3, seed=8)
    assert isinstance(noisy, PerformanceModel)
    for model in MODELS:
        exact = BUILTIN.iteration_time(model, 64, 4, 2, 2)
        assert noisy.iteration_time(model, 64, 4, 2, 2) == pytest.approx(
            exact * noisy.factor(model)
        )
        assert noisy.factor(model) == again.factor(model)
        assert noisy.gpu_memory_mb(model, 8) == BUILTIN.gpu_memory_mb(model, 8)
    assert any(noisy.factor(m) != other.factor(m) for m in MODELS)
    assert len({round(noisy.factor(m), 9) for m in MODELS}) > 1
    assert NoisyEstimates(BUILTIN, sigma=0.0).factor("bert") == 1.0


def test_noisy_estimates_know_the_convergence_curves_their_base_knows() -> None:
    """The noise is in iteration times only: a policy that reads convergence curves
    (ones) sees the same curves with noisy estimates as with exact ones."""
    noisy = NoisyEstimates(BUILTIN, sigma=0.3, seed=7)
    assert isinstance(noisy, ConvergenceSource)
    assert noisy.convergence("cifar10") is BUILTIN.convergence("cifar10") is not None
    assert noisy.convergence("resnet18") is BUILTIN.convergence("resnet18") is None


@settings(max_examples=100, deadline=None)
@given(model=models, batch=batches, gpus=st.integers(1, 32), accum=accum_steps)
def test_noisy_estimates_keep_the_contract(model: str, batch: int, gpus: int, accum: int) -> None:
    noisy = NoisyEstimates(BUILTIN, sigma=1.0, seed=3)
    times = [noisy.iteration_time(model, batch, gpus, n, accum) for n in range(1, gpus + 1)]
    assert times == sorted(times) and times[0] > 0
    assert noisy.iteration_time(model, batch, gpus, 1, accum) >= noisy.iteration_time(
        model, batch, gpus, 1
    )


def test_a_repeated_call_is_answered_from_the_cache(perf: ProfilePerformanceModel) -> None:
    first = perf.colocation_slowdown(JobShape("bert", 64, 8, 2), JobShape("resnet18", 128, 1, 1))
    cached = len(perf._slow_cache)
    again = perf.colocation_slowdown(JobShape("bert", 64, 8, 2), JobShape("resnet18", 128, 1, 1))
    assert again == first and len(perf._slow_cache) == cached
