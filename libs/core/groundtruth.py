"""The ground-truth performance model: what really happens when a job runs.

It drives the simulator and the node agent's emulated GPUs; schedulers never read it
directly (they see estimates, e.g. :class:`NoisyEstimates`).

Two layers:

- the project's own analytic profiles (``builtin/profiles.json``), which cover every
  model and make every command work without research data;
- research profiles read at run time from a data directory (never copied into the
  project), each overriding the analytic layer only where it has measurements:
  Pollux step times by placement and per-GPU batch (iteration time), Gavel throughputs
  of co-located pairs on V100 (co-location slowdown) and Synergy's throughput grids over
  CPU cores and memory per GPU (CPU/memory speedup). Their readers live in
  ``gpusched.libs.core.profiles``.

Interpolated measurements are noisy, so the contract of
:class:`~gpusched.libs.core.perf.PerformanceModel` is enforced explicitly on top of them (for
example, an iteration on more nodes takes the maximum of its own estimate and the
estimate on fewer nodes). Every public method caches its results by argument tuple: the
model is immutable after construction and these calls sit on the simulator's hot path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpusched.libs.core.convergence import Convergence, convergence_models
from gpusched.libs.core.estimates import NoisyEstimates
from gpusched.libs.core.parallelism import Degrees, iteration_time_at
from gpusched.libs.core.perf import CpuMemDemand, UnknownModelError, demand_on_node
from gpusched.libs.core.profiles.builtin import (
    FAIR_CPUS_PER_GPU,
    FAIR_MEM_GB_PER_GPU,
    ModelProfile,
    Network,
    load_builtin,
)
from gpusched.libs.core.profiles.gavel import (
    GAVEL_GPU,
    GavelSpeeds,
    GavelTable,
    read_gavel,
    read_gavel_speeds,
)
from gpusched.libs.core.profiles.pollux import MIN_COMPUTE_S, PolluxProfile, read_pollux_model
from gpusched.libs.core.profiles.synergy import SynergyData, SynergyModel, read_synergy
from gpusched.libs.core.shape import JobShape

#: what other modules have long imported from here
__all__ = ["NoisyEstimates", "ProfilePerformanceModel", "load_performance_model"]

#: how the ground truth turns a CPU/memory allocation into speed: "grid" reads it from
#: Synergy's throughput grids (our analytic sensitivity where a model has none);
#: "binary" is Synergy's artifact: the best-case speed-up with the whole best-case
#: vector, else none
SPEED_MODELS = ("grid", "binary")
#: the servers the binary speed model scales multi-GPU demands for (Synergy's: 8 GPUs,
#: their CPUs the fair share of each)
BINARY_SERVER_GPUS = 8
#: Synergy model -> category, for the models of ``models.json`` the simulator knows by
#: their own names (image, language, speech as Synergy's workload splits them)
SYNERGY_CATEGORIES = {
    "alexnet": "image",
    "mobilenet": "image",
    "res18": "image",
    "res50": "image",
    "shufflenet": "image",
    "vae": "image",
    "bert": "language",
    "gnmt": "language",
    "lstm": "language",
    "transformer": "language",
    "deepspeech": "speech",
    "m5": "speech",
}


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class ProfilePerformanceModel:
    """The ground truth: built-in analytic profiles, overridden by research data.

    Build one with :meth:`builtin` or :meth:`from_data_dir`. Instances are immutable;
    every query is cached by its arguments.
    """

    __slots__ = (
        "_convergence",
        "_gavel",
        "_gavel_speeds",
        "_iter_cache",
        "_mem_cache",
        "_network",
        "_parallel_cache",
        "_pollux",
        "_profiles",
        "_slow_cache",
        "_speed_cache",
        "_speed_model",
        "_synergy",
    )

    def __init__(
        self,
        profiles: Mapping[str, ModelProfile],
        network: Network,
        pollux: Mapping[str, PolluxProfile] | None = None,
        gavel: GavelTable | None = None,
        synergy: SynergyData | None = None,
        speed_model: str = "grid",
        convergence: Mapping[str, Convergence] | None = None,
        gavel_speeds: GavelSpeeds | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a performance model needs at least one model profile")
        if speed_model not in SPEED_MODELS:
            raise ValueError(f"speed_model must be one of {SPEED_MODELS}, got {speed_model!r}")
        self._speed_model = speed_model
        self._profiles = dict(profiles)
        self._network = network
        self._pollux = dict(pollux or {})
        self._gavel = gavel
        self._gavel_speeds = gavel_speeds
        self._synergy = synergy
        self._iter_cache: dict[tuple[str, int, int, int, int], float] = {}
        self._parallel_cache: dict[tuple[str, int, Degrees, tuple[int, ...], int], float] = {}
        self._slow_cache: dict[tuple[str, int, int, int, str, int, int, int], float] = {}
        self._mem_cache: dict[tuple[str, float], float] = {}
        self._speed_cache: dict[tuple[str, int, float, float], float] = {}
        self._convergence = dict(convergence or {})

    # ----------------------------------------------------------------- construction

    @classmethod
    def builtin(cls, speed_model: str = "grid") -> ProfilePerformanceModel:
        """Only the project's own analytic profiles; needs no data directory."""
        profiles, network = load_builtin()
        return cls(profiles, network, speed_model=speed_model, convergence=convergence_models(None))

    @classmethod
    def from_data_dir(cls, path: str | Path, speed_model: str = "grid") -> ProfilePerformanceModel:
        """The built-in profiles, overridden where the research data in ``path`` covers
        a model (``profiles/pollux``, ``profiles/gavel``, ``profiles/synergy``). The
        models of Synergy's ``models.json`` that no built-in model is named after become
        models of their own (see :func:`synergy_profile`).

        Missing files keep the built-in values; malformed ones raise ``ValueError``
        naming the file and the line or key at fault.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"data directory {root} does not exist")
        profiles, network = load_builtin()
        profiles_dir = root / "profiles"
        pollux = {}
        for name in profiles:
            model_dir = profiles_dir / "pollux" / name
            found = read_pollux_model(model_dir) if model_dir.is_dir() else None
            if found is not None:
                pollux[name] = found
        gavel_json = profiles_dir / "gavel" / "simulation_throughputs.json"
        synergy_json = profiles_dir / "synergy" / "models.json"
        gavel = read_gavel(gavel_json) if gavel_json.is_file() else None
        speeds = read_gavel_speeds(gavel_json) if gavel_json.is_file() else None
        synergy = read_synergy(synergy_json) if synergy_json.is_file() else None
        if synergy is not None:
            for name, measured in sorted(synergy.models.items()):
                if name not in profiles and name in synergy.grids:
                    profiles[name] = synergy_profile(name, measured, profiles)
        return cls(
            profiles, network, pollux, gavel, synergy, speed_model, convergence_models(root),
            speeds,
        )

    # ----------------------------------------------------------------- introspection

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._profiles))

    def profile(self, model: str) -> ModelProfile:
        """The built-in analytic profile of ``model`` (category, defaults, intensity...)."""
        try:
            return self._profiles[model]
        except KeyError:
            raise UnknownModelError(model, self.models()) from None

    def data_sources(self, model: str) -> dict[str, str]:
        """Which source backs each method for ``model``: 'builtin' or the data set."""
        p = self.profile(model)
        gavel_ok = self._gavel is not None and p.gavel_type in self._gavel.batches
        synergy_ok = self._synergy is not None and p.synergy_model in self._synergy.grids
        return {
            "iteration_time": "pollux" if model in self._pollux else "builtin",
            "colocation_slowdown": f"gavel:{GAVEL_GPU}:{p.gavel_type}" if gavel_ok else "builtin",
            "cpu_mem_speedup": f"synergy:{p.synergy_model}" if synergy_ok else "builtin",
            "gpu_memory_mb": "builtin",
            "default_batch_size": "builtin",
        }

    def default_batch_size(self, model: str) -> int:
        return self.profile(model).default_batch_size

    def gavel_speed(self, model: str, sub_batch: float, gpu: str) -> float | None:
        """How fast ``model`` runs on one GPU of Gavel's type ``gpu`` (k80, p100, v100)
        against a V100, at the sub-batch Gavel measured nearest ``sub_batch``; None
        without Gavel's file or where it has no figure of the model's job type."""
        if self._gavel_speeds is None:
            return None
        return self._gavel_speeds.speed(self.profile(model).gavel_type, sub_batch, gpu)

    def convergence(self, model: str) -> Convergence | None:
        return self._convergence.get(model)

    # ----------------------------------------------------------------- iteration time

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        key = (model, batch_size, gpus, nodes, accum_steps)
        try:
            return self._iter_cache[key]
        except KeyError:
            return self._iteration_time_miss(model, batch_size, gpus, nodes, accum_steps)

    def _iteration_time_miss(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int
    ) -> float:
        self.profile(model)
        _check_positive(batch_size=batch_size, gpus=gpus, nodes=nodes, accum_steps=accum_steps)
        if nodes > gpus or nodes != int(nodes) or gpus != int(gpus):
            raise ValueError(f"{gpus} GPUs cannot span {nodes} nodes")
        if accum_steps != int(accum_steps):
            raise ValueError(f"accum_steps must be an integer, got {accum_steps!r}")
        # enforce the contract on top of noisy data: walk up from one node, so that a
        # wider spread is never faster, and never let accumulation beat a single pass
        slowest = 0.0
        for spread in range(1, nodes + 1):
            key = (model, batch_size, gpus, spread, accum_steps)
            value = self._iter_cache.get(key)
            if value is None:
                value = self._raw_iteration_time(
                    model, batch_size / gpus, gpus, spread, accum_steps
                )
                if accum_steps > 1:
                    value = max(value, self.iteration_time(model, batch_size, gpus, spread))
                value = max(value, slowest)
                self._iter_cache[key] = value
            slowest = value
        return slowest

    def _raw_iteration_time(
        self, model: str, per_gpu_batch: float, gpus: int, nodes: int, accum_steps: int
    ) -> float:
        step, sync = self._step_sync(model, per_gpu_batch / accum_steps, gpus, nodes)
        if accum_steps == 1:
            return step  # exactly the measured value at a profiled point
        # every sub-batch but the last skips the all-reduce (as Pollux models it)
        return accum_steps * max(step - sync, MIN_COMPUTE_S) + sync

    def _step_sync(self, model: str, batch: float, gpus: int, nodes: int) -> tuple[float, float]:
        """One step of ``batch`` per GPU, and the sync wait it includes."""
        pollux = self._pollux.get(model)
        measured = pollux.step_sync(batch, gpus, nodes) if pollux is not None else None
        if measured is None:
            p = self._profiles[model]
            sync = self._network.allreduce_s(p.comm_mb, gpus, nodes)
            return p.compute_s(batch) + sync, sync
        step, sync = measured
        return max(step, sync + MIN_COMPUTE_S), sync

    def parallel_iteration_time(
        self,
        model: str,
        batch_size: int,
        degrees: Degrees,
        node_of_rank: Sequence[int],
        accum_steps: int = 1,
    ) -> float:
        """Seconds per iteration of a job of data, tensor and pipeline parallel
        ``degrees`` with rank r on server ``node_of_rank[r]``: the analytic model of
        ``gpusched.libs.core.parallelism`` over the built-in profile (research profiles measure
        data-parallel jobs only, so they are not read here)."""
        first_seen: dict[int, int] = {}
        shape = tuple(first_seen.setdefault(n, len(first_seen)) for n in node_of_rank)
        key = (model, batch_size, degrees, shape, accum_steps)
        try:
            return self._parallel_cache[key]
        except KeyError:
            pass
        value = iteration_time_at(
            self.profile(model), self._network, batch_size, degrees, shape, accum_steps
        )
        self._parallel_cache[key] = value
        return value

    # ----------------------------------------------------------------- co-location

    def colocation_slowdown(self, shape: JobShape, partner: JobShape) -> float:
        # a tuple of the fields hashes several times faster than the two shapes
        key = (
            shape.model,
            shape.batch_size,
            shape.gpus,
            shape.accum_steps,
            partner.model,
            partner.batch_size,
            partner.gpus,
            partner.accum_steps,
        )
        try:
            return self._slow_cache[key]
        except KeyError:
            pass
        own, other = self.profile(shape.model), self.profile(partner.model)
        _check_positive(
            batch_size=shape.batch_size,
            gpus=shape.gpus,
            accum_steps=shape.accum_steps,
            partner_batch_size=partner.batch_size,
            partner_gpus=partner.gpus,
            partner_accum_steps=partner.accum_steps,
        )
        # what shares a GPU is one worker's sub-batch, whatever the job's size
        own_sub = shape.batch_size / (shape.gpus * shape.accum_steps)
        other_sub = partner.batch_size / (partner.gpus * partner.accum_steps)
        value = self._gavel_slowdown(own, own_sub, other, other_sub)
        if value is None:
            value = self._analytic_slowdown(own, own_sub, other, other_sub)
        self._slow_cache[key] = value
        return value

    def _gavel_slowdown(
        self, own: ModelProfile, own_sub: float, other: ModelProfile, other_sub: float
    ) -> float | None:
        if self._gavel is None:
            return None
        own_key = self._gavel.key(own.gavel_type, own_sub)
        other_key = self._gavel.key(other.gavel_type, other_sub)
        if own_key is None or other_key is None:
            return None
        return self._gavel.slowdown(own_key, other_key)

    @staticmethod
    def _analytic_slowdown(
        own: ModelProfile, own_sub: float, other: ModelProfile, other_sub: float
    ) -> float:
        """1.1 (time-slicing overhead) up to 2.0 (two saturating jobs): the partner's
        pressure hurts more the more this job needs the GPU itself."""
        pressure = _effective_intensity(other, other_sub)
        need = _effective_intensity(own, own_sub)
        return 1.1 + 0.9 * pressure * (0.4 + 0.6 * need)

    # ----------------------------------------------------------------- memory, CPU

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        key = (model, per_gpu_batch)
        try:
            return self._mem_cache[key]
        except KeyError:
            pass
        p = self.profile(model)
        if not per_gpu_batch >= 0 or not math.isfinite(per_gpu_batch):
            raise ValueError(f"per_gpu_batch must be a finite number >= 0, got {per_gpu_batch!r}")
        value = self._mem_cache[key] = p.mem_base_mb + p.mem_per_sample_mb * per_gpu_batch
        return value

    @property
    def speed_model(self) -> str:
        return self._speed_model

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        p = self.profile(model)
        if self._synergy is not None and p.synergy_model is not None:
            found = self._synergy.models.get(p.synergy_model)
            if found is not None and p.synergy_model in self._synergy.grids:
                return found.demand
        return p.cpu_mem

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        key = (model, gpus, cpus_per_gpu, mem_gb_per_gpu)
        try:
            return self._speed_cache[key]
        except KeyError:
            pass
        p = self.profile(model)
        _check_positive(gpus=gpus)
        for name, value in (("cpus_per_gpu", cpus_per_gpu), ("mem_gb_per_gpu", mem_gb_per_gpu)):
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        speedup = None
        if self._speed_model == "binary":
            speedup = self._binary_speedup(model, gpus, cpus_per_gpu, mem_gb_per_gpu)
        elif self._synergy is not None and p.synergy_model is not None:
            speedup = self._synergy.speedup(p.synergy_model, gpus, cpus_per_gpu, mem_gb_per_gpu)
        if speedup is None:
            speedup = p.cpu_mem_speedup(cpus_per_gpu, mem_gb_per_gpu)
        self._speed_cache[key] = speedup
        return speedup

    def _binary_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        """The artifact's speed: the best case with at least its (server-capped) vector
        per GPU, else the fair-share speed."""
        fair_cpus, fair_mem = self._fair_share()
        best = demand_on_node(
            self.cpu_mem_demand(model),
            gpus,
            node_cpus=BINARY_SERVER_GPUS * fair_cpus,
            node_gpus=BINARY_SERVER_GPUS,
            fair_cpus_per_gpu=fair_cpus,
            fair_mem_gb_per_gpu=fair_mem,
        )
        reached = (
            cpus_per_gpu >= best.cpus_per_gpu - _SLACK
            and mem_gb_per_gpu >= best.mem_gb_per_gpu - _SLACK
        )
        return best.speedup if reached else 1.0

    def _fair_share(self) -> tuple[float, float]:
        if self._synergy is not None:
            return self._synergy.fair_cpus, self._synergy.fair_mem_gb
        return FAIR_CPUS_PER_GPU, FAIR_MEM_GB_PER_GPU


#: CPU/memory a binary allocation may fall short of its vector by: float rounding of a
#: whole job's allocation divided by its GPUs
_SLACK = 1e-9


def synergy_profile(
    name: str, synergy: SynergyModel, builtin: Mapping[str, ModelProfile]
) -> ModelProfile:
    """A model known only to Synergy: its iteration time at the fair share spread over
    its batch (no fixed part), and GPU memory, GPU pressure and gradient size from the
    built-in model standing in for it (one mapped to it, else the first of its category)."""
    category = SYNERGY_CATEGORIES.get(name, "image")
    mapped = [p for p in builtin.values() if p.synergy_model == name]
    same_category = [p for p in builtin.values() if p.category == category]
    stand_in = (mapped or same_category or list(builtin.values()))[0]
    return ModelProfile(
        name=name,
        category=category,
        default_batch_size=synergy.batch_size,
        t0_s=0.0,
        per_sample_s=synergy.iter_time_s / synergy.batch_size,
        mem_base_mb=stand_in.mem_base_mb,
        mem_per_sample_mb=stand_in.mem_per_sample_mb,
        intensity=stand_in.intensity,
        comm_mb=stand_in.comm_mb,
        cpu_mem_class=stand_in.cpu_mem_class,
        gavel_type=stand_in.gavel_type if mapped else None,
        synergy_model=name,
        cpu_mem=synergy.demand,
    )


def _effective_intensity(profile: ModelProfile, sub_batch: float) -> float:
    """A smaller sub-batch leaves more of the GPU idle, so it presses less (mildly)."""
    ratio = min(1.0, sub_batch / profile.default_batch_size)
    return profile.intensity * (0.7 + 0.3 * ratio)


def load_performance_model(
    data_dir: str | Path | None, speed_model: str = "grid"
) -> ProfilePerformanceModel:
    """The ground truth: built-in profiles alone (``None``), or overridden by the
    research data in ``data_dir``; ``speed_model`` as in :data:`SPEED_MODELS`."""
    if data_dir is None:
        return ProfilePerformanceModel.builtin(speed_model)
    return ProfilePerformanceModel.from_data_dir(data_dir, speed_model)
