"""Prometheus metrics of the node agents in this process (summed over the agents when
an emulated cluster runs many of them in one process)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.commands = Counter(
            "gpusched_nodeagent_commands_total",
            "Commands answered, by command and result (ok or refused)",
            ["command", "result"],
            registry=registry,
        )
        self.runs_started = Counter(
            "gpusched_nodeagent_runs_started_total",
            "Runs started, by kind (simulated, process, held)",
            ["kind"],
            registry=registry,
        )
        self.runs_ended = Counter(
            "gpusched_nodeagent_runs_ended_total",
            "Runs ended, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.running = Gauge(
            "gpusched_nodeagent_running_runs", "Runs holding GPUs now", registry=registry
        )
        self.exit_retries = Counter(
            "gpusched_nodeagent_exit_publish_retries_total",
            "Failed attempts to publish a JobExit into JetStream (each is retried)",
            registry=registry,
        )
        self.exit_delivery_seconds = Histogram(
            "gpusched_nodeagent_exit_delivery_seconds",
            "From a run's end to its JobExit stored in JetStream",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )
        self.published = Counter(
            "gpusched_nodeagent_messages_published_total",
            "Heartbeats, telemetry samples and progress events sent, by kind",
            ["kind"],
            registry=registry,
        )


_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The process-wide metrics, created on first use."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics
