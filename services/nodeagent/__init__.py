"""The node agent: one per GPU server (or many emulated ones in one process).

It registers the node, runs what the scheduler starts on it (simulated jobs, the torch
worker in ``gpusched.services.nodeagent.worker`` or a user's command), and reports heartbeats,
telemetry, progress and durable exits over NATS. See docs/nodeagent.md.

Public API: :class:`gpusched.services.nodeagent.config.NodeAgentConfig`,
:class:`gpusched.services.nodeagent.agent.NodeAgent` and
:class:`gpusched.services.nodeagent.cluster.EmulatedCluster`. This package imports nothing itself,
so that ``python -m gpusched.services.nodeagent.worker`` starts without loading the agent.
"""
