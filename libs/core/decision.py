"""What a policy decides: starts, preemptions, resizes, and why every other job waits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    gpu_ids: tuple[int, ...]
    #: gradient-accumulation steps: the job runs sub-batches of batch/(gpus*accum_steps)
    accum_steps: int = 1
    #: resident jobs this one will share GPUs with (empty: exclusive)
    shares_with: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Resize:
    """Restart a running job with a new shape from its checkpoint (an elastic policy's
    move). The GPUs are global ids; the job keeps its progress."""

    job_id: str
    gpu_ids: tuple[int, ...]
    batch_size: int
    accum_steps: int = 1
    reason: str = ""


_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class Decision:
    starts: tuple[Start, ...] = ()
    preemptions: tuple[Preempt, ...] = ()
    resizes: tuple[Resize, ...] = ()
    #: why each examined job stays pending
    reasons: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    #: why every other pending job waits (the policy stopped looking once nothing could fit)
    default_reason: str = "waiting for the next scheduling round"
    #: the policy wants to decide again at this time even if nothing else happens
    wake_at: float | None = None

    def why(self, job_id: str) -> str:
        """A readable reason for a job the decision leaves pending."""
        return self.reasons.get(job_id, self.default_reason)

    @property
    def shared_pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple((s.job_id, other) for s in self.starts for other in s.shares_with)
