"""Asking the predictor service over NATS.

The scheduler calls it on its hot path and falls back to its own profiles when the
service is away, so every failure is one of two exceptions (both
:class:`PredictorClientError`): :class:`PredictorUnavailable` (no answer in time, no
service listening, no connection) and :class:`PredictorError` (the service answered
with an error: its code and description).
"""

from __future__ import annotations

import math
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import (
    ComputeProfile,
    ComputeProfileRequest,
    CpuProfile,
    CpuProfileRequest,
    MeasuredProfile,
    MeasuredProfileRequest,
    Prediction,
    PredictRequest,
    RemainingRequest,
    SizeErrorReport,
)

T = TypeVar("T", bound=msgspec.Struct)

__all__ = ["PredictorClient", "PredictorClientError", "PredictorError", "PredictorUnavailable"]


class PredictorClientError(Exception):
    """Any failure to get a prediction."""


class PredictorUnavailable(PredictorClientError):
    """No predictor answered (timeout, no responders, no connection)."""


class PredictorError(PredictorClientError):
    """The predictor answered with an error: ``code`` is "400" (bad request), "404"
    (unknown model) or "500"; "502" when its reply could not be read."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(f"predictor error {code}: {description}")
        self.code = code
        self.description = description


class PredictorClient:
    def __init__(self, nc: Client, timeout_s: float = 0.5) -> None:
        if not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        self._nc = nc
        self.timeout_s = timeout_s

    async def iterations(self, req: PredictRequest) -> Prediction:
        return await self._ask(subjects.PREDICT_ITERATIONS, req, Prediction)

    async def throughput(self, req: PredictRequest) -> Prediction:
        return await self._ask(subjects.PREDICT_THROUGHPUT, req, Prediction)

    async def slowdown(self, req: PredictRequest) -> Prediction:
        return await self._ask(subjects.PREDICT_SLOWDOWN, req, Prediction)

    async def remaining(self, req: RemainingRequest) -> Prediction:
        """A running job's remaining iterations (ONES's progress predictor)."""
        return await self._ask(subjects.PREDICT_REMAINING, req, Prediction)

    async def cpu_profile(self, model: str) -> CpuProfile | None:
        """The model's measured CPU profile; None when none was measured."""
        return await self._stored(
            subjects.PREDICT_CPU_PROFILE, CpuProfileRequest(model=model), CpuProfile
        )

    async def compute_profile(self, model: str) -> ComputeProfile | None:
        """The model's compute profile (GENIE's profiling run); None when none was measured."""
        return await self._stored(
            subjects.PREDICT_COMPUTE_PROFILE, ComputeProfileRequest(model=model), ComputeProfile
        )

    async def measured_profile(
        self, gpu_type: str, model: str | None = None, batch_size: int | None = None
    ) -> MeasuredProfile | None:
        """The measured profile of ``gpu_type`` (only ``model``'s figures where given, and
        only if they hold ``batch_size`` where given); None when there is none."""
        request = MeasuredProfileRequest(gpu_type=gpu_type, model=model, batch_size=batch_size)
        return await self._stored(subjects.PREDICT_MEASURED_PROFILE, request, MeasuredProfile)

    async def _stored(self, subject: str, req: msgspec.Struct, kind: type[T]) -> T | None:
        """What the predictor stored; None when it has nothing (404)."""
        try:
            return await self._ask(subject, req, kind)
        except PredictorError as exc:
            if exc.code == "404":
                return None
            raise

    async def size_error(self) -> SizeErrorReport:
        """The size forest's error figures over the jobs finished so far."""
        return await self._ask(subjects.PREDICT_SIZE_ERROR, SizeErrorReport(), SizeErrorReport)

    async def _ask(self, subject: str, req: msgspec.Struct, kind: type[T]) -> T:
        try:
            reply = await self._nc.request(
                subject, codec.encode(req), timeout=self.timeout_s, headers=codec.headers()
            )
        except (TimeoutError, nats.errors.Error) as exc:
            reason = "no answer in time" if isinstance(exc, TimeoutError) else repr(exc)
            raise PredictorUnavailable(f"predictor unavailable on {subject}: {reason}") from exc
        headers = reply.headers or {}
        code = headers.get(ERROR_CODE_HEADER)
        if code:
            raise PredictorError(code, headers.get(ERROR_HEADER, ""))
        try:
            return codec.decode(reply.data, kind)
        except msgspec.DecodeError as exc:
            raise PredictorError("502", f"unreadable reply on {subject}: {exc}") from exc
