"""Many emulated node agents in one process: ``gpusched up``, tests and benchmarks.

Every agent is a full :class:`NodeAgent` with its own subjects, registration and
timers; they share one NATS connection (unless asked not to), one ground-truth model
and one work directory, which then acts as the cluster's shared file system: a job
preempted on one node resumes from its checkpoint on another.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

from nats.aio.client import Client

from gpusched.libs.common.bus import connection
from gpusched.libs.core.groundtruth import ProfilePerformanceModel, load_performance_model
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import DEFAULT_EMULATED_GPUS


class EmulatedCluster:
    """``nodes`` agents named ``<prefix>-0`` .. ``<prefix>-<nodes-1>``, each configured
    like ``template`` (its name aside). Emulated GPUs always: a template without a GPU
    count gets ``DEFAULT_EMULATED_GPUS`` per node."""

    def __init__(
        self,
        template: NodeAgentConfig,
        nodes: int,
        *,
        prefix: str = "node",
        share_connection: bool = True,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes: must be an integer >= 1, got {nodes!r}")
        self.configs: list[NodeAgentConfig] = [
            dataclasses.replace(
                template,
                name=f"{prefix}-{i}",
                gpus=template.gpus or DEFAULT_EMULATED_GPUS,
            )
            for i in range(nodes)
        ]
        self.share_connection = share_connection
        self.agents: list[NodeAgent] = []
        self._stack = contextlib.AsyncExitStack()

    @classmethod
    def of(
        cls,
        nats_url: str,
        nodes: int,
        gpus_per_node: int = DEFAULT_EMULATED_GPUS,
        *,
        cpus_per_gpu: int = 4,
        host_mem_gb_per_gpu: float = 64.0,
        prefix: str = "node",
        share_connection: bool = True,
        **settings: object,
    ) -> EmulatedCluster:
        """A cluster of identical nodes; ``settings`` are further NodeAgentConfig fields
        (time_scale, jobs_mode, work_dir, heartbeat_s, ...)."""
        # every agent of this cluster runs on this host
        settings.setdefault("advertise_host", "127.0.0.1")
        template = NodeAgentConfig(
            nats_url=nats_url,
            name=f"{prefix}-0",
            gpus=gpus_per_node,
            cpus=cpus_per_gpu * gpus_per_node,
            host_mem_gb=host_mem_gb_per_gpu * gpus_per_node,
            **settings,  # type: ignore[arg-type]
        )
        return cls(template, nodes, prefix=prefix, share_connection=share_connection)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.configs]

    async def __aenter__(self) -> EmulatedCluster:
        try:
            await self._open()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _open(self) -> None:
        first = self.configs[0]
        truth: ProfilePerformanceModel = await asyncio.to_thread(
            load_performance_model, first.data_dir
        )
        nc: Client | None = None
        if self.share_connection:
            nc = await self._stack.enter_async_context(
                connection(first.nats_url, "nodeagent-cluster")
            )
        self.agents = [NodeAgent(config, nc=nc, truth=truth) for config in self.configs]
        entered = await asyncio.gather(
            *(agent.__aenter__() for agent in self.agents), return_exceptions=True
        )
        failures = [e for e in entered if isinstance(e, BaseException)]
        started = [a for a, e in zip(self.agents, entered, strict=True) if e is a]
        self._stack.push_async_callback(_close_all, started)
        if failures:
            raise failures[0]

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


async def _close_all(agents: Sequence[NodeAgent]) -> None:
    await asyncio.gather(*(agent.__aexit__(None, None, None) for agent in agents))
