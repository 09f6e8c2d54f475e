"""BaselinePredictor and PredictorConfig on their own: no NATS, numbers worked out by hand."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.common.schemas import JobProgressEvent, PredictRequest, Progress
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.perf import UnknownModelError
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.model import (
    DEFAULT_RUN_S,
    RATIO_BOUNDS,
    BaselinePredictor,
    InvalidRequest,
    Learned,
    LearnedIterations,
    LearnedRatio,
)
from tests.builders import TablePerf


@dataclass(frozen=True)
class SpeedupPerf(TablePerf):
    """TablePerf whose CPU/memory speedup is ``cpus_per_gpu / 4`` (1.0 at four cores)."""

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        return cpus_per_gpu / 4


def table() -> TablePerf:
    # a: 0.5 s per iteration alone, b: 0.25 s; a next to b slows down 1.5x
    return TablePerf(
        iter_s={"a": 0.5, "b": 0.25}, slowdown={("a", "b"): 1.5}, spread_penalty=2.0
    )


def predictor(weight: float = 0.2) -> BaselinePredictor:
    return BaselinePredictor(table(), history_weight=weight)


def progress(
    job_id: str = "j1",
    iteration_s: float | None = 1.0,
    iteration: int = 10,
    model: str = "a",
    co_runners: tuple[str, ...] = (),
    nodes: int = 1,
    gpus: int = 1,
    batch_size: int = 32,
    run_id: int = 1,
) -> JobProgressEvent:
    return JobProgressEvent(
        job_id=job_id,
        run_id=run_id,
        node="n0",
        model=model,
        batch_size=batch_size,
        gpus=gpus,
        nodes=nodes,
        co_runners=list(co_runners),
        iteration_s=iteration_s,
        progress=Progress(iteration=iteration),
    )


def ask(model: str = "a", **fields: object) -> PredictRequest:
    return PredictRequest(model=model, batch_size=32, **fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- throughput


def test_throughput_before_any_history_is_the_profile_figure():
    answer = predictor().throughput(ask())
    assert answer.iteration_s == 0.5
    assert answer.samples_per_s == answer.value == 64.0
    assert (answer.kind, answer.source) == ("throughput", "profile")


def test_throughput_matches_the_ground_truth_profiles_for_a_real_model():
    truth = ProfilePerformanceModel.builtin()
    answer = BaselinePredictor(truth).throughput(
        PredictRequest(model="resnet50", batch_size=64, gpus=2, accum_steps=2)
    )
    assert answer.iteration_s == pytest.approx(truth.iteration_time("resnet50", 64, 2, 1, 2))


def test_one_solo_measurement_moves_the_estimate_by_the_history_weight():
    model = predictor(weight=0.2)
    assert model.observe_progress(progress(iteration_s=1.0))  # measured 2x the profile
    answer = model.throughput(ask())
    # factor 1 + 0.2 * (2 - 1) = 1.2
    assert answer.iteration_s == pytest.approx(0.6)
    assert answer.source == "profile+history"


def test_repeated_measurements_converge_on_the_measured_time():
    model = predictor(weight=0.2)
    for i in range(1, 11):
        model.observe_progress(progress(iteration_s=1.0, iteration=i))
    # factor after n samples: 2 - 0.8 ** n
    assert model.throughput(ask()).iteration_s == pytest.approx(0.5 * (2 - 0.8**10))


def test_the_correction_is_relative_to_the_profile_at_the_events_own_placement():
    model = predictor(weight=1.0)
    # two nodes: the profile says 0.5 * 2 = 1.0 s, so 1.0 s measured is no surprise
    model.observe_progress(progress(iteration_s=1.0, nodes=2, gpus=2))
    assert model.solo_factor("a", 32, 2) == pytest.approx(1.0)
    assert model.throughput(ask(gpus=2)).iteration_s == pytest.approx(0.5)


def test_learning_is_kept_apart_per_batch_size_and_gpu_count():
    model = predictor(weight=1.0)
    model.observe_progress(progress(iteration_s=1.0, batch_size=64))
    assert model.throughput(ask()).source == "profile"
    assert model.throughput(ask(gpus=2)).source == "profile"
    assert model.solo_factor("a", 64, 1) == pytest.approx(2.0)


def test_an_event_that_did_not_advance_an_iteration_teaches_nothing():
    model = predictor(weight=0.5)
    assert model.observe_progress(progress(iteration_s=1.0, iteration=10))
    assert not model.observe_progress(progress(iteration_s=1.0, iteration=10))
    assert model.solo_factor("a", 32, 1) == pytest.approx(1.5)


def test_a_new_run_learns_even_from_a_lower_iteration():
    model = predictor(weight=0.5)
    model.observe_progress(progress(iteration_s=1.0, iteration=10, run_id=1))
    assert model.observe_progress(progress(iteration_s=1.0, iteration=3, run_id=2))


@pytest.mark.parametrize("measured", [None, 0.0, -1.0, float("nan"), float("inf")])
def test_an_event_without_a_usable_measurement_teaches_nothing(measured: float | None):
    model = predictor()
    assert not model.observe_progress(progress(iteration_s=measured))
    assert model.throughput(ask()).source == "profile"


def test_a_wild_measurement_is_clamped_before_it_is_averaged():
    model = predictor(weight=0.2)
    model.observe_progress(progress(iteration_s=0.5 * 1000))
    assert model.solo_factor("a", 32, 1) == pytest.approx(1 + 0.2 * (RATIO_BOUNDS[1] - 1))


def test_co_located_measurements_do_not_change_the_exclusive_estimate():
    model = predictor(weight=1.0)
    model.observe_progress(progress(job_id="p", model="b"))
    model.observe_progress(progress(iteration_s=3.0, co_runners=("p",)))
    assert model.throughput(ask()).iteration_s == 0.5


def test_cpu_and_memory_below_the_fair_share_slow_the_prediction():
    model = BaselinePredictor(SpeedupPerf(iter_s={"a": 0.5}))
    assert model.throughput(ask(cpus_per_gpu=2.0)).iteration_s == pytest.approx(1.0)
    assert model.throughput(ask(cpus_per_gpu=8.0)).iteration_s == pytest.approx(0.25)


# ---------------------------------------------------------------------- slowdown


def test_slowdown_before_any_history_is_the_profile_figure():
    answer = predictor().slowdown(ask(partner="b"))
    assert (answer.kind, answer.value, answer.source) == ("slowdown", 1.5, "profile")
    assert answer.iteration_s == pytest.approx(0.75)
    assert answer.samples_per_s == pytest.approx(32 / 0.75)


def test_a_co_located_measurement_corrects_the_slowdown_of_that_pair():
    model = predictor(weight=0.5)
    model.observe_progress(progress(job_id="p", model="b"))
    # 0.5 s alone; 1.5 s next to b is a slowdown of 3, twice the profile's 1.5
    assert model.observe_progress(progress(iteration_s=1.5, co_runners=("p",)))
    answer = model.slowdown(ask(partner="b"))
    # correction 1 + 0.5 * (2 - 1) = 1.5, so 1.5 * 1.5
    assert answer.value == pytest.approx(2.25)
    assert answer.source == "profile+history"
    assert model.slowdown(ask(partner="b", partner_gpus=2)).source == "profile"


def test_the_slowdown_is_measured_against_the_learned_exclusive_time():
    model = predictor(weight=1.0)
    model.observe_progress(progress(iteration_s=1.0, iteration=1))  # alone: really 1.0 s
    model.observe_progress(progress(job_id="p", model="b"))
    model.observe_progress(progress(iteration_s=1.5, iteration=2, co_runners=("p",)))
    # 1.5 / 1.0 = 1.5: exactly what the profile says
    assert model.slowdown(ask(partner="b")).value == pytest.approx(1.5)


def test_a_slowdown_never_drops_below_one():
    model = predictor(weight=1.0)
    model.observe_progress(progress(job_id="p", model="b"))
    model.observe_progress(progress(iteration_s=0.1, co_runners=("p",)))
    assert model.slowdown(ask(partner="b")).value == 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=1e4), min_size=1, max_size=20))
def test_any_measurements_keep_slowdown_at_least_one_and_factors_in_bounds(times: list[float]):
    model = predictor(weight=0.3)
    model.observe_progress(progress(job_id="p", model="b"))
    for i, seconds in enumerate(times, start=1):
        model.observe_progress(progress(iteration_s=seconds, iteration=i))
        model.observe_progress(progress(iteration_s=seconds, iteration=i, co_runners=("p",)))
    assert model.slowdown(ask(partner="b")).value >= 1.0
    low, high = RATIO_BOUNDS
    assert low <= model.solo_factor("a", 32, 1) <= high


def test_a_partner_whose_model_is_unknown_or_several_partners_teach_nothing():
    model = predictor()
    assert not model.observe_progress(progress(iteration_s=3.0, co_runners=("never-seen",)))
    model.observe_progress(progress(job_id="p", model="b"))
    model.observe_progress(progress(job_id="q", model="b"))
    assert not model.observe_progress(progress(iteration_s=3.0, co_runners=("p", "q")))
    assert model.slowdown(ask(partner="b")).source == "profile"


def test_a_forgotten_job_is_no_longer_known_as_a_partner():
    model = predictor()
    model.observe_progress(progress(job_id="p", model="b"))
    model.forget_job("p")
    assert model.tracked_jobs() == 0
    assert not model.observe_progress(progress(iteration_s=3.0, co_runners=("p",)))


def test_a_slowdown_without_a_partner_is_refused_naming_the_field():
    with pytest.raises(InvalidRequest, match=r"^partner: ") as caught:
        predictor().slowdown(ask())
    assert caught.value.field == "partner"


# ---------------------------------------------------------------------- iterations


def test_declared_iterations_are_answered_as_declared():
    answer = predictor().iterations(ask(iterations=1234))
    assert (answer.kind, answer.value, answer.source) == ("iterations", 1234.0, "declared")


def test_without_history_the_default_iterations_fill_the_default_run_time():
    answer = predictor().iterations(ask())
    assert answer.value == DEFAULT_RUN_S / 0.5
    assert answer.source == "default"


def test_completed_jobs_give_the_mean_iterations_of_their_model():
    model = predictor()
    model.observe_completion("a", 100)
    model.observe_completion("a", 301)
    answer = model.iterations(ask())
    assert (answer.value, answer.source) == (200.0, "history")
    assert model.iterations(ask(model="b")).source == "default"
    assert model.iterations(ask(iterations=7)).value == 7.0


def test_a_completion_with_an_unknown_model_or_no_iterations_is_refused():
    model = predictor()
    with pytest.raises(UnknownModelError):
        model.observe_completion("zzz", 10)
    with pytest.raises(ValueError, match="iterations"):
        model.observe_completion("a", 0)


# ---------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("kind", ["iterations", "throughput", "slowdown"])
def test_an_unknown_model_is_refused_listing_the_valid_names(kind: str):
    model = BaselinePredictor(ProfilePerformanceModel.builtin())
    with pytest.raises(UnknownModelError) as caught:
        getattr(model, kind)(PredictRequest(model="alexnet", batch_size=8, partner="bert"))
    assert "alexnet" in str(caught.value)
    assert "resnet50" in str(caught.value) and "bert" in str(caught.value)


def test_an_unknown_partner_model_is_refused():
    with pytest.raises(UnknownModelError, match="'zzz'"):
        predictor().slowdown(ask(partner="zzz"))


def test_more_nodes_than_gpus_is_refused_naming_nodes():
    with pytest.raises(InvalidRequest, match=r"^nodes: "):
        predictor().throughput(ask(gpus=2, nodes=3))


def test_a_progress_event_of_an_unknown_model_raises():
    with pytest.raises(UnknownModelError):
        predictor().observe_progress(progress(model="zzz"))


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5])
def test_a_history_weight_outside_zero_to_one_is_refused(weight: float):
    with pytest.raises(ValueError, match="history_weight"):
        BaselinePredictor(table(), history_weight=weight)


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"nats_url": "localhost:4222"}, "nats_url"),
        ({"history_weight": 0}, "history_weight"),
        ({"history_weight": float("nan")}, "history_weight"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"data_dir": Path("/nonexistent/gpusched")}, "data_dir"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(fields: dict[str, object], named: str):
    with pytest.raises(ValueError, match=named):
        PredictorConfig(**fields)  # type: ignore[arg-type]


def test_the_config_is_read_from_the_environment(tmp_path: Path):
    config = PredictorConfig.from_env(
        {
            "NATS_URL": "nats://example:4333",
            "GPUSCHED_DATA_DIR": str(tmp_path),
            "GPUSCHED_PREDICTOR_HISTORY_WEIGHT": "0.5",
            "GPUSCHED_PREDICTOR_METRICS_PORT": "9100",
        }
    )
    assert config == PredictorConfig(
        nats_url="nats://example:4333", data_dir=tmp_path, history_weight=0.5, metrics_port=9100
    )
    assert PredictorConfig.from_env({}) == PredictorConfig()


def test_a_malformed_environment_variable_is_named():
    with pytest.raises(ValueError, match="GPUSCHED_PREDICTOR_HISTORY_WEIGHT"):
        PredictorConfig.from_env({"GPUSCHED_PREDICTOR_HISTORY_WEIGHT": "lots"})


def test_what_one_predictor_learned_restores_into_another_exactly():
    first = predictor(weight=0.5)
    first.observe_progress(progress("j1", iteration_s=1.0, iteration=1))
    first.observe_progress(progress("j2", iteration_s=0.25, iteration=1, model="b"))
    first.observe_progress(progress("j1", iteration_s=3.0, iteration=2, co_runners=("j2",)))
    first.observe_completion("a", 300)
    second = predictor(weight=0.5)

    taken = second.restore(first.learned())

    assert taken == 4  # two solo ratios, one pair, one model's iterations
    assert second.learned() == first.learned()
    for request in (
        PredictRequest(model="a", batch_size=32),
        PredictRequest(model="a", batch_size=32, partner="b", partner_batch_size=32),
    ):
        assert second.throughput(request) == first.throughput(request)
    assert second.iterations(PredictRequest(model="a", batch_size=32)) == first.iterations(
        PredictRequest(model="a", batch_size=32)
    )


def test_restoring_skips_entries_of_unknown_models_or_the_wrong_shape():
    learned = Learned(
        solo=[
            LearnedRatio(["a", 32, 1], 2.0, 3),
            LearnedRatio(["gpt-17", 32, 1], 2.0, 3),
            LearnedRatio(["a", 32], 2.0, 3),
            LearnedRatio(["a", "32", 1], 2.0, 3),
            LearnedRatio(["b", 32, 1], -1.0, 3),
        ],
        completed=[LearnedIterations("a", 2, 500), LearnedIterations("nope", 1, 5)],
    )
    restored = predictor()

    assert restored.restore(learned) == 2
    assert restored.solo_factor("a", 32, 1) == 2.0
    assert restored.solo_factor("b", 32, 1) == 1.0
