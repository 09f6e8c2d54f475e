"""GPU quotas shared by every admission instance.

Each tenant with a quota has one entry in the ``gpusched_quota`` KV bucket: a ledger of
reservations, job id -> GPUs. A submission reserves its job's GPUs there before the job
record is written, and every change to a ledger is a compare-and-set (``create``, or
``update(last=revision)``, re-read and re-applied on a conflict), so two instances can
never both take the last free GPUs of a tenant.

A reservation is given back when the job finishes (every instance follows the job
records and releases the reservations of jobs that reach a terminal state), when the
submission fails after reserving, and by a periodic reconciliation against the job
records: a reservation whose job finished, or whose record still does not exist
``RESERVATION_GRACE_S`` after it was made (an instance died between reserving and
writing the record), is released; an unfinished job missing from its tenant's ledger is
entered into it.

Within one instance all changes to a tenant's ledger go through one worker, which
applies every request waiting in its queue with a single compare-and-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from gpusched.libs.common import subjects

log = structlog.get_logger("gpusched.admission")

QUOTA_BUCKET = subjects.QUOTA_BUCKET
#: how often each instance reconciles the ledgers against the job records
RECONCILE_S = 10.0
#: how long a reservation may wait for its job record before it counts as abandoned
RESERVATION_GRACE_S = 60.0
#: the most queued requests one compare-and-set applies
MAX_BATCH = 512
#: tenant names that are KV keys as they are; others are hex-encoded behind ``=``,
#: which no tenant name contains
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class Reservation(msgspec.Struct, frozen=True, array_like=True):
    gpus: int
    #: seconds since the epoch when it was made
    at: float


class Ledger(msgspec.Struct, frozen=True):
    """One tenant's reservations, by job id."""

    reservations: dict[str, Reservation] = {}

    @property
    def used(self) -> int:
        return sum(reservation.gpus for reservation in self.reservations.values())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Ledger)


class QuotaExceeded(Exception):
    def __init__(self, used: int) -> None:
        super().__init__(f"{used} GPUs in use")
        self.used = used


def ledger_key(tenant: str) -> str:
    if _PLAIN_KEY.match(tenant):
        return tenant
    return "=" + tenant.encode().hex()


async def open_bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(QUOTA_BUCKET)
    except Exception:
        return await js.create_key_value(
            KeyValueConfig(bucket=QUOTA_BUCKET, history=1, storage=StorageType.FILE)
        )


async def read_ledger(kv: KeyValue, tenant: str) -> tuple[int, Ledger]:
    """The tenant's ledger and its revision (0: there is none yet)."""
    try:
        entry = await kv.get(ledger_key(tenant))
    except KeyDeletedError as exc:
        deleted = exc.entry.revision if exc.entry is not None else None
        return deleted or 0, Ledger()
    except KeyNotFoundError:
        return 0, Ledger()
    if not entry.value:
        return entry.revision or 0, Ledger()
    try:
        return entry.revision or 0, _decoder.decode(entry.value)
    except msgspec.MsgspecError as exc:
        log.error("undecodable quota ledger replaced", tenant=tenant, error=str(exc))
        return entry.revision or 0, Ledger()


@dataclass
class _Change:
    """One request to a tenant's worker. ``kind``: ``reserve`` (within the quota),
    ``adopt`` (regardless of it) or ``release``. The result is, for a reserve, True
    when it added the reservation, False when the job held one already."""

    kind: str
    job_id: str
    gpus: int = 0
    at: float = 0.0
    done: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class TenantQuota:
    """The ledger of one tenant, changed only by its ``run`` worker."""

    def __init__(self, kv: KeyValue, tenant: str, quota: int) -> None:
        self.kv = kv
        self.tenant = tenant
        self.quota = quota
        self._key = ledger_key(tenant)
        self._queue: asyncio.Queue[_Change] = asyncio.Queue()
        #: the last ledger this instance read or wrote; None: not read yet
        self._revision: int | None = None
        self._ledger = Ledger()

    def submit(self, change: _Change) -> asyncio.Future[bool]:
        self._queue.put_nowait(change)
        return change.done

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                outcomes = await self._apply(batch)
            except Exception as exc:
                # the cache may be wrong now; the next batch reads the ledger again
                self._revision = None
                log.warning("quota ledger not changed", tenant=self.tenant, error=repr(exc))
                for change in batch:
                    if not change.done.done():
                        change.done.set_exception(exc)
                        # a release nobody waits for must not warn as never retrieved
                        change.done.exception()
                continue
            for change, outcome in zip(batch, outcomes, strict=True):
                if change.done.done():
                    continue
                if isinstance(outcome, QuotaExceeded):
                    change.done.set_exception(outcome)
                else:
                    change.done.set_result(outcome)

    async def _apply(self, batch: list[_Change]) -> list[bool | QuotaExceeded]:
        fresh = False
        if self._revision is None:
            await self._refresh()
            fresh = True
        while True:
            ledger, outcomes, changed, unsure = self._plan(batch)
            if changed:
                data = _encoder.encode(ledger)
                try:
                    if self._revision == 0:
                        revision = await self.kv.create(self._key, data)
                    else:
                        revision = await self.kv.update(self._key, data, last=self._revision)
                except KeyWrongLastSequenceError:
                    await self._refresh()
                    fresh = True
                    continue
                self._revision, self._ledger = revision, ledger
                return outcomes
            if unsure and not fresh:
                # a refusal or a release of an unknown job, decided on what this
                # instance saw last: decide again on the ledger as it is now
                await self._refresh()
                fresh = True
                continue
            return outcomes

    def _plan(
        self, batch: list[_Change]
    ) -> tuple[Ledger, list[bool | QuotaExceeded], bool, bool]:
        reservations = dict(self._ledger.reservations)
        used = sum(reservation.gpus for reservation in reservations.values())
        outcomes: list[bool | QuotaExceeded] = []
        changed = unsure = False
        for change in batch:
            held = reservations.get(change.job_id)
            if change.kind == "release":
                if held is None:
                    unsure = True
                else:
                    del reservations[change.job_id]
                    used -= held.gpus
                    changed = True
                outcomes.append(held is not None)
            elif held is not None:
                outcomes.append(False)
            elif change.kind == "reserve" and used + change.gpus > self.quota:
                outcomes.append(QuotaExceeded(used))
                unsure = True
            else:
                reservations[change.job_id] = Reservation(change.gpus, change.at)
                used += change.gpus
                changed = True
                outcomes.append(True)
        return Ledger(reservations), outcomes, changed, unsure

    async def _refresh(self) -> None:
        self._revision, self._ledger = await read_ledger(self.kv, self.tenant)


#: what reconciliation needs to know of a job: True unfinished, False finished, None no
#: record known
JobStatus = Callable[[str], bool | None]


class Quotas:
    """The shared ledgers of every tenant with a quota in this instance's settings."""

    def __init__(self, kv: KeyValue, quotas: Mapping[str, int]) -> None:
        self.kv = kv
        self._tenants = {tenant: TenantQuota(kv, tenant, gpus) for tenant, gpus in quotas.items()}

    def limit(self, tenant: str) -> int | None:
        quota = self._tenants.get(tenant)
        return quota.quota if quota is not None else None

    async def run(self) -> None:
        """The tenants' workers; cancel to stop."""
        await asyncio.gather(*(quota.run() for quota in self._tenants.values()))

    async def reserve(self, tenant: str, job_id: str, gpus: int) -> bool:
        """Reserve ``gpus`` for ``job_id``: True when reserved now, False when the job
        held a reservation already or the tenant has no quota. Raises QuotaExceeded."""
        quota = self._tenants.get(tenant)
        if quota is None:
            return False
        change = _Change("reserve", job_id, gpus, time.time())
        return await asyncio.shield(quota.submit(change))

    def release(self, tenant: str, job_id: str) -> asyncio.Future[bool] | None:
        """Give the job's reservation back. The release happens even when the caller
        does not wait for it; the future tells when (True: there was one to release)."""
        quota = self._tenants.get(tenant)
        if quota is None:
            return None
        return quota.submit(_Change("release", job_id))

    async def used(self, tenant: str) -> int:
        """GPUs reserved for the tenant now, read from the bucket."""
        return (await read_ledger(self.kv, tenant))[1].used

    async def reconcile(
        self,
        status: JobStatus,
        unfinished: Callable[[str], Mapping[str, int]],
        stored: Callable[[str], Awaitable[bool]],
    ) -> None:
        """Release the reservations of finished jobs and of jobs whose record never
        came; enter unfinished jobs the ledger misses. ``status`` and ``unfinished``
        read this instance's mirror of the job records; ``stored`` asks the bucket
        whether a record exists (the mirror may not have seen it yet)."""
        for tenant, quota in self._tenants.items():
            _, ledger = await read_ledger(self.kv, tenant)
            horizon = time.time() - RESERVATION_GRACE_S
            stale = []
            for job_id, reservation in ledger.reservations.items():
                known = status(job_id)
                if known is False or (
                    known is None and reservation.at < horizon and not await stored(job_id)
                ):
                    stale.append(job_id)
            missing = {
                job_id: gpus
                for job_id, gpus in unfinished(tenant).items()
                if job_id not in ledger.reservations
            }
            waits = [quota.submit(_Change("release", job_id)) for job_id in stale]
            waits += [
                quota.submit(_Change("adopt", job_id, gpus, time.time()))
                for job_id, gpus in missing.items()
            ]
            if stale or missing:
                log.info("quota ledger reconciled", tenant=tenant, released=len(stale),
                         entered=len(missing))
            for wait in waits:
                with contextlib.suppress(Exception):
                    await asyncio.shield(wait)
