"""Synergy's optimistic profile of a model, from what a node measured with the real
worker (a :class:`~gpusched.libs.common.schemas.CpuProfile`, see
services/nodeagent/cpu_profiling.py).

The measurement gives, per CPU count ``c`` (all the node's cores halved down to one),
seconds per training sample with the data set's decoded samples cached (``hit(c)``) and
with every sample decoded again (``miss(c)``). From it:

- **CPU axis**: per-sample times are linear in the CPU count between measured counts and
  flat outside them (nothing was measured below one core or above the node's cores).
- **Memory axis**, from the worker's cache model: a worker given ``m`` GB keeps decoded
  samples in what its process does not otherwise hold, so it caches the fraction
  ``f(m) = clamp((m - resident) / dataset, 0, 1)`` of the data set (``resident``: the
  worker's memory besides the cache; ``dataset``: the decoded data set of the default
  size). Its data set is read in a new order every epoch, so a sample is a hit with
  probability ``f``: ``t(c, m) = f hit(c) + (1 - f) miss(c)``. More memory, fewer
  re-decodes; past ``resident + dataset`` more memory changes nothing.
- **Throughput** ``1 / t(c, m)``, **normalised** at the measuring node's fair share per
  GPU (its CPUs and memory over its GPUs): 1.0 there.
- **Best case** (Synergy's demand vector): memory for the whole cache (rounded up to
  0.1 GB) and the fewest measured CPUs whose throughput there is within
  :data:`BEST_TOLERANCE` of the best measured (a core that buys less than that is noise
  on a busy machine, not a peak); its speed-up is its normalised throughput.

Speeds are per GPU: the profile runs one worker on one GPU, and a job's CPUs and memory
per GPU feed one worker each.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from gpusched.libs.common.schemas import CpuProfile, CpuProfilePoint
from gpusched.libs.core.perf import CpuMemDemand

#: a CPU count within this fraction of the best measured throughput counts as the peak
BEST_TOLERANCE = 0.05
#: the best-case memory is rounded up to a multiple of this (GB)
MEM_STEP_GB = 0.1


@dataclass(frozen=True)
class Sensitivity:
    """A measured profile's speeds over CPUs and memory per GPU."""

    profile: CpuProfile

    @property
    def model(self) -> str:
        return self.profile.model

    @property
    def fair_cpus(self) -> float:
        return self.profile.node_cpus / self.profile.node_gpus

    @property
    def fair_mem_gb(self) -> float:
        return self.profile.node_mem_gb / self.profile.node_gpus

    @property
    def full_cache_gb(self) -> float:
        """Memory per GPU at which the whole data set is cached, rounded up."""
        need = self.profile.resident_gb + self.profile.dataset_gb
        return max(MEM_STEP_GB, math.ceil(need / MEM_STEP_GB - 1e-9) * MEM_STEP_GB)

    def cached_fraction(self, mem_gb: float) -> float:
        dataset = self.profile.dataset_gb
        if dataset <= 0:
            return 1.0
        return min(1.0, max(0.0, (mem_gb - self.profile.resident_gb) / dataset))

    def sample_s(self, cpus: float, mem_gb: float) -> float:
        """Seconds per sample at ``cpus`` cores and ``mem_gb`` GB for one worker."""
        points = sorted(self.profile.points, key=lambda p: p.cpus)
        hit, miss = _interpolate(points, cpus)
        cached = self.cached_fraction(mem_gb)
        return cached * hit + (1 - cached) * miss

    def throughput(self, cpus: float, mem_gb: float) -> float:
        """Samples per second of one worker."""
        return 1.0 / self.sample_s(cpus, mem_gb)

    def speedup(self, cpus_per_gpu: float, mem_gb_per_gpu: float) -> float:
        """Throughput over the throughput at the fair share."""
        fair = self.throughput(self.fair_cpus, self.fair_mem_gb)
        return self.throughput(cpus_per_gpu, mem_gb_per_gpu) / fair

    def demand(self) -> CpuMemDemand:
        """The best-case vector per GPU and its speed-up over the fair share."""
        mem = self.full_cache_gb
        counts = sorted({p.cpus for p in self.profile.points})
        best = max(self.throughput(c, mem) for c in counts)
        cpus = next(c for c in counts if self.throughput(c, mem) >= (1 - BEST_TOLERANCE) * best)
        return CpuMemDemand(float(cpus), mem, self.speedup(cpus, mem))

    def gain_from_cores(self, mem_gb: float = 0.0) -> float:
        """Throughput on the most cores measured over that on the fewest (at ``mem_gb``
        per GPU: by default no cache, where the input pipeline does the most work)."""
        counts = [p.cpus for p in self.profile.points]
        return self.throughput(max(counts), mem_gb) / self.throughput(min(counts), mem_gb)


def _interpolate(points: list[CpuProfilePoint], cpus: float) -> tuple[float, float]:
    """(hit, miss) seconds per sample at ``cpus``, linear between the measured counts
    (sorted by CPUs), flat outside them."""
    if cpus <= points[0].cpus:
        return points[0].cached_sample_s, points[0].uncached_sample_s
    for low, high in itertools.pairwise(points):
        if cpus <= high.cpus:
            share = (cpus - low.cpus) / (high.cpus - low.cpus)
            return (
                low.cached_sample_s + share * (high.cached_sample_s - low.cached_sample_s),
                low.uncached_sample_s + share * (high.uncached_sample_s - low.uncached_sample_s),
            )
    return points[-1].cached_sample_s, points[-1].uncached_sample_s
