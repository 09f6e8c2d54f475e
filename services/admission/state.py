"""What the admission service keeps in memory: every job record and node registration,
mirrored from their KV buckets by watchers, and the latest telemetry of each node.

Listing jobs, quota checks and the cluster view read these mirrors instead of scanning
KV on each request. Reading one job goes to KV directly (read-your-writes).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import JobRecord, JobState, NodeInfo, Placement, Telemetry

log = structlog.get_logger("gpusched.admission")

#: how often an idle watcher looks whether the connection was re-established
RECONNECT_CHECK_S = 0.5
RETRY_S = 0.25
#: how far back the cluster view's mean GPU utilisation over a window reaches
UTIL_WINDOW_S = 60.0


class _SpecSummary(msgspec.Struct, frozen=True):
    gpus: int = 1


class _JobSummary(msgspec.Struct, frozen=True):
    """The fields of a JobRecord the indexes need; decoding only these is cheaper than
    decoding the whole record (unknown fields are skipped)."""

    tenant: str
    spec: _SpecSummary
    state: JobState = JobState.QUEUED
    placement: list[Placement] = []


_summary_decoder = msgspec.msgpack.Decoder(_JobSummary)


class JobIndex:
    """Every job record by id, with per-tenant views kept current on each change: ids in
    order (for paging) and the GPUs of unfinished jobs (for quotas).

    Records are kept as their MessagePack bytes next to the few fields the indexes use,
    not as objects: bytes, strings and numbers are not tracked by the garbage collector,
    so a full collection does not walk every job ever submitted (with records as
    objects, those pauses reached ~90 ms at 20,000 jobs).

    Fed by the KV watcher and by this service's own writes; each key keeps its highest
    revision, so a late watcher update never undoes a newer write."""

    def __init__(self, on_finished: Callable[[str, str], object] | None = None) -> None:
        #: id -> (revision, record bytes, tenant, held GPUs); None bytes mark a deleted key
        self._entries: dict[str, tuple[int, bytes | None, str, int]] = {}
        self._ids_by_tenant: dict[str, list[str]] = {}
        self._held_gpus: dict[str, int] = {}
        #: tenant -> {id: GPUs} of its unfinished jobs
        self._unfinished: dict[str, dict[str, int]] = {}
        #: called with (tenant, job id) when an unfinished job finishes or is deleted
        self._on_finished = on_finished
        #: unfinished jobs with a placement, for the cluster view (at most a few per GPU)
        self._placed: dict[str, list[Placement]] = {}

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids_by_tenant.values())

    def apply(self, revision: int, job_id: str, data: bytes | None) -> bool:
        """Store the encoded record ``data`` (None: deleted) unless a newer revision of
        it is already known. Undecodable records are skipped."""
        previous = self._entries.get(job_id)
        if previous is not None and previous[0] >= revision:
            return False
        summary = None
        if data is not None:
            try:
                summary = _summary_decoder.decode(data)
            except msgspec.MsgspecError as exc:
                log.warning("undecodable job record skipped", job_id=job_id, error=str(exc))
                return False
        held = 0 if summary is None or summary.state.terminal else summary.spec.gpus
        if previous is not None and previous[1] is not None:
            old_tenant = previous[2]
            self._held_gpus[old_tenant] -= previous[3]
            self._unfinished[old_tenant].pop(job_id, None)
            if summary is None or summary.tenant != old_tenant:
                ids = self._ids_by_tenant[old_tenant]
                del ids[bisect.bisect_left(ids, job_id)]
            if previous[3] and not held and self._on_finished is not None:
                self._on_finished(old_tenant, job_id)
        if summary is None:
            self._entries[job_id] = (revision, None, "", 0)
            self._placed.pop(job_id, None)
            return True
        tenant = summary.tenant
        self._entries[job_id] = (revision, data, tenant, held)
        self._held_gpus[tenant] = self._held_gpus.get(tenant, 0) + held
        unfinished = self._unfinished.setdefault(tenant, {})
        if held:
            unfinished[job_id] = held
        if previous is None or previous[1] is None or previous[2] != tenant:
            bisect.insort(self._ids_by_tenant.setdefault(tenant, []), job_id)
        if summary.placement and not summary.state.terminal:
            self._placed[job_id] = summary.placement
        else:
            self._placed.pop(job_id, None)
        return True

    def knows(self, job_id: str) -> bool:
        entry = self._entries.get(job_id)
        return entry is not None and entry[1] is not None

    def get(self, job_id: str) -> JobRecord | None:
        entry = self._entries.get(job_id)
        if entry is None or entry[1] is None:
            return None
        return codec.decode(entry[1], JobRecord)

    def held_gpus(self, tenant: str) -> int:
        """GPUs asked for by the tenant's jobs that have not finished."""
        return self._held_gpus.get(tenant, 0)

    def unfinished(self, tenant: str) -> dict[str, int]:
        """The tenant's unfinished jobs: id -> GPUs asked for."""
        return dict(self._unfinished.get(tenant, {}))

    def status(self, job_id: str) -> bool | None:
        """True: the job has not finished; False: it has; None: no record is known."""
        entry = self._entries.get(job_id)
        if entry is None or entry[1] is None:
            return None
        return entry[3] > 0

    def page(
        self,
        tenant: str,
        *,
        states: Collection[JobState] = (),
        after: str | None = None,
        limit: int = 50,
    ) -> tuple[list[JobRecord], str | None]:
        """Up to ``limit`` of the tenant's jobs with ids above ``after``, in id order, and
        the id to continue after (None when nothing is left)."""
        ids = self._ids_by_tenant.get(tenant, [])
        start = bisect.bisect_right(ids, after) if after is not None else 0
        jobs: list[JobRecord] = []
        for position in range(start, len(ids)):
            data = self._entries[ids[position]][1]
            if data is None:
                continue
            record = codec.decode(data, JobRecord)
            if states and record.state not in states:
                continue
            if len(jobs) == limit:
                return jobs, jobs[-1].id
            jobs.append(record)
        return jobs, None

    def records_after(self, tenant: str, after: str) -> Iterator[bytes]:
        """The stored records of the tenant's jobs with ids above ``after``, in id order,
        as MessagePack bytes."""
        ids = self._ids_by_tenant.get(tenant, [])
        for job_id in ids[bisect.bisect_right(ids, after):]:
            data = self._entries[job_id][1]
            if data is not None:
                yield data

    def records(self, tenants: Collection[str] | None = None) -> Iterator[bytes]:
        """The stored records of ``tenants``' jobs (None: every tenant's), as
        MessagePack bytes, tenant by tenant in id order."""
        chosen = sorted(self._ids_by_tenant) if tenants is None else sorted(tenants)
        for tenant in chosen:
            for job_id in self._ids_by_tenant.get(tenant, []):
                data = self._entries[job_id][1]
                if data is not None:
                    yield data

    def placed(self) -> Iterable[tuple[str, list[Placement]]]:
        """(job id, placement) of every unfinished job placed on GPUs."""
        return self._placed.items()


class NodeIndex:
    """Node registrations by name."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[int, NodeInfo | None]] = {}

    def apply(self, revision: int, name: str, data: bytes | None) -> bool:
        previous = self._nodes.get(name)
        if previous is not None and previous[0] >= revision:
            return False
        info = None
        if data is not None:
            try:
                info = codec.decode(data, NodeInfo)
            except msgspec.MsgspecError as exc:
                log.warning("undecodable node registration skipped", node=name, error=str(exc))
                return False
            if info.name != name:
                # a node's user writes its own key only: the key, not the payload, is who
                log.warning("node registration naming another node skipped", node=name,
                            claimed_node=info.name[:64])
                return False
        self._nodes[name] = (revision, info)
        return True

    def nodes(self) -> list[NodeInfo]:
        return sorted((info for _, info in self._nodes.values() if info), key=_name)


def _name(info: NodeInfo) -> str:
    return info.name


class KvMirror:
    """Follows every key of a KV bucket and hands each change to ``apply`` (revision,
    key, value bytes or None when deleted).

    nats-py's watcher is an ordered consumer that only notices a restarted server after
    missing heartbeats for several seconds, so after any reconnect the mirror starts a
    fresh watcher: it replays the latest value of every key (newer revisions win in
    ``apply``, so the replay is harmless)."""

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        apply: Callable[[int, str, bytes | None], object],
        name: str,
    ) -> None:
        self._nc = nc
        self._kv = kv
        self._apply = apply
        self._name = name
        #: set once the first full replay of the bucket has been applied
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            reconnects = self._nc.stats["reconnects"]
            try:
                watcher = await self._kv.watchall()
            except Exception as exc:
                if self._nc.is_closed:
                    return
                log.debug("kv watch not ready", bucket=self._name, error=str(exc))
                await asyncio.sleep(RETRY_S)
                continue
            follow = asyncio.create_task(self._follow(watcher), name=f"kv-mirror-{self._name}")
            try:
                # waiting here rather than with a timeout per update keeps the hot path lean
                while not follow.done() and self._nc.stats["reconnects"] == reconnects:
                    await asyncio.wait({follow}, timeout=RECONNECT_CHECK_S)
            finally:
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follow
                with contextlib.suppress(Exception):
                    await watcher.stop()
            if not follow.cancelled() and follow.exception() is not None:
                log.warning("kv watch failed", bucket=self._name, error=repr(follow.exception()))
            log.info("kv watch restarted", bucket=self._name)

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:
                self.synced.set()
            elif entry.operation in (KV_DEL, KV_PURGE):
                self._apply(entry.revision or 0, entry.key, None)
            else:
                self._apply(entry.revision or 0, entry.key, entry.value or b"")


class TelemetryCache:
    """The latest Telemetry of each node, from ``gpusched.node.*.telemetry``, and the
    mean GPU utilisation of every reading of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = UTIL_WINDOW_S) -> None:
        self._latest: dict[str, Telemetry] = {}
        self._subscription: Subscription | None = None
        self.window_s = window_s
        #: (sample time, summed utilisation, GPU readings) per sample, in arrival order
        self._window: deque[tuple[float, float, int]] = deque()
        self._window_sum = 0.0
        self._window_count = 0

    def latest(self, node: str) -> Telemetry | None:
        return self._latest.get(node)

    def window_util(self, now: float) -> float | None:
        """Mean DCGM_FI_DEV_GPU_UTIL of the GPU readings taken in the ``window_s``
        seconds before ``now`` (None: none)."""
        self._forget_before(now - self.window_s)
        if not self._window_count:
            return None
        return max(0.0, self._window_sum / self._window_count)

    def _forget_before(self, start: float) -> None:
        while self._window and self._window[0][0] < start:
            _, summed, count = self._window.popleft()
            self._window_sum -= summed
            self._window_count -= count
        if not self._window:
            self._window_sum, self._window_count = 0.0, 0  # no rounding left over

    async def start(self, nc: Client) -> None:
        self._subscription = await nc.subscribe(subjects.ALL_TELEMETRY, cb=self._received)

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    async def _received(self, msg: Msg) -> None:
        try:
            sample = codec.decode(msg.data, Telemetry)
        except msgspec.MsgspecError as exc:
            log.debug("undecodable telemetry skipped", subject=msg.subject, error=str(exc))
            return
        if not subjects.matches_sender(msg.subject, sample.node):
            # the subject names the node that sent it; a sample claiming another is forged
            log.warning("telemetry claiming another node dropped", subject=msg.subject,
                        claimed_node=sample.node[:64])
            return
        known = self._latest.get(sample.node)
        if known is None or sample.at >= known.at:
            self._latest[sample.node] = sample
        if (known is None or sample.at > known.at) and sample.gpus:
            # a node whose clock runs ahead must not push the others' readings out
            at = min(sample.at, time.time())
            summed = sum(gpu.util for gpu in sample.gpus)
            self._window.append((at, summed, len(sample.gpus)))
            self._window_sum += summed
            self._window_count += len(sample.gpus)
            self._forget_before(at - self.window_s)  # bounded even when nobody asks
