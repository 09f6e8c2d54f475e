"""The node's registration: its NodeInfo under its own key in the nodes bucket.

The agent writes it when it starts, again after a reconnect (the server may have lost
the entry, or the scheduler may have dropped the node) and until a write succeeds, and
deletes it when it stops. Both are the KV messages themselves, published into the
bucket's stream with the codec headers every message carries: the agent's NATS user may
not create, inspect or read a stream (libs/common/natsauth.py).
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import NodeInfo
from gpusched.services.nodeagent.exits import PUBLISH_TIMEOUT_S


class Registration:
    """One node's entry in the nodes bucket, and when to write it again."""

    def __init__(self, js: JetStreamContext, node: str, info: NodeInfo, log: Any) -> None:
        self._js = js
        self._node = node
        self._info = info
        self._log = log
        self.registered = False
        #: a write runs beside the actor, which learns its result as a message
        self.registering = False
        #: the connection's reconnect count when the entry was last due
        self.seen_reconnects = 0

    async def register(self) -> bool:
        try:
            # the same write as KeyValue.put, with the codec headers every message carries
            await self._js.publish(
                f"$KV.{subjects.NODES_BUCKET}.{self._node}",
                codec.encode(self._info),
                headers=codec.headers(),
                timeout=PUBLISH_TIMEOUT_S,
            )
        except Exception as exc:
            self._log.warning("registration failed; will retry", error=repr(exc))
            return False
        self._log.info("node registered")
        return True

    def due(self, nc: Client, closing: bool) -> bool:
        """Whether to register again now: after a reconnect, and until the first
        registration succeeds. True marks a write as under way until :meth:`written`."""
        reconnects = nc.stats["reconnects"]
        if self.registering or closing or not nc.is_connected:
            return False
        if self.registered and reconnects == self.seen_reconnects:
            return False
        self.seen_reconnects = reconnects
        self.registering = True
        return True

    def written(self, ok: bool) -> None:
        """The write that :meth:`due` started is over."""
        self.registering = False
        self.registered = ok

    async def deregister(self) -> None:
        try:
            # KeyValue.delete's message: a delete marker on its own key
            await self._js.publish(
                f"$KV.{subjects.NODES_BUCKET}.{self._node}",
                headers={"KV-Operation": "DEL"}, timeout=PUBLISH_TIMEOUT_S,
            )
            self._log.info("node deregistered")
        except Exception as exc:
            self._log.warning("deregistration failed", error=repr(exc))
