"""What the leading scheduler says about itself: its lease and its status endpoint."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import Lease

#: how long a status request may take; a leader that does not answer says nothing
STATUS_TIMEOUT_S = 1.0
#: a lease last renewed more than this many lease TTLs ago names no leader: its holder
#: renews it several times per TTL, and a store that cannot write may not expire the key
#: (the margin is for clocks that differ between machines)
STALE_TTLS = 2.0

log = structlog.get_logger("admission")


async def stored_lease(leases: KeyValue) -> Lease | None:
    """The scheduler lease as stored, renewed recently or not; None when there is none."""
    try:
        entry = await leases.get(subjects.SCHEDULER_LEASE_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    if entry.value is None:
        return None
    try:
        return codec.decode(entry.value, Lease)
    except msgspec.MsgspecError:
        return None


async def lease_ttl_s(leases: KeyValue) -> float | None:
    """The lease bucket's TTL (its entries' maximum age)."""
    return (await leases.status()).ttl


def lapsed(lease: Lease, ttl_s: float | None, now: float | None = None) -> bool:
    """Whether ``lease`` was last renewed too long ago to name a leader."""
    if not ttl_s:
        return False
    return (time.time() if now is None else now) - lease.at > STALE_TTLS * ttl_s


async def current_lease(leases: KeyValue) -> Lease | None:
    """The scheduler lease while it names a leader: None when there is none, or when it
    was last renewed more than STALE_TTLS TTLs ago."""
    lease = await stored_lease(leases)
    if lease is None or lapsed(lease, await lease_ttl_s(leases)):
        return None
    return lease


async def leader_status(nc: Client, leases: KeyValue) -> tuple[Lease | None, dict[str, Any]]:
    """The scheduler lease and what its holder's status endpoint answers ({} when it
    does not answer in time); (None, {}) when no scheduler leads: no lease, a lapsed
    one, or a holder that says it does not lead (its scheduler stopped)."""
    lease = await current_lease(leases)
    if lease is None:
        return None, {}
    try:
        reply = await nc.request(
            subjects.scheduler_status(lease.holder), b"", timeout=STATUS_TIMEOUT_S
        )
        status = json.loads(reply.data)
    except (nats.errors.Error, TimeoutError, ValueError) as exc:
        log.debug("scheduler status not answered", leader=lease.holder, error=repr(exc))
        return lease, {}
    if not isinstance(status, dict):
        return lease, {}
    if status.get("leader") is False:
        return None, {}
    return lease, status
