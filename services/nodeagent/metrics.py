"""Prometheus metrics of the node agents in this process (summed over the agents when
an emulated cluster runs many of them in one process), and each agent's GPU and job view
in the series NVIDIA's dcgm-exporter serves (:class:`NodeView`, :class:`NodeCollector`).
Every series is listed in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gpusched.libs.common.schemas import GpuInfo, GpuTelemetry


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

    def collect(self) -> Iterator[Metric]:
        """Every family of these series (to expose them beside other services' without
        the process-wide registry's own collectors)."""
        for metric in (
            self.commands, self.runs_started, self.runs_ended, self.running,
            self.exit_retries, self.exit_delivery_seconds, self.published,
        ):
            yield from metric.collect()


#: the labels dcgm-exporter gives every GPU series, in its own spelling
DCGM_LABELS = ("gpu", "UUID", "Hostname", "modelName")
#: dcgm-exporter's field names: (series, help, GpuTelemetry attribute)
DCGM_FIELDS = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "fb_free_mib"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp_c"),
)
#: readings NVML gives as 0 where a board does not measure them: left out then
_UNKNOWN_WHEN_ZERO = frozenset({"power_w", "temp_c"})


@dataclass(frozen=True, slots=True)
class JobReading:
    """A job's progress as the node running its leader part last reported it."""

    iteration: int
    total: int
    at: float

    @property
    def ratio(self) -> float:
        return min(1.0, self.iteration / self.total) if self.total > 0 else 0.0


class NodeView:
    """What one agent exports: its GPUs' last telemetry and its jobs' progress. Each is
    replaced whole, never changed in place, so a scrape from another thread reads one
    consistent picture."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        #: (labels in DCGM_LABELS order, reading) per GPU, as of the last telemetry
        self.gpus: tuple[tuple[tuple[str, str, str, str], GpuTelemetry], ...] = ()
        self.jobs: Mapping[str, JobReading] = {}

    def update(
        self, gpus: Collection[GpuInfo], emulated: bool, readings: Iterable[GpuTelemetry],
        jobs: Mapping[str, JobReading],
    ) -> None:
        """The agent's telemetry tick: its GPUs (``emulated`` ones are named "Emulated
        <model>"), their readings, and the progress of the jobs it leads."""
        models = {g.index: (f"Emulated {g.model}" if emulated else g.model) for g in gpus}
        self.gpus = tuple(
            ((str(r.index), r.uuid, self.hostname, models.get(r.index, "")), r)
            for r in readings
        )
        self.jobs = dict(jobs)

    def forget_job(self, job_id: str) -> None:
        """The job's run here ended: its series go at once."""
        if job_id in self.jobs:
            self.jobs = {k: v for k, v in self.jobs.items() if k != job_id}

    def clear(self) -> None:
        self.gpus, self.jobs = (), {}


class NodeCollector:
    """A collector yielding the DCGM series of every GPU and the progress of every job
    of the views ``views()`` returns when scraped (the agents running then)."""

    def __init__(self, views: Callable[[], Iterable[NodeView]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Metric]:
        views = list(self._views())
        for name, doc, attribute in DCGM_FIELDS:
            family = GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
            for view in views:
                for labels, reading in view.gpus:
                    value = float(getattr(reading, attribute))
                    if value == 0.0 and attribute in _UNKNOWN_WHEN_ZERO:
                        continue
                    family.add_metric(labels, value)
            yield family
        # a job between two nodes (a move, a resize) may be on both for a moment: the
        # latest reading wins, so that each job has one series
        jobs: dict[str, JobReading] = {}
        for view in views:
            for job_id, job in view.jobs.items():
                known = jobs.get(job_id)
                if known is None or job.at > known.at:
                    jobs[job_id] = job
        ratio = GaugeMetricFamily(
            "gpusched_job_progress_ratio",
            "Iterations done over the job's total, by job (running jobs only)",
            labels=("job",),
        )
        done = GaugeMetricFamily(
            "gpusched_job_iterations_done",
            "Iterations the job has done, by job (running jobs only)",
            labels=("job",),
        )
        for job_id, job in sorted(jobs.items()):
            ratio.add_metric((job_id,), job.ratio)
            done.add_metric((job_id,), float(job.iteration))
        yield ratio
        yield done


_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The process-wide metrics, created on first use."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics
