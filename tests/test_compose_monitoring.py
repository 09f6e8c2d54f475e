"""compose fit for real use: health checks that probe the running services, a stop grace
that lets node agents checkpoint, versioned CPU and CUDA images, no root, and the
monitoring profile (Prometheus scraping every service, Grafana's dashboard querying
series the code exports)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from gpusched.libs.common.embedded import NatsServer, free_port
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.metrics import Metrics as AdmissionMetrics
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.metrics import Metrics as NodeAgentMetrics
from gpusched.services.nodeagent.metrics import NodeCollector
from gpusched.services.nodeagent.runs import STDERR_DRAIN_S
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.scheduler.live.metrics import SchedulerMetrics, endpoint_from_env
from tests.test_compose import _VARIABLE, SECRETS, interpolate, is_gpusched, load

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def services() -> dict[str, Any]:
    found = load("compose.yaml")["services"]
    assert isinstance(found, dict)
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment as compose gives it with every secret set."""
    return {k: interpolate(v, SECRETS) for k, v in (service.get("environment") or {}).items()}


def kind(service: dict[str, Any]) -> str:
    return str(service["command"][2])


def seconds(duration: str) -> float:
    """A compose duration such as ``2m30s`` or ``120s`` in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# ------------------------------------------------------------------ files and docker


def test_both_compose_files_parse_and_the_monitoring_profile_holds_prometheus_and_grafana():
    base, gpu = load("compose.yaml"), load("compose.gpu.yaml")
    assert set(gpu["services"]) <= set(base["services"])
    profiled = {n for n, s in base["services"].items() if "monitoring" in s.get("profiles", [])}
    assert profiled == {"prometheus", "grafana"}
    for name in profiled:
        image = base["services"][name]["image"]
        repository, _, tag = image.partition(":")
        assert repository in ("prom/prometheus", "grafana/grafana"), image
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin a release, not {tag!r}"


def test_docker_compose_accepts_both_files_with_the_monitoring_profile():
    docker = shutil.which("docker")
    reason = "docker is not installed"
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True,
                               check=False)  # fmt: skip
        reason = f"docker compose is unavailable: {(probe.stderr or probe.stdout).strip()}"
        if probe.returncode == 0:
            reason = ""
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    assert docker is not None
    for files in (["-f", "compose.yaml"], ["-f", "compose.yaml", "-f", "compose.gpu.yaml"]):
        done = subprocess.run(
            [docker, "compose", *files, "--profile", "monitoring", "config", "-q"],
            cwd=ROOT, env={"PATH": "/usr/bin:/bin", **SECRETS}, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------ fit for real use


def test_every_service_has_a_health_check_that_runs_a_command():
    for name, service in services().items():
        check = service.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert check["test"][0] == "CMD" and len(check["test"]) > 1, name
        assert seconds(check["interval"]) > 0 and check["retries"] >= 1, name


def test_the_gpusched_services_check_their_heartbeat_and_admission_its_healthz():
    for name, service in services().items():
        if not is_gpusched(service):
            continue
        test = service["healthcheck"]["test"]
        if kind(service) == "admission":
            port = AdmissionConfig.from_env(environment(service)).port
            assert f"http://127.0.0.1:{port}/healthz" in test[-1], name
        else:
            assert test[1:4] == ["python", "-m", "gpusched.libs.common.health"], name
            assert environment(service)["GPUSCHED_HEALTH_FILE"], name


def test_node_agents_are_given_longer_to_stop_than_their_runs_take_to_checkpoint():
    agents = {n: s for n, s in services().items() if is_gpusched(s) and kind(s) == "nodeagent"}
    assert agents
    for name, agent in agents.items():
        config = NodeAgentConfig.from_env(environment(agent))
        # on SIGTERM: runs get preempt_grace_s to checkpoint (and their stderr drained),
        # then undelivered exits are retried for exit_flush_s
        shutdown = config.preempt_grace_s + STDERR_DRAIN_S + config.exit_flush_s
        grace = seconds(agent["stop_grace_period"])
        assert grace >= shutdown + 10, f"{name}: {grace} s to stop, shutdown takes {shutdown} s"


def test_the_cpu_and_cuda_images_carry_the_version_and_their_kind():
    base = services()
    for name, service in base.items():
        if is_gpusched(service):
            assert service["image"] == f"gpusched:{VERSION}-cpu", name
    for name, service in load("compose.gpu.yaml")["services"].items():
        assert service["image"] == f"gpusched:{VERSION}-cuda", name
        assert "/whl/cu" in service["build"]["args"]["TORCH_INDEX"], name
        assert service["build"]["context"] == "."


#: what a node agent keeps as root: it starts jobs as the image's unprivileged job user
#: (docs/security.md, Job processes), hands them their directory and reads and signals them
NODE_AGENT_CAPABILITIES = {"SETUID", "SETGID", "CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL"}


def test_no_service_runs_as_root_or_privileged_but_node_agents_with_few_capabilities():
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] == "gpusched"
    base = services()
    for compose in ("compose.yaml", "compose.gpu.yaml"):
        for name, service in load(compose)["services"].items():
            assert not service.get("privileged"), f"{compose}: {name} is privileged"
            if not name.startswith("nodeagent-"):
                assert "user" not in service, f"{compose}: {name} overrides the user"
                continue
            merged = {**base[name], **service}
            assert merged.get("user") == "root", name
            assert merged["cap_drop"] == ["ALL"], name
            assert set(merged["cap_add"]) == NODE_AGENT_CAPABILITIES, name
            assert base[name]["environment"]["GPUSCHED_JOB_USER"] == "gpusched-job", name
    assert "useradd --system --no-create-home" in "\n".join(dockerfile)


# ------------------------------------------------------------------ health, for real


def _health_command(service: dict[str, Any], port: int | None = None) -> list[str]:
    """The service's compose health check as this machine runs it."""
    test = [sys.executable if word == "python" else word
            for word in service["healthcheck"]["test"][1:]]  # fmt: skip
    return [word.replace(":8080/", f":{port}/") for word in test] if port else test


def _check(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip


def _wait(done: Any, what: str, limit_s: float, process: subprocess.Popen[str]) -> None:
    started = time.monotonic()
    while not done():
        if process.poll() is not None:
            raise AssertionError(f"the service exited ({process.returncode}) before {what}")
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"no {what} within {limit_s} s")
        time.sleep(0.1)


def _service_env(tmp_path: Path, nats_url: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": nats_url,
        "GPUSCHED_HEALTH_FILE": str(tmp_path / "health"), "GPUSCHED_HEALTH_EVERY_S": "0.2",
        **extra,
    }  # fmt: skip


#: a service starts in a few seconds here (imports, NATS, its streams); a wide margin
START_LIMIT_S = 120.0


def test_a_schedulers_health_check_passes_while_it_is_connected_and_fails_once_nats_is_gone(
    tmp_path: Path,
):
    service = services()["scheduler"]
    nats = NatsServer(store_dir=tmp_path / "nats").start()
    env = _service_env(tmp_path, nats.url, {"GPUSCHED_POLICY": "fifo"})
    command = _health_command(service)
    assert _check(command, env).returncode == 1  # not started yet: no heartbeat
    process = subprocess.Popen([sys.executable, "-m", "gpusched.services.cli.main", "service",
                                "scheduler"], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _wait(lambda: _check(command, env).returncode == 0, "healthy check", START_LIMIT_S,
              process)  # fmt: skip
        health = tmp_path / "health"
        nats.stop()
        # beats stop once the client sees NATS gone: the file stays as it was
        stopped_at: list[float] = []

        def still() -> bool:
            written = health.stat().st_mtime
            if not stopped_at or stopped_at[0] != written:
                stopped_at[:] = [written, time.time()]
                return False
            return time.time() - stopped_at[1] > 2.0  # ten beats missed

        _wait(still, "pause of the heartbeat", START_LIMIT_S, process)
        stale = _check([*command[:-1], "1"], env)  # --max-age 1
        assert stale.returncode == 1 and "NATS lost" in stale.stderr, stale
        assert process.poll() is None, "the scheduler keeps running, reconnecting"
    finally:
        process.terminate()
        process.communicate(timeout=60)
        nats.stop()


def test_admissions_health_check_asks_healthz_which_fails_without_a_scheduler_or_nats(
    tmp_path: Path,
):
    service = services()["admission"]
    nats = NatsServer(store_dir=tmp_path / "nats").start()
    port = free_port()
    env = _service_env(tmp_path, nats.url, {
        "GPUSCHED_HTTP_HOST": "127.0.0.1", "GPUSCHED_HTTP_PORT": str(port),
        "GPUSCHED_TOKENS": "t0ken=default",
    })  # fmt: skip
    command = _health_command(service, port)
    process = subprocess.Popen([sys.executable, "-m", "gpusched.services.cli.main", "service",
                                "admission"], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    scheduler: subprocess.Popen[str] | None = None
    try:
        # connected, but no scheduler leads: degraded
        _wait(lambda: "503" in _check(command, env).stderr, "degraded check", START_LIMIT_S,
              process)  # fmt: skip
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "gpusched.services.cli.main", "service", "scheduler"],
            cwd=tmp_path, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**env, "GPUSCHED_POLICY": "fifo",
                 "GPUSCHED_HEALTH_FILE": str(tmp_path / "scheduler-health")},
        )  # fmt: skip
        _wait(lambda: _check(command, env).returncode == 0, "healthy check", START_LIMIT_S,
              process)  # fmt: skip
        nats.stop()
        _wait(lambda: _check(command, env).returncode != 0, "failing check", START_LIMIT_S,
              process)  # fmt: skip
        assert "503" in _check(command, env).stderr
    finally:
        for running in (process, scheduler):
            if running is not None:
                running.terminate()
                running.communicate(timeout=60)
        nats.stop()


# ------------------------------------------------------------------ monitoring


def _metrics_port(service: dict[str, Any]) -> int | None:
    """The port the service serves Prometheus metrics on, read as the service reads it."""
    env = environment(service)
    match kind(service):
        case "admission":
            return AdmissionConfig.from_env(env).port
        case "scheduler":
            endpoint = endpoint_from_env(env)
            return endpoint[1] if endpoint else None
        case "predictor":
            return PredictorConfig.from_env(env).metrics_port
        case _:
            return NodeAgentConfig.from_env(env).metrics_port


def test_prometheus_scrapes_every_gpusched_service_where_it_serves_metrics():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    scraped: dict[str, str] = {}
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                scraped[target] = job.get("metrics_path", "/metrics")
    expected = set()
    for name, service in services().items():
        if is_gpusched(service):
            port = _metrics_port(service)
            assert port, f"{name} serves no metrics"
            expected.add(f"{name}:{port}")
    assert expected <= set(scraped)
    assert set(scraped) - expected == {"localhost:9090"}  # Prometheus itself
    assert set(scraped.values()) == {"/metrics"}
    prometheus = services()["prometheus"]
    assert "./monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def _sample_names(family: Metric) -> set[str]:
    """The names a family's samples have on /metrics."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }.get(family.type, ("",))
    return {family.name + suffix for suffix in suffixes}


def exported_series() -> set[str]:
    """Every series name the services register (their registries, collected empty)."""
    agents = CollectorRegistry()
    NodeAgentMetrics(agents)
    families = [
        *AdmissionMetrics().registry.collect(),
        *SchedulerMetrics().registry.collect(),
        *agents.collect(),
        *NodeCollector(lambda: []).collect(),
    ]
    return {name for family in families for name in _sample_names(family)}


def dashboard() -> dict[str, Any]:
    document = json.loads((MONITORING / "grafana/dashboards/gpusched.json").read_text())
    assert isinstance(document, dict)
    return document


def test_the_dashboard_queries_only_series_the_services_export():
    exported = exported_series()
    queries = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    assert queries
    used = set()
    for query in queries:
        names = set(re.findall(r"\b(?:gpusched_\w+|DCGM_FI_\w+)", query))
        assert names, f"no gpusched series in {query!r}"
        used |= names
    assert used <= exported, f"not exported: {sorted(used - exported)}"


_DECISIONS = "sum by (le) (rate(gpusched_scheduler_decision_duration_seconds_bucket"


def test_the_dashboard_shows_queue_gpus_decision_time_gpu_telemetry_and_submissions():
    queries = " ".join(t["expr"] for p in dashboard()["panels"] for t in p.get("targets", []))
    for wanted in (
        "sum by (reason) (gpusched_scheduler_pending_jobs)",
        "gpusched_scheduler_gpus_allocated", "gpusched_scheduler_gpus_shared",
        "gpusched_scheduler_gpus_idle",
        f"histogram_quantile(0.5, {_DECISIONS}", f"histogram_quantile(0.99, {_DECISIONS}",
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
        "rate(gpusched_admission_jobs_submitted_total",
    ):  # fmt: skip
        assert wanted in queries, wanted


def test_grafana_is_provisioned_from_the_repository_and_guarded_by_a_password():
    grafana = services()["grafana"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = MONITORING / "grafana/provisioning"
    sources = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    providers = yaml.safe_load((provisioning / "dashboards/gpusched.yml").read_text())
    (provider,) = providers["providers"]
    assert mounts["./monitoring/grafana/dashboards"] == provider["options"]["path"]
    for panel in dashboard()["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]

    env = grafana["environment"]
    match = _VARIABLE.fullmatch(env["GF_SECURITY_ADMIN_PASSWORD"])
    assert match and match.group(1) == "GRAFANA_ADMIN_PASSWORD" and match.group(2) == ":?"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    for name in ("grafana", "prometheus"):
        ports = services()[name]["ports"]
        assert all(p.startswith("127.0.0.1:") for p in ports), f"{name}: this host only"
