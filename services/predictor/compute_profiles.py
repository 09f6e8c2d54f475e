"""The predictor's part of GENIE's profiling: :class:`ComputeProfiler` keeps the latest
compute profile of each model and the latest link measurement (KV ``gpusched_predictor``,
key ``compute_profiles``), has a node measure a model on request or, with
``GPUSCHED_PREDICTOR_PROFILE_COMPUTE=1``, where a job of an unprofiled model first runs,
and publishes each profile it stores on ``gpusched.model.<model>.compute_profile``. The
predictor answers from them through
:class:`~gpusched.libs.common.compute_model.ComputeProfiled` (the estimates themselves:
libs/common/compute_model.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeVar

import msgspec
import structlog
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import ERROR_HEADER, ServiceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.compute_model import ComputeProfiled, configured_network
from gpusched.libs.common.schemas import (
    ComputeProfile,
    ComputeProfileRequest,
    JobRecord,
    JobStateEvent,
    LinkProfile,
)
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.libs.core.profiles.builtin import Network
from gpusched.services.predictor.model import BaselinePredictor

#: in the predictor's bucket: the stored compute profiles and link measurement
STORED_KEY = "compute_profiles"

log = structlog.get_logger("gpusched.predictor")


class StoredComputeProfiles(msgspec.Struct, frozen=True, kw_only=True):
    """What the predictor keeps between restarts (key :data:`STORED_KEY`)."""

    profiles: list[ComputeProfile] = []
    links: LinkProfile | None = None


class ProfilingFailed(RuntimeError):
    """A node did not measure a compute profile."""


_Reply = TypeVar("_Reply", bound=msgspec.Struct)


async def ask_node(
    nc: Client,
    subject: str,
    request: msgspec.Struct,
    reply_type: type[_Reply],
    timeout_s: float,
    bound: Any,
    what: str,
) -> _Reply | None:
    """Ask a node agent to measure a ``what`` profile; its reply, or None (logged on
    ``bound``) when the request, the agent or the decoding failed."""
    try:
        reply = await nc.request(
            subject, codec.encode(request), timeout=timeout_s, headers=codec.headers()
        )
        error = (reply.headers or {}).get(ERROR_HEADER)
        if error:
            bound.warning(f"measuring a {what} profile failed", error=error)
            return None
        return codec.decode(reply.data, reply_type)
    except Exception as exc:
        bound.warning(f"measuring a {what} profile failed", error=repr(exc))
        return None


class ComputeProfiler:
    """The predictor's compute profiles: stored, measured on request, published."""

    def __init__(
        self, predictor: BaselinePredictor, timeout_s: float, network: Network | None = None
    ) -> None:
        self.predictor = predictor
        #: what the predictor answers from where no model has a profile
        self.base = predictor.performance
        self.timeout_s = timeout_s
        self.network = network or configured_network()
        self.profiles: dict[str, ComputeProfile] = {}
        self.links: LinkProfile | None = None
        self._measuring: dict[str, asyncio.Task[ComputeProfile | None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._nc: Client | None = None
        self._kv: KeyValue | None = None

    def get(self, model: str) -> ComputeProfile | None:
        return self.profiles.get(model)

    def _follow(self) -> None:
        """The predictor answers from the profiles stored now."""
        self.predictor.performance = ComputeProfiled(self.base, self.profiles, self.network)

    async def start(self, nc: Client, kv: KeyValue) -> None:
        """Take back what an earlier instance stored."""
        self._nc, self._kv = nc, kv
        try:
            entry = await kv.get(STORED_KEY)
            stored = codec.decode(entry.value or b"", StoredComputeProfiles)
        except KeyNotFoundError:
            return
        except msgspec.DecodeError as exc:
            log.warning("stored compute profiles unreadable; starting without", error=str(exc))
            return
        self.profiles = {p.model: p for p in stored.profiles}
        self.links = stored.links
        self._follow()
        log.info("restored compute profiles", models=sorted(self.profiles))

    async def stop(self) -> None:
        await cancel_and_wait(*self._background, *self._measuring.values())
        self._measuring.clear()

    async def answer(self, wanted: ComputeProfileRequest) -> ComputeProfile:
        """The stored profile, or one ``wanted.node`` measures first (see the request).
        Raises ``ServiceError`` 404 (none) or 502 (the node failed)."""
        profile = self.profiles.get(wanted.model)
        if wanted.node is not None and (profile is None or wanted.refresh):
            profile = await self._profile(wanted, wanted.node)
            if profile is None:
                raise ServiceError(
                    "502", f"node {wanted.node} could not measure {wanted.model!r} (see its log)"
                )
        if profile is None:
            raise ServiceError("404", f"no compute profile of {wanted.model!r}")
        return profile

    def on_running(self, event: JobStateEvent, stores: Stores) -> None:
        """A job started: have its first node profile its model if nobody has yet
        (beside the caller: measuring takes seconds)."""
        task = asyncio.create_task(self._profile_first_run(event, stores))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _profile_first_run(self, event: JobStateEvent, stores: Stores) -> None:
        try:
            entry = await stores.jobs.get(event.job_id)
            spec = codec.decode(entry.value or b"", JobRecord).current_spec
        except Exception as exc:  # no record (yet), unreadable, NATS away: no profile now
            log.debug("no model to profile", job_id=event.job_id, error=repr(exc))
            return
        if spec.model in self.profiles or spec.model in self._measuring:
            return
        wanted = ComputeProfileRequest(model=spec.model, batch_size=spec.batch_size)
        await self._profile(wanted, event.placement[0].node)

    async def _profile(self, wanted: ComputeProfileRequest, node: str) -> ComputeProfile | None:
        """Have ``node`` measure (joining a measurement of the model under way)."""
        task = self._measuring.get(wanted.model)
        if task is None:
            task = asyncio.create_task(self._measure(wanted, node))
            self._measuring[wanted.model] = task
            task.add_done_callback(lambda _: self._measuring.pop(wanted.model, None))
        return await asyncio.shield(task)

    async def _measure(self, wanted: ComputeProfileRequest, node: str) -> ComputeProfile | None:
        assert self._nc is not None
        bound = log.bind(model=wanted.model, node=node)
        # the links are measured once (and again on a refresh), then carried by every profile
        request = msgspec.structs.replace(
            wanted, node=None, links=self.links is None or wanted.refresh
        )
        profile = await ask_node(
            self._nc, subjects.node_compute_profile(node), request, ComputeProfile,
            self.timeout_s, bound, "compute",
        )  # fmt: skip
        if profile is None:
            return None
        if profile.links is not None:
            self.links = profile.links
        profile = msgspec.structs.replace(profile, links=self.links)
        self.profiles[profile.model] = profile
        self.predictor.forget_speed(profile.model)
        self._follow()
        await self.save()
        with contextlib.suppress(Exception):
            await self._nc.publish(
                subjects.compute_profile_measured(profile.model), codec.encode(profile),
                headers=codec.headers(),
            )  # fmt: skip
        points = [(p.batch_size, p.iteration_s) for p in profile.points]
        bound.info("stored a compute profile", points=points, model_bytes=profile.model_bytes)
        return profile

    async def save(self) -> None:
        if self._kv is None:
            return
        stored = StoredComputeProfiles(profiles=list(self.profiles.values()), links=self.links)
        try:
            await self._kv.put(STORED_KEY, codec.encode(stored))
        except Exception as exc:  # NATS away: the next profile saves everything again
            log.warning("saving compute profiles failed", error=str(exc))


__all__ = ["ComputeProfiler", "StoredComputeProfiles", "ask_node"]
