"""The predictor asks: what the live scheduler asks the predictor service (a job's
iteration time, a running job's remaining iterations, a model's measured CPU and
compute profiles, a GPU type's measured profile).

Each ask runs beside the actor, as a task the actor owns (``spawn``), and its answer
comes back as a message (``tell``): ``Estimated``, ``RemainingPredicted``,
``Measured``, ``ComputeMeasured``, ``GpuMeasured``. A predictor that does not answer
leaves the scheduler on its own profiles, so a failed ask is only logged (and a
profile asked again with the model's next job, a GPU type's when the nodes change).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

from gpusched.libs.common.predictor_client import PredictorClient, PredictorClientError
from gpusched.libs.common.schemas import JobRecord, PredictRequest, RemainingRequest
from gpusched.libs.core.cluster import Cluster
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.gpu_types import GpuMeasured, GpuTypes
from gpusched.services.scheduler.live.messages import (
    ComputeMeasured,
    Estimated,
    Measured,
    Message,
    RemainingPredicted,
)
from gpusched.services.scheduler.live.state import consolidated_nodes, remaining_iterations


class PredictorAsks:
    """Asks the predictor for the actor whose ``spawn`` and ``tell`` it is given.
    ``cluster`` gives the actor's cluster as it is when an ask runs (None without
    nodes); ``gpu_types`` is the actor's, read likewise."""

    def __init__(
        self, nc: Client, config: SchedulerConfig, gpu_types: GpuTypes,
        cluster: Callable[[], Cluster | None], log: Any,
        spawn: Callable[[Awaitable[None]], None], tell: Callable[[Message], None],
    ) -> None:
        self.client = PredictorClient(nc, timeout_s=config.predictor_timeout_s)
        self.config = config
        self.gpu_types = gpu_types
        self.cluster = cluster
        self.log = log
        self.spawn = spawn
        self.tell = tell
        #: models whose measured CPU profile was asked for (the predictor publishes
        #: any measured later)
        self.profiles_asked: set[str] = set()
        #: models whose compute profile was asked for (likewise)
        self.compute_asked: set[str] = set()

    def ask_estimate(self, record: JobRecord) -> None:
        """The job's iteration time in its current shape (``Estimated``), and with the
        first job of a model, the model's measured CPU profile (``Measured``)."""
        self.spawn(self._ask_estimate(record))

    def ask_compute_profile(self, model: str) -> None:
        """The model's compute profile (``ComputeMeasured``), once per model."""
        if model not in self.compute_asked:
            self.compute_asked.add(model)
            self.spawn(self._ask_compute_profile(model))

    def ask_remaining(self, record: JobRecord, iteration: int) -> None:
        """A running job's remaining iterations at ``iteration`` (``RemainingPredicted``)."""
        self.spawn(self._ask_remaining(record, iteration))

    def ask_gpu_profile(self, gpu_type: str) -> None:
        """The GPU type's measured profile (``GpuMeasured``)."""
        self.spawn(self._ask_gpu_profile(gpu_type))

    async def _ask_estimate(self, record: JobRecord) -> None:
        spec = record.current_spec
        nodes = consolidated_nodes(spec.gpus, self.cluster())
        request = PredictRequest(
            model=spec.model,
            batch_size=spec.batch_size,
            gpus=spec.gpus,
            nodes=nodes,
            cpus_per_gpu=spec.cpus_per_gpu,
            mem_gb_per_gpu=spec.mem_gb_per_gpu,
            gpu_type=self.gpu_types.main,
        )
        try:
            prediction = await self.client.throughput(request)
        except PredictorClientError as exc:
            self.log.debug("predictor unavailable; keeping the profile", error=str(exc))
            return
        if prediction.iteration_s:
            self.tell(Estimated(record.id, spec.batch_size, spec.gpus,
                                prediction.iteration_s * self.config.time_scale))
        if spec.model not in self.profiles_asked:
            self.profiles_asked.add(spec.model)
            try:
                profile = await self.client.cpu_profile(spec.model)
            except PredictorClientError as exc:
                self.profiles_asked.discard(spec.model)  # the next job of it asks again
                self.log.debug("no CPU profile from the predictor", error=str(exc))
                return
            if profile is not None:
                self.tell(Measured(profile))

    async def _ask_compute_profile(self, model: str) -> None:
        try:
            profile = await self.client.compute_profile(model)
        except PredictorClientError as exc:
            self.compute_asked.discard(model)  # the next job of it asks again
            self.log.debug("no compute profile from the predictor", error=str(exc))
            return
        if profile is not None:
            self.tell(ComputeMeasured(profile))

    async def _ask_remaining(self, record: JobRecord, iteration: int) -> None:
        request = RemainingRequest(
            job_id=record.id,
            model=record.current_spec.model,
            batch_size=record.current_spec.batch_size,
            iteration=iteration,
            planned=remaining_iterations(record, iteration),
        )
        try:
            prediction = await self.client.remaining(request)
        except PredictorClientError as exc:
            self.log.debug("no remaining iterations from the predictor", error=str(exc))
            return
        self.tell(RemainingPredicted(record.id, record.run_id, iteration, prediction.value))

    async def _ask_gpu_profile(self, gpu_type: str) -> None:
        try:
            profile = await self.client.measured_profile(gpu_type)
        except PredictorClientError as exc:
            self.gpu_types.asked.discard(gpu_type)  # asked again when the nodes change
            self.log.debug("no measured profile from the predictor", error=str(exc))
            return
        if profile is not None:
            self.tell(GpuMeasured(profile))
