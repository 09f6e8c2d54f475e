"""A node's measured profile of its GPU type: iteration time and peak memory per
(model, per-GPU batch), measured here and handed to the predictor (docs/profiles.md).

- **When.** The first time a run of a model starts on this node at a per-GPU batch the
  node has not seen, a background task asks the predictor whether it holds figures of
  that model at that batch for this node's GPU type
  (``gpusched.predictor.measured_profile``); where it holds none, the node measures the
  model at that batch and its half and hands the figures in. The run starts at once
  either way. On emulated GPUs only simulated runs count (a real process there runs on
  the CPU, which is no GPU type's figure; GENIE's compute profile measures that).
  ``gpusched.node.<node>.gpu_profile`` (a
  :class:`~gpusched.libs.common.schemas.GpuProfileRequest`) measures on request.
- **How.** On real GPUs: the training worker's own ``--profile`` (a fresh model per
  batch, warm-up iterations, then ``repeats`` timed; the median time counts, peak memory
  is torch's ``max_memory_allocated``) in its own process on one GPU that no run here
  holds; where every GPU is held, nothing is measured now (the next start of the model
  tries again), since a measurement beside a job times both of them. The worker trains
  the architecture it has for the model (its small stand-in, unless its report names a
  real one). On emulated GPUs nothing is trained: the figures are the ground truth's,
  marked ``emulated``.
- **Handing in.** A request on ``gpusched.node.<node>.measured_profile`` that the
  predictor answers once it stored the figures; with no predictor answering, the
  figures are dropped and the next start of the model measures again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro.request import ERROR_CODE_HEADER

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.measured import to_wire
from gpusched.libs.common.schemas import (
    CommandReply,
    GpuProfileRequest,
    MeasuredProfile,
    MeasuredProfileRequest,
    NodeInfo,
    StartJob,
)
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.profiles.measured import (
    ARCHITECTURES,
    GpuProfile,
    MeasuredPoint,
    ModelFigures,
    gpu_type_key,
)

WORKER_MODULE = "gpusched.services.nodeagent.worker"


class GpuProfilingError(RuntimeError):
    """Figures could not be measured (unknown model, every GPU busy, the worker failed)."""


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """``warmup`` and ``repeats`` iterations per batch; the worker is killed after
    ``timeout_s``; a predictor request waits ``request_timeout_s``."""

    warmup: int = 3
    repeats: int = 10
    timeout_s: float = 300.0
    request_timeout_s: float = 5.0


def measured_at() -> str:
    """Now, as a measured profile dates its figures (ISO 8601, UTC, seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def profiled_batches(batch_size: int) -> list[int]:
    """A batch and its half (rounded down), one point when the half is 0: 64 -> [32, 64]."""
    return [batch_size] if batch_size < 2 else [batch_size // 2, batch_size]


def per_gpu_batch(start: StartJob) -> int | None:
    """The sub-batch one worker of ``start`` computes at a time; None where the global
    batch does not split evenly (no figure measured would be its own)."""
    share, rest = divmod(start.spec.batch_size, start.spec.gpus * start.accum_steps)
    return share if share >= 1 and rest == 0 else None


# ---- measuring ----------------------------------------------------------------------


def figures_from_report(report: dict[str, Any], when: str, node: str = "") -> ModelFigures:
    """A model's figures from the JSON report of the worker's ``--profile`` (batches
    that ran out of memory are left out). Raises :class:`GpuProfilingError` where none
    is left."""
    points = [
        MeasuredPoint(
            batch_size=int(entry["batch_size"]),
            iteration_s=float(entry.get("median_iteration_s") or entry["mean_iteration_s"]),
            memory_mb=float(entry["gpu_mem_mb"]),
        )
        for entry in report["results"]
        if "error" not in entry
    ]
    if not points:
        raise GpuProfilingError(f"{report['model']}: every batch ran out of memory")
    architecture = report.get("architecture", "stand-in")
    return ModelFigures(
        model=str(report["model"]),
        architecture=architecture if architecture in ARCHITECTURES else "stand-in",
        device=str(report["device"]),
        torch=str(report.get("torch", "")),
        measured_at=when,
        node=node,
        points=tuple(points),
    )


async def run_worker_profile(
    model: str,
    batches: Sequence[int],
    *,
    device: str,
    env: dict[str, str] | None = None,
    settings: MeasureSettings | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The worker's ``--profile`` report of ``model`` at ``batches`` on ``device``
    (``python -m gpusched.services.nodeagent.worker --profile``, in its own process).
    Raises :class:`GpuProfilingError` when it fails or outlives ``timeout_s``."""
    settings = settings or MeasureSettings()
    arguments = [
        "-m", WORKER_MODULE, "--profile", "--model", model, "--device", device,
        "--batch-sizes", ",".join(map(str, batches)),
        "--warmup", str(settings.warmup), "--repeats", str(settings.repeats),
        *(["--threads", str(threads)] if threads else []),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, *arguments, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env if env is not None else dict(os.environ),
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), settings.timeout_s)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        if isinstance(exc, TimeoutError):
            raise GpuProfilingError(
                f"profiling {model} took over {settings.timeout_s:g} s"
            ) from None
        raise
    if process.returncode != 0:
        tail = " | ".join(err.decode(errors="replace").strip().splitlines()[-3:])
        raise GpuProfilingError(f"profiling {model} exited {process.returncode}: {tail}")
    try:
        report: dict[str, Any] = json.loads(out.decode())
    except json.JSONDecodeError as exc:
        raise GpuProfilingError(f"profiling {model}: unreadable report ({exc})") from None
    return report


def emulated_figures(
    truth: PerformanceModel, model: str, batches: Sequence[int], node: str
) -> ModelFigures:
    """What an emulated GPU would measure: the ground truth's one-GPU iteration time and
    memory at each batch."""
    points = tuple(
        MeasuredPoint(b, truth.iteration_time(model, b, 1, 1), truth.gpu_memory_mb(model, b))
        for b in batches
    )
    return ModelFigures(
        model=model, architecture="emulated", device="emulated", torch="",
        measured_at=measured_at(), node=node, points=points,
    )  # fmt: skip


# ---- the node's part ----------------------------------------------------------------


class GpuProfiling:
    """One node's measurements of its GPU type (see the module). ``held`` answers the
    indices of the GPUs runs hold now; ``lock`` keeps one measurement at a time on the
    node (CPU and compute profiles take it too)."""

    def __init__(
        self,
        nc: Client,
        info: NodeInfo,
        truth: PerformanceModel,
        held: Callable[[], Collection[int]],
        lock: asyncio.Lock,
        log: Any = None,
        settings: MeasureSettings | None = None,
    ) -> None:
        self._nc = nc
        self.info = info
        self.truth = truth
        self._known = frozenset(truth.models())
        self._held = held
        self._lock = lock
        self.log = log or structlog.get_logger("gpusched.nodeagent").bind(node=info.name)
        self.settings = settings or MeasureSettings()
        self.gpu_name = info.gpus[0].model if info.gpus else "unknown"
        self.gpu_type = gpu_type_key(self.gpu_name)
        #: (model, per-GPU batch) checked, being checked, or measured here
        self._seen: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def on_start(self, start: StartJob, kind: str) -> None:
        """A run of ``start`` began here as ``kind`` (simulated, process or held): check
        its model at its per-GPU batch once. On emulated GPUs only simulated runs count:
        they go at the ground truth's speed, while a process there runs on the CPU,
        which is no GPU type's figure."""
        batch = per_gpu_batch(start)
        model = start.spec.model
        if self.info.emulated and kind != "simulated":
            return
        if batch is None or model not in self._known or (model, batch) in self._seen:
            return
        self._seen.add((model, batch))
        task = asyncio.create_task(self._first_run(model, batch), name=f"gpu-profile-{model}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)

    async def on_request(self, request: GpuProfileRequest) -> MeasuredProfile:
        """Measure on request and hand the figures in; answers them (handed in or not)."""
        if request.model not in self._known:
            raise GpuProfilingError(f"unknown model {request.model!r}")
        batches = sorted(set(request.batch_sizes)) or profiled_batches(
            self.truth.default_batch_size(request.model)
        )
        figures = await self.measure(request.model, batches, request.repeats)
        await self.hand_in(figures)
        return to_wire(figures)

    async def _first_run(self, model: str, batch: int) -> None:
        bound = self.log.bind(model=model, batch=batch, gpu_type=self.gpu_type)
        try:
            stored = await self._stored(model, batch)
        except Exception as exc:  # no predictor, NATS away: the next start asks again
            self._seen.discard((model, batch))
            bound.debug("no answer about measured figures", error=repr(exc))
            return
        if stored:
            return
        try:
            figures = await self.measure(model, profiled_batches(batch), self.settings.repeats)
        except GpuProfilingError as exc:
            self._seen.discard((model, batch))
            bound.info("not measured now", reason=str(exc))
            return
        if not await self.hand_in(figures):
            self._seen.discard((model, batch))

    async def _stored(self, model: str, batch: int) -> bool:
        """Whether the predictor holds figures of ``model`` at ``batch`` on this type
        (it answers 404 where not); raises where it does not answer."""
        request = MeasuredProfileRequest(gpu_type=self.gpu_type, model=model, batch_size=batch)
        reply = await self._nc.request(
            subjects.PREDICT_MEASURED_PROFILE, codec.encode(request),
            timeout=self.settings.request_timeout_s, headers=codec.headers(),
        )  # fmt: skip
        code = (reply.headers or {}).get(ERROR_CODE_HEADER)
        if code == "404":
            return False
        if code:
            raise GpuProfilingError(f"the predictor answered {code}")
        return True

    async def measure(self, model: str, batches: Sequence[int], repeats: int) -> GpuProfile:
        """``model``'s figures at ``batches`` on this node's GPU type (see the module)."""
        if self.info.emulated or not self.info.gpus:
            figures = emulated_figures(self.truth, model, batches, self.info.name)
        else:
            figures = await self._measure_on_gpu(model, batches, repeats)
        points = [(p.batch_size, round(p.iteration_s, 6), round(p.memory_mb)) for p in
                  figures.points]
        self.log.info(
            "measured figures", model=model, gpu_type=self.gpu_type,
            architecture=figures.architecture, points=points,
        )  # fmt: skip
        return GpuProfile(self.gpu_name, self.gpu_type, {model: figures})

    async def _measure_on_gpu(
        self, model: str, batches: Sequence[int], repeats: int
    ) -> ModelFigures:
        async with self._lock:
            held = set(self._held())
            idle = [g for g in self.info.gpus if g.index not in held]
            if not idle:
                raise GpuProfilingError(f"every GPU of {self.info.name} is held by a run")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": idle[0].uuid}
            settings = MeasureSettings(
                self.settings.warmup, repeats, self.settings.timeout_s,
                self.settings.request_timeout_s,
            )  # fmt: skip
            report = await run_worker_profile(
                model, batches, device="cuda", env=env, settings=settings
            )
        return figures_from_report(report, measured_at(), self.info.name)

    async def hand_in(self, figures: GpuProfile) -> bool:
        """Give ``figures`` to the predictor; True once it stored them."""
        try:
            reply = await self._nc.request(
                subjects.node_measured_profile(self.info.name), codec.encode(to_wire(figures)),
                timeout=self.settings.request_timeout_s, headers=codec.headers(),
            )  # fmt: skip
            answer = codec.decode(reply.data, CommandReply)
        except Exception as exc:  # no predictor, NATS away, an unreadable answer
            self.log.warning("measured figures not handed in", error=repr(exc))
            return False
        if not answer.ok:
            self.log.warning("measured figures refused", error=answer.error)
        return answer.ok


__all__ = [
    "GpuProfiling",
    "GpuProfilingError",
    "MeasureSettings",
    "emulated_figures",
    "figures_from_report",
    "measured_at",
    "per_gpu_batch",
    "profiled_batches",
    "run_worker_profile",
]
