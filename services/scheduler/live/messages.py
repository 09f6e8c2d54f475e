"""The messages the live scheduler's actor reads from its inbox, and what becomes of a
stored one it did not handle (``redeliver``).

Every input reaches the actor as one of these: stored inputs of the jobs and exits
streams (``Durable``), heartbeats and progress from their subscriptions, its own timers
(``Round``, ``Sweep``, ``Rescan``), and the answers of the adapters that run beside it
(node commands, the predictor). They are a module of their own because the actor, the
adapters that report back and the service that feeds the inbox all name them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from nats.aio.msg import Msg

from gpusched.libs.common.schemas import ComputeProfile, CpuProfile, Heartbeat, JobProgressEvent
from gpusched.services.scheduler.live import timing
from gpusched.services.scheduler.live.gpu_types import GpuMeasured


@dataclass(frozen=True)
class Durable:
    """A message from the jobs stream; acknowledged once handled."""

    msg: Msg


@dataclass(frozen=True)
class Beat:
    heartbeat: Heartbeat


@dataclass(frozen=True)
class InputsDue:
    """Inputs wait beside the inbox (``LiveScheduler.durables_arrived``, ``beat_arrived``,
    ``progress_arrived``, and the start results its commands report): stream messages
    and start results in their order, heartbeats and progress the latest per sender.
    One ``InputsDue`` takes all that waits as one step, whose record reads and writes
    are under way together, so a backlog costs one step, not one round trip per
    message."""


@dataclass(frozen=True)
class ProgressSeen:
    event: JobProgressEvent


@dataclass(frozen=True)
class Round:
    pass


@dataclass(frozen=True)
class Sweep:
    pass


@dataclass(frozen=True)
class Rescan:
    pass


@dataclass(frozen=True)
class Resync:
    """Read a job's record back (a write of it failed, or its reading did)."""

    job_id: str


@dataclass(frozen=True)
class StartResult:
    job_id: str
    run_id: int
    error: str
    #: no answer came at all: the node may have started the run and its reply been lost
    unanswered: bool = False


@dataclass(frozen=True)
class Estimated:
    job_id: str
    #: the shape the estimate is for (a resize may have changed it since)
    batch_size: int
    gpus: int
    iteration_s: float


@dataclass(frozen=True)
class RemainingPredicted:
    """A running job's remaining iterations at ``iteration``, from the predictor."""

    job_id: str
    run_id: int
    iteration: int
    remaining: float


@dataclass(frozen=True)
class Measured:
    """A model's CPU profile, measured by a node (from the predictor)."""

    profile: CpuProfile


@dataclass(frozen=True)
class ComputeMeasured:
    """A model's compute profile, from GENIE's profiling run (from the predictor)."""

    profile: ComputeProfile


@dataclass(frozen=True)
class StopFailed:
    job_id: str
    run_id: int
    error: str


Message = (
    Durable | Beat | InputsDue | ProgressSeen | Round | Sweep | Rescan | Resync
    | StartResult | StopFailed | Estimated | Measured | RemainingPredicted | ComputeMeasured
    | GpuMeasured
)


async def redeliver(message: Message, first_s: float = timing.REDELIVER_S) -> None:
    """A stored input that was not handled goes back to its stream: it comes again after
    ``first_s``, doubled per delivery up to REDELIVER_MAX_S, so one that keeps failing
    (a store that cannot write) does not spin. Anything else is dropped: it is not
    durable, or comes again by itself (rounds, sweeps)."""
    if isinstance(message, Durable):
        await redeliver_msg(message.msg, first_s)


async def redeliver_msg(msg: Msg, first_s: float = timing.REDELIVER_S) -> None:
    """``redeliver`` for a stream message not wrapped in ``Durable``."""
    with contextlib.suppress(Exception):
        metadata = msg.metadata
        delay = min(first_s * 2 ** max(metadata.num_delivered - 1, 0), timing.REDELIVER_MAX_S)
        await msg.nak(delay=delay or None)
