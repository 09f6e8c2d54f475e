"""The live scheduler's measured profiles per GPU type (docs/profiles.md).

Policies see one performance model for the whole cluster, so the live scheduler times
jobs on one GPU type: the type that holds most of the live nodes' GPUs (ties: the
first by name). Where the predictor holds a measured profile of that type, the
scheduler's estimates take iteration times and memory from its figures
(libs/core/measured.py) under the time scale and the measured CPU sensitivity, and the
predictor is asked for jobs' figures on that type (``PredictRequest.gpu_type``). The
scheduler asks the predictor for the type's profile when the type first becomes the
cluster's, and follows every profile the predictor publishes on
``gpusched.gpu.<type>.measured_profile``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpusched.libs.common.measured import from_wire
from gpusched.libs.common.schemas import MeasuredProfile, NodeInfo
from gpusched.libs.core.measured import MeasuredPerformance
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.profiles.measured import GpuProfile, gpu_type_key
from gpusched.services.scheduler.live.state import ScaledModel


@dataclass(frozen=True)
class GpuMeasured:
    """A GPU type's measured profile (from the predictor)."""

    profile: MeasuredProfile


def main_gpu_type(nodes: Iterable[NodeInfo]) -> str:
    """The GPU type holding most of ``nodes``' GPUs ('' without any GPU)."""
    counts = Counter(gpu_type_key(gpu.model) for node in nodes for gpu in node.gpus)
    if not counts:
        return ""
    return min(counts, key=lambda t: (-counts[t], t))


class GpuTypes:
    """What the scheduler knows of measured profiles, and the type it times jobs on."""

    def __init__(self) -> None:
        self.profiles: dict[str, GpuProfile] = {}
        #: the GPU type estimates are for ('' before any node)
        self.main = ""
        #: types whose profile was asked for (the predictor publishes any stored later)
        self.asked: set[str] = set()
        self._over: tuple[ScaledModel, GpuProfile, ScaledModel] | None = None

    def follow(self, nodes: Iterable[NodeInfo]) -> bool:
        """Take the main type of the live ``nodes``; True when it changed."""
        main = main_gpu_type(nodes)
        changed, self.main = main != self.main, main
        return changed

    def to_ask(self) -> str | None:
        """The main type, when its profile is neither known nor asked for yet."""
        if not self.main or self.main in self.profiles or self.main in self.asked:
            return None
        self.asked.add(self.main)
        return self.main

    def take(self, message: MeasuredProfile) -> set[str]:
        """Keep a published profile; the models whose figures changed on the main type
        (every model of it where it is the main type's first profile)."""
        profile = from_wire(message)
        old = self.profiles.get(profile.gpu_type)
        self.profiles[profile.gpu_type] = profile
        if profile.gpu_type != self.main:
            return set()
        return {
            model for model, figures in profile.models.items()
            if old is None or old.figures(model) != figures
        }  # fmt: skip

    def over(self, scaled: ScaledModel) -> PerformanceModel:
        """``scaled`` timing the main type's measured models from their figures."""
        profile = self.profiles.get(self.main)
        if profile is None:
            return scaled
        if self._over is not None and self._over[0] is scaled and self._over[1] is profile:
            return self._over[2]  # the same object: policies keep what they derived
        typed = ScaledModel(
            MeasuredPerformance(scaled.inner, profile), scaled.time_scale, scaled.measured
        )
        self._over = (scaled, profile, typed)
        return typed


__all__ = ["GpuMeasured", "GpuTypes", "main_gpu_type"]
