"""What the live scheduler's core asks the world to do: the effects of a step.

The core (``core.py`` and the modules under it) changes its picture of the cluster at
once and in memory, and lists here what must follow outside it, in order: a record to
write, a command for a node, a question for the predictor, news to publish, a round to
run. The actor (``actor.py``) carries them out through its adapters; a test can read
them instead, with no NATS at all.

A record's write comes before anything that depends on it (a start command follows the
write of the run's record), so the actor stops at a write that fails and reads back the
records of every job whose effects it did not carry out (``carry_out`` in actor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpusched.libs.common.schemas import DecisionSummary, JobRecord, JobState, Placement

if TYPE_CHECKING:
    from gpusched.services.scheduler.live.state import LiveJob


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """Compare-and-set ``job``'s record to ``record`` (the core already holds it).
    ``partner``: the write is another job's on the way (a shared GPU's partner), whose
    failure is that job's alone."""

    job: LiveJob
    record: JobRecord
    partner: bool = False


@dataclass(frozen=True, slots=True)
class MarkLive:
    """Enter the job in the index of unfinished jobs."""

    job_id: str


@dataclass(frozen=True, slots=True)
class UnmarkLive:
    """Take the job out of the index of unfinished jobs."""

    job_id: str


@dataclass(frozen=True, slots=True)
class StartRun:
    record: JobRecord
    placement: list[Placement]


@dataclass(frozen=True, slots=True)
class StopRun:
    node: str
    job_id: str
    run_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResizeRun:
    """Resize run ``run_id`` in place on ``part``'s node into run ``new_run_id``."""

    job_id: str
    run_id: int
    new_run_id: int
    part: Placement
    batch_size: int
    accum_steps: int


@dataclass(frozen=True, slots=True)
class ReallocateRun:
    record: JobRecord


@dataclass(frozen=True, slots=True)
class AskEstimate:
    """Ask the predictor for the job's iteration time (and its model's CPU profile)."""

    record: JobRecord


@dataclass(frozen=True, slots=True)
class AskComputeProfile:
    model: str


@dataclass(frozen=True, slots=True)
class AskRemaining:
    record: JobRecord
    iteration: int


@dataclass(frozen=True, slots=True)
class AskGpuProfile:
    gpu_type: str


@dataclass(frozen=True, slots=True)
class PublishState:
    """News of a job's state, as its record held it when the state changed."""

    job_id: str
    state: JobState
    reason: str
    placement: list[Placement] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PublishDecision:
    summary: DecisionSummary


@dataclass(frozen=True, slots=True)
class RequestRound:
    """Run a round after what is queued now."""


Effect = (
    WriteRecord | MarkLive | UnmarkLive | StartRun | StopRun | ResizeRun | ReallocateRun
    | AskEstimate | AskComputeProfile | AskRemaining | AskGpuProfile | PublishState
    | PublishDecision | RequestRound
)


def job_of(effect: Effect) -> str | None:
    """The job an effect is about (None: a question about a model, a round)."""
    match effect:
        case WriteRecord(job=job):
            return job.id
        case StartRun(record=record) | ReallocateRun(record=record) | AskEstimate(
            record=record
        ) | AskRemaining(record=record):
            return record.id
        case StopRun(job_id=job_id) | ResizeRun(job_id=job_id) | MarkLive(
            job_id=job_id
        ) | UnmarkLive(job_id=job_id) | PublishState(job_id=job_id):
            return job_id
    return None
