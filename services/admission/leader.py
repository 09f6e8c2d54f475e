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
    status = await _ask(nc, lease)
    if status.get("leader") is False:
        return None, {}
    return lease, status


async def _ask(nc: Client, lease: Lease) -> dict[str, Any]:
    """What the lease's holder's status endpoint answers; {} when it does not in time."""
    try:
        reply = await nc.request(
            subjects.scheduler_status(lease.holder), b"", timeout=STATUS_TIMEOUT_S
        )
        status = json.loads(reply.data)
    except (nats.errors.Error, TimeoutError, ValueError) as exc:
        log.debug("scheduler status not answered", leader=lease.holder, error=repr(exc))
        return {}
    return status if isinstance(status, dict) else {}


class LeaderPolicy:
    """Whether the leading scheduler's policy honours priorities, asked of the leader
    once per term rather than on every submission that has a priority.

    A scheduler's policy is fixed for as long as it leads, so its answer holds while the
    stored lease names the same holder in the same term. Each question still reads the
    lease (one KV read; the bucket's TTL is read once, a bucket's TTL is set when it is
    made), and a lease that names another holder, none, or a lapsed one forgets the
    answer. A holder that stopped and leads again may run another policy: it can only
    create the lease again after its last renewal expired, a TTL or more earlier, while
    renewals of one term follow each other within a TTL, so a lease renewed a TTL or
    more after the one last seen starts a new term and the leader is asked again."""

    def __init__(self, nc: Client, leases: KeyValue) -> None:
        self._nc = nc
        self._leases = leases
        self._ttl_s: float | None = None
        #: the holder whose answer is kept, and when the lease last seen was renewed
        self._term: tuple[str, float] | None = None
        self._honours: bool | None = None
        self._policy: str | None = None

    async def honours_priority(self) -> tuple[bool | None, str | None]:
        """(True or False as the leader says, its policy's name) or (None, None) where
        no scheduler leads or the leader did not answer."""
        lease = await stored_lease(self._leases)
        if self._ttl_s is None:
            self._ttl_s = await lease_ttl_s(self._leases) or 0.0
        if lease is None or lapsed(lease, self._ttl_s):
            self._forget()
            return None, None
        if self._honours is not None and self._same_term(lease):
            self._term = (lease.holder, lease.at)
            return self._honours, self._policy
        self._forget()
        status = await _ask(self._nc, lease)
        honours = status.get("honours_priority")
        policy = status.get("policy")
        if not isinstance(honours, bool) or status.get("leader") is False:
            return None, None
        self._term, self._honours = (lease.holder, lease.at), honours
        self._policy = str(policy)
        return honours, self._policy

    def _same_term(self, lease: Lease) -> bool:
        if self._term is None:
            return False
        holder, seen_at = self._term
        ttl_s = self._ttl_s or 0.0
        return lease.holder == holder and (not ttl_s or lease.at - seen_at < ttl_s)

    def _forget(self) -> None:
        self._term, self._honours, self._policy = None, None, None
