"""Leader election through a KV key: ``create`` wins it, ``update(last=rev)`` keeps it.

The lease bucket has a TTL, so a leader that dies stops renewing and its key expires;
a standby's ``create`` then succeeds and it takes over. A write whose answer was lost (a
timeout) may still have been stored: a key that names this holder is its own, and is
taken back at the revision stored rather than waited out.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import Lease

log = structlog.get_logger("gpusched.lease")


class LeaderLease:
    def __init__(self, bucket: KeyValue, holder: str, ttl_s: float) -> None:
        self.bucket = bucket
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = subjects.SCHEDULER_LEASE_KEY
        self._revision: int | None = None
        self._renewed_at = 0.0

    @property
    def held(self) -> bool:
        return self._revision is not None

    def _value(self) -> bytes:
        return codec.encode(Lease(holder=self.holder, at=time.time()))

    async def try_acquire(self) -> bool:
        try:
            try:
                self._revision = await self.bucket.create(self.key, self._value())
            except KeyWrongLastSequenceError:
                # held: by another instance, or still by this one (it led before and
                # its last renewal was stored though it saw it fail)
                revision = await self._own_revision() if self._renewed_at else None
                if revision is None:
                    return False
                self._revision = await self.bucket.update(
                    self.key, self._value(), last=revision
                )
        except Exception as exc:
            log.debug("lease acquire failed", error=str(exc))
            self._revision = None
            return False
        self._renewed_at = time.monotonic()
        log.info("leadership acquired", holder=self.holder)
        return True

    async def _own_revision(self) -> int | None:
        """The revision of the stored lease when it names this holder, else None."""
        entry = await self.bucket.get(self.key)
        if not entry.value or entry.revision is None:
            return None
        lease = codec.decode(entry.value, Lease)
        return entry.revision if lease.holder == self.holder else None

    async def renew(self) -> bool:
        """Keep the lease; False once it is lost (taken, or unrenewed for a whole TTL)."""
        if self._revision is None:
            return False
        try:
            self._revision = await self.bucket.update(
                self.key, self._value(), last=self._revision
            )
            self._renewed_at = time.monotonic()
            return True
        except KeyWrongLastSequenceError:
            if await self._retake():
                return True
            log.warning("leadership lost: lease taken", holder=self.holder)
        except Exception as exc:
            # NATS unreachable: we still lead until the lease could have lapsed
            if time.monotonic() - self._renewed_at < self.ttl_s * 0.8:
                log.warning("lease renew failed; retrying", error=str(exc))
                return True
            log.warning("leadership lost: lease could not be renewed", error=str(exc))
        self._revision = None
        return False

    async def _retake(self) -> bool:
        """After a conflict: whether the stored lease is still this holder's (an earlier
        renewal was stored though its answer was lost), now renewed at its revision."""
        try:
            revision = await self._own_revision()
            if revision is None:
                return False
            self._revision = await self.bucket.update(self.key, self._value(), last=revision)
        except Exception as exc:
            log.debug("lease not taken back", error=str(exc))
            return False
        self._renewed_at = time.monotonic()
        return True

    async def release(self) -> None:
        if self._revision is None:
            return
        try:
            await asyncio.wait_for(self.bucket.delete(self.key, last=self._revision), 2)
            log.info("leadership released", holder=self.holder)
        except Exception as exc:
            log.debug("lease release failed", error=str(exc))
        self._revision = None

