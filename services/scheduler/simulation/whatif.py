"""What-if: the figures of what a live cluster really did with its jobs (the live
outcome columns of an exported history, docs/trace-format.md "Exported history") beside
those of each policy's replay of the same jobs, and which served them best.

Every row counts the same way: mean and p99 (nearest rank) of the job completion time
(submission to end) and mean queueing (time waiting, before the first start and after
preemptions) over the jobs that ended, and GPU-hours as each job's GPUs times the time
it held them (its completion time less its waits).

Two more pieces serve the replay of an export and its check against the live run:
``measured_over`` times each model the live cluster measured by its measured
iteration times (``measured_iteration_s``) rather than by the performance model alone,
and ``fidelity`` sets a replay's job completion times beside the live ones, job by
job (bench/fidelity.py)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import ConvergenceSource, DelegatingModel, PerformanceModel
from gpusched.libs.core.traces import TraceJob
from gpusched.services.scheduler.simulation.results import SimResult, percentile

#: the row of the live cluster's own figures
LIVE = "live"


@dataclass(frozen=True)
class Figures:
    """One row of the what-if table."""

    #: ``live``, ``live (POLICY)`` or the policy replayed
    name: str
    jobs: int
    #: jobs that ended (live: whose end the export knows; replayed: that finished)
    ended: int
    mean_jct_s: float
    p99_jct_s: float
    mean_queue_s: float
    gpu_hours: float

    def as_dict(self) -> dict[str, object]:
        return _finite(asdict(self))


@dataclass(frozen=True)
class Best:
    """The policy of the lowest mean JCT, and how much it beats the live one by."""

    policy: str
    mean_jct_s: float
    #: live mean JCT less the policy's (negative: the live cluster did better); None
    #: without live figures
    saved_s: float | None = None
    #: ``saved_s`` as a share of the live mean JCT, in percent
    saved_pct: float | None = None


def _finite(fields: dict[str, object]) -> dict[str, object]:
    """``fields`` with every float that is not finite as None (JSON has no NaN)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in fields.items()}


def live_policy(jobs: Sequence[TraceJob]) -> str | None:
    """The live policy the export names, where its rows agree on one."""
    named = {job.live_policy for job in jobs if job.live_policy}
    return named.pop() if len(named) == 1 else None


def live_figures(jobs: Sequence[TraceJob]) -> tuple[Figures | None, str]:
    """The live row, or None and why it cannot be had (an export without live columns,
    from before they were written)."""
    timed = [job for job in jobs if job.live_jct_s is not None and job.live_queue_s is not None]
    if not timed:
        return None, (
            "live figures missing: the trace has no live_jct_s/live_queue_s columns (an "
            "export older than them, or not an export); the policies are still compared"
        )
    policy = live_policy(jobs)
    name = f"{LIVE} ({policy})" if policy else LIVE
    jcts = sorted(float(job.live_jct_s or 0.0) for job in timed)
    queues = [float(job.live_queue_s or 0.0) for job in timed]
    held = sum(job.gpus * (float(job.live_jct_s or 0.0) - float(job.live_queue_s or 0.0))
               for job in timed)
    figures = Figures(
        name=name,
        jobs=len(jobs),
        ended=len(timed),
        mean_jct_s=sum(jcts) / len(jcts),
        p99_jct_s=percentile(jcts, 99),
        mean_queue_s=sum(queues) / len(queues),
        gpu_hours=held / 3600,
    )
    why = ""
    if len(timed) < len(jobs):
        why = (f"live figures cover {len(timed)} of {len(jobs)} jobs: the others' histories "
               "do not reach their end")
    return figures, why


def live_states(jobs: Sequence[TraceJob]) -> dict[str, int]:
    """How the jobs ended on the live cluster, by state (where the export says)."""
    return dict(sorted(Counter(job.live_state for job in jobs if job.live_state).items()))


def simulated_figures(result: SimResult) -> Figures:
    done = result.finished()
    jcts = sorted(j.jct_s for j in done if j.jct_s is not None)
    queues = [j.queue_s for j in done]
    held = sum(j.gpus * ((j.jct_s or 0.0) - j.queue_s) for j in done)
    return Figures(
        name=result.policy,
        jobs=len(result.jobs),
        ended=len(done),
        mean_jct_s=sum(jcts) / len(jcts) if jcts else math.nan,
        p99_jct_s=percentile(jcts, 99),
        mean_queue_s=sum(queues) / len(queues) if queues else math.nan,
        gpu_hours=held / 3600,
    )


def best(policies: Sequence[Figures], live: Figures | None) -> Best | None:
    """The replayed policy of the lowest mean JCT (the first of equals, in run order),
    among those that finished every job; None when none did."""
    complete = [f for f in policies if f.ended == f.jobs and math.isfinite(f.mean_jct_s)]
    if not complete:
        return None
    winner = min(complete, key=lambda f: f.mean_jct_s)
    if live is None or not live.mean_jct_s > 0:
        return Best(winner.name, winner.mean_jct_s)
    saved = live.mean_jct_s - winner.mean_jct_s
    return Best(winner.name, winner.mean_jct_s, saved, 100 * saved / live.mean_jct_s)


def best_line(winner: Best | None, live: Figures | None) -> str:
    if winner is None:
        return "best: none (no policy finished every job)"
    line = f"best: {winner.policy}, mean JCT {_duration(winner.mean_jct_s)}"
    if live is None or winner.saved_s is None or winner.saved_pct is None:
        return line + " (no live figures to compare with)"
    if winner.saved_s >= 0:
        return line + (f", {_duration(winner.saved_s)} ({winner.saved_pct:.1f}%) shorter "
                       f"than {live.name}'s {_duration(live.mean_jct_s)}")
    return line + (f", {_duration(-winner.saved_s)} ({-winner.saved_pct:.1f}%) longer than "
                   f"{live.name}'s {_duration(live.mean_jct_s)}: no policy beat the live one")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


# ------------------------------------------------------------- measured iteration times

#: a measured iteration time within this share of the model's counts as the model's: the
#: export rounds it to six significant digits
AGREES = 1e-4


class MeasuredModels(DelegatingModel):
    """``inner`` with the iteration times of each model a live cluster measured scaled
    by ``factors[model]`` (its measured time over the model's), at every batch,
    placement and accumulation. Other models, co-location, memory, CPU sensitivity and
    convergence are the model's."""

    def __init__(self, inner: PerformanceModel, factors: dict[str, float]) -> None:
        super().__init__(inner)
        self.factors = dict(factors)

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        time = self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        return time * self.factors.get(model, 1.0)

    def convergence(self, model: str) -> Convergence | None:
        inner = self.inner
        return inner.convergence(model) if isinstance(inner, ConvergenceSource) else None

    def parallel_iteration_time(
        self, model: str, batch_size: int, degrees: Any, node_of_rank: Sequence[int],
        accum_steps: int = 1,
    ) -> float:
        inner: Any = self.inner
        if not hasattr(inner, "parallel_iteration_time"):  # times data-parallel jobs only
            return self.iteration_time(model, batch_size, len(node_of_rank),
                                       len(set(node_of_rank)), accum_steps)
        wrapped = float(inner.parallel_iteration_time(model, batch_size, degrees,
                                                      node_of_rank, accum_steps))
        return wrapped * self.factors.get(model, 1.0)


def measured_factors(
    jobs: Sequence[TraceJob], perf: PerformanceModel, cluster: Cluster
) -> dict[str, float]:
    """Per model the live cluster measured: the lowest ratio of a job's measured
    iteration time to ``perf``'s for the job's shape (its batch and GPUs, on the fewest
    nodes of ``cluster``). The lowest, since a figure is the job's speed at its last
    report, slowed by whatever shared its GPUs then, and the jobs of a model pooled, so
    that one of them that ended alone gives the model's own speed. A model whose ratio
    is within ``AGREES`` of 1 is left out (``perf`` already times it so)."""
    lowest: dict[str, float] = {}
    for job in jobs:
        measured = job.measured_iteration_s
        if measured is None or job.model is None or job.batch_size is None:
            continue
        if job.tensor_parallel * job.pipeline_parallel != 1 or job.gpus > cluster.total_gpus:
            continue
        try:
            modelled = perf.iteration_time(job.model, job.batch_size, job.gpus,
                                           cluster.fewest_nodes(job.gpus))
        except ValueError:  # a model perf does not know: the replay's loader says so
            continue
        ratio = measured / modelled if modelled > 0 else math.nan
        if math.isfinite(ratio) and ratio > 0:
            lowest[job.model] = min(ratio, lowest.get(job.model, math.inf))
    return {model: ratio for model, ratio in sorted(lowest.items())
            if abs(ratio - 1) > AGREES}


def measured_over(
    jobs: Sequence[TraceJob], perf: PerformanceModel, cluster: Cluster
) -> tuple[PerformanceModel, str]:
    """``perf`` timing the models the export measured by their measured iteration times
    (``MeasuredModels``; ``perf`` itself where every figure agrees with it or none was
    measured), and a note saying which."""
    measured = sum(job.measured_iteration_s is not None for job in jobs)
    if not measured:
        return perf, "no job has a measured iteration time: the replay times every job by the model"
    # the export gives a job a measured time only where its speed was of a run in the
    # job's own shape (services/admission/history.py), resized jobs included
    factors = measured_factors(jobs, perf, cluster)
    if not factors:
        return perf, (f"{measured} of {len(jobs)} jobs have a measured iteration time; the "
                      "fastest of each model agrees with the model's, which times the replay")
    said = ", ".join(f"{model} {factor:.3g}x" for model, factor in factors.items())
    return MeasuredModels(perf, factors), (
        f"{measured} of {len(jobs)} jobs have a measured iteration time; the replay times "
        f"{len(factors)} model(s) by the fastest measured, against the model's: {said}"
    )


# ------------------------------------------------------------------- decision delay


def delayed(jobs: Sequence[JobSpec], delay_s: float) -> list[JobSpec]:
    """``jobs`` each reaching the policy ``delay_s`` after its submission, as a live
    job's submission, the round that places it and its start command take a while
    (``from_submission`` counts the replay's times from the real submissions again).
    Deadlines stay where they were. Only arrivals are delayed: a job started after
    another's end starts at that end."""
    if delay_s < 0 or not math.isfinite(delay_s):
        raise ValueError(f"decision delay must be a finite number >= 0, got {delay_s!r}")
    if delay_s == 0:
        return list(jobs)
    return [replace(job, submit_time=job.submit_time + delay_s) for job in jobs]


def from_submission(result: SimResult, jobs: Sequence[JobSpec]) -> SimResult:
    """``result``, a replay of ``delayed(jobs, ...)``, with every job's times counted
    from its submission in ``jobs``: its completion time and its queueing grow by its
    delay."""
    submitted = {job.job_id: job.submit_time for job in jobs}
    outcomes = []
    for outcome in result.jobs:
        at = submitted.get(outcome.job_id, outcome.submit_time)
        late = max(0.0, outcome.submit_time - at)
        outcomes.append(replace(outcome, submit_time=at, queue_s=outcome.queue_s + late)
                        if late else outcome)
    return replace(result, jobs=tuple(outcomes))


# --------------------------------------------------------------------- live vs replay


@dataclass(frozen=True)
class Fidelity:
    """A replay of an export set beside what the live cluster did, job by job: the jobs
    that ended in both (with a live JCT above 0) are compared."""

    policy: str
    #: jobs compared, and those of the export that could not be (no live end, or not
    #: finished in the replay)
    compared: int
    left_out: int
    live_mean_jct_s: float
    replay_mean_jct_s: float
    #: (replayed mean - live mean) / live mean, in percent (positive: the replay is slower)
    mean_diff_pct: float
    #: share of compared jobs, in percent, whose replayed JCT is within ``within_pct`` of
    #: the live one
    within_pct: float
    jobs_within_pct: float
    #: |replayed - live| / live per job, in percent: nearest-rank p50 and p90, and the
    #: signed mean (positive: replayed jobs take longer)
    diff_p50_pct: float
    diff_p90_pct: float
    diff_mean_signed_pct: float

    def as_dict(self) -> dict[str, object]:
        return _finite(asdict(self))


def fidelity(exported: Sequence[TraceJob], result: SimResult,
             within_pct: float = 10.0) -> Fidelity:
    """How close ``result``, a replay of ``exported``, came to the live cluster."""
    replayed = {job.job_id: job.jct_s for job in result.finished()}
    pairs = []
    for job in exported:
        jct = replayed.get(job.job_id)
        if job.live_jct_s is not None and job.live_jct_s > 0 and jct is not None:
            pairs.append((float(job.live_jct_s), float(jct)))
    live = [a for a, _ in pairs]
    again = [b for _, b in pairs]
    diffs = [(b - a) / a for a, b in pairs]
    spread = sorted(abs(d) for d in diffs)
    n = len(pairs)
    live_mean = sum(live) / n if n else math.nan
    replay_mean = sum(again) / n if n else math.nan
    return Fidelity(
        policy=result.policy,
        compared=n,
        left_out=len(exported) - n,
        live_mean_jct_s=live_mean,
        replay_mean_jct_s=replay_mean,
        mean_diff_pct=100 * (replay_mean - live_mean) / live_mean if n else math.nan,
        within_pct=within_pct,
        jobs_within_pct=(100 * sum(d <= within_pct / 100 for d in spread) / n) if n else math.nan,
        diff_p50_pct=100 * percentile(spread, 50),
        diff_p90_pct=100 * percentile(spread, 90),
        diff_mean_signed_pct=100 * sum(diffs) / n if n else math.nan,
    )


__all__ = [
    "AGREES",
    "LIVE",
    "Best",
    "Fidelity",
    "Figures",
    "MeasuredModels",
    "best",
    "best_line",
    "delayed",
    "fidelity",
    "from_submission",
    "live_figures",
    "live_policy",
    "live_states",
    "measured_factors",
    "measured_over",
    "simulated_figures",
]
