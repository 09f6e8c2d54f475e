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


#: accumulation steps a scheduler may choose from (sub-batch = batch / (gpus * k))
ACCUM_CHOICES = (1, 2, 4, 8, 16)


def accum_steps_choices(batch_size: int, gpus: int) -> tuple[int, ...]:
    """Accumulation steps that leave every sub-batch at least one sample."""
    per_gpu = batch_size // gpus
    return tuple(k for k in ACCUM_CHOICES if per_gpu // k >= 1)
