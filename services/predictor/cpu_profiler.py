"""The predictor's CPU profiles (Synergy's optimistic profiling): a node agent measures a
model with the real worker on request (``gpusched.predictor.cpu_profile`` naming a node)
or, with ``GPUSCHED_PREDICTOR_PROFILE_CPU=1``, where a job of an unmeasured model first
runs; the predictor's model keeps the profile (saved with the rest of what it learned)
and it is published on ``gpusched.model.<model>.cpu_profile``. What a profile means:
libs/common/cpu_sensitivity.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client
from nats.micro.request import ServiceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import CpuProfile, CpuProfileRequest, JobRecord, JobStateEvent
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.services.predictor.compute_profiles import ask_node
from gpusched.services.predictor.model import BaselinePredictor
from gpusched.services.predictor.requests import one_line

log = structlog.get_logger("gpusched.predictor")


class ProfilingFailed(RuntimeError):
    """A node did not measure a CPU profile."""


class CpuProfiler:
    """Measures CPU profiles on nodes, one measurement per model at a time; ``save``
    saves what the predictor learned once a profile is stored."""

    def __init__(
        self, predictor: BaselinePredictor, timeout_s: float, save: Callable[[], Awaitable[None]]
    ) -> None:
        self.predictor = predictor
        self.timeout_s = timeout_s
        self._save = save
        self._nc: Client | None = None
        #: models whose CPU profile a node is measuring now
        self._profiling: dict[str, asyncio.Task[CpuProfile | None]] = {}
        self._background: set[asyncio.Task[None]] = set()

    def start(self, nc: Client) -> None:
        self._nc = nc

    async def stop(self) -> None:
        await cancel_and_wait(*self._background, *self._profiling.values())
        self._profiling.clear()

    async def answer(self, wanted: CpuProfileRequest) -> CpuProfile:
        """The stored profile, or one ``wanted.node`` measures first (when none is stored
        or ``refresh`` is set). Raises ``ServiceError`` 404 (none) or 502 (the node
        failed)."""
        profile = self.predictor.cpu_profile(wanted.model)
        if wanted.node is not None and (profile is None or wanted.refresh):
            try:
                profile = await self.profile(wanted.model, wanted.node)
            except ProfilingFailed as exc:
                raise ServiceError("502", one_line(str(exc))) from None
        if profile is None:
            raise ServiceError("404", f"no measured CPU profile of {wanted.model!r}")
        return profile

    def on_running(self, event: JobStateEvent, stores: Stores) -> None:
        """A job started: have its node measure its model if nobody has yet (beside the
        caller: measuring takes seconds)."""
        task = asyncio.create_task(self._profile_first_run(event, stores))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def profile(self, model: str, node: str) -> CpuProfile:
        """Have ``node`` measure ``model`` (joining a measurement under way), store the
        profile, publish it and save. Raises :class:`ProfilingFailed`."""
        task = self._profiling.get(model)
        if task is None:
            task = asyncio.create_task(self._measure(model, node), name=f"profile-{model}")
            self._profiling[model] = task
            task.add_done_callback(lambda _: self._profiling.pop(model, None))
        profile = await asyncio.shield(task)
        if profile is None:
            raise ProfilingFailed(f"node {node} could not measure {model!r} (see its log)")
        return profile

    async def _measure(self, model: str, node: str) -> CpuProfile | None:
        assert self._nc is not None
        bound = log.bind(model=model, node=node)
        profile = await ask_node(
            self._nc, subjects.node_profile(node), CpuProfileRequest(model=model), CpuProfile,
            self.timeout_s, bound, "CPU",
        )  # fmt: skip
        if profile is None:
            return None
        self.predictor.observe_cpu_profile(profile)
        with contextlib.suppress(Exception):
            await self._nc.publish(
                subjects.cpu_profile_measured(model), codec.encode(profile),
                headers=codec.headers(),
            )  # fmt: skip
        await self._save()
        bound.info("stored a measured CPU profile", points=len(profile.points))
        return profile

    async def _profile_first_run(self, event: JobStateEvent, stores: Stores) -> None:
        try:
            entry = await stores.jobs.get(event.job_id)
            if not entry.value:
                return
            model = codec.decode(entry.value, JobRecord).current_spec.model
        except Exception as exc:  # no record (yet), unreadable, NATS away: no profile now
            log.debug("no model to profile", job_id=event.job_id, error=repr(exc))
            return
        if self.predictor.cpu_profile(model) is None and model not in self._profiling:
            with contextlib.suppress(ProfilingFailed):
                await self.profile(model, event.placement[0].node)
