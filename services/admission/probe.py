"""What ``GET /healthz`` checks beyond the connection: that the store takes writes and
that a scheduler leads.

The store is probed with a write to admission's own bucket, of the size of a job record
and more (a full disk can still take a write that fits a page it has begun). Probes are
at most one per ``every_s``: health checks in between share the last answer, and
concurrent ones the probe in flight.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
from nats.js.kv import KeyValue

from gpusched.libs.common import codec
from gpusched.services.admission.leader import lapsed, lease_ttl_s, stored_lease

#: the probe's key in the quota bucket: no ledger key starts with "=" and a non-hex letter
PROBE_KEY = "=probe"
#: bytes written by each probe: more than a page, more than a job record
PROBE_BYTES = 4096
PROBE_EVERY_S = 2.0
#: a probe write not answered in this long counts as failed
PROBE_TIMEOUT_S = 2.0


class StoreProbe:
    def __init__(
        self, kv: KeyValue, every_s: float = PROBE_EVERY_S, timeout_s: float = PROBE_TIMEOUT_S
    ) -> None:
        self.kv = kv
        self.every_s = every_s
        self.timeout_s = timeout_s
        self._at = -float("inf")
        self._problem: str | None = None
        self._running: asyncio.Task[str | None] | None = None

    async def problem(self) -> str | None:
        """Why the store does not take writes now, or None when it does."""
        if time.monotonic() - self._at < self.every_s:
            return self._problem
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> str | None:
        value = codec.encode(time.time()) + b" " * PROBE_BYTES
        try:
            await asyncio.wait_for(self.kv.put(PROBE_KEY, value), self.timeout_s)
            problem = None
        except (TimeoutError, nats.errors.TimeoutError):
            problem = f"the store does not take writes: none answered within {self.timeout_s:g} s"
        except nats.errors.Error as exc:
            problem = f"the store does not take writes: {store_error(exc)}"
        self._at, self._problem = time.monotonic(), problem
        return problem


def store_error(exc: Exception) -> str:
    """A NATS or JetStream error as a person reads it."""
    description = getattr(exc, "description", None)
    return str(description) if description else type(exc).__name__


async def leader_problem(leases: KeyValue) -> str | None:
    """Why no scheduler leads now, or None when one holds a lease it renews."""
    lease = await stored_lease(leases)
    if lease is None:
        return "no scheduler holds the lease"
    if lapsed(lease, await lease_ttl_s(leases)):
        return (f"no scheduler leads: the lease of {lease.holder} was last renewed "
                f"{time.time() - lease.at:.0f} s ago")
    return None
