"""Workloads: trace jobs made runnable, and synthetic traces.

`materialize` turns `TraceJob`s (what a trace says) into `JobSpec`s (what the
simulator runs): it gives model-less jobs a model drawn from a seeded mix, fills in
batch sizes, and converts run times into iteration counts with a performance model.
`synthetic` generates a trace of Poisson arrivals with lognormal run times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence

from libs.core.cluster import Cluster
from libs.core.jobs import JobSpec
from libs.core.perf import PerformanceModel
from libs.core.traces import TraceJob, write_native

__all__ = [
    "CATEGORY_WEIGHTS",
    "MODEL_CATEGORIES",
    "MODEL_MIX",
    "materialize",
    "mix_from_categories",
    "parse_mix",
    "synthetic",
    "write_native",
]

#: Model names of the built-in profile set, by the task family Synergy's workload
#: split uses (image, language, speech), plus two families it does not.
MODEL_CATEGORIES: Mapping[str, tuple[str, ...]] = {
    "image": (
        "resnet18",
        "resnet50",
        "vgg16",
        "vgg19",
        "shufflenet_v2",
        "cifar10",
        "imagenet",
        "yolov3",
    ),
    "language": ("bert", "gpt2", "transformer", "lm"),
    "speech": ("deepspeech2",),
    "recommendation": ("ncf", "recommendation"),
    "rl": ("dqn", "a2c"),
}

#: Synergy's (20, 70, 10) split of image, language and speech jobs. Recommendation and
#: RL models get no share by default so the split stays the published one; name them
#: in a mix (see `parse_mix`) to include them.
CATEGORY_WEIGHTS: Mapping[str, float] = {"image": 0.2, "language": 0.7, "speech": 0.1}


def mix_from_categories(weights: Mapping[str, float]) -> dict[str, float]:
    """Spread each category's weight evenly over its models."""
    mix: dict[str, float] = {}
    for category, weight in weights.items():
        models = MODEL_CATEGORIES.get(category)
        if models is None:
            raise ValueError(
                f"unknown model category {category!r}; known: {', '.join(MODEL_CATEGORIES)}"
            )
        for model in models:
            mix[model] = mix.get(model, 0.0) + weight / len(models)
    return mix


#: The default mix: model name -> probability a model-less trace job gets it.
MODEL_MIX: Mapping[str, float] = mix_from_categories(CATEGORY_WEIGHTS)


def parse_mix(spec: str) -> dict[str, float]:
    """Parse ``name=weight,...`` where a name is a category or a model.

    ``image=20,language=70,speech=10`` is the default mix; ``resnet50=1,bert=3`` names
    models directly. Weights are relative and need not sum to anything.
    """
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, text = part.partition("=")
        try:
            weight = float(text) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"mix entry {part!r} is not name=weight with a weight >= 0")
        name = name.strip()
        share = mix_from_categories({name: weight}) if name in MODEL_CATEGORIES else {name: weight}
        for model, value in share.items():
            mix[model] = mix.get(model, 0.0) + value
    if not mix or sum(mix.values()) <= 0:
        raise ValueError(f"mix {spec!r} gives no model a positive weight")
    return mix


class _Picker:
    """Seeded draws from a mix; the same seed and call order give the same models."""

    def __init__(self, mix: Mapping[str, float], rng: random.Random) -> None:
        self.models = tuple(m for m, w in mix.items() if w > 0)
        if not self.models or any(w < 0 for w in mix.values()):
            raise ValueError("a model mix needs weights >= 0 and at least one > 0")
        self.cum_weights = tuple(_running_sum(mix[m] for m in self.models))
        self.rng = rng

    def pick(self) -> str:
        return self.rng.choices(self.models, cum_weights=self.cum_weights)[0]


def _running_sum(values: Iterable[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def materialize(
    trace_jobs: Sequence[TraceJob],
    perf: PerformanceModel,
    *,
    seed: int,
    mix: Mapping[str, float] | None = None,
    cluster: Cluster | None = None,
    gpus_per_node_hint: int = 8,
) -> list[JobSpec]:
    """Turn trace jobs into runnable jobs.

    - A job without a model gets one drawn from ``mix`` (default `MODEL_MIX`) with
      ``random.Random(seed)``, in trace order, so a seed fixes the assignment.
    - A job without a batch size gets ``perf.default_batch_size(model)``. A batch
      smaller than the GPU count is raised to the GPU count, the smallest batch that
      gives every GPU at least one sample; larger batches are kept as given (the
      per-GPU batch may be fractional, as performance models accept).
    - A job given a run time runs ``duration_s / t`` iterations (a fraction of one, or
      not a whole number, as it comes), where ``t`` is its exclusive iteration time at
      its reference placement: on ``cluster``, the placement it gets there alone
      (``Cluster.fewest_nodes``), so that it alone takes exactly its trace duration on
      the cluster simulated; without a cluster,
      ``ceil(gpus / gpus_per_node_hint)`` nodes. A job larger than ``cluster`` never
      runs there; its count uses one node, an O(1) stand-in that costs no per-GPU work.
    """
    if gpus_per_node_hint < 1:
        raise ValueError(f"gpus_per_node_hint must be >= 1, got {gpus_per_node_hint}")
    known = frozenset(perf.models())
    picker = _checked_picker(trace_jobs, known, mix, seed)
    iteration_times: dict[tuple[str, int, int], float] = {}

    def reference_nodes(gpus: int) -> int:
        if cluster is None:
            return math.ceil(gpus / gpus_per_node_hint)
        return cluster.fewest_nodes(gpus) if gpus <= cluster.total_gpus else 1

    def iteration_time(model: str, batch: int, gpus: int) -> float:
        key = (model, batch, gpus)
        if key not in iteration_times:
            iteration_times[key] = perf.iteration_time(model, batch, gpus, reference_nodes(gpus), 1)
        return iteration_times[key]

    specs = []
    for job in trace_jobs:
        model = job.model if job.model is not None else picker.pick()
        if model not in known:
            raise ValueError(
                f"job {job.job_id} (line {job.line}): unknown model {model!r}; "
                f"valid models: {', '.join(sorted(known))}"
            )
        batch = max(job.batch_size or perf.default_batch_size(model), job.gpus)
        iterations: float
        if job.iterations is not None:
            iterations = job.iterations
        else:
            assert job.duration_s is not None  # TraceJob holds exactly one of the two
            # not rounded: a whole number of iterations would miss the run time by up
            # to half an iteration, enough to reorder jobs of equal trace durations
            iterations = job.duration_s / iteration_time(model, batch, job.gpus)
        specs.append(_spec(job, model, batch, iterations))
    return specs


def _checked_picker(
    jobs: Sequence[TraceJob], known: frozenset[str], mix: Mapping[str, float] | None, seed: int
) -> _Picker:
    chosen = MODEL_MIX if mix is None else mix
    # a mix only matters when some job lacks a model; then every model in it must exist
    if any(j.model is None for j in jobs):
        unknown = sorted(m for m, w in chosen.items() if w > 0 and m not in known)
        if unknown:
            raise ValueError(
                f"model mix names models the performance model lacks: {', '.join(unknown)}; "
                f"valid models: {', '.join(sorted(known))}"
            )
    return _Picker(chosen, random.Random(seed))


def _spec(job: TraceJob, model: str, batch: int, iterations: float) -> JobSpec:
    return JobSpec(
        job_id=job.job_id,
        submit_time=job.submit_time,
        model=model,
        gpus=job.gpus,
        batch_size=batch,
        iterations=iterations,
        allow_sharing=job.allow_sharing,
        deadline=job.deadline,
        user=job.user,
        cpus_per_gpu=job.cpus_per_gpu,
        mem_gb_per_gpu=job.mem_gb_per_gpu,
    )


def synthetic(
    n_jobs: int,
    *,
    seed: int,
    arrival_rate_per_h: float,
    mix: Mapping[str, float] | None = None,
    gpu_choices: Sequence[tuple[int, float]] = ((1, 0.7), (2, 0.1), (4, 0.1), (8, 0.1)),
    duration_median_s: float = 3600,
    duration_sigma: float = 1.5,
) -> list[TraceJob]:
    """A trace of ``n_jobs`` Poisson arrivals with lognormal exclusive run times.

    The first job arrives at 0, as loaded traces do; gaps are exponential with mean
    ``3600 / arrival_rate_per_h`` s. GPU counts follow ``gpu_choices`` ((gpus, weight)
    pairs), models follow ``mix`` (default `MODEL_MIX`), and run times have median
    ``duration_median_s`` and log-standard-deviation ``duration_sigma``.
    The same arguments always give the same trace.
    """
    _check_synthetic(n_jobs, arrival_rate_per_h, gpu_choices, duration_median_s, duration_sigma)
    rng = random.Random(seed)
    picker = _Picker(MODEL_MIX if mix is None else mix, rng)
    sizes = tuple(g for g, _ in gpu_choices)
    size_weights = tuple(_running_sum(w for _, w in gpu_choices))
    mu, rate_per_s = math.log(duration_median_s), arrival_rate_per_h / 3600
    jobs, now = [], 0.0
    for i in range(n_jobs):
        if i:
            now += rng.expovariate(rate_per_s)
        jobs.append(
            TraceJob(
                job_id=f"syn-{i}",
                submit_time=now,
                gpus=rng.choices(sizes, cum_weights=size_weights)[0],
                model=picker.pick(),
                duration_s=rng.lognormvariate(mu, duration_sigma),
                line=i + 1,
            )
        )
    return jobs


def _check_synthetic(
    n_jobs: int,
    rate: float,
    gpu_choices: Sequence[tuple[int, float]],
    median: float,
    sigma: float,
) -> None:
    if n_jobs < 0:
        raise ValueError(f"n_jobs must be >= 0, got {n_jobs}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"arrival_rate_per_h must be > 0, got {rate}")
    if not gpu_choices or any(g < 1 or w < 0 for g, w in gpu_choices):
        raise ValueError("gpu_choices needs (gpus >= 1, weight >= 0) pairs")
    if sum(w for _, w in gpu_choices) <= 0:
        raise ValueError("gpu_choices needs at least one positive weight")
    if not (median > 0 and sigma >= 0):
        raise ValueError("duration_median_s must be > 0 and duration_sigma >= 0")
