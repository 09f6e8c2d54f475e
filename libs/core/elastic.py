"""Elastic bounds: the GPU counts and global batches a job declares it may run at.

A job that declares any bound is *elastic*: a policy that sizes jobs (ONES) keeps its
GPU count within ``min_gpus``..``max_gpus`` and its global batch within
``min_batch_size``..``max_batch_size``. A job that declares none has no `Elastic` at all
(None), and such a policy sizes it as it always has. The job's own ``gpus`` and
``batch_size`` must lie within its bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the four bounds, in the order a trace and a job spec name them
BOUND_FIELDS = ("min_gpus", "max_gpus", "min_batch_size", "max_batch_size")


def bounds_problem(
    gpus: int | None,
    batch: int | None,
    min_gpus: int | None,
    max_gpus: int | None,
    min_batch: int | None,
    max_batch: int | None,
) -> tuple[str, str] | None:
    """(the field, what is wrong) when the bounds are below 1, cross, or leave out the
    job's own ``gpus`` or ``batch``; None when they are fine (an absent value is not
    checked)."""
    for lo_name, hi_name, own_name, own, lo, hi in (
        ("min_gpus", "max_gpus", "gpus", gpus, min_gpus, max_gpus),
        ("min_batch_size", "max_batch_size", "batch_size", batch, min_batch, max_batch),
    ):
        for name, bound in ((lo_name, lo), (hi_name, hi)):
            if bound is not None and bound < 1:
                return name, f"{name} must be >= 1, got {bound}"
        if lo is not None and hi is not None and lo > hi:
            return lo_name, f"{lo_name} {lo} is above {hi_name} {hi}"
        if own is not None and lo is not None and lo > own:
            return lo_name, f"{lo_name} {lo} is above {own_name} {own}"
        if own is not None and hi is not None and hi < own:
            return hi_name, f"{hi_name} {hi} is below {own_name} {own}"
    return None


@dataclass(frozen=True, slots=True)
class Elastic:
    """The bounds a job declared (an absent upper bound: none)."""

    min_gpus: int = 1
    max_gpus: int | None = None
    min_batch_size: int = 1
    max_batch_size: int | None = None

    @classmethod
    def of(
        cls,
        min_gpus: int | None,
        max_gpus: int | None,
        min_batch_size: int | None,
        max_batch_size: int | None,
    ) -> Elastic | None:
        """The bounds of a job that declares these (None where it declares none)."""
        if (min_gpus, max_gpus, min_batch_size, max_batch_size) == (None, None, None, None):
            return None
        return cls(min_gpus or 1, max_gpus, min_batch_size or 1, max_batch_size)

    def gpus_within(self, n: int) -> int:
        """``n`` moved into ``min_gpus``..``max_gpus``."""
        n = max(n, self.min_gpus)
        return n if self.max_gpus is None else min(n, self.max_gpus)

    def batch_within(self, batch: int) -> int:
        """``batch`` moved into ``min_batch_size``..``max_batch_size``."""
        batch = max(batch, self.min_batch_size)
        return batch if self.max_batch_size is None else min(batch, self.max_batch_size)

    def allows(self, gpus: int, batch: int) -> bool:
        """Whether a job of these bounds may run on ``gpus`` GPUs at global ``batch``."""
        return self.gpus_within(gpus) == gpus and self.batch_within(batch) == batch
