"""The predictor's Prometheus metrics (docs/metrics.md) and the HTTP server that serves
them with a health check."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.exposition import generate_latest

from gpusched.libs.common.schemas import SizeErrorReport

#: the size forest's error shares, as the label ``within`` of its gauge
WITHIN = (("0.1", "within_10"), ("0.25", "within_25"), ("0.5", "within_50"))


class PredictorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpusched_predictor_requests_total",
            "Prediction requests answered, by endpoint and reply code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "gpusched_predictor_request_seconds",
            "Time to answer a prediction request",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5),
        )
        self.observations = Counter(
            "gpusched_predictor_observations_total",
            "Messages learned from, by kind (progress, completion) and result "
            "(learned, ignored, invalid)",
            ["kind", "result"],
            registry=self.registry,
        )
        self.size_mape = Gauge(
            "gpusched_predictor_size_mape_ratio",
            "Mean absolute percentage error of the iterations predicted at submission, "
            "over the newest scored jobs (NaN before any)",
            registry=self.registry,
        )
        self.size_within = Gauge(
            "gpusched_predictor_size_within_ratio",
            "Share of scored jobs whose iterations predicted at submission were within "
            "`within` of the truth (NaN before any)",
            ["within"],
            registry=self.registry,
        )
        self.size_scored = Gauge(
            "gpusched_predictor_size_scored_jobs",
            "Finished jobs the size error figures are taken over",
            registry=self.registry,
        )
        self.size_errors(SizeErrorReport())

    def size_errors(self, report: SizeErrorReport) -> None:
        nan = float("nan")
        self.size_mape.set(nan if report.mape is None else report.mape)
        for label, field in WITHIN:
            share = getattr(report, field)
            self.size_within.labels(label).set(nan if share is None else share)
        self.size_scored.set(report.scored_jobs)

    def text(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(
    host: str, port: int, text: Callable[[], bytes], connected: Callable[[], bool]
) -> web.AppRunner:
    """``/metrics`` (``text()``) and ``/healthz`` (503 while not ``connected()``) on
    ``host:port``; the runner to clean up."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        up = connected()
        return web.json_response({"nats": up}, status=200 if up else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
