"""Prometheus metrics of one admission app, in a registry of its own (several apps may
run in one process). The ``tenant`` label takes only the tenants of the configuration
(its tokens and quotas), so its values are bounded. Every series is listed in
docs/metrics.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

#: the route label of requests that matched no route, so unknown paths add no series
UNMATCHED_ROUTE = "unmatched"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class Metrics:
    def __init__(self) -> None:
        #: labelled children by (method, route, status): label lookups cost more than
        #: the increments themselves on the request path
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        #: the submission counter's child by tenant, for the same reason
        self._submitted_by_tenant: dict[str, Any] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpusched_admission_requests_total",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "gpusched_admission_request_seconds",
            "Time to answer an HTTP request (server-sent event streams: until they end)",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.jobs_submitted = Counter(
            "gpusched_admission_jobs_submitted_total",
            "Jobs created (idempotent replays not counted), by tenant",
            ["tenant"],
            registry=self.registry,
        )
        self.idempotent_replays = Counter(
            "gpusched_admission_idempotent_replays_total",
            "Submissions answered with an existing job because of their Idempotency-Key",
            registry=self.registry,
        )
        self.cancels_requested = Counter(
            "gpusched_admission_cancels_requested_total",
            "Cancel requests passed on to the scheduler",
            registry=self.registry,
        )
        self.event_streams = Gauge(
            "gpusched_admission_event_streams",
            "Open server-sent event streams",
            registry=self.registry,
        )

    def watch_tenants(
        self, tenants: Iterable[str], quotas: Mapping[str, int],
        held_gpus: Callable[[str], int],
    ) -> None:
        """Count submissions of ``tenants`` (each from 0) and, at each scrape, give every
        tenant with a quota its GPUs held by unfinished jobs (``held_gpus``) against it."""
        for tenant in tenants:
            self.jobs_submitted.labels(tenant)
        self.registry.register(_QuotaCollector(dict(quotas), held_gpus))

    def submitted(self, tenant: str) -> None:
        child = self._submitted_by_tenant.get(tenant)
        if child is None:
            child = self._submitted_by_tenant[tenant] = self.jobs_submitted.labels(tenant)
        child.inc()

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(method, route, str(status)),
                self.request_seconds.labels(method, route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _QuotaCollector:
    """Quota use per tenant with a quota, read when scraped."""

    def __init__(self, quotas: Mapping[str, int], held_gpus: Callable[[str], int]) -> None:
        self._quotas = quotas
        self._held = held_gpus

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            "gpusched_admission_quota_gpus", "GPU quota, by tenant", labels=("tenant",)
        )
        used = GaugeMetricFamily(
            "gpusched_admission_quota_used_gpus",
            "GPUs asked for by the tenant's unfinished jobs, by tenant with a quota",
            labels=("tenant",),
        )
        ratio = GaugeMetricFamily(
            "gpusched_admission_quota_used_ratio",
            "GPUs asked for by the tenant's unfinished jobs over its quota, by tenant",
            labels=("tenant",),
        )
        for tenant, gpus in sorted(self._quotas.items()):
            held = self._held(tenant)
            limit.add_metric((tenant,), gpus)
            used.add_metric((tenant,), held)
            ratio.add_metric((tenant,), held / gpus if gpus else 0.0)
        yield limit
        yield used
        yield ratio
