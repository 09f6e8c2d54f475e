"""NATS connections and the JetStream streams and buckets every service relies on."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyNotFoundError
from nats.js.kv import KeyValue

from gpusched.libs.common import codec, health, natsauth, subjects
from gpusched.libs.common.tasks import close_within

log = structlog.get_logger("gpusched.bus")

#: submissions older than this are gone from the stream; the KV record keeps the job
STREAM_MAX_AGE_S = 7 * 24 * 3600
#: duplicate window for Nats-Msg-Id (idempotent submission)
DUPLICATE_WINDOW_S = 24 * 3600
#: the longest a closing connection's drain (its subscriptions' callbacks finished, its
#: pending messages flushed) may take before the connection is closed without it
DRAIN_S = 5.0


def credentials(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The connect options for ``url``: its servers (one URL or several, comma-separated)
    and the user, from the URL (``nats://user:password@host:port``) or else from
    ``NATS_USER`` with ``NATS_PASSWORD`` or ``NATS_PASSWORD_FILE``. A user gets its own
    reply inbox prefix, the one its permissions allow."""
    env = os.environ if environ is None else environ
    servers, user, secret = natsauth.credentials_in(url)
    if user is None and env.get("NATS_USER"):
        user = env["NATS_USER"]
        secret = env.get("NATS_PASSWORD")
        if not secret and env.get("NATS_PASSWORD_FILE"):
            secret = Path(env["NATS_PASSWORD_FILE"]).read_text().strip()
    options: dict[str, Any] = {"servers": servers}
    if user is not None:
        options["user"] = user
        options["password"] = secret or ""
        options["inbox_prefix"] = natsauth.inbox_prefix(user)
    return options


async def connect(
    url: str, name: str, first_connect_s: float = 30.0, **options: Any
) -> Client:
    """A client that reconnects forever: a NATS restart is a pause, not a crash. The
    first connection waits up to ``first_connect_s`` for a server that is still starting;
    refused credentials fail at once. ``url`` may carry credentials (see
    ``credentials``); they never appear in a log line or an error."""

    client: list[Client] = []
    shown = natsauth.redact(url)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[Exception] = loop.create_future()
    also_on_error = options.pop("error_cb", None)

    async def disconnected() -> None:
        closing = client and (client[0].is_closed or client[0].is_draining)
        if not closing:
            log.warning("nats disconnected", client=name)

    async def reconnected() -> None:
        log.info("nats reconnected", client=name)

    async def error(exc: Exception) -> None:
        text = str(exc).lower()
        if not client and "authorization violation" in text and not refused.done():
            refused.set_result(exc)
        # a permissions violation is a publish or subscription the server dropped
        denied = "permissions violation" in text
        (log.warning if denied else log.debug)("nats error", client=name, error=str(exc))
        if also_on_error is not None:
            await also_on_error(exc)

    settings: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        "allow_reconnect": True,
        "disconnected_cb": disconnected,
        "reconnected_cb": reconnected,
        "error_cb": error,
        **credentials(url),
    }
    settings.update(options)
    # nats-py retries the first connection by itself (max_reconnect_attempts=-1)
    attempt = asyncio.ensure_future(nats.connect(**settings))
    waited: set[asyncio.Future[Any]] = {attempt, refused}
    done, _ = await asyncio.wait(
        waited, timeout=first_connect_s, return_when=asyncio.FIRST_COMPLETED
    )
    if attempt in done:
        nc = attempt.result()
        client.append(nc)
        health.watch(nc)  # GPUSCHED_HEALTH_FILE: the container's health check reads it
        return nc
    attempt.cancel()
    with contextlib.suppress(BaseException):
        await attempt
    if refused.done():
        raise ConnectionError(f"NATS at {shown} refused the credentials: {refused.result()}")
    raise ConnectionError(f"cannot reach NATS at {shown} within {first_connect_s} s")


@contextlib.asynccontextmanager
async def connection(url: str, name: str, **options: Any) -> AsyncIterator[Client]:
    """A connection drained (pending messages flushed) when the block exits."""
    nc = await connect(url, name, **options)
    try:
        yield nc
    finally:
        await close_connection(nc, name)


async def close_connection(nc: Client, name: str) -> None:
    """Drain ``nc`` for up to ``DRAIN_S``, then close it if the drain did not; each step
    bounded (`close_within`), so that a drain or close that never ends (nats-py's drain
    goes on after its cancellation) cannot hold up whoever closes it."""
    if not (nc.is_closed or nc.is_draining):
        await close_within(nc.drain(), f"{name}: nats drain", DRAIN_S)
    if not nc.is_closed:
        await close_within(nc.close(), f"{name}: nats close")


async def settle(nc: Client, timeout_s: float = 5.0) -> None:
    """Return once the server has processed every command sent so far on ``nc``.

    ``Client.flush()`` in nats-py 2.16 writes its PING straight to the socket, ahead of
    SUBs still waiting in the client's buffer, so it does not prove a subscription is
    live. A message to a private inbox is queued behind those SUBs, so its return does.
    """
    inbox = nc.new_inbox()
    echoed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def arrived(_: Msg) -> None:
        if not echoed.done():
            echoed.set_result(None)

    subscription = await nc.subscribe(inbox, cb=arrived)
    try:
        await nc.publish(inbox, b"")
        await asyncio.wait_for(echoed, timeout_s)
    finally:
        await subscription.unsubscribe()


#: the settings of the jobs stream that Stores.open sees to
_STREAM_SETTINGS = ("subjects", "retention", "storage", "discard", "max_age",
                    "duplicate_window", "num_replicas")


async def _stream(js: JetStreamContext, config: StreamConfig, keep_replicas: bool = False) -> None:
    """Create the stream, or bring an existing one to ``config``; with ``keep_replicas``
    an existing stream keeps its replica count (whoever created it chose it)."""
    try:
        await js.add_stream(config)
    except BadRequestError:
        if keep_replicas:
            current = (await js.stream_info(config.name or "")).config
            config = dataclasses.replace(config, num_replicas=current.num_replicas)
            if all(getattr(current, f) == getattr(config, f) for f in _STREAM_SETTINGS):
                return
        await js.update_stream(config)


async def _bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.key_value(config.bucket)
    except Exception:
        return await js.create_key_value(config)


async def _registry(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The node registry: a bucket whose stream refuses rollup headers. Each node's user
    may write its own key only, but a ``Nats-Rollup: all`` header on that key would
    purge the whole stream, every other node's registration with it."""
    try:
        bucket = await _bucket(js, config)
    except BadRequestError:  # made meanwhile by another service, rollups refused
        bucket = await js.key_value(config.bucket)
    current = (await js.stream_info(f"KV_{config.bucket}")).config
    if current.allow_rollup_hdrs:
        await js.update_stream(dataclasses.replace(current, allow_rollup_hdrs=False))
    return bucket


#: how many key markers one pull brings when listing a bucket
KEYS_BATCH = 1000
_KV_REMOVED = ("DEL", "PURGE")


async def kv_keys(js: JetStreamContext, bucket: str, timeout_s: float = 5.0) -> list[str]:
    """Every live key of a KV bucket, in stream order.

    ``KeyValue.keys()`` in nats-py 2.16 can answer "no keys" for a bucket that has
    some: its watcher signals that the initial values are done when the consumer shows
    nothing pending and nothing counted yet, which is also true while the first value
    is in flight to the client. A pull consumer is asked for exactly the values it
    reported pending, so it cannot stop early.
    """
    prefix = f"$KV.{bucket}."
    subscription = await js.pull_subscribe(
        prefix + ">",
        stream=f"KV_{bucket}",
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            inactive_threshold=timeout_s * 6,
        ),
    )
    keys: list[str] = []
    consumer = ""
    try:
        info = await subscription.consumer_info()
        consumer = info.name
        pending = info.num_pending or 0
        while pending > 0:
            messages = await subscription.fetch(min(pending, KEYS_BATCH), timeout=timeout_s)
            for message in messages:
                if (message.headers or {}).get("KV-Operation") not in _KV_REMOVED:
                    keys.append(message.subject[len(prefix) :])
            pending = messages[-1].metadata.num_pending
        return keys
    finally:
        if consumer:
            with contextlib.suppress(Exception):
                await js.delete_consumer(f"KV_{bucket}", consumer)
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()


def live_entry() -> bytes:
    """The value of a job's entry in the live index: when it entered."""
    return codec.encode(time.time())


class Stores:
    """The JetStream objects of gpusched, created on first use by whichever service
    starts first (creation is idempotent)."""

    def __init__(
        self,
        js: JetStreamContext,
        jobs: KeyValue,
        nodes: KeyValue,
        lease: KeyValue,
        live: KeyValue,
    ):
        self.js = js
        self.jobs = jobs
        self.nodes = nodes
        self.lease = lease
        #: the index of unfinished jobs (see ``mark_live``)
        self.live = live
        #: replicas of the streams and buckets this creates (None: 1, and an existing
        #: stream keeps its own)
        self.replicas: int | None = None

    async def job_ids(self) -> list[str]:
        """Every stored job, finished or not: grows without bound, so only for tools and
        for building the live index once."""
        return await kv_keys(self.js, subjects.JOBS_BUCKET)

    async def live_job_ids(self) -> list[str]:
        """The jobs in the live index: every unfinished job, and for a short while a
        finished one whose entry was not yet removed or an id whose record was never
        written. Its size follows the jobs in flight, not the jobs ever stored."""
        keys = await kv_keys(self.js, subjects.LIVE_BUCKET)
        return [k for k in keys if k != subjects.LIVE_INDEX_COMPLETE_KEY]

    async def mark_live(self, job_id: str) -> None:
        """Enter a job into the live index (before its record exists is fine)."""
        await self.live.put(job_id, live_entry())

    async def unmark_live(self, job_id: str, revision: int | None = None) -> None:
        """Take a job out of the live index. The key's messages are purged from the
        bucket's stream rather than deleted, so no delete marker stays behind for every
        job that ever ran (and a purge needs no room in a full store). With ``revision``
        only that entry and older ones go: the job entered again since (a retried
        submission) stays in the index."""
        await self.js.purge_stream(
            f"KV_{subjects.LIVE_BUCKET}", subject=f"$KV.{subjects.LIVE_BUCKET}.{job_id}",
            seq=revision + 1 if revision else None,
        )

    async def live_mark(self, job_id: str) -> tuple[float, int] | None:
        """When the job entered the live index and that entry's revision; None when it
        is not there."""
        try:
            entry = await self.live.get(job_id)
        except KeyNotFoundError:
            return None
        if not entry.value or entry.revision is None:
            return None
        return codec.decode(entry.value, float), entry.revision

    async def live_marked_at(self, job_id: str) -> float | None:
        """When the job entered the live index; None when it is not there."""
        mark = await self.live_mark(job_id)
        return None if mark is None else mark[0]

    async def purge_job(self, job_id: str, revision: int) -> None:
        """Remove a job record of ``revision`` (or older) without writing anything: a
        KV delete writes a marker, which a full store refuses; a purge needs no room. A
        later revision (another writer's) stays."""
        await self.js.purge_stream(
            f"KV_{subjects.JOBS_BUCKET}", subject=f"$KV.{subjects.JOBS_BUCKET}.{job_id}",
            seq=revision + 1,
        )

    async def live_index_complete(self) -> bool:
        return await self.live_marked_at(subjects.LIVE_INDEX_COMPLETE_KEY) is not None

    async def mark_live_index_complete(self) -> None:
        await self.mark_live(subjects.LIVE_INDEX_COMPLETE_KEY)

    async def node_names(self) -> list[str]:
        return await kv_keys(self.js, subjects.NODES_BUCKET)

    async def predictor_bucket(self) -> KeyValue:
        """The predictor's bucket, created on first use."""
        return await _bucket(
            self.js,
            KeyValueConfig(bucket=subjects.PREDICTOR_BUCKET, history=1, storage=StorageType.FILE,
                           replicas=self.replicas or 1),
        )

    @classmethod
    async def open(
        cls, nc: Client, lease_ttl_s: float = 3.0, replicas: int | None = None
    ) -> Stores:
        """``replicas``: how many servers of a JetStream cluster hold each stream and
        bucket this creates, and the jobs stream is moved to; None: ``GPUSCHED_NATS_REPLICAS``
        when set, else an existing stream keeps its own (1 for a new one), so services
        need not know it."""
        js = nc.jetstream(timeout=5)
        configured = os.environ.get("GPUSCHED_NATS_REPLICAS", "").strip()
        if replicas is None and configured:
            replicas = int(configured)
        copies = replicas or 1
        await _stream(
            js,
            StreamConfig(
                name=subjects.JOBS_STREAM,
                subjects=list(subjects.JOBS_STREAM_SUBJECTS),
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                max_age=STREAM_MAX_AGE_S,
                duplicate_window=DUPLICATE_WINDOW_S,
                num_replicas=copies,
            ),
            keep_replicas=replicas is None,
        )
        await _stream(
            js,
            StreamConfig(
                name=subjects.EXITS_STREAM,
                subjects=list(subjects.EXITS_STREAM_SUBJECTS),
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                max_age=STREAM_MAX_AGE_S,
                duplicate_window=DUPLICATE_WINDOW_S,
                num_replicas=copies,
            ),
            keep_replicas=replicas is None,
        )
        jobs = await _bucket(
            js, KeyValueConfig(bucket=subjects.JOBS_BUCKET, history=1, storage=StorageType.FILE,
                               replicas=copies)
        )
        nodes = await _registry(
            js, KeyValueConfig(bucket=subjects.NODES_BUCKET, history=1, storage=StorageType.FILE,
                               replicas=copies)
        )
        lease = await _bucket(
            js,
            KeyValueConfig(
                bucket=subjects.LEASE_BUCKET,
                history=1,
                ttl=lease_ttl_s,
                storage=StorageType.FILE,
                replicas=copies,
            ),
        )
        live = await _bucket(
            js, KeyValueConfig(bucket=subjects.LIVE_BUCKET, history=1, storage=StorageType.FILE,
                               replicas=copies)
        )
        stores = cls(js, jobs, nodes, lease, live)
        stores.replicas = replicas
        return stores
