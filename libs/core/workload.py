"""Workloads: trace jobs made runnable, and synthetic traces.

`materialize` turns `TraceJob`s (what a trace says) into `JobSpec`s (what the
simulator runs): it gives model-less jobs a model drawn from a seeded mix, fills in
batch sizes, and converts run times into iteration counts with a performance model.
`synthetic` generates a trace of Poisson arrivals with lognormal run times;
`synergy_trace` generates Synergy's workload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import SYNERGY_CATEGORIES
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.parallelism import alone_iteration_time
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.traces import TraceJob, write_native

__all__ = [
    "CATEGORY_WEIGHTS",
    "MODEL_CATEGORIES",
    "MODEL_MIX",
    "PHILLY_LIKE_GPUS",
    "SYNERGY_PREFIX",
    "in_id_range",
    "job_number",
    "materialize",
    "mix_from_categories",
    "parse_id_range",
    "parse_mix",
    "synergy_count",
    "synergy_jobs",
    "synergy_models",
    "synergy_trace",
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
        batch = max(job.batch_size or _default_batch(job, perf.default_batch_size(model)), job.gpus)
        iterations: float
        if job.iterations is not None:
            iterations = job.iterations
        else:
            assert job.duration_s is not None  # TraceJob holds exactly one of the two
            # not rounded: a whole number of iterations would miss the run time by up
            # to half an iteration, enough to reorder jobs of equal trace durations
            iterations = job.duration_s / iteration_time(model, batch, job.gpus)
        spec = _spec(job, model, batch, iterations)
        # a (d, t, p) job's run time counts at its own iteration time where the mapper
        # puts it on ``cluster`` (None: a data-parallel job, or no cluster or model for it)
        parallel = None if cluster is None else alone_iteration_time(perf, cluster, spec)
        if parallel is not None and job.duration_s is not None:
            spec = replace(spec, iterations=job.duration_s / parallel)
        specs.append(spec)
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


def _default_batch(job: TraceJob, default: int) -> int:
    """The model's default batch, moved into the batch bounds the job declares."""
    if job.min_batch_size is not None:
        default = max(default, job.min_batch_size)
    if job.max_batch_size is not None:
        default = min(default, job.max_batch_size)
    return default


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
        priority=job.priority,
        tensor_parallel=job.tensor_parallel,
        pipeline_parallel=job.pipeline_parallel,
        min_gpus=job.min_gpus,
        max_gpus=job.max_gpus,
        min_batch_size=job.min_batch_size,
        max_batch_size=job.max_batch_size,
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


# ------------------------------------------------------------ Synergy's workload

#: the GPU counts ``synergy_trace(multigpu=True)`` draws from, Philly-like (as `synthetic`)
PHILLY_LIKE_GPUS: Sequence[tuple[int, float]] = ((1, 0.7), (2, 0.1), (4, 0.1), (8, 0.1))
#: the prefix of ``--trace synergy:N``
SYNERGY_PREFIX = "synergy:"


def synergy_models(perf: PerformanceModel) -> dict[str, tuple[str, ...]]:
    """The models of Synergy's workload by class (image, language, speech): Synergy's own
    (``profiles/synergy/models.json``) where ``perf`` knows them, else the built-in
    models of each class it knows."""
    known = set(perf.models())
    own = {
        cls: tuple(sorted(m for m, c in SYNERGY_CATEGORIES.items() if c == cls and m in known))
        for cls in CATEGORY_WEIGHTS
    }
    if all(own.values()):
        return own
    builtin = {
        cls: tuple(m for m in MODEL_CATEGORIES[cls] if m in known) for cls in CATEGORY_WEIGHTS
    }
    missing = [cls for cls, models in builtin.items() if not models]
    if missing:
        raise ValueError(f"the performance model has no {', '.join(missing)} model")
    return builtin


def synergy_duration_s(rng: random.Random) -> float:
    """Synergy's run times: with probability 0.8 ``60 x 10^U(1.5, 3)`` s, else
    ``60 x 10^U(3, 4)`` s."""
    low, high = (1.5, 3.0) if rng.random() < 0.8 else (3.0, 4.0)
    return 60.0 * 10 ** rng.uniform(low, high)


def synergy_trace(
    n_jobs: int,
    *,
    seed: int,
    arrival_rate_per_h: float,
    models_by_class: Mapping[str, Sequence[str]],
    multigpu: bool = False,
) -> list[TraceJob]:
    """Synergy's workload: Poisson arrivals at ``arrival_rate_per_h``, run times from
    `synergy_duration_s`, each job's class drawn with the (20, 70, 10) split of image,
    language and speech and its model the next of that class round robin; one GPU per
    job, or Philly-like counts with ``multigpu``. Job ids are 0, 1, ... (Synergy measures
    ids 4000-4999). The same arguments always give the same trace."""
    _check_synthetic(n_jobs, arrival_rate_per_h, PHILLY_LIKE_GPUS, 1.0, 0.0)
    rng = random.Random(seed)
    classes = tuple(CATEGORY_WEIGHTS)
    class_weights = tuple(_running_sum(CATEGORY_WEIGHTS[c] for c in classes))
    sizes = tuple(g for g, _ in PHILLY_LIKE_GPUS)
    size_weights = tuple(_running_sum(w for _, w in PHILLY_LIKE_GPUS))
    next_of = dict.fromkeys(classes, 0)
    rate_per_s = arrival_rate_per_h / 3600
    jobs, now = [], 0.0
    for i in range(n_jobs):
        if i:
            now += rng.expovariate(rate_per_s)
        cls = rng.choices(classes, cum_weights=class_weights)[0]
        models = models_by_class[cls]
        model = models[next_of[cls] % len(models)]
        next_of[cls] += 1
        gpus = rng.choices(sizes, cum_weights=size_weights)[0] if multigpu else 1
        jobs.append(
            TraceJob(
                job_id=str(i),
                submit_time=now,
                gpus=gpus,
                model=model,
                duration_s=synergy_duration_s(rng),
                line=i + 1,
            )
        )
    return jobs


def synergy_count(trace: str) -> int | None:
    """N of ``synergy:N``; None for any other trace."""
    if not trace.startswith(SYNERGY_PREFIX):
        return None
    text = trace[len(SYNERGY_PREFIX) :]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--trace {trace!r}: expected synergy:N with N >= 1 jobs")
    return int(text)


def synergy_jobs(
    n_jobs: int,
    perf: PerformanceModel,
    *,
    seed: int,
    arrival_rate_per_h: float,
    multigpu: bool = False,
    cluster: Cluster | None = None,
) -> tuple[list[JobSpec], str]:
    """`synergy_trace` made runnable on ``cluster``, and a line saying what it is."""
    by_class = synergy_models(perf)
    trace = synergy_trace(
        n_jobs,
        seed=seed,
        arrival_rate_per_h=arrival_rate_per_h,
        models_by_class=by_class,
        multigpu=multigpu,
    )
    models = ", ".join(f"{cls} {'/'.join(ms)}" for cls, ms in by_class.items())
    note = (
        f"synergy: {n_jobs} jobs, Poisson arrivals at {arrival_rate_per_h:g}/h, "
        f"{'Philly-like GPU counts' if multigpu else '1 GPU each'}, seed {seed}; {models}"
    )
    return materialize(trace, perf, seed=seed, cluster=cluster), note


def parse_id_range(spec: str) -> range:
    """``4000-4999`` (both ends included) or a single ``4000``."""
    low, sep, high = spec.strip().partition("-")
    try:
        first = int(low)
        last = int(high) if sep else first
    except ValueError:
        raise ValueError(f"expected a job id range such as 4000-4999, got {spec!r}") from None
    if first < 0 or last < first:
        raise ValueError(
            f"expected a job id range FIRST-LAST with 0 <= FIRST <= LAST, got {spec!r}"
        )
    return range(first, last + 1)


def job_number(job_id: str) -> int | None:
    """The number a job id ends in (``4000``, ``syn-4000``), None if it ends in none."""
    digits = len(job_id) - len(job_id.rstrip("0123456789"))
    return int(job_id[-digits:]) if digits else None


def in_id_range(job_id: str, ids: range) -> bool:
    number = job_number(job_id)
    return number is not None and number in ids


def parse_slack_range(spec: str) -> tuple[float, float]:
    """``LO-HI`` (``1.2-3``): the range a deadline's slack factor is drawn from; both
    finite, ``0 < LO <= HI``."""
    low_text, sep, high_text = spec.partition("-")
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise ValueError(f"expected LO-HI such as 1.2-3, got {spec!r}") from None
    if not sep or not (math.isfinite(low) and math.isfinite(high)) or not 0 < low <= high:
        raise ValueError(f"expected LO-HI with 0 < LO <= HI, got {spec!r}")
    return low, high


def alone_run_s(job: JobSpec, perf: PerformanceModel, cluster: Cluster) -> float:
    """Seconds ``job`` runs alone at its most consolidated placement on ``cluster``."""
    nodes = cluster.fewest_nodes(job.gpus)
    return job.iterations * perf.iteration_time(job.model, job.batch_size, job.gpus, nodes)


def with_deadlines(
    jobs: Sequence[JobSpec],
    perf: PerformanceModel,
    cluster: Cluster,
    slack: tuple[float, float],
    seed: int = 0,
) -> list[JobSpec]:
    """Every job given the deadline ``submit + s x`` its isolated run time (alone at its
    most consolidated placement on ``cluster``), ``s`` uniform in ``slack`` and seeded
    (GENIE's deadline workloads draw them so); a job wider than the cluster keeps none."""
    rng = random.Random(f"deadlines:{seed}")
    low, high = slack
    dated = []
    for job in jobs:
        factor = rng.uniform(low, high)  # drawn for every job, so a job's draw is its own
        if job.gpus > cluster.total_gpus:
            dated.append(job)  # it cannot run here at all: no run time to set one from
            continue
        dated.append(
            replace(job, deadline=job.submit_time + factor * alone_run_s(job, perf, cluster))
        )
    return dated
