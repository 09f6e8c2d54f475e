"""The scheduler service: one instance of the live scheduler, leading while it holds
the KV lease and waiting as a hot standby otherwise.

``SchedulerService`` campaigns for the lease for as long as it runs, starts a
``LiveScheduler`` for each leadership and feeds its inbox: the durable consumers of the
jobs and exits streams, and the subscriptions to heartbeats, progress and the
profiles the predictor publishes. It answers ``status`` as a ``nats.micro`` endpoint.
A lost lease deposes the actor, whose stored inputs go back to their streams for the
next leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from nats import micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.schemas import (
    ComputeProfile,
    CpuProfile,
    Heartbeat,
    JobProgressEvent,
    MeasuredProfile,
)
from gpusched.libs.common.tasks import cancel_and_wait, close_within
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.actor import LiveScheduler
from gpusched.services.scheduler.live.gpu_types import GpuMeasured
from gpusched.services.scheduler.live.lease import LeaderLease
from gpusched.services.scheduler.live.messages import (
    ComputeMeasured,
    Measured,
)
from gpusched.services.scheduler.live.metrics import SchedulerMetrics
from gpusched.services.scheduler.live.reports import from_sender, valid_runs
from gpusched.services.scheduler.policies import honours_priority
from gpusched.services.scheduler.policies.base import Policy

log = structlog.get_logger("gpusched.scheduler")

SCHEDULER_VERSION = "0.1.0"


class SchedulerService:
    """One scheduler instance: leads while it holds the lease, else waits as a standby."""

    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self.config = config
        #: a policy object of the embedder's own, used instead of ``config.policy`` by
        #: every leadership of this instance (see ``use_policy``)
        self.policy = policy
        self.nc: Client | None = None
        self.stores: Stores | None = None
        self.scheduler: LiveScheduler | None = None
        self._stack = contextlib.AsyncExitStack()
        self._task: asyncio.Task[None] | None = None
        self._lease: LeaderLease | None = None
        self.log = log.bind(instance=config.instance)
        self.metrics = SchedulerMetrics()

    def use_policy(self, policy: Policy) -> None:
        """Decide with ``policy`` from now on: in the leadership under way, if any, and
        in every later one (a lease lost and taken back starts a new scheduler)."""
        self.policy = policy
        if self.scheduler is not None:
            self.scheduler.policy = policy

    @property
    def is_leader(self) -> bool:
        """Holds the lease and its scheduler runs (one whose start failed does not)."""
        live = self.scheduler
        return live is not None and live.running and not live.deposed

    async def __aenter__(self) -> SchedulerService:
        self.nc = await self._stack.enter_async_context(
            connection(self.config.nats_url, f"gpusched-scheduler-{self.config.instance}")
        )
        self.stores = await Stores.open(self.nc, lease_ttl_s=self.config.lease_ttl_s)
        self._lease = LeaderLease(self.stores.lease, self.config.instance, self.config.lease_ttl_s)
        service = await micro.add_service(
            self.nc,
            name="gpusched-scheduler",
            version=SCHEDULER_VERSION,
            description="gpusched scheduler: leader or hot standby",
            metadata={"instance": self.config.instance, "policy": self.config.policy},
        )
        self._stack.push_async_callback(_stop_service, service)
        await service.add_endpoint(
            name="status",
            subject=subjects.scheduler_status(self.config.instance),
            handler=self._status,
        )
        self._task = asyncio.create_task(self._run(), name="scheduler-lease")
        return self

    def status(self) -> dict[str, Any]:
        live = self.scheduler
        return {
            "instance": self.config.instance,
            "policy": self.config.policy,
            "leader": self.is_leader,
            "jobs": len(live.jobs) if live else None,
            "nodes": len(live.nodes) if live else None,
            "rounds": live.rounds if live else None,
            "last_decide_ms": live.last_decide_ms if live else None,
            "refused_decisions": live.refused_decisions if live else None,
            "honours_priority": honours_priority(live.policy) if live else None,
        }

    async def _status(self, request: micro.Request) -> None:
        await request.respond(msgspec.json.encode(self.status()))

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self._stack.aclose()

    async def _run(self) -> None:
        """Campaign for the lease for as long as the service runs: lead while it is
        held, and after it is lost, or leading failed, try again."""
        assert self._lease is not None
        try:
            while True:
                try:
                    if await self._lease.try_acquire():
                        await self._lead()
                        continue
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.log.exception("leading failed; campaigning again")
                    await self._lease.release()
                await asyncio.sleep(self.config.lease_renew_s / 2)
        finally:
            await self._lease.release()

    async def _lead(self) -> None:
        assert self._lease is not None
        async with self._leading() as scheduler:
            while True:
                await asyncio.sleep(self.config.lease_renew_s)
                if not scheduler.running:
                    # its start failed (a NATS timeout reading the jobs): holding the
                    # lease would leave the cluster with a leader that never decides
                    self.log.error("the scheduler stopped; giving up the lease")
                    break
                if not await self._lease.renew():
                    scheduler.depose()
                    break
        # given up while held (not lost): a standby, or this instance, takes over now
        await self._lease.release()

    @contextlib.asynccontextmanager
    async def _leading(self) -> AsyncIterator[LiveScheduler]:
        assert self.nc is not None and self.stores is not None
        scheduler = LiveScheduler(self.config, self.nc, self.stores, self.metrics)
        if self.policy is not None:
            scheduler.policy = self.policy
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(scheduler)
            beats = await self.nc.subscribe(
                subjects.ALL_HEARTBEATS, cb=functools.partial(_heartbeat_arrived, scheduler)
            )
            stack.push_async_callback(_unsubscribe, beats)
            progress = await self.nc.subscribe(
                subjects.ALL_JOB_PROGRESS, cb=functools.partial(_progress_arrived, scheduler)
            )
            stack.push_async_callback(_unsubscribe, progress)
            profiles = await self.nc.subscribe(
                subjects.ALL_CPU_PROFILES,
                cb=functools.partial(_tell, scheduler, CpuProfile, Measured),
            )
            stack.push_async_callback(_unsubscribe, profiles)
            computed = await self.nc.subscribe(
                subjects.ALL_COMPUTE_PROFILES,
                cb=functools.partial(_tell, scheduler, ComputeProfile, ComputeMeasured),
            )
            stack.push_async_callback(_unsubscribe, computed)
            measured = await self.nc.subscribe(
                subjects.ALL_GPU_PROFILES,
                cb=functools.partial(_tell, scheduler, MeasuredProfile, GpuMeasured),
            )
            stack.push_async_callback(_unsubscribe, measured)
            consumers = [
                asyncio.create_task(self._consume(scheduler, stream), name=f"consume-{stream}")
                for stream in (subjects.JOBS_STREAM, subjects.EXITS_STREAM)
            ]

            async def stop_consumer() -> None:
                for consumer in consumers:
                    await cancel_and_wait(consumer)

            stack.push_async_callback(stop_consumer)
            self.scheduler = scheduler
            self.metrics.leading(True)
            try:
                yield scheduler
            finally:
                self.scheduler = None
                self.metrics.leading(False)
                self.log.info("leadership ended")

    async def _consume(self, scheduler: LiveScheduler, stream: str) -> None:
        """Hand the messages of ``stream`` (the jobs stream, or the exits stream) to the
        scheduler through the durable consumer of that stream."""
        assert self.stores is not None
        js = self.stores.js
        config = ConsumerConfig(
            durable_name=subjects.SCHEDULER_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30,
            max_ack_pending=10_000,
        )
        while True:
            try:
                await js.add_consumer(stream, config)
                sub = await js.pull_subscribe_bind(
                    durable=subjects.SCHEDULER_CONSUMER, stream=stream
                )
                break
            except Exception as exc:
                self.log.warning("cannot bind the consumer yet", stream=stream, error=str(exc))
                await asyncio.sleep(0.5)
        try:
            while True:
                try:
                    messages = await sub.fetch(256, timeout=1.0)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # a fetch timeout when idle, or NATS reconnecting: try again
                    await asyncio.sleep(0.01)
                    continue
                scheduler.durables_arrived(messages)
        finally:
            # an open pull request would hold up draining the connection
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _tell(scheduler: LiveScheduler, kind: type, wrap: type, msg: Msg) -> None:
    try:
        scheduler.tell(wrap(codec.decode(msg.data, kind)))
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))


async def _heartbeat_arrived(scheduler: LiveScheduler, msg: Msg) -> None:
    try:
        beat = valid_runs(codec.decode(msg.data, Heartbeat))
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))
        return
    if from_sender(msg, beat, scheduler.metrics, "heartbeat") is None:
        return
    scheduler.liveness.saw(beat, arrived=time.time())
    scheduler.beat_arrived(beat)


async def _progress_arrived(scheduler: LiveScheduler, msg: Msg) -> None:
    try:
        event = codec.decode(msg.data, JobProgressEvent)
    except msgspec.DecodeError as exc:
        log.warning("dropping undecodable message", subject=msg.subject, error=str(exc))
        return
    if from_sender(msg, event, scheduler.metrics, "progress") is not None:
        scheduler.progress_arrived(event)


async def _stop_service(service: micro.Service) -> None:
    await close_within(service.stop(), "scheduler: micro service stop")


async def _unsubscribe(sub: Any) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()

