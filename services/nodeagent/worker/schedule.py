"""The learning rate of an elastic job: linear in the global batch up to a cap, ramped
over an epoch after every change (no torch import here).

A job's rate is ``base_lr x batch / base_batch``, at most ``max_lr``: a job that the
scheduler gives more GPUs (and so a larger global batch) takes larger steps, as ONES and
the linear scaling rule have it, but never past the rate the job says is still stable.
A change does not apply at once: from the iteration the new shape starts at, the rate
moves linearly from the old rate to the new one over the iterations of one epoch at the
new batch, so the optimizer's momentum is never hit by a jump.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: rates this close are the same rate (a ramp towards it would do nothing)
SAME_RATE = 1e-12


@dataclass(frozen=True, slots=True)
class LearningRateRule:
    """``base_lr`` at a global batch of ``base_batch``, linear in the batch, capped."""

    base_lr: float
    base_batch: int
    max_lr: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr must be > 0, got {self.base_lr}")
        if self.base_batch < 1:
            raise ValueError(f"base_batch must be >= 1, got {self.base_batch}")
        if self.max_lr is not None and not (math.isfinite(self.max_lr) and self.max_lr > 0):
            raise ValueError(f"max_lr must be > 0, got {self.max_lr}")

    def rate(self, batch: int) -> float:
        scaled = self.base_lr * batch / self.base_batch
        return scaled if self.max_lr is None else min(scaled, self.max_lr)


@dataclass(frozen=True, slots=True)
class Ramp:
    """The rate of every iteration from ``start`` on: ``start_lr`` moving linearly to
    ``end_lr`` over ``iterations`` iterations (iteration ``start`` is the first of them),
    then ``end_lr``."""

    start_lr: float
    end_lr: float
    start: int = 0
    iterations: int = 1

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    @classmethod
    def constant(cls, lr: float) -> Ramp:
        return cls(lr, lr)

    def at(self, iteration: int) -> float:
        """The rate of 0-based ``iteration``; the ramp's last iteration has ``end_lr``."""
        done = min(1.0, max(0.0, (iteration - self.start + 1) / self.iterations))
        return self.start_lr + (self.end_lr - self.start_lr) * done

    def towards(self, lr: float, start: int, iterations: int) -> Ramp:
        """This ramp if it already ends at ``lr``; else a ramp from the rate reached
        before ``start`` to ``lr`` over ``iterations`` iterations from ``start``."""
        if abs(lr - self.end_lr) <= SAME_RATE * max(1.0, abs(lr)):
            return self
        return Ramp(self.at(start - 1), lr, start, max(1, iterations))

    def to_state(self) -> list[float]:
        return [self.start_lr, self.end_lr, float(self.start), float(self.iterations)]

    @classmethod
    def from_state(cls, state: list[float]) -> Ramp:
        start_lr, end_lr, start, iterations = state
        return cls(float(start_lr), float(end_lr), int(start), int(iterations))


def epoch_iterations(dataset_size: int, batch: int) -> int:
    """Iterations of one epoch at a global batch of ``batch``."""
    return max(1, math.ceil(dataset_size / batch))
