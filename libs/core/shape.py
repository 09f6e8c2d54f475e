"""A job's shape: what its speed, memory and co-location slowdown depend on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobShape:
    """A job as a performance model sees it: its model, global batch, GPU count and
    gradient-accumulation steps (each GPU's batch split into that many sub-batches)."""

    model: str
    batch_size: int
    gpus: int
    accum_steps: int = 1
