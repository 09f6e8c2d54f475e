"""The node registry: the live scheduler's reads of node registrations in KV.

A node agent registers under its own name, the only key its NATS user may write; a
registration that names another node is dropped here, so the actor only ever sees
registrations that speak for the key they were stored under.
"""

from __future__ import annotations

import structlog
from nats.js.errors import KeyNotFoundError

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import NodeInfo

log = structlog.get_logger("gpusched.scheduler")


class NodeRegistry:
    """Registrations over the scheduler's ``Stores`` (read at the time of each call)."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores

    async def names(self) -> list[str]:
        """The names of the registered nodes."""
        return await self.stores.node_names()

    async def registration(self, name: str) -> NodeInfo | None:
        """The node's registration; None when it has none, or one naming another node."""
        try:
            entry = await self.stores.nodes.get(name)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return registration(name, codec.decode(entry.value, NodeInfo))


def registration(key: str, info: NodeInfo) -> NodeInfo | None:
    """A node's registration, stored under its own key (the only one its user may
    write); one naming another node is dropped."""
    if info.name == key:
        return info
    log.warning("registration naming another node dropped", key=key,
                claimed_node=info.name[:64])
    return None
