"""A performance model that times the models of a measured profile from the figures one
GPU type measured (libs/core/profiles/measured.py), and everything else as the model it
wraps (the research profiles, or the estimates built on them).

For a model with figures, at per-GPU sub-batch ``b = B / (g a)``:

- **compute** per sub-batch is the measured iteration time at ``b``, linear between
  measured batches; outside them, the nearest measured point scaled as the wrapped
  model's one-GPU time scales from that batch to ``b``;
- an **iteration** of ``a`` accumulation steps on ``g`` GPUs over ``n`` servers is ``a``
  computes plus what the wrapped model adds beyond its own ``a`` one-GPU computes (its
  all-reduce at that placement): nothing was measured about links here. An iteration
  is never faster with accumulation than without, as the contract asks;
- **memory** at ``b`` is the measured peak, linear between measured batches; outside,
  the nearest measured point plus the wrapped model's growth from that batch.

Tensor and pipeline parallel jobs take the wrapped model's analytic time scaled by the
measured/wrapped compute ratio at the data-parallel per-GPU batch. Co-location, CPU and
memory sensitivity and default batches are the wrapped model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.perf import ConvergenceSource, DelegatingModel, PerformanceModel
from gpusched.libs.core.profiles.measured import (
    GpuProfile,
    MeasuredProfileError,
    ModelFigures,
    read_profile,
)


class MeasuredPerformance(DelegatingModel):
    """``inner`` with the iteration times and memory of ``profile``'s models from it."""

    def __init__(self, inner: PerformanceModel, profile: GpuProfile) -> None:
        super().__init__(inner)
        self.profile = profile
        known = set(inner.models())
        #: the profile's models the wrapped model knows (others cannot be scheduled)
        self.figures: dict[str, ModelFigures] = {
            name: f for name, f in profile.models.items() if name in known
        }
        self._iter_cache: dict[tuple[str, int, int, int, int], float] = {}
        self._mem_cache: dict[tuple[str, float], float] = {}

    @property
    def gpu_type(self) -> str:
        return self.profile.gpu_type

    def measured(self, model: str) -> bool:
        return model in self.figures

    def compute_s(self, model: str, batch: float) -> float:
        """Seconds of one sub-batch of ``batch`` samples on one GPU of this type."""
        figures = self.figures[model]
        found = figures.iteration_s(batch)
        if found is not None:
            return found
        edge = figures.edge(batch)
        return edge.iteration_s * self._inner_one(model, batch) / self._inner_one(
            model, edge.batch_size
        )

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        if model not in self.figures:
            return self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        key = (model, batch_size, gpus, nodes, accum_steps)
        found = self._iter_cache.get(key)
        if found is not None:
            return found
        wrapped = self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        sub_batch = batch_size / (gpus * accum_steps)
        computes = accum_steps * self._inner_one(model, sub_batch)
        value = accum_steps * self.compute_s(model, sub_batch) + max(0.0, wrapped - computes)
        if accum_steps > 1:
            value = max(value, self.iteration_time(model, batch_size, gpus, nodes))
        self._iter_cache[key] = value
        return value

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        if model not in self.figures:
            return self.inner.gpu_memory_mb(model, per_gpu_batch)
        key = (model, per_gpu_batch)
        found = self._mem_cache.get(key)
        if found is not None:
            return found
        figures = self.figures[model]
        value = figures.memory_mb(per_gpu_batch)
        if value is None:
            edge = figures.edge(per_gpu_batch)
            growth = self.inner.gpu_memory_mb(model, per_gpu_batch) - self.inner.gpu_memory_mb(
                model, edge.batch_size
            )
            # below the smallest batch the growth is negative: never below a tenth of it
            value = max(edge.memory_mb + growth, 0.1 * edge.memory_mb)
        self._mem_cache[key] = value
        return value

    def convergence(self, model: str) -> Convergence | None:
        inner = self.inner
        return inner.convergence(model) if isinstance(inner, ConvergenceSource) else None

    def parallel_iteration_time(
        self,
        model: str,
        batch_size: int,
        degrees: Any,
        node_of_rank: Sequence[int],
        accum_steps: int = 1,
    ) -> float:
        inner: Any = self.inner
        if not hasattr(inner, "parallel_iteration_time"):  # times data-parallel jobs only
            gpus, nodes = len(node_of_rank), len(set(node_of_rank))
            return self.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        wrapped = float(
            inner.parallel_iteration_time(model, batch_size, degrees, node_of_rank, accum_steps)
        )
        if model not in self.figures:
            return wrapped
        batch = batch_size / (degrees.data * accum_steps)
        return wrapped * self.compute_s(model, batch) / self._inner_one(model, batch)

    def _inner_one(self, model: str, batch: float) -> float:
        """The wrapped model's one-GPU seconds at ``batch`` (whole samples, at least 1)."""
        return self.inner.iteration_time(model, max(1, round(batch)), 1, 1)


def measured_over(inner: PerformanceModel, profile: GpuProfile | None) -> PerformanceModel:
    """``inner`` timed from ``profile`` where it has figures; ``inner`` itself when None."""
    return inner if profile is None else MeasuredPerformance(inner, profile)


def read_over(inner: PerformanceModel, path: str | Path) -> MeasuredPerformance:
    """``inner`` timed from the measured profile in the file ``path``. Raises
    :class:`MeasuredProfileError` for a file that cannot be read, or that holds no
    model ``inner`` knows."""
    wrapped = MeasuredPerformance(inner, read_profile(path))
    if not wrapped.figures:
        raise MeasuredProfileError(
            f"{path}: none of its models ({', '.join(sorted(wrapped.profile.models))}) is "
            f"one this performance model knows ({', '.join(inner.models())})"
        )
    return wrapped


__all__ = ["MeasuredPerformance", "measured_over", "read_over"]
