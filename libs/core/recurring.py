"""A recurring workload: users who resubmit variants of the same few jobs.

Our generator (no published trace has these fields), for ``--trace recurring:N``. The
size predictor (`gpusched.libs.core.size_predictor`) learns from such workloads what a user's
declared size does not say.

- ``users`` users (default ``round(sqrt(N))`` between 4 and 40), each with 2 to 5 job
  *templates*: a model from the performance model's mix (image 20 %, language 70 %,
  speech 10 %, as `gpusched.libs.core.workload.MODEL_MIX`), a data set of that model's family, a
  task (``pretrain``, ``finetune``, ...), GPUs from ``gpu_choices`` and the model's
  default batch per GPU.
- A template's run time alone (at its most consolidated placement on the cluster) is
  lognormal across templates, median ``run_time_median_s`` and log-sigma
  ``run_time_sigma`` (heavy-tailed), turned into its *base* iterations.
- Templates are picked Zipf-like (weight ``1/rank^0.8``, seeded shuffle), so a few
  recur often. Each submission runs ``base x lognormal(0, noise_sigma)`` iterations and
  is named ``<user>-<model>-<task>-v<k>`` for its k-th submission of the template.
- Declared iterations over-estimate: ``max(truth, base x inflation x
  lognormal(0, declared_sigma))`` with a per-user inflation uniform in
  ``declared_inflation`` (users who ask for 1.3 to 3 times what they need).
- Poisson arrivals at ``arrival_rate_per_h``; job ids ``rec-0``, ``rec-1``, ...

The same arguments always give the same jobs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.workload import MODEL_CATEGORIES, MODEL_MIX

#: the prefix of ``--trace recurring:N``
RECURRING_PREFIX = "recurring:"

#: data sets a template may train on, by model family
DATASETS: dict[str, tuple[str, ...]] = {
    "image": ("imagenet", "cifar10", "coco", "places365"),
    "language": ("wikitext103", "squad", "glue-mnli", "openwebtext"),
    "speech": ("librispeech", "commonvoice"),
    "recommendation": ("movielens", "criteo"),
    "rl": ("atari", "mujoco"),
}
TASKS = ("pretrain", "finetune", "sweep", "ablation", "baseline", "distill")


@dataclass(frozen=True)
class RecurringConfig:
    """The knobs of `recurring_jobs`; checked at construction, each error names its field."""

    users: int | None = None
    templates_per_user: tuple[int, int] = (2, 5)
    run_time_median_s: float = 1800.0
    run_time_sigma: float = 1.5
    noise_sigma: float = 0.2
    declared_inflation: tuple[float, float] = (1.3, 3.0)
    declared_sigma: float = 0.25
    gpu_choices: Sequence[tuple[int, float]] = ((1, 0.55), (2, 0.2), (4, 0.15), (8, 0.1))

    def __post_init__(self) -> None:
        if self.users is not None and self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        low, high = self.templates_per_user
        if not 1 <= low <= high:
            raise ValueError(
                f"templates_per_user must be (lo, hi) with 1 <= lo <= hi, got {low, high}"
            )
        if not (self.run_time_median_s > 0 and math.isfinite(self.run_time_median_s)):
            raise ValueError(f"run_time_median_s must be > 0, got {self.run_time_median_s}")
        for field_name in ("run_time_sigma", "noise_sigma", "declared_sigma"):
            value = getattr(self, field_name)
            if not (0 <= value <= 5):
                raise ValueError(f"{field_name} must be in 0..5, got {value}")
        lo, hi = self.declared_inflation
        if not 1 <= lo <= hi < math.inf:
            raise ValueError(
                f"declared_inflation must be (lo, hi) with 1 <= lo <= hi, got {lo, hi}"
            )
        if not self.gpu_choices or any(g < 1 or w < 0 for g, w in self.gpu_choices):
            raise ValueError("gpu_choices needs (gpus >= 1, weight >= 0) pairs")
        if sum(w for _, w in self.gpu_choices) <= 0:
            raise ValueError("gpu_choices needs at least one positive weight")


@dataclass(frozen=True)
class Template:
    """One job a user submits again and again (its variants differ in size)."""

    user: str
    model: str
    dataset: str
    task: str
    gpus: int
    batch: int
    base_iterations: float
    inflation: float
    #: seconds an iteration takes alone at its most consolidated placement
    iter_s: float


def recurring_count(trace: str) -> int | None:
    """N of ``recurring:N``; None for any other trace."""
    if not trace.startswith(RECURRING_PREFIX):
        return None
    text = trace[len(RECURRING_PREFIX) :]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--trace {trace!r}: expected recurring:N with N >= 1 jobs")
    return int(text)


def default_users(n_jobs: int) -> int:
    return min(40, max(4, round(math.sqrt(n_jobs))))


def _family(model: str) -> str:
    for family, models in MODEL_CATEGORIES.items():
        if model in models:
            return family
    return "image"


def make_templates(
    rng: random.Random,
    perf: PerformanceModel,
    cluster: Cluster | None,
    users: int,
    config: RecurringConfig,
) -> list[Template]:
    """``config.templates_per_user`` templates for each of ``users`` users, drawn with
    ``rng`` (see the module's text), sized for ``cluster`` where given."""
    known = set(perf.models())
    mix = {m: w for m, w in MODEL_MIX.items() if m in known and w > 0}
    if not mix:
        mix = dict.fromkeys(sorted(known), 1.0)
    models, weights = tuple(mix), tuple(mix.values())
    sizes = tuple(g for g, _ in config.gpu_choices)
    size_weights = tuple(w for _, w in config.gpu_choices)
    most = cluster.total_gpus if cluster is not None else max(sizes)
    mu = math.log(config.run_time_median_s)
    templates = []
    for u in range(users):
        user = f"user{u}"
        inflation = rng.uniform(*config.declared_inflation)
        tasks = list(TASKS)
        rng.shuffle(tasks)
        count = rng.randint(*config.templates_per_user)
        for t in range(count):
            model = rng.choices(models, weights)[0]
            gpus = min(rng.choices(sizes, size_weights)[0], most)
            batch = perf.default_batch_size(model) * gpus
            nodes = cluster.fewest_nodes(gpus) if cluster is not None else math.ceil(gpus / 8)
            alone_s = rng.lognormvariate(mu, config.run_time_sigma)
            iter_s = perf.iteration_time(model, batch, gpus, nodes, 1)
            templates.append(
                Template(
                    user=user,
                    model=model,
                    dataset=rng.choice(DATASETS[_family(model)]),
                    task=tasks[t % len(tasks)],
                    gpus=gpus,
                    batch=batch,
                    base_iterations=alone_s / iter_s,
                    inflation=inflation,
                    iter_s=iter_s,
                )
            )
    return templates


def recurring_jobs(
    n_jobs: int,
    perf: PerformanceModel,
    *,
    seed: int,
    arrival_rate_per_h: float,
    cluster: Cluster | None = None,
    config: RecurringConfig | None = None,
) -> tuple[list[JobSpec], str]:
    """``n_jobs`` recurring jobs (see the module's text) and a line saying what they are,
    with the load they offer ``cluster``."""
    config = config or RecurringConfig()
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    if not (math.isfinite(arrival_rate_per_h) and arrival_rate_per_h > 0):
        raise ValueError(f"arrival_rate_per_h must be > 0, got {arrival_rate_per_h}")
    rng = random.Random(f"recurring:{seed}")
    users = config.users or default_users(n_jobs)
    templates = make_templates(rng, perf, cluster, users, config)
    popularity = [1.0 / (rank + 1) ** 0.8 for rank in range(len(templates))]
    rng.shuffle(popularity)
    submitted = [0] * len(templates)
    rate_per_s = arrival_rate_per_h / 3600
    jobs: list[JobSpec] = []
    now = 0.0
    gpu_s = 0.0
    for i in range(n_jobs):
        if i:
            now += rng.expovariate(rate_per_s)
        k = rng.choices(range(len(templates)), popularity)[0]
        tpl = templates[k]
        submitted[k] += 1
        truth = tpl.base_iterations * rng.lognormvariate(0.0, config.noise_sigma)
        declared = tpl.base_iterations * tpl.inflation
        declared *= rng.lognormvariate(0.0, config.declared_sigma)
        jobs.append(
            JobSpec(
                job_id=f"rec-{i}",
                submit_time=now,
                model=tpl.model,
                gpus=tpl.gpus,
                batch_size=tpl.batch,
                iterations=truth,
                user=tpl.user,
                name=f"{tpl.user}-{tpl.model}-{tpl.task}-v{submitted[k]}",
                dataset=tpl.dataset,
                declared_iterations=max(truth, declared),
            )
        )
        gpu_s += truth * tpl.iter_s * tpl.gpus
    note = (
        f"recurring: {n_jobs} jobs of {users} users ({len(templates)} templates), "
        f"Poisson arrivals at {arrival_rate_per_h:g}/h, noise sigma {config.noise_sigma:g}, "
        f"seed {seed}"
    )
    if cluster is not None and now > 0:
        load = gpu_s / (now * cluster.total_gpus)
        note += f"; offered load {load:.2f} of {cluster.total_gpus} GPUs"
    return jobs, note
