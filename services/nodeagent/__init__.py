"""The node agent: one per GPU server (or many emulated ones in one process).

It registers the node, runs what the scheduler starts on it (simulated jobs, the torch
worker in ``services.nodeagent.worker`` or a user's command), and reports heartbeats,
telemetry, progress and durable exits over NATS. See docs/nodeagent.md.

Public API: :class:`services.nodeagent.config.NodeAgentConfig`,
:class:`services.nodeagent.agent.NodeAgent` and
:class:`services.nodeagent.cluster.EmulatedCluster`. This package imports nothing itself,
so that ``python -m services.nodeagent.worker`` starts without loading the agent.
"""
