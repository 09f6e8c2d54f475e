"""How fast a model trains on each GPU type of a cluster, against the cluster's
reference type (docs/gpu-types.md).

A type-blind performance model (the ground truth, the estimates) gives the figures of
the cluster's *reference* type, its first (``Cluster.gpu_types[0]``). A job on GPUs of
another type runs its iterations ``speed`` times as fast, where ``speed(model, sub_batch,
type)`` is the type's speed over the reference's, each taken against the GPU class of
the project's analytic profiles (V100-class) from the first source that knows it:

1. **Gavel's throughputs** (``profiles/gavel`` in the data directory, a ground truth with
   :class:`GavelSource`): for a K80, P100 or V100 and a model with a Gavel job type, its
   steps/s alone there over on a V100, at Gavel's batch nearest the sub-batch;
2. **measured profiles** of the type (the shipped ones in ``libs/core/builtin/measured``
   or those given): the wrapped model's one-GPU time over the measured one at the
   sub-batch, for the models measured there;
3. **our own relative speed** of the type's family (``gpu_types.OUR_RELATIVE_SPEEDS``);
4. a type of no known family that nothing measured runs as fast as the reference (a
   reference of that kind counts as the V100 class); :meth:`TypeSpeeds.unknown` names
   such types.

On a cluster of one type every speed is 1 and nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.gpu_types import OUR_RELATIVE_SPEEDS, family
from gpusched.libs.core.measured import MeasuredPerformance
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.profiles.measured import GpuProfile, shipped_gpu_profiles

#: where a speed came from (``TypeSpeeds.source``)
GAVEL, MEASURED, OURS, UNKNOWN = "gavel", "measured", "ours", "unknown"


@runtime_checkable
class GavelSource(Protocol):
    def gavel_speed(self, model: str, sub_batch: float, gpu: str) -> float | None:
        """``model``'s speed on Gavel's GPU type ``gpu`` over on a V100 (None: unknown)."""
        ...


class TypeSpeeds:
    """Every (model, sub-batch, type) speed of one cluster's types, cached."""

    def __init__(
        self,
        cluster: Cluster,
        truth: PerformanceModel,
        measured: Sequence[GpuProfile] | None = None,
    ) -> None:
        self.cluster = cluster
        self._gavel = truth if isinstance(truth, GavelSource) else None
        profiles = list(shipped_gpu_profiles() if measured is None else measured)
        self._families = [family(key) for key in cluster.gpu_types]
        self._measured = [
            _profile_for(key, fam, profiles, truth)
            for key, fam in zip(cluster.gpu_types, self._families, strict=True)
        ]
        self._cache: dict[tuple[str, float, int], float] = {}

    def unknown(self) -> list[str]:
        """The cluster's types of no known family (they run at the reference's speed
        where nothing measured them)."""
        return [k for k, f in zip(self.cluster.gpu_types, self._families, strict=True) if not f]

    def speed(self, model: str, sub_batch: float, kind: int) -> float:
        """How many times as fast ``model`` runs at ``sub_batch`` samples per GPU on
        type ``kind`` (an index in ``cluster.gpu_types``) as on the reference type."""
        if kind == 0:
            return 1.0
        key = (model, sub_batch, kind)
        found = self._cache.get(key)
        if found is None:
            value, source = self.against_class(model, sub_batch, kind)
            if source != UNKNOWN:  # an unknown type runs as fast as the reference
                value /= self.against_class(model, sub_batch, 0)[0]
            found = self._cache[key] = value if source != UNKNOWN else 1.0
        return found

    def of_gpus(self, model: str, sub_batch: float, gpu_ids: Sequence[int]) -> float:
        """``speed`` on the type of ``gpu_ids`` (a job's GPUs, all of one type)."""
        return self.speed(model, sub_batch, self.cluster.gpu_type[gpu_ids[0]]) if gpu_ids else 1.0

    def against_class(self, model: str, sub_batch: float, kind: int) -> tuple[float, str]:
        """(speed against the analytic profiles' V100 class, its source) on type ``kind``."""
        fam = self._families[kind]
        if self._gavel is not None and fam is not None:
            found = self._gavel.gavel_speed(model, sub_batch, fam)
            if found is not None:
                return found, GAVEL
        measured = self._measured[kind]
        if measured is not None and measured.measured(model):
            one = measured.inner.iteration_time(model, max(1, round(sub_batch)), 1, 1)
            return one / measured.compute_s(model, sub_batch), MEASURED
        if fam is None:
            return 1.0, UNKNOWN
        return OUR_RELATIVE_SPEEDS[fam], OURS

    def source(self, model: str, sub_batch: float, kind: int) -> str:
        return self.against_class(model, sub_batch, kind)[1]


def _profile_for(
    key: str, fam: str | None, profiles: Sequence[GpuProfile], truth: PerformanceModel
) -> MeasuredPerformance | None:
    """The measured profile of type ``key`` (else of its family), over ``truth``."""
    exact = [p for p in profiles if p.gpu_type == key]
    alike = [p for p in profiles if fam is not None and family(p.gpu_type) == fam]
    found = exact or alike
    return MeasuredPerformance(truth, found[0]) if found else None


def type_speeds(cluster: Cluster, truth: PerformanceModel) -> TypeSpeeds | None:
    """The speeds of a cluster of several types; None for one of a single type."""
    return TypeSpeeds(cluster, truth) if cluster.mixed else None


__all__ = ["GAVEL", "MEASURED", "OURS", "UNKNOWN", "GavelSource", "TypeSpeeds", "type_speeds"]
