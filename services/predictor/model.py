"""What the predictor believes: the profiles, corrected by what running jobs measured.

:class:`BaselinePredictor` does no I/O: the service feeds it messages and asks it
questions, tests drive it directly.

What it learns, and from what:

- **Iteration time** of a ``(model, batch_size, gpus)`` on a GPU type: every progress
  event of a job running alone (no co-runners) gives ``measured / profiled`` seconds
  per iteration, the profile taken at the event's own nodes and accumulation steps. An
  exponentially weighted moving average of that ratio (``history_weight`` per sample,
  starting from 1.0, i.e. from the profile) multiplies the profile's answer. The
  profile of a GPU type with a measured profile (docs/profiles.md) is its measured
  figures over the research ones (libs/core/measured.py), so the ratio corrects the
  measured figure and stays near 1 there; a ratio is kept per GPU type (the event's
  node's, '' where unknown) and a new measurement of the model drops that type's.
- **Co-location slowdown** of a pair: a progress event with exactly one co-runner whose
  model is known (from that job's own last progress event) gives the measured slowdown
  ``measured / predicted exclusive time``; a moving average of its ratio to the
  profile's slowdown corrects the profile's answer, which never drops below 1.
- **Iterations** of a model: the mean ``total_iterations`` of its completed jobs.
- **CPU/memory sensitivity** of a model: the last profile a node measured with the real
  worker (:class:`~gpusched.libs.common.schemas.CpuProfile`, see
  libs/common/cpu_sensitivity.py);
  where there is one, a request's CPUs and memory per GPU take their speed-up from it
  instead of from the built-in profile.

A progress event whose job has not advanced an iteration since its previous event
repeats an old measurement and teaches nothing.

What is learned survives a restart: :meth:`BaselinePredictor.learned` exports it as a
:class:`Learned` record (the service stores it in KV) and :meth:`BaselinePredictor.restore`
takes it back.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.schemas import CpuProfile, JobProgressEvent, Prediction, PredictRequest
from gpusched.libs.core.measured import MeasuredPerformance
from gpusched.libs.core.perf import PerformanceModel, UnknownModelError
from gpusched.libs.core.profiles.measured import GpuProfile
from gpusched.libs.core.profiles.synergy import SYNERGY_FAIR_CPUS, SYNERGY_FAIR_MEM_GB
from gpusched.libs.core.shape import JobShape

__all__ = [
    "DEFAULT_HISTORY_WEIGHT",
    "DEFAULT_RUN_S",
    "MAX_TRACKED_JOBS",
    "RATIO_BOUNDS",
    "BaselinePredictor",
    "InvalidRequest",
    "Learned",
    "UnknownModelError",
]

DEFAULT_HISTORY_WEIGHT = 0.2
#: with no declared iterations and no completed job of the model, a job is assumed to
#: run this long alone on the requested GPUs (the median run time of the synthetic
#: workloads), so the default iteration count follows the model's speed
DEFAULT_RUN_S = 3600.0
#: a measured/profiled ratio is clamped into these bounds before it is averaged in, so
#: one glitched interval (a stall, a resume) cannot throw the estimate arbitrarily far
RATIO_BOUNDS = (0.05, 20.0)
#: jobs whose last progress event is kept (to know a co-runner's model); the oldest
#: are dropped first, and finished jobs are dropped by :meth:`BaselinePredictor.forget_job`
MAX_TRACKED_JOBS = 100_000

SOURCE_PROFILE = "profile"
SOURCE_HISTORY = "profile+history"
SOURCE_MEASURED = "measured"
SOURCE_MEASURED_HISTORY = "measured+history"
SOURCE_DECLARED = "declared"
SOURCE_COMPLETED = "history"
SOURCE_DEFAULT = "default"

K = TypeVar("K")
#: (model, batch size, GPUs, GPU type)
SoloKey = tuple[str, int, int, str]
PairKey = tuple[str, int, int, str, int, int]


class InvalidRequest(ValueError):
    """A request the predictor cannot answer; the message starts with the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class MovingAverage:
    """An exponentially weighted moving average that starts from ``value``."""

    weight: float
    value: float = 1.0
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value += self.weight * (sample - self.value)
        self.samples += 1


class LearnedRatio(msgspec.Struct, frozen=True, array_like=True):
    #: (model, batch size, GPUs, GPU type) of a job alone (stores of before GPU types
    #: hold the first three), and (model, batch size, GPUs) of both jobs of a pair
    key: list[str | int]
    value: float
    samples: int


class LearnedIterations(msgspec.Struct, frozen=True, array_like=True):
    model: str
    jobs: int
    iterations: int


class Learned(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the predictor has learned, as stored between restarts."""

    version: int = 1
    solo: list[LearnedRatio] = []
    pairs: list[LearnedRatio] = []
    completed: list[LearnedIterations] = []
    #: the latest measured CPU profile of each model
    cpu_profiles: list[CpuProfile] = []


@dataclass(frozen=True, slots=True)
class _LastProgress:
    run_id: int
    model: str
    batch_size: int
    gpus: int
    accum_steps: int
    iteration: int


class BaselinePredictor:
    """Answers :class:`PredictRequest` questions from a performance model's profiles,
    corrected by measurements (see the module docstring for what is learned)."""

    def __init__(
        self,
        performance: PerformanceModel,
        history_weight: float = DEFAULT_HISTORY_WEIGHT,
        default_run_s: float = DEFAULT_RUN_S,
    ) -> None:
        if not 0 < history_weight <= 1:
            raise ValueError(f"history_weight must be in (0, 1], got {history_weight!r}")
        if not default_run_s > 0 or not math.isfinite(default_run_s):
            raise ValueError(f"default_run_s must be a finite number > 0, got {default_run_s!r}")
        self.performance = performance
        self.history_weight = history_weight
        self.default_run_s = default_run_s
        self._solo: dict[SoloKey, MovingAverage] = {}
        self._pairs: dict[PairKey, MovingAverage] = {}
        #: model -> (completed jobs, their iterations summed)
        self._completed: dict[str, tuple[int, int]] = {}
        self._jobs: OrderedDict[str, _LastProgress] = OrderedDict()
        #: model -> its measured CPU/memory sensitivity
        self._sensitivity: dict[str, Sensitivity] = {}
        #: GPU type -> its measured profile, and the performance model timing it
        self._measured: dict[str, GpuProfile] = {}
        self._typed: dict[str, MeasuredPerformance] = {}
        #: bumped by every change to what is learned (to know when to save it)
        self.changes = 0

    # ----------------------------------------------------------------- questions

    def models(self) -> tuple[str, ...]:
        return self.performance.models()

    def performance_for(self, gpu_type: str) -> PerformanceModel:
        """The profiles of a job on ``gpu_type``: its measured figures over
        :attr:`performance` where it has a measured profile, else :attr:`performance`."""
        profile = self._measured.get(gpu_type)
        if profile is None:
            return self.performance
        typed = self._typed.get(gpu_type)
        # a compute profile replaces ``performance``: the wrapper follows it
        if typed is None or typed.inner is not self.performance or typed.profile is not profile:
            typed = self._typed[gpu_type] = MeasuredPerformance(self.performance, profile)
        return typed

    def measured_profile(self, gpu_type: str) -> GpuProfile | None:
        """The measured profile of ``gpu_type``; None where none was measured."""
        return self._measured.get(gpu_type)

    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(self._measured))

    def iterations(self, req: PredictRequest) -> Prediction:
        """The declared iterations, else the mean of completed jobs of the model, else
        the iterations that fill :data:`DEFAULT_RUN_S` at the predicted speed."""
        self._check(req)
        if req.iterations is not None:
            return Prediction(
                model=req.model, kind="iterations", value=float(req.iterations),
                source=SOURCE_DECLARED,
            )
        completed = self._completed.get(req.model)
        if completed is not None:
            count, total = completed
            return Prediction(
                model=req.model, kind="iterations", value=float(max(1, round(total / count))),
                source=SOURCE_COMPLETED,
            )
        iteration_s, _ = self._iteration_s(req)
        return Prediction(
            model=req.model,
            kind="iterations",
            value=float(max(1, round(self.default_run_s / iteration_s))),
            iteration_s=iteration_s,
            source=SOURCE_DEFAULT,
        )

    def throughput(self, req: PredictRequest) -> Prediction:
        """Samples per second running alone; ``iteration_s`` is the time per iteration."""
        self._check(req)
        iteration_s, source = self._iteration_s(req)
        samples_per_s = req.batch_size / iteration_s
        return Prediction(
            model=req.model,
            kind="throughput",
            value=samples_per_s,
            iteration_s=iteration_s,
            samples_per_s=samples_per_s,
            source=source,
        )

    def slowdown(self, req: PredictRequest) -> Prediction:
        """Co-located / exclusive iteration time next to ``req.partner`` (>= 1);
        ``iteration_s`` and ``samples_per_s`` are the co-located speed."""
        self._check(req)
        if req.partner is None:
            raise InvalidRequest("partner", "a slowdown prediction needs the partner's model")
        partner_batch = req.partner_batch_size or self.performance.default_batch_size(req.partner)
        profiled = self.performance.colocation_slowdown(
            JobShape(req.model, req.batch_size, req.gpus, req.accum_steps),
            JobShape(req.partner, partner_batch, req.partner_gpus, req.partner_accum_steps),
        )
        correction = self._pairs.get(
            (req.model, req.batch_size, req.gpus, req.partner, partner_batch, req.partner_gpus)
        )
        value = max(1.0, profiled * (correction.value if correction else 1.0))
        exclusive_s, _ = self._iteration_s(req)
        iteration_s = exclusive_s * value
        return Prediction(
            model=req.model,
            kind="slowdown",
            value=value,
            iteration_s=iteration_s,
            samples_per_s=req.batch_size / iteration_s,
            source=SOURCE_HISTORY if correction else SOURCE_PROFILE,
        )

    # ----------------------------------------------------------------- learning

    def observe_progress(self, event: JobProgressEvent, gpu_type: str = "") -> bool:
        """Learn from one progress event of a run on ``gpu_type`` (its node's; '' where
        unknown); True when it changed an estimate.

        Raises :class:`UnknownModelError` for a model without a profile and
        ``ValueError`` for an impossible placement (more nodes than GPUs).
        """
        profiled_s = self.performance_for(gpu_type).iteration_time(
            event.model, event.batch_size, event.gpus, event.nodes, event.accum_steps
        )
        previous = self._remember(event)
        measured_s = event.iteration_s
        if measured_s is None or not math.isfinite(measured_s) or measured_s <= 0:
            return False
        if (
            previous is not None
            and previous.run_id == event.run_id
            and event.progress.iteration <= previous.iteration
        ):
            return False
        if not event.co_runners:
            self._average(
                self._solo, (event.model, event.batch_size, event.gpus, gpu_type)
            ).add(_clamp(measured_s / profiled_s))
            self.changes += 1
            return True
        if len(event.co_runners) != 1:
            return False  # the slowdown cannot be split between several partners
        partner = self._jobs.get(event.co_runners[0])
        if partner is None:
            return False
        exclusive_s = profiled_s * self._solo_factor(
            event.model, event.batch_size, event.gpus, gpu_type
        )
        profiled_slowdown = self.performance.colocation_slowdown(
            JobShape(event.model, event.batch_size, event.gpus, event.accum_steps),
            JobShape(partner.model, partner.batch_size, partner.gpus, partner.accum_steps),
        )
        key = (
            event.model, event.batch_size, event.gpus,
            partner.model, partner.batch_size, partner.gpus,
        )
        self._average(self._pairs, key).add(_clamp(measured_s / exclusive_s / profiled_slowdown))
        self.changes += 1
        return True

    def observe_completion(self, model: str, iterations: int) -> None:
        """A job of ``model`` finished after ``iterations`` iterations."""
        if model not in self.performance.models():
            raise UnknownModelError(model, self.performance.models())
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        count, total = self._completed.get(model, (0, 0))
        self._completed[model] = (count + 1, total + iterations)
        self.changes += 1

    def observe_cpu_profile(self, profile: CpuProfile) -> None:
        """A node measured ``profile.model``'s CPU/memory sensitivity (replaces any
        earlier profile of the model)."""
        self._sensitivity[profile.model] = Sensitivity(profile)
        self.changes += 1

    def forget_speed(self, model: str, gpu_type: str | None = None) -> None:
        """Drop ``model``'s learned speed corrections (on ``gpu_type`` only, where
        given): its profiled times changed (a compute profile or measured figures
        replaced them), and they were ratios to the old ones."""
        for key in [
            key for key in self._solo
            if key[0] == model and (gpu_type is None or key[3] == gpu_type)
        ]:  # fmt: skip
            del self._solo[key]
        self.changes += 1

    def observe_measured(self, profile: GpuProfile, models: Iterable[str]) -> None:
        """``profile`` is now the measured profile of its GPU type, and ``models`` got new
        figures in it: their learned speed corrections on that type are dropped."""
        self._measured[profile.gpu_type] = profile
        for model in models:
            self.forget_speed(model, profile.gpu_type)
        self.changes += 1

    def cpu_profile(self, model: str) -> CpuProfile | None:
        """The measured profile of ``model``, None where none was measured."""
        found = self._sensitivity.get(model)
        return None if found is None else found.profile

    def learned(self) -> Learned:
        """What has been learned so far, to store."""
        return Learned(
            solo=[LearnedRatio(list(k), a.value, a.samples) for k, a in self._solo.items()],
            pairs=[LearnedRatio(list(k), a.value, a.samples) for k, a in self._pairs.items()],
            completed=[
                LearnedIterations(model, jobs, total)
                for model, (jobs, total) in self._completed.items()
            ],
            cpu_profiles=[found.profile for found in self._sensitivity.values()],
        )

    def restore(self, learned: Learned) -> int:
        """Take back what an earlier instance learned; entries of models this one has no
        profile for, or of the wrong shape, are skipped. Returns how many were taken."""
        known = set(self.performance.models())
        taken = 0
        for table, entries, size in ((self._solo, learned.solo, 3),
                                     (self._pairs, learned.pairs, 6)):
            for entry in entries:
                key = tuple(entry.key)
                if table is self._solo:
                    key = _solo_key(key)
                if not _valid_key(key[:size], size, known) or not entry.value > 0:
                    continue
                table[key] = MovingAverage(  # type: ignore[index]
                    self.history_weight, _clamp(entry.value), max(0, entry.samples)
                )
                taken += 1
        for done in learned.completed:
            if done.model in known and done.jobs > 0 and done.iterations >= done.jobs:
                self._completed[done.model] = (done.jobs, done.iterations)
                taken += 1
        for profile in learned.cpu_profiles:
            self._sensitivity[profile.model] = Sensitivity(profile)
            taken += 1
        return taken

    def forget_job(self, job_id: str) -> None:
        """Drop what is kept about a job that will report no more progress."""
        self._jobs.pop(job_id, None)

    # ----------------------------------------------------------------- introspection

    def solo_factor(self, model: str, batch_size: int, gpus: int, gpu_type: str = "") -> float:
        """The learned measured/profiled iteration-time ratio (1.0 before any sample)."""
        return self._solo_factor(model, batch_size, gpus, gpu_type)

    def tracked_jobs(self) -> int:
        return len(self._jobs)

    # ----------------------------------------------------------------- internals

    def _check(self, req: PredictRequest) -> None:
        known = self.performance.models()
        for name in (req.model, req.partner):
            if name is not None and name not in known:
                raise UnknownModelError(name, known)
        if req.nodes > req.gpus:
            raise InvalidRequest(
                "nodes", f"{req.nodes} nodes cannot share {req.gpus} GPU(s); give nodes <= gpus"
            )

    def _iteration_s(self, req: PredictRequest) -> tuple[float, str]:
        performance = self.performance_for(req.gpu_type)
        seconds = performance.iteration_time(
            req.model, req.batch_size, req.gpus, req.nodes, req.accum_steps
        )
        measured = isinstance(performance, MeasuredPerformance) and performance.measured(
            req.model
        )
        sensitivity = self._sensitivity.get(req.model)
        allocated = req.cpus_per_gpu is not None or req.mem_gb_per_gpu is not None
        if sensitivity is not None and allocated:
            seconds /= sensitivity.speedup(
                sensitivity.fair_cpus if req.cpus_per_gpu is None else req.cpus_per_gpu,
                sensitivity.fair_mem_gb if req.mem_gb_per_gpu is None else req.mem_gb_per_gpu,
            )
        elif allocated:
            speedup = self.performance.cpu_mem_speedup(
                req.model,
                req.gpus,
                SYNERGY_FAIR_CPUS if req.cpus_per_gpu is None else req.cpus_per_gpu,
                SYNERGY_FAIR_MEM_GB if req.mem_gb_per_gpu is None else req.mem_gb_per_gpu,
            )
            if speedup > 0:
                seconds /= speedup
        learned = self._solo.get((req.model, req.batch_size, req.gpus, req.gpu_type))
        if learned is None:
            return seconds, SOURCE_MEASURED if measured else SOURCE_PROFILE
        return seconds * learned.value, SOURCE_MEASURED_HISTORY if measured else SOURCE_HISTORY

    def _solo_factor(self, model: str, batch_size: int, gpus: int, gpu_type: str) -> float:
        learned = self._solo.get((model, batch_size, gpus, gpu_type))
        return 1.0 if learned is None else learned.value

    def _average(self, table: dict[K, MovingAverage], key: K) -> MovingAverage:
        found = table.get(key)
        if found is None:
            found = table[key] = MovingAverage(self.history_weight)
        return found

    def _remember(self, event: JobProgressEvent) -> _LastProgress | None:
        previous = self._jobs.pop(event.job_id, None)
        self._jobs[event.job_id] = _LastProgress(
            run_id=event.run_id,
            model=event.model,
            batch_size=event.batch_size,
            gpus=event.gpus,
            accum_steps=event.accum_steps,
            iteration=event.progress.iteration,
        )
        while len(self._jobs) > MAX_TRACKED_JOBS:
            self._jobs.popitem(last=False)
        return previous


def _valid_key(key: tuple[str | int, ...], size: int, known: set[str]) -> bool:
    if len(key) != size:
        return False
    for i in range(0, size, 3):
        model, batch_size, gpus = key[i : i + 3]
        if model not in known or not isinstance(batch_size, int) or not isinstance(gpus, int):
            return False
        if batch_size < 1 or gpus < 1:
            return False
    return True


def _solo_key(key: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A stored solo key with its GPU type: '' for one stored before GPU types; an
    impossible key where the type is not text (:func:`_valid_key` refuses it)."""
    if len(key) == 3:
        return (*key, "")
    if len(key) == 4 and isinstance(key[3], str):
        return key
    return ()


def _clamp(ratio: float) -> float:
    low, high = RATIO_BOUNDS
    return min(high, max(low, ratio))
