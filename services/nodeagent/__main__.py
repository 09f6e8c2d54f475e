"""``python -m gpusched.services.nodeagent [--nodes N]``: run a node agent (or N emulated ones,
named ``<name>-0`` .. ``<name>-<N-1>``) until SIGINT or SIGTERM, with its settings from
the environment (see ``gpusched.services.nodeagent.config.ENVIRONMENT``). On the signal, running
jobs are preempted so that they checkpoint, their exits are delivered, and the node
deregisters."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from prometheus_client import REGISTRY, start_http_server

from gpusched.libs.common.logging import configure_logging
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.metrics import NodeCollector


async def serve(config: NodeAgentConfig, nodes: int = 1) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    service: NodeAgent | EmulatedCluster = (
        NodeAgent(config) if nodes == 1 else EmulatedCluster(config, nodes, prefix=config.name)
    )
    async with contextlib.AsyncExitStack() as stack:
        if config.metrics_port is not None:
            # the agents' GPU and job series beside the process-wide ones
            collector = NodeCollector(lambda: [
                agent.view
                for agent in ([service] if isinstance(service, NodeAgent) else service.agents)
            ])
            REGISTRY.register(collector)
            stack.callback(REGISTRY.unregister, collector)
            start_http_server(config.metrics_port)
        await stack.enter_async_context(service)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpusched.services.nodeagent", description=__doc__
    )
    parser.add_argument(
        "--nodes", type=int, default=1,
        help="emulate this many nodes in one process (default 1: this node)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes: must be >= 1")
    configure_logging()
    try:
        config = NodeAgentConfig.from_env()
    except ValueError as exc:
        sys.exit(f"node agent: {exc}")
    asyncio.run(serve(config, args.nodes))


if __name__ == "__main__":
    main()
