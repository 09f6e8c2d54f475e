"""compose.yaml and its GPU override describe the system as the code knows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from libs.cli.serve import ServiceName
from services.admission.config import AdmissionConfig
from services.nodeagent.config import NodeAgentConfig
from services.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict[str, Any]:
    document = yaml.safe_load((ROOT / name).read_text())
    assert isinstance(document, dict)
    return document


def test_the_compose_file_parses_and_runs_every_service_against_a_healthy_nats():
    services = load("compose.yaml")["services"]
    nats = services["nats"]
    assert "-js" in nats["command"] and "healthcheck" in nats
    assert any(str(v).endswith(":/data") for v in nats["volumes"])
    commanded = {name: s["command"] for name, s in services.items() if name != "nats"}
    run = {cmd[2] for cmd in commanded.values()}
    assert run == {s.value for s in ServiceName}
    for name, command in commanded.items():
        assert command[:2] == ["gpusched", "service"], name
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"
        assert services[name]["environment"]["NATS_URL"] == "nats://nats:4222"
    agents = [n for n, c in commanded.items() if c[2] == "nodeagent"]
    assert len(agents) == 2
    schedulers = [n for n, c in commanded.items() if c[2] == "scheduler"]
    assert len(schedulers) == 2, "a hot standby scheduler"


def test_every_service_accepts_the_environment_compose_gives_it():
    services = load("compose.yaml")["services"]
    for name, service in services.items():
        if name == "nats":
            continue
        env = {k: str(v).replace("${GPUSCHED_TOKENS:-change-me=default}", "change-me=default")
               .replace("${GPUSCHED_POLICY:-sjf-bsbf}", "sjf-bsbf")
               for k, v in service["environment"].items()}
        kind = service["command"][2]
        if kind == "admission":
            config = AdmissionConfig.from_env(env)
            assert config.tokens == {"change-me": "default"} and config.port == 8080
        elif kind == "nodeagent":
            assert NodeAgentConfig.from_env(env).gpus == 4
        elif kind == "scheduler":
            policy = env["GPUSCHED_POLICY"]
            assert SchedulerConfig(nats_url=env["NATS_URL"], policy=policy).policy == policy


def test_the_gpu_override_reserves_gpus_for_existing_node_agents_only():
    base = load("compose.yaml")["services"]
    override = load("compose.gpu.yaml")["services"]
    assert override, "the override names no service"
    for name, service in override.items():
        assert base[name]["command"][2] == "nodeagent"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert service["environment"]["GPUSCHED_JOBS_MODE"] == "process"
