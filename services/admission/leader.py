"""What the leading scheduler says about itself: its lease and its status endpoint."""

from __future__ import annotations

import json
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

log = structlog.get_logger("admission")


async def leader_status(nc: Client, leases: KeyValue) -> tuple[Lease | None, dict[str, Any]]:
    """The scheduler lease and what its holder's status endpoint answers ({} when it
    does not answer in time); (None, {}) when no scheduler holds the lease."""
    try:
        entry = await leases.get(subjects.SCHEDULER_LEASE_KEY)
    except (KeyNotFoundError, KeyDeletedError):
        return None, {}
    if entry.value is None:
        return None, {}
    try:
        lease = codec.decode(entry.value, Lease)
    except msgspec.MsgspecError:
        return None, {}
    try:
        reply = await nc.request(
            subjects.scheduler_status(lease.holder), b"", timeout=STATUS_TIMEOUT_S
        )
        status = json.loads(reply.data)
    except (nats.errors.Error, TimeoutError, ValueError) as exc:
        log.debug("scheduler status not answered", leader=lease.holder, error=repr(exc))
        return lease, {}
    return lease, status if isinstance(status, dict) else {}
