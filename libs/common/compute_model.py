"""GENIE's estimates: a model's iteration time at any placement from its measured
compute profile (:class:`~gpusched.libs.common.schemas.ComputeProfile`, see
services/nodeagent/compute_profiling.py) and the platform model (libs/core/platform.py).

- **Compute** at a per-GPU batch ``b``: the line through the measured points (the
  profiled batch and its half), ``t0 + s b``, with ``t0`` and ``s`` at least 0 (noise that
  would make either negative leaves the line through the origin, or flat); one point
  alone is taken as flat. An iteration with ``k`` accumulation steps computes ``k``
  sub-batches and all-reduces once.
- **Communication**: the ring all-reduce of the model's parameter bytes at the placement,
  from the links measured on a node (intra-node; inter-node too when the cluster's nodes
  share that machine, ``shared_machine``), else the configured figures of the built-in
  profiles' ``network``.

:class:`ComputeProfiled` is a performance model that answers ``iteration_time`` this way
for the models with a profile and asks the model it wraps for everything else; the
predictor answers with it (services/predictor/compute_profiles.py keeps, measures and
publishes the profiles), and the live scheduler's estimates follow the profiles the
predictor publishes.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpusched.libs.common.schemas import ComputeProfile, LinkProfile
from gpusched.libs.core.perf import DelegatingModel, PerformanceModel
from gpusched.libs.core.platform import PlatformModel, fit_link
from gpusched.libs.core.profiles.builtin import Network, load_builtin


def configured_network() -> Network:
    """The built-in profiles' network figures (used where nothing was measured)."""
    return load_builtin()[1]


def platform_of(links: LinkProfile | None, network: Network) -> PlatformModel:
    """The platform model of a link measurement, ``network``'s figures where it has none."""
    if links is None:
        return PlatformModel.configured(network)
    measured = fit_link([(p.nbytes, p.seconds) for p in links.points])
    return PlatformModel.measured(measured, measured if links.shared_machine else None, network)


def compute_line(profile: ComputeProfile) -> tuple[float, float]:
    """``(t0, s)``: compute seconds per iteration at per-GPU batch ``b`` are ``t0 + s b``."""
    points = sorted({(p.batch_size, p.iteration_s) for p in profile.points})
    if len({b for b, _ in points}) < 2:
        return sum(t for _, t in points) / len(points), 0.0
    (b1, t1), (b2, t2) = points[0], points[-1]
    slope = (t2 - t1) / (b2 - b1)
    if slope < 0:
        return sum(t for _, t in points) / len(points), 0.0
    t0 = t1 - slope * b1
    if t0 < 0:
        return 0.0, sum(t for _, t in points) / sum(b for b, _ in points)
    return t0, slope


class ComputeProfiled(DelegatingModel):
    """A performance model whose iteration times of the profiled models come from their
    compute profiles and the platform model (see the module); the rest from ``inner``."""

    def __init__(
        self,
        inner: PerformanceModel,
        profiles: Mapping[str, ComputeProfile],
        network: Network | None = None,
    ) -> None:
        super().__init__(inner)
        self.profiles = dict(profiles)
        self.network = network or configured_network()
        self._lines = {model: compute_line(p) for model, p in self.profiles.items()}
        self._platforms = {
            model: platform_of(p.links, self.network) for model, p in self.profiles.items()
        }
        self._cache: dict[tuple[str, int, int, int, int], float] = {}

    def with_profile(self, profile: ComputeProfile) -> ComputeProfiled:
        """A new model (policies forget what they derived from the old one) that times
        ``profile.model`` from this profile."""
        return ComputeProfiled(self.inner, {**self.profiles, profile.model: profile}, self.network)

    def platform(self, model: str) -> PlatformModel:
        """The platform model ``model``'s profile is read with."""
        return self._platforms[model]

    def compute_s(self, model: str, per_gpu_batch: float) -> float:
        t0, slope = self._lines[model]
        return t0 + slope * per_gpu_batch

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        if model not in self.profiles:
            return self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        key = (model, batch_size, gpus, nodes, accum_steps)
        found = self._cache.get(key)
        if found is None:
            compute = accum_steps * self.compute_s(model, batch_size / (gpus * accum_steps))
            found = (
                self._platforms[model]
                .predict(compute, self.profiles[model].model_bytes, gpus, nodes)
                .iteration_s
            )
            self._cache[key] = found
        return found


def with_compute_profile(model: PerformanceModel, profile: ComputeProfile) -> ComputeProfiled:
    """``model`` timing ``profile.model`` from the profile (``model`` may already be a
    :class:`ComputeProfiled`: its other profiles stay)."""
    if isinstance(model, ComputeProfiled):
        return model.with_profile(profile)
    return ComputeProfiled(model, {profile.model: profile})


__all__ = [
    "ComputeProfiled",
    "compute_line",
    "configured_network",
    "platform_of",
    "with_compute_profile",
]
