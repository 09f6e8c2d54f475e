"""The predictor's measured profiles: per GPU type, the iteration time and memory per
(model, per-GPU batch) that nodes of that type measured (docs/profiles.md).

- A node agent hands the figures it measured to the predictor as a request on
  ``gpusched.node.<node>.measured_profile`` (a one-model
  :class:`~gpusched.libs.common.schemas.MeasuredProfile`); every predictor instance
  hears it, merges it into the type's profile (libs/core/profiles/measured.py
  ``merged``: an emulated node's figures never replace a GPU's), keeps every type's
  profile under key ``measured_profiles`` of its bucket, answers a
  :class:`~gpusched.libs.common.schemas.CommandReply` and publishes the type's whole
  profile on ``gpusched.gpu.<type>.measured_profile``.
- ``gpusched.predictor.measured_profile`` answers a type's profile (a
  :class:`~gpusched.libs.common.schemas.MeasuredProfileRequest`; 404 when none, or none
  for the model and batch asked).
- Answers and learning time a job on a type from the type's figures (the predictor's
  ``performance_for``); a progress event's type is its node's first GPU's, read from the
  node registry (``gpusched_nodes``) once per node.
- At start, the profiles the project measured on GPUs itself
  (``libs/core/builtin/measured/``) fill in the models a type's nodes have not measured
  (``PredictorConfig.shipped_profiles``). A node's own measurement of a model is merged
  with them as any other (its batches stand); figures still exactly the shipped ones
  are not saved, so a later release's replace them.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import ServiceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.measured import from_wire, to_wire
from gpusched.libs.common.schemas import (
    CommandReply,
    MeasuredProfile,
    MeasuredProfileRequest,
    NodeInfo,
)
from gpusched.libs.core.profiles.measured import (
    GpuProfile,
    ModelFigures,
    gpu_type_key,
    shipped_gpu_profiles,
    with_figures,
    with_missing_models,
)
from gpusched.services.predictor.model import BaselinePredictor

#: how long a node missing from the registry is taken as of no known type
UNKNOWN_NODE_S = 30.0

log = structlog.get_logger("gpusched.predictor")


class StoredMeasured(msgspec.Struct, frozen=True, kw_only=True):
    """What the predictor keeps between restarts (key ``measured_profiles``)."""

    profiles: list[MeasuredProfile] = []


class MeasuredProfiles:
    """The measured profiles of every GPU type: stored, merged, served, published."""

    def __init__(self, predictor: BaselinePredictor, *, shipped: bool = True) -> None:
        self.predictor = predictor
        self._shipped = shipped
        #: (GPU type, model) -> the shipped figures added at start
        self._shipped_figures: dict[tuple[str, str], ModelFigures] = {}
        self._nc: Client | None = None
        self._kv: KeyValue | None = None
        self._nodes: KeyValue | None = None
        self._subscription: Subscription | None = None
        #: node -> (its GPU type, '' when unknown; until when an unknown one holds)
        self._node_types: dict[str, tuple[str, float]] = {}

    def get(self, gpu_type: str) -> GpuProfile | None:
        return self.predictor.measured_profile(gpu_type)

    async def start(self, nc: Client, kv: KeyValue, nodes: KeyValue) -> None:
        """Take back what an earlier instance stored, then listen to the nodes."""
        self._nc, self._kv, self._nodes = nc, kv, nodes
        try:
            entry = await kv.get(subjects.PREDICTOR_MEASURED_KEY)
            stored = codec.decode(entry.value or b"", StoredMeasured)
        except KeyNotFoundError:
            stored = StoredMeasured()
        except msgspec.DecodeError as exc:
            log.warning("stored measured profiles unreadable; starting without", error=str(exc))
            stored = StoredMeasured()
        for message in stored.profiles:
            try:
                profile = from_wire(message)
            except ValueError as exc:
                log.warning("a stored measured profile is unreadable", error=str(exc))
                continue
            self.predictor.observe_measured(profile, ())
        if stored.profiles:
            log.info("restored measured profiles", gpu_types=self.predictor.gpu_types())
        if self._shipped:
            self._add_shipped()
        self._subscription = await nc.subscribe(
            subjects.ALL_NODE_MEASURED_PROFILES, cb=self._on_measured
        )

    def _add_shipped(self) -> None:
        for shipped in shipped_gpu_profiles():
            profile = with_missing_models(self.get(shipped.gpu_type), shipped)
            self.predictor.observe_measured(profile, ())
            self._shipped_figures.update(
                ((shipped.gpu_type, model), figures)
                for model, figures in shipped.models.items()
                if profile.figures(model) == figures
            )  # fmt: skip
            log.info("shipped measured profile", gpu_type=shipped.gpu_type,
                     models=sorted(shipped.models))  # fmt: skip

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    # ---- questions --------------------------------------------------------------------

    def answer(self, wanted: MeasuredProfileRequest) -> MeasuredProfile:
        """The type's profile (only ``wanted.model``'s figures where it names one).
        Raises ``ServiceError`` 404 where there are none."""
        profile = self.get(wanted.gpu_type)
        if profile is None:
            raise ServiceError("404", f"no measured profile of GPU type {wanted.gpu_type!r}")
        if wanted.model is None:
            return to_wire(profile)
        figures = profile.figures(wanted.model)
        if figures is None:
            raise ServiceError(
                "404", f"no measured figures of {wanted.model!r} on {wanted.gpu_type!r}"
            )
        if wanted.batch_size is not None and not figures.has_batch(wanted.batch_size):
            raise ServiceError(
                "404",
                f"no measured figures of {wanted.model!r} at batch {wanted.batch_size} on "
                f"{wanted.gpu_type!r}",
            )
        return to_wire(GpuProfile(profile.gpu_name, profile.gpu_type, {figures.model: figures}))

    async def gpu_type_of(self, node: str) -> str:
        """The GPU type of ``node``'s first GPU from the node registry ('' for a node not
        registered, or whose registration is unreadable)."""
        now = time.monotonic()
        known = self._node_types.get(node)
        if known is not None and (known[0] or now < known[1]):
            return known[0]
        gpu_type = ""
        if self._nodes is not None:
            try:
                entry = await self._nodes.get(node)
                info = codec.decode(entry.value or b"", NodeInfo)
                # the key is the node (its own user wrote it); a payload naming another is not
                if info.gpus and info.name == node:
                    gpu_type = gpu_type_key(info.gpus[0].model)
            except Exception as exc:  # not registered (yet), unreadable, NATS away
                log.debug("no GPU type for a node", node=node, error=repr(exc))
        self._node_types[node] = (gpu_type, now + UNKNOWN_NODE_S)
        return gpu_type

    # ---- storing ----------------------------------------------------------------------

    async def _on_measured(self, msg: Msg) -> None:
        node = msg.subject.split(".")[2]
        try:
            figures = from_wire(codec.decode(msg.data, MeasuredProfile), f"node {node}")
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("unreadable measured profile", node=node, error=str(exc))
            await self._reply(msg, CommandReply(False, f"unreadable measured profile: {exc}"))
            return
        # a node knows its own GPUs: its type is the one its figures name
        self._node_types[node] = (figures.gpu_type, 0.0)
        changed = await self.store(figures)
        await self._reply(msg, CommandReply(True))
        log.info(
            "stored measured figures", node=node, gpu_type=figures.gpu_type,
            models=sorted(figures.models), changed=changed,
        )  # fmt: skip

    async def store(self, figures: GpuProfile) -> list[str]:
        """Merge ``figures`` into their type's profile, save it and publish it where it
        changed; returns the models whose figures changed (an emulated node's figures
        leave a GPU's as they are)."""
        old = self.get(figures.gpu_type)
        profile = old
        for new in figures.models.values():
            profile = with_figures(profile, figures.gpu_name, new)
        assert profile is not None
        changed = [
            model for model in figures.models
            if old is None or old.figures(model) != profile.figures(model)
        ]  # fmt: skip
        self.predictor.observe_measured(profile, changed)
        await self.save()
        if self._nc is not None and changed:
            with contextlib.suppress(Exception):
                await self._nc.publish(
                    subjects.gpu_profile_stored(profile.gpu_type), codec.encode(to_wire(profile)),
                    headers=codec.headers(),
                )  # fmt: skip
        return changed

    async def save(self) -> None:
        if self._kv is None:
            return
        stored = StoredMeasured(
            profiles=[
                to_wire(own)
                for t in self.predictor.gpu_types()
                if (own := self._own_figures(t)) is not None
            ]
        )
        try:
            await self._kv.put(subjects.PREDICTOR_MEASURED_KEY, codec.encode(stored))
        except Exception as exc:  # NATS away: the next measurement saves everything again
            log.warning("saving measured profiles failed", error=str(exc))

    def _own_figures(self, gpu_type: str) -> GpuProfile | None:
        """The type's profile without the figures that are still the shipped ones."""
        profile = self.predictor.measured_profile(gpu_type)
        if profile is None:
            return None
        models = {
            model: figures for model, figures in profile.models.items()
            if self._shipped_figures.get((gpu_type, model)) != figures
        }  # fmt: skip
        return GpuProfile(profile.gpu_name, gpu_type, models) if models else None

    @staticmethod
    async def _reply(msg: Msg, reply: CommandReply) -> None:
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(codec.encode(reply))


__all__ = ["MeasuredProfiles", "StoredMeasured"]
