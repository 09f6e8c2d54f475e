"""Prometheus metrics of one scheduler instance, in a registry of its own (several
instances, and several whole clusters in tests, may run in one process), and the small
HTTP endpoint that serves a registry: the scheduler's alone
(``GPUSCHED_SCHEDULER_METRICS_PORT``), or every service's together under ``gpusched up``
(:func:`combined`). Every series is listed in docs/metrics.md.

A job's pending reason is free text written by the policy that left it waiting; the
``reason`` label maps it onto the fixed vocabulary ``PENDING_REASONS`` (our own, see
:func:`pending_reason_label`), so the label has a bounded set of values whatever the
policies write.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from gpusched.libs.common import settings
from gpusched.libs.common.settings import Setting, load

if TYPE_CHECKING:
    from gpusched.libs.core.decision import Decision
    from gpusched.services.scheduler.live.state import LiveJob, LiveNode

#: the values of the ``reason`` label of ``gpusched_scheduler_pending_jobs``
PENDING_REASONS = (
    "waiting_for_gpus",
    "gang_does_not_fit",
    "memory",
    "host_resources",
    "policy_order",
    "quota",
    "deadline_hopeless",
    "unschedulable",
    "retry_backoff",
    "pending_decision",
    "no_nodes",
    "other",
)
#: the values of the ``input`` label of ``gpusched_scheduler_input_lag_seconds``
INPUTS = ("heartbeat", "progress", "durable")
#: the values of the ``kind`` label of ``gpusched_scheduler_reports_refused_total``
REPORT_KINDS = ("heartbeat", "progress", "exit")
#: the values of the ``state`` label of ``gpusched_scheduler_jobs_finished_total``
FINISHED_STATES = ("succeeded", "failed", "cancelled")

_DECISION_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# what live.py and admission write while a job waits for a decision (prefixes)
_UNDECIDED = (
    "waiting for the scheduler", "waiting for the next", "preempted", "requeued",
    "stopped on", "start failed", "resize failed", "starting", "submitted",
)
# a policy chose other jobs first, or its sharing rules said no
_POLICY = (
    "queue order", "priority queue", "higher-ranked", "best schedule found",
    "shortest queued jobs only", "would not lower mean completion",
    "max_resident_slowdown", "let go by a job that changes size",
)
_NEEDS = re.compile(r"needs (\d+) (?:idle )?gpus?(?:[;,] (\d+) idle)?")


def pending_reason_label(reason: str) -> str:
    """The ``reason`` label (one of ``PENDING_REASONS``) of a waiting job's free-text
    pending reason. Rules in order, first match wins:

    - ``no_nodes``: no node with GPUs has registered;
    - ``retry_backoff``: a failed job waits out its retry delay (``retry 1/3 in 2 s``);
    - ``pending_decision``: submitted, preempted, requeued or a start failed, and no
      round has explained it since;
    - ``unschedulable``: it can never run on this cluster (too many GPUs, too little
      memory even at its smallest sub-batch);
    - ``deadline_hopeless``: it can no longer meet its deadline (genie);
    - ``quota``: a quota holds it;
    - ``host_resources``: the CPUs or host memory it needs are not free (Synergy);
    - ``memory``: GPU memory rules out the GPUs it could use or share;
    - ``policy_order``: the policy gave the GPUs to other jobs (queue order, priority,
      a better schedule) or its sharing rules declined a partner;
    - ``waiting_for_gpus``: fewer GPUs are idle than it needs;
    - ``gang_does_not_fit``: enough GPUs are idle in all, but not where its GPUs can go
      together (one node's block, or a placement the policy accepts);
    - ``other``: anything else.
    """
    text = " ".join(reason.lower().split())
    if text.startswith("no nodes with gpus"):
        return "no_nodes"
    if re.match(r"retry \d+/\d+", text):
        return "retry_backoff"
    if not text or text.startswith(_UNDECIDED):
        return "pending_decision"
    if text.startswith("unschedulable"):
        return "unschedulable"
    if "deadline" in text:
        return "deadline_hopeless"
    if "quota" in text:
        return "quota"
    if re.search(r"\d+ cpus and [\d.]+ gb", text):
        return "host_resources"
    if "memory" in text:
        return "memory"
    if any(phrase in text for phrase in _POLICY):
        return "policy_order"
    needs = _NEEDS.search(text)
    if needs is not None and needs.group(2) is not None:
        needed, idle = int(needs.group(1)), int(needs.group(2))
        return "gang_does_not_fit" if idle >= needed else "waiting_for_gpus"
    if needs is not None or "gpus are busy" in text:
        return "waiting_for_gpus"
    return "other"


class SchedulerMetrics:
    """The series of one scheduler instance. The live scheduler calls the hooks below;
    the gauges of its picture (queue, GPUs, nodes) are set after every round and zeroed
    while the instance stands by."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decision_seconds = Histogram(
            "gpusched_scheduler_decision_duration_seconds",
            "Time to build the snapshot and run the policy, per decision",
            ["policy"], buckets=_DECISION_BUCKETS, registry=r,
        )
        self.decisions = Counter(
            "gpusched_scheduler_decisions",
            "Decisions taken, by policy and outcome (applied, or refused by the check)",
            ["policy", "outcome"], registry=r,
        )
        self.preemptions = Counter(
            "gpusched_scheduler_preemptions", "Preemptions in applied decisions", registry=r
        )
        self.resizes = Counter(
            "gpusched_scheduler_resizes", "Resizes in applied decisions", registry=r
        )
        self.jobs_started = Counter(
            "gpusched_scheduler_jobs_started",
            "Runs that went RUNNING (a start confirmed by its node; resizes not counted)",
            registry=r,
        )
        self.jobs_finished = Counter(
            "gpusched_scheduler_jobs_finished",
            "Jobs that reached a final state, by state", ["state"], registry=r,
        )
        self.input_lag = Histogram(
            "gpusched_scheduler_input_lag_seconds",
            "From an input's publication (its own timestamp, or JetStream's for durable "
            "inputs) to the scheduler handling it, by input",
            ["input"], buckets=_LAG_BUCKETS, registry=r,
        )
        self.reports_refused = Counter(
            "gpusched_scheduler_reports_refused",
            "Node reports dropped, by kind: one claiming another node or job than its "
            "subject names, or of a run its sender does not lead",
            ["kind"], registry=r,
        )
        self.leader = Gauge(
            "gpusched_scheduler_leader", "1 while this instance leads, else 0", registry=r
        )
        self.pending = Gauge(
            "gpusched_scheduler_pending_jobs",
            "Jobs waiting for GPUs, by pending reason (a fixed vocabulary)",
            ["reason"], registry=r,
        )
        self.running = Gauge(
            "gpusched_scheduler_running_jobs",
            "Jobs holding GPUs (starting, running or stopping)", registry=r,
        )
        self.nodes = Gauge("gpusched_scheduler_nodes", "Live nodes", registry=r)
        self.gpus = Gauge("gpusched_scheduler_gpus", "GPUs of the live nodes", registry=r)
        self.gpus_allocated = Gauge(
            "gpusched_scheduler_gpus_allocated", "GPUs holding at least one job", registry=r
        )
        self.gpus_shared = Gauge(
            "gpusched_scheduler_gpus_shared", "GPUs holding two or more jobs", registry=r
        )
        self.gpus_idle = Gauge(
            "gpusched_scheduler_gpus_idle", "GPUs of the live nodes holding no job", registry=r
        )
        # every labelled series exists from the start, at 0
        self._pending = {reason: self.pending.labels(reason) for reason in PENDING_REASONS}
        self._lag = {name: self.input_lag.labels(name) for name in INPUTS}
        self._finished = {state: self.jobs_finished.labels(state) for state in FINISHED_STATES}
        self._refused = {kind: self.reports_refused.labels(kind) for kind in REPORT_KINDS}

    # ---- hooks ----------------------------------------------------------------------
    def decided(self, policy: str, seconds: float, decision: Decision, refused: bool) -> None:
        self.decision_seconds.labels(policy).observe(seconds)
        self.decisions.labels(policy, "refused" if refused else "applied").inc()
        if not refused:
            self.preemptions.inc(len(decision.preemptions))
            self.resizes.inc(len(decision.resizes))

    def transitioned(self, state: str, reason: str) -> None:
        """A job's record changed state to ``state`` (a JobState value)."""
        name = state.lower()
        if name == "running" and reason == "started":
            self.jobs_started.inc()
        elif name in self._finished:
            self._finished[name].inc()

    def input_seen(self, kind: str, published_at: float) -> None:
        """An input of ``kind`` (one of ``INPUTS``) published at ``published_at`` (seconds
        since the epoch, 0: unknown) is being handled now."""
        if published_at > 0:
            self._lag[kind].observe(max(0.0, time.time() - published_at))

    def report_refused(self, kind: str) -> None:
        """A node's report of ``kind`` (one of ``REPORT_KINDS``) was dropped: it spoke for
        another node, or of a run its sender does not lead."""
        self._refused[kind].inc()

    def durable_seen(self, msg: Any) -> None:
        """A message of the jobs stream is being handled: its lag from JetStream's
        timestamp."""
        try:
            stamp = msg.metadata.timestamp
        except Exception:  # not a JetStream message (tests), or no metadata
            return
        self.input_seen("durable", stamp.timestamp() if hasattr(stamp, "timestamp") else 0.0)

    def leading(self, leads: bool) -> None:
        self.leader.set(1 if leads else 0)
        if not leads:
            self.observe({}, {})

    def observe(self, jobs: Mapping[str, LiveJob], nodes: Mapping[str, LiveNode]) -> None:
        """Set the picture's gauges from the scheduler's jobs and live nodes."""
        counts = dict.fromkeys(PENDING_REASONS, 0)
        running = 0
        held: dict[tuple[str, int], int] = {}
        for job in jobs.values():
            if not job.holds_gpus:
                counts[pending_reason_label(job.record.pending_reason)] += 1
                continue
            running += 1
            for part in job.record.placement:
                for gpu in part.gpus:
                    held[(part.node, gpu)] = held.get((part.node, gpu), 0) + 1
        for reason, child in self._pending.items():
            child.set(counts[reason])
        total = sum(len(node.info.gpus) for node in nodes.values())
        mine = [jobs_on for (node, _), jobs_on in held.items() if node in nodes]
        allocated = len(mine)
        self.running.set(running)
        self.nodes.set(len(nodes))
        self.gpus.set(total)
        self.gpus_allocated.set(allocated)
        self.gpus_shared.set(sum(1 for n in mine if n > 1))
        self.gpus_idle.set(max(0, total - allocated))


# ---- serving ------------------------------------------------------------------------


class _Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class Combined:
    """A collector that yields every family of ``sources`` (registries or collectors),
    families of one name from several sources merged into one: one exposition for the
    services of one process, each keeping its own registry."""

    def __init__(self, sources: Iterable[_Collector]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                else:
                    known.samples.extend(family.samples)
        yield from merged.values()


def combined(sources: Iterable[_Collector]) -> CollectorRegistry:
    """A registry of its own exposing every family of ``sources``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Combined(sources))
    return registry


class MetricsServer:
    """``async with MetricsServer(registry, host, port)``: ``GET /metrics`` serves the
    registry in Prometheus' text format until the block ends; port 0 takes a free one
    (``server.url`` says which)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        if isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535], got {port!r}")
        if not host:
            raise ValueError("metrics_host: must not be empty")
        self.registry = registry
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    async def __aenter__(self) -> MetricsServer:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        for address in self._runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


#: where a scheduler run alone serves its metrics: unset port, none served
ENVIRONMENT: dict[str, Setting[Any]] = {
    "port": Setting("GPUSCHED_SCHEDULER_METRICS_PORT", settings.integer(0, 65535)),
    "host": Setting("GPUSCHED_SCHEDULER_METRICS_HOST", settings.text()),
}
DEFAULT_METRICS_HOST = "0.0.0.0"


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(host, port) from ``GPUSCHED_SCHEDULER_METRICS_PORT`` and ``_HOST`` (default
    0.0.0.0), or None when no port is set. A bad value raises naming the variable."""
    values = load(ENVIRONMENT, environ)
    if "port" not in values:
        return None
    return values.get("host", DEFAULT_METRICS_HOST), values["port"]
