"""What one simulated run produced: per-job outcomes, a timeline, and the summary."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FINISHED = "finished"
UNSCHEDULABLE = "unschedulable"
UNFINISHED = "unfinished"


@dataclass(frozen=True, slots=True)
class JobOutcome:
    job_id: str
    model: str
    gpus: int
    submit_time: float
    #: first time the job started, None if it never did
    start_time: float | None
    finish_time: float | None
    #: true run time alone on a consolidated placement (the JCT lower bound)
    exclusive_s: float
    #: total time spent waiting in the queue (before the first start and after preemptions)
    queue_s: float
    preemptions: int
    #: did the job ever share a GPU with another job
    shared: bool
    state: str
    #: why it did not finish, for unschedulable/unfinished jobs
    reason: str = ""
    #: when it had to finish by, where it had a deadline
    deadline: float | None = None

    @property
    def met_deadline(self) -> bool | None:
        """Whether it finished by its deadline; None without one."""
        if self.deadline is None:
            return None
        return self.finish_time is not None and self.finish_time <= self.deadline

    @property
    def jct_s(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.submit_time


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    time: float
    busy_gpus: int
    queued_jobs: int
    running_jobs: int


def thin(points: list[TimelinePoint], most: int) -> tuple[TimelinePoint, ...]:
    """At most ``most`` points of a timeline, evenly spaced, and always its last."""
    if len(points) <= most:
        return tuple(points)
    step = len(points) / most
    return (*tuple(points[int(i * step)] for i in range(most)), points[-1])


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class SimResult:
    policy: str
    total_gpus: int
    jobs: tuple[JobOutcome, ...]
    #: time the last job finished, measured from the first submission
    makespan_s: float
    #: busy GPU-seconds / (total GPUs x makespan)
    gpu_util: float
    preemptions: int
    shared_pairs: int
    wall_s: float
    decisions: int
    timeline: tuple[TimelinePoint, ...]
    #: running jobs restarted with a new shape (each also paid the restart overhead)
    resizes: int = 0
    #: the policy's cap on a resident's slowdown, where it has one (see ``SjfBsbf``)
    max_resident_slowdown: float | None = None
    #: Synergy-OPT's throughput bound over the run, where asked for (see ``OptBounded``)
    opt_bound: Mapping[str, float | int] | None = None
    #: the error of the sizes the policy was given, where they were predicted
    #: (``SimConfig.predictor``; see ``gpusched.libs.core.size_predictor.SubmissionSizes``)
    prediction: Mapping[str, float | int | str] | None = None
    #: A-SRPT's Lemma-1 factor over the run's jobs, for a policy that works it out
    rho: float | None = None
    #: busy GPU-hours of each GPU type, on a cluster of several types (one type: the
    #: busy GPU-hours are ``gpu_util`` x GPUs x makespan)
    gpu_hours_by_type: Mapping[str, float] | None = None

    def finished(self) -> list[JobOutcome]:
        return [j for j in self.jobs if j.state == FINISHED]

    def summary(self) -> dict[str, Any]:
        done = self.finished()
        jcts = sorted(j.jct_s for j in done if j.jct_s is not None)
        queues = [j.queue_s for j in done]
        summary: dict[str, Any] = {
            "jobs": len(self.jobs),
            "finished": len(done),
            "unschedulable": sum(1 for j in self.jobs if j.state == UNSCHEDULABLE),
            "avg_jct_s": sum(jcts) / len(jcts) if jcts else math.nan,
            "p50_jct_s": percentile(jcts, 50),
            "p99_jct_s": percentile(jcts, 99),
            "avg_queue_s": sum(queues) / len(queues) if queues else math.nan,
            "makespan_s": self.makespan_s,
            "gpu_util": self.gpu_util,
            "preemptions": self.preemptions,
            "shared_pairs": self.shared_pairs,
            "wall_s": self.wall_s,
            "decisions": self.decisions,
        }
        dated = [j.met_deadline for j in self.jobs if j.deadline is not None]
        if dated:
            # unfinished jobs with a deadline missed it
            summary["qos_pct"] = 100 * sum(1 for met in dated if met) / len(dated)
        if self.max_resident_slowdown is not None:
            summary["max_resident_slowdown"] = self.max_resident_slowdown
        if self.opt_bound is not None:
            summary["opt_bound"] = dict(self.opt_bound)
        if self.prediction is not None:
            summary["prediction"] = dict(self.prediction)
        if self.rho is not None:
            summary["rho"] = self.rho
        if self.gpu_hours_by_type is not None:
            summary["gpu_hours_by_type"] = dict(self.gpu_hours_by_type)
        return summary
