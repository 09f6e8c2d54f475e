"""Notes under the results table: the facts of a run that explain a figure.

Two policies can give the same figures to the digit because the one feature that sets
them apart had nothing to act on: ``edf`` on a trace without deadlines orders jobs by
submission, as ``fifo-backfill`` does. Without a word, that reads as a coincidence or a
bug. `result_notes` says, for each policy of a run, when its feature found nothing to
act on (worked out from the run itself: the jobs' deadlines, the sharing pairs formed,
the preemptions and resizes made, the models' CPU/memory sensitivity), and which
policies gave the very same schedule, job for job; on a cluster of several GPU types,
each policy's busy GPU-hours per type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.services.scheduler.policies import POLICIES, Policy, UnknownPolicyError, make_policy
from gpusched.services.scheduler.simulation.results import SimResult

#: a model counts as CPU/memory sensitive when its best case beats the GPU-proportional
#: share by more than this factor
SENSITIVE_SPEEDUP = 1.0 + 1e-9


@dataclass(frozen=True)
class WorkloadFacts:
    """What the jobs of a run offer the policies' features, beyond what its results say."""

    jobs: int
    #: jobs whose model runs faster with more CPU and memory than its GPU-proportional
    #: share (Synergy's best case above 1)
    cpu_mem_sensitive: int
    #: jobs that declare elastic bounds (``JobSpec.elastic``)
    elastic: int = 0

    @classmethod
    def of(cls, jobs: Sequence[JobSpec], truth: PerformanceModel) -> WorkloadFacts:
        speedups = {model: truth.cpu_mem_demand(model).speedup for model in {j.model for j in jobs}}
        sensitive = sum(1 for job in jobs if speedups[job.model] > SENSITIVE_SPEEDUP)
        elastic = sum(1 for job in jobs if job.elastic is not None)
        return cls(jobs=len(jobs), cpu_mem_sensitive=sensitive, elastic=elastic)


def result_notes(results: Sequence[SimResult], facts: WorkloadFacts | None = None) -> list[str]:
    """One line per fact worth a reader's attention, each starting with the policy it is
    about (``edf: ...``) or with ``Same schedule``; none when every feature acted and no
    two schedules are alike. ``facts`` adds what only the jobs tell (CPU/memory
    sensitivity for the synergy policies)."""
    notes = [note for result in results for note in _idle_feature(result, facts)]
    notes += [_type_hours(result) for result in results if result.gpu_hours_by_type]
    return notes + same_schedules(results)


def _type_hours(result: SimResult) -> str:
    """On a cluster of several GPU types: the busy GPU-hours of each."""
    hours = result.gpu_hours_by_type or {}
    each = ", ".join(f"{name} {value:,.1f}" for name, value in hours.items())
    return f"{result.policy}: busy GPU-hours by GPU type: {each}."


def _idle_feature(result: SimResult, facts: WorkloadFacts | None) -> list[str]:
    policy = _policy(result.policy)
    name = result.policy
    if policy is None or not result.jobs:
        return []
    notes: list[str] = []
    can = policy.capabilities
    if can.without_deadlines is not None and all(job.deadline is None for job in result.jobs):
        notes.append(f"{name}: no job has a deadline, so {can.without_deadlines}.")
    if policy.preemptive and not can.resizes and result.preemptions == 0:
        notes.append(f"{name}: preempted no job; its preemption never acted.")
    if can.shares_gpus and result.shared_pairs == 0:
        notes.append(f"{name}: formed no sharing pair; every job ran on GPUs of its own.")
    if can.tunes_cpu_mem and facts is not None and facts.cpu_mem_sensitive == 0:
        notes.append(
            f"{name}: no job's model runs faster with more CPU or memory than its "
            "GPU-proportional share, so it gave every job that share."
        )
    if can.sizes_only_elastic and facts is not None and facts.elastic == 0:
        notes.append(
            f"{name}: no job declares elastic bounds, so its elastic search never ran."
        )
    elif can.resizes and result.resizes == 0:
        notes.append(f"{name}: resized no running job; its search only placed new ones.")
    return notes


def _policy(name: str) -> Policy | None:
    if name not in POLICIES:  # e.g. a labelled variant of a benchmark
        return None
    try:
        return make_policy(name)
    except UnknownPolicyError:
        return None


def same_schedules(results: Sequence[SimResult]) -> list[str]:
    """``Same schedule, job for job: edf = fifo-backfill.`` for every group of policies
    whose jobs all started and finished at the same times (with the same preemptions
    and sharing)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for result in results:
        if result.jobs:
            groups.setdefault(_schedule(result), []).append(result.policy)
    return [
        f"Same schedule, job for job: {' = '.join(names)}."
        for names in groups.values()
        if len(names) > 1
    ]


def _schedule(result: SimResult) -> tuple[object, ...]:
    return tuple(
        (j.job_id, j.start_time, j.finish_time, j.preemptions, j.shared) for j in result.jobs
    )
