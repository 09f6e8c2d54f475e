"""What a node tells the cluster about its runs: heartbeats, telemetry, progress events.

These are skipped while the connection is down rather than queued: a late heartbeat
would make a dead node look alive. Progress is measured in the job's own seconds (a
simulated run's wall time divided by the time scale), so measurements compare with the
ground truth at any speed-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

import msgspec
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import (
    Heartbeat,
    JobProgressEvent,
    Progress,
    RunningJob,
    RunRef,
    Telemetry,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.services.nodeagent.gpus import GpuInventory, Nvml, emulated_telemetry
from gpusched.services.nodeagent.metrics import Metrics
from gpusched.services.nodeagent.residents import Run, co_runners


class Reporter:
    """Publishes one node's reports about the runs it is given."""

    def __init__(
        self,
        nc: Client,
        node: str,
        time_scale: float,
        inventory: GpuInventory,
        truth: ProfilePerformanceModel,
        known_models: frozenset[str],
        log: Any,
        metrics: Metrics,
        nvml: Nvml | None = None,
    ) -> None:
        self._nc = nc
        #: the agent's NVML, open for its life (None on emulated GPUs)
        self._nvml = nvml
        self._node = node
        self._time_scale = time_scale
        self._inventory = inventory
        self._truth = truth
        self._known_models = known_models
        self._log = log
        self._metrics = metrics

    def gpu_memory_mb(self, run: Run) -> float:
        """What one GPU of this run holds: the ground truth where the model is known."""
        spec = run.start.spec
        if spec.model in self._known_models:
            return self._truth.gpu_memory_mb(
                spec.model, spec.batch_size / (spec.gpus * run.start.accum_steps)
            )
        return run.progress.gpu_mem_mb

    def progress_of(self, run: Run, now: float) -> Progress:
        if run.clock is None:
            return run.progress
        batch = run.start.spec.batch_size
        return Progress(
            iteration=int(run.clock.at(now)),
            samples_per_s=batch / (run.alone_s * run.slowdown),
            gpu_mem_mb=self.gpu_memory_mb(run),
            at=time.time(),
        )

    def running(self, runs: Collection[Run]) -> list[RunningJob]:
        now = asyncio.get_running_loop().time()
        return [
            RunningJob(run.job_id, run.run_id, self.progress_of(run, now))
            for run in runs
        ]

    async def _publish(self, subject: str, value: Any, kind: str) -> None:
        if not self._nc.is_connected:
            return  # a late heartbeat is worse than none: the scheduler would trust it
        try:
            await self._nc.publish(subject, codec.encode(value), headers=codec.headers())
        except Exception as exc:
            self._log.debug("publish failed", subject=subject, error=repr(exc))
            return
        self._metrics.published.labels(kind).inc()

    async def heartbeat(self, runs: Collection[Run], exiting: list[RunRef]) -> None:
        beat = Heartbeat(
            node=self._node, at=time.time(), running=self.running(runs), exiting=exiting,
        )
        await self._publish(subjects.node_heartbeat(self._node), beat, "heartbeat")

    async def telemetry(self, runs: Collection[Run]) -> Telemetry:
        """Publish the node's GPU readings and running jobs; returns the sample."""
        if self._inventory.emulated:
            used: dict[int, float] = {}
            for run in runs:
                per_gpu = self.gpu_memory_mb(run)
                for index in run.start.gpus:
                    used[index] = used.get(index, 0.0) + per_gpu
            busy = {i for run in runs for i in run.start.gpus}
            gpus = emulated_telemetry(self._inventory.gpus, used, busy)
        else:
            readings = await asyncio.to_thread(self._nvml.read) if self._nvml else None
            gpus = [g.telemetry() for g in readings or ()]
        sample = Telemetry(
            node=self._node, at=time.time(), gpus=gpus, jobs=self.running(runs)
        )
        await self._publish(subjects.node_telemetry(self._node), sample, "telemetry")
        return sample

    async def progress_events(self, runs: Collection[Run]) -> None:
        now = asyncio.get_running_loop().time()
        for run in list(runs):
            if run.kind == "held" or not run.start.leader:
                continue
            # the run's shape, with the speed it is of: a record keeps the last progress
            # across runs, resized ones included (services/admission/history.py)
            progress = msgspec.structs.replace(
                self.progress_of(run, now), batch_size=run.start.spec.batch_size,
                gpus=run.start.spec.gpus,
            )
            event = JobProgressEvent(
                job_id=run.job_id,
                run_id=run.run_id,
                node=self._node,
                model=run.start.spec.model,
                batch_size=run.start.spec.batch_size,
                gpus=run.start.spec.gpus,
                nodes=run.start.nodes,
                accum_steps=run.start.accum_steps,
                co_runners=co_runners(run, runs),
                iteration_s=self._measure(run, now),
                progress=progress,
            )
            await self._publish(subjects.job_progress(self._node, run.job_id), event, "progress")

    def _measure(self, run: Run, now: float) -> float | None:
        """Seconds per iteration over the interval since the last progress event, in
        the job's own seconds: a simulated run's wall time divided by the time scale,
        so that measurements compare with the ground truth at any speed-up."""
        if run.clock is not None:
            point = (run.clock.at(now), now / self._time_scale)
        elif run.samples:
            last = run.samples[-1]
            point = (float(last[0]), last[1])
            if run.measured_from is None:
                first = run.samples[0]
                run.measured_from = (float(first[0]), first[1])
            run.samples.clear()
        else:
            return None
        base, run.measured_from = run.measured_from, point
        if base is None or point[0] <= base[0]:
            return None
        return (point[1] - base[1]) / (point[0] - base[0])

    def warn_if_memory_overflows(self, runs: Collection[Run], gpus: list[int]) -> None:
        if not self._inventory.emulated:
            return
        capacity = {g.index: g.memory_mb for g in self._inventory.gpus}
        for index in gpus:
            residents = [r for r in runs if index in r.start.gpus]
            used = sum(self.gpu_memory_mb(r) for r in residents)
            if used > capacity[index]:
                self._log.warning(
                    "GPU memory oversubscribed", gpu=index, used_mb=round(used),
                    capacity_mb=capacity[index], jobs=sorted(r.job_id for r in residents),
                )
