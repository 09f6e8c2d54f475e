"""A mixed workload: every feature the five methods exploit, in stated shares, for
``--trace mixed:N`` (our generator; the shares and distributions are our own choice,
documented in docs/trace-format.md, "Generated workloads").

Each job independently, from its own seeded draws:

- **recurring** (share ``recurring``, default 30 %): a resubmission of one of a few
  dozen job templates of recurring users, as A-SRPT's setting and ``recurring:N``
  (`gpusched.libs.core.recurring`): the template fixes model, data set, GPUs and batch,
  the run time is the template's times ``lognormal(0, 0.2)``, the job is named
  ``<user>-<model>-<task>-v<k>`` and declares an over-estimate of its iterations;
  otherwise a one-off job: a model from Synergy's split (image 20 %, language 70 %,
  speech 10 %, `gpusched.libs.core.workload.MODEL_MIX`, whose CPU and memory
  sensitivity the performance model gives), Philly-like GPU counts (1: 70 %, 2, 4, 8:
  10 % each) and a heavy-tailed run time alone, lognormal with median 1,800 s and
  log-sigma 1.5 (the templates' run times follow the same law);
- **deadline** (share ``deadlines``, default 20 %): ``submit + s x`` its run time alone,
  half of them tight (``s`` uniform in 1.2-2) and half loose (2-4);
- **elastic** (share ``elastic``, default 30 %): declares ``min_gpus = max(1, g // 2)``,
  ``max_gpus = 2 g`` and the global batches of its per-GPU batch at those counts.

Every job's global batch is its model's default per-GPU batch times its GPUs. Arrivals
are Poisson; with ``load`` the rate is ``load x GPUs x 3600 / mean GPU-seconds`` of the
drawn jobs (`rate_for_load`), so the jobs offer that share of the cluster's GPU
time. The same seed draws the same jobs at any load or rate: only the gaps scale.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.recurring import RecurringConfig, default_users, make_templates
from gpusched.libs.core.workload import MODEL_MIX, PHILLY_LIKE_GPUS

#: the prefix of ``--trace mixed:N``
MIXED_PREFIX = "mixed:"
#: the parameters ``mixed:N,KEY=VALUE,...`` may set
PARAMETERS = ("load", "deadlines", "elastic", "recurring")


@dataclass(frozen=True)
class MixedConfig:
    """The knobs of `mixed_jobs`; checked at construction, each error names its field."""

    #: offered load relative to the cluster's GPUs (None: the arrival rate is given)
    load: float | None = None
    deadlines: float = 0.2
    elastic: float = 0.3
    recurring: float = 0.3
    #: of the jobs with a deadline, the share with a tight one
    tight: float = 0.5
    tight_slack: tuple[float, float] = (1.2, 2.0)
    loose_slack: tuple[float, float] = (2.0, 4.0)
    gpu_choices: Sequence[tuple[int, float]] = PHILLY_LIKE_GPUS
    run_time_median_s: float = 1800.0
    run_time_sigma: float = 1.5
    #: the spread of a recurring job's run time around its template's
    noise_sigma: float = 0.2

    def __post_init__(self) -> None:
        if self.load is not None and not (math.isfinite(self.load) and 0 < self.load <= 100):
            raise ValueError(f"load must be a number in (0, 100], got {self.load:g}")
        for name in ("deadlines", "elastic", "recurring", "tight"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be a share from 0 to 1, got {value:g}")


def mixed_spec(trace: str) -> tuple[int, MixedConfig] | None:
    """N and the parameters of ``mixed:N[,KEY=VALUE...]`` (KEY one of `PARAMETERS`);
    None for any other trace. A bad N, key or value raises ValueError naming it."""
    if not trace.startswith(MIXED_PREFIX):
        return None
    count, *parts = trace[len(MIXED_PREFIX) :].split(",")
    if not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"--trace {trace!r}: expected mixed:N with N >= 1 jobs")
    values: dict[str, float] = {}
    for part in parts:
        key, sep, text = (p.strip() for p in part.partition("="))
        if key not in PARAMETERS or not sep:
            raise ValueError(
                f"--trace {trace!r}: {part.strip()!r} is not KEY=VALUE with KEY one of "
                f"{', '.join(PARAMETERS)}"
            )
        try:
            values[key] = float(text)
        except ValueError:
            raise ValueError(f"--trace {trace!r}: {key} must be a number, got {text!r}") from None
    try:
        return int(count), MixedConfig(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--trace {trace!r}: {exc}") from None


def rate_for_load(load: float, total_gpus: int, mean_gpu_s: float) -> float:
    """Jobs per hour that offer ``load`` x ``total_gpus`` GPU-seconds a second when each
    job needs ``mean_gpu_s`` GPU-seconds alone."""
    if not (mean_gpu_s > 0 and total_gpus > 0):
        raise ValueError("the load needs jobs of some GPU time and a cluster with GPUs")
    return load * total_gpus * 3600.0 / mean_gpu_s


@dataclass(frozen=True)
class _Drawn:
    """One job before its arrival time: what the shape draws gave it."""

    model: str
    gpus: int
    batch: int
    run_s: float
    user: str = ""
    name: str = ""
    dataset: str = ""
    #: the iterations the user declares, as a multiple of the true ones (0: none)
    declared_factor: float = 0.0


def mixed_jobs(
    n_jobs: int,
    perf: PerformanceModel,
    cluster: Cluster,
    *,
    seed: int,
    arrival_rate_per_h: float | None = None,
    config: MixedConfig | None = None,
) -> tuple[list[JobSpec], str]:
    """``n_jobs`` jobs of the mixed workload (see the module's text) on ``cluster`` and a
    line saying what they are. The rate is ``config.load``'s where it sets one, else
    ``arrival_rate_per_h``."""
    config = config or MixedConfig()
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    drawn = _draw_jobs(n_jobs, perf, cluster, seed, config)
    mean_gpu_s = sum(d.gpus * d.run_s for d in drawn) / n_jobs
    if config.load is not None:
        rate = rate_for_load(config.load, cluster.total_gpus, mean_gpu_s)
    elif arrival_rate_per_h is None or not (
        math.isfinite(arrival_rate_per_h) and arrival_rate_per_h > 0
    ):
        raise ValueError(f"arrival rate must be > 0 jobs an hour, got {arrival_rate_per_h}")
    else:
        rate = arrival_rate_per_h
    gaps = random.Random(f"mixed:{seed}:arrivals")
    features = random.Random(f"mixed:{seed}:features")
    jobs, now = [], 0.0
    counts = dict.fromkeys(("deadline", "tight", "elastic", "recurring"), 0)
    for i, job in enumerate(drawn):
        if i:
            now += gaps.expovariate(rate / 3600.0)
        # four draws a job whatever it becomes, so a share changes only its own feature
        dated, tight, elastic, slack = (features.random() for _ in range(4))
        spec = _spec(f"mix-{i}", now, job, perf, cluster)
        if dated < config.deadlines:
            low, high = config.tight_slack if tight < config.tight else config.loose_slack
            factor = low + (high - low) * slack
            spec = replace(spec, deadline=now + factor * job.run_s)
            counts["deadline"] += 1
            counts["tight"] += tight < config.tight
        if elastic < config.elastic:
            spec = _elastic(spec)
            counts["elastic"] += 1
        counts["recurring"] += bool(job.name)
        jobs.append(spec)
    how = f"load {config.load:g}, " if config.load is not None else ""
    note = (
        f"mixed: {n_jobs} jobs, seed {seed}, Poisson arrivals at {how}{rate:.2f}/h "
        f"(mean {mean_gpu_s / 3600:.2f} GPU-hours a job"
    )
    if now > 0:  # what the drawn gaps really offer over the arrivals' span
        offered = mean_gpu_s * n_jobs / (now * cluster.total_gpus)
        note += f"; {offered:.2f} of {cluster.total_gpus} GPUs over the arrivals"
    note += (
        f"); {counts['deadline']} with deadlines ({counts['tight']} tight), "
        f"{counts['elastic']} elastic, {counts['recurring']} recurring"
    )
    return jobs, note


def _draw_jobs(
    n_jobs: int, perf: PerformanceModel, cluster: Cluster, seed: int, config: MixedConfig
) -> list[_Drawn]:
    """Every job's model, GPUs, batch and run time alone, in submission order."""
    known = set(perf.models())
    mix = {m: w for m, w in MODEL_MIX.items() if m in known and w > 0}
    if not mix:
        raise ValueError("the performance model knows none of the models of Synergy's mix")
    models, model_weights = tuple(mix), tuple(mix.values())
    sizes = tuple(g for g, _ in config.gpu_choices)
    size_weights = tuple(w for _, w in config.gpu_choices)
    most = cluster.total_gpus
    families = random.Random(f"mixed:{seed}:families")
    users = default_users(n_jobs)
    templates = make_templates(
        families,
        perf,
        cluster,
        users,
        RecurringConfig(
            gpu_choices=config.gpu_choices,
            run_time_median_s=config.run_time_median_s,
            run_time_sigma=config.run_time_sigma,
        ),
    )
    popularity = [1.0 / (rank + 1) ** 0.8 for rank in range(len(templates))]
    families.shuffle(popularity)
    submitted = [0] * len(templates)
    kinds = random.Random(f"mixed:{seed}:kinds")
    shapes = random.Random(f"mixed:{seed}:shapes")
    mu = math.log(config.run_time_median_s)
    drawn = []
    for _ in range(n_jobs):
        # every job draws its one-off shape and its template, so that a share changes
        # only which of the two it takes
        model = shapes.choices(models, model_weights)[0]
        gpus = min(shapes.choices(sizes, size_weights)[0], most)
        run_s = shapes.lognormvariate(mu, config.run_time_sigma)
        user = f"user{shapes.randrange(users)}"
        k = families.choices(range(len(templates)), popularity)[0]
        noise = families.lognormvariate(0.0, config.noise_sigma)
        declared = families.lognormvariate(0.0, 0.25)
        if kinds.random() >= config.recurring:
            batch = perf.default_batch_size(model) * gpus
            drawn.append(_Drawn(model, gpus, batch, run_s, user))
            continue
        tpl = templates[k]
        submitted[k] += 1
        factor = max(1.0, tpl.inflation * declared / noise)
        drawn.append(
            _Drawn(
                tpl.model,
                tpl.gpus,
                tpl.batch,
                tpl.base_iterations * tpl.iter_s * noise,
                tpl.user,
                f"{tpl.user}-{tpl.model}-{tpl.task}-v{submitted[k]}",
                tpl.dataset,
                factor,
            )
        )
    return drawn


def _spec(
    job_id: str, submit: float, job: _Drawn, perf: PerformanceModel, cluster: Cluster
) -> JobSpec:
    """The job, its run time alone turned into iterations at its most consolidated
    placement on ``cluster`` (where it alone takes exactly ``run_s``)."""
    nodes = cluster.fewest_nodes(job.gpus)
    iterations = job.run_s / perf.iteration_time(job.model, job.batch, job.gpus, nodes, 1)
    return JobSpec(
        job_id=job_id,
        submit_time=submit,
        model=job.model,
        gpus=job.gpus,
        batch_size=job.batch,
        iterations=iterations,
        user=job.user,
        name=job.name,
        dataset=job.dataset,
        declared_iterations=iterations * job.declared_factor if job.declared_factor else None,
    )


def _elastic(spec: JobSpec) -> JobSpec:
    """``spec`` declaring half to twice its GPUs, at its per-GPU batch."""
    per_gpu = spec.batch_size // spec.gpus
    low, high = max(1, spec.gpus // 2), 2 * spec.gpus
    return replace(
        spec,
        min_gpus=low,
        max_gpus=high,
        min_batch_size=per_gpu * low,
        max_batch_size=per_gpu * high,
    )
