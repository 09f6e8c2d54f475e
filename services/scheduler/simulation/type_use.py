"""What the simulator keeps of a cluster of several GPU types: how fast each job runs on
the type it was given (``gpusched.libs.core.type_speed``) and the busy GPU-seconds of
each type, for the summary's GPU-hours per type. A cluster of one type has none of it:
nothing changes there."""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.type_speed import TypeSpeeds


class TypeUse:
    def __init__(self, cluster: Cluster, truth: PerformanceModel) -> None:
        self.speeds = TypeSpeeds(cluster, truth)
        self._kind = cluster.gpu_type
        self._types = cluster.gpu_types
        #: busy GPUs of each type now, and busy GPU-seconds of each so far
        self._busy = [0] * len(cluster.gpu_types)
        self._busy_s = [0.0] * len(cluster.gpu_types)

    @classmethod
    def of(cls, cluster: Cluster, truth: PerformanceModel) -> TypeUse | None:
        return cls(cluster, truth) if cluster.mixed else None

    def speed(self, model: str, sub_batch: float, gpu_ids: Sequence[int]) -> float:
        """How many times as fast as on the reference type a job runs on ``gpu_ids``."""
        return self.speeds.of_gpus(model, sub_batch, gpu_ids)

    def advance(self, seconds: float) -> None:
        busy_s = self._busy_s
        for kind, busy in enumerate(self._busy):
            busy_s[kind] += busy * seconds

    def busy(self, gpu: int, change: int) -> None:
        """``gpu`` became busy (``change`` +1) or idle (-1)."""
        self._busy[self._kind[gpu]] += change

    def gpu_hours(self) -> dict[str, float]:
        """Busy GPU-hours of each type, by type name."""
        return {name: s / 3600 for name, s in zip(self._types, self._busy_s, strict=True)}
