"""compose.yaml and its GPU override describe the system as the code knows it."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from gpusched.libs.common import natsauth
from gpusched.libs.common.bus import connect
from gpusched.libs.common.embedded import free_port, server_binary, wait_until
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.cli.serve import ServiceName
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict[str, Any]:
    document = yaml.safe_load((ROOT / name).read_text())
    assert isinstance(document, dict)
    return document


def is_gpusched(service: dict[str, Any]) -> bool:
    """A gpusched service (not nats, Prometheus or Grafana)."""
    return service.get("command", [""])[0] == "gpusched"


#: ${NAME}, ${NAME:-default} or ${NAME:?message}, as compose interpolates them
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(value: object, env: dict[str, str]) -> str:
    """``value`` as compose would pass it with ``env`` set: a missing required variable
    fails as compose refuses to start."""

    def one(match: re.Match[str]) -> str:
        name, kind, rest = match.groups()
        if name in env:
            return env[name]
        if kind == ":?":
            raise LookupError(f"{name}: {rest}")
        return rest or ""

    return _VARIABLE.sub(one, str(value))


#: what an operator puts in .env: one random secret per variable compose requires
SECRETS = {
    "GPUSCHED_TOKENS": "t0ken=default",
    "GRAFANA_ADMIN_PASSWORD": "pw-grafana",
    **{natsauth.password_variable(u.name): f"pw-{u.name}" for u in natsauth.compose_users()},
}


def test_the_compose_file_parses_and_runs_every_service_against_a_healthy_nats():
    services = load("compose.yaml")["services"]
    nats = services["nats"]
    assert "-js" in nats["command"] and "healthcheck" in nats
    assert any(str(v).endswith(":/data") for v in nats["volumes"])
    assert "./compose.nats.conf:/etc/nats/gpusched.conf:ro" in nats["volumes"]
    commanded = {name: s["command"] for name, s in services.items()
                 if is_gpusched(s)}
    run = {cmd[2] for cmd in commanded.values()}
    assert run == {s.value for s in ServiceName}
    for name, command in commanded.items():
        assert command[:2] == ["gpusched", "service"], name
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"
        assert interpolate(services[name]["environment"]["NATS_URL"], {}) == "nats://nats:4222"
    agents = [n for n, c in commanded.items() if c[2] == "nodeagent"]
    assert len(agents) == 2
    schedulers = [n for n, c in commanded.items() if c[2] == "scheduler"]
    assert len(schedulers) == 2, "a hot standby scheduler"


def test_every_service_accepts_the_environment_compose_gives_it():
    services = load("compose.yaml")["services"]
    for service in services.values():
        if not is_gpusched(service):
            continue
        env = {k: interpolate(v, SECRETS) for k, v in service["environment"].items()}
        kind = service["command"][2]
        if kind == "admission":
            config = AdmissionConfig.from_env(env)
            assert config.tokens == {"t0ken": "default"} and config.port == 8080
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


def secret_like(name: str) -> bool:
    return any(word in name for word in ("TOKEN", "PASSWORD", "SECRET", "KEY"))


def test_compose_has_no_default_secret_and_refuses_to_start_without_each_one():
    text = (ROOT / "compose.yaml").read_text()
    assert "change-me" not in text
    services = load("compose.yaml")["services"]
    required: set[str] = set()
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if not secret_like(key):
                continue
            match = _VARIABLE.fullmatch(str(value))
            assert match and match.group(2) == ":?", f"{name}.{key} = {value!r}"
            required.add(match.group(1))
            missing = {k: v for k, v in SECRETS.items() if k != match.group(1)}
            with pytest.raises(LookupError, match=match.group(1)):
                interpolate(value, missing)
    assert required == set(SECRETS)


def test_every_service_connects_as_its_own_nats_user_of_the_compose_configuration():
    assert (ROOT / "compose.nats.conf").read_text() == natsauth.compose_config(), (
        "regenerate it: python -m gpusched.libs.common.natsauth > compose.nats.conf"
    )
    services = load("compose.yaml")["services"]
    users = {u.name: u for u in natsauth.compose_users()}
    nats_env = services["nats"]["environment"]
    assert set(nats_env) == {natsauth.password_variable(u) for u in users}
    seen = set()
    for name, service in services.items():
        if not is_gpusched(service):
            continue
        env = service["environment"]
        user = env["NATS_USER"]
        assert env["NATS_PASSWORD"] == nats_env[natsauth.password_variable(user)], name
        if service["command"][2] == "nodeagent":
            assert user == natsauth.nodeagent_user(env["GPUSCHED_NODE_NAME"])
        else:
            assert user == service["command"][2]
        seen.add(user)
    assert seen == set(users)


async def test_the_compose_nats_configuration_admits_each_user_with_its_password_only(
    tmp_path,
):
    """The configuration file as nats-server reads it, passwords from its environment."""
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{tmp_path}\" }}\n"
                      + natsauth.compose_config())
    process = await asyncio.create_subprocess_exec(
        server_binary(), "-c", str(config), env={**os.environ, **SECRETS},
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    try:
        async def listening() -> bool:
            try:
                nc = await nats.connect(url, user="predictor", password="pw-predictor",
                                        allow_reconnect=False, max_reconnect_attempts=0,
                                        inbox_prefix=natsauth.inbox_prefix("predictor"))
            except Exception:
                return False
            await nc.close()
            return True

        await wait_until(listening, timeout_s=30, every_s=0.1)
        agent = await connect(natsauth.with_credentials(url, "nodeagent-node-1",
                                                        "pw-nodeagent-node-1"), "t")
        await agent.close()
        with pytest.raises(ConnectionError, match="refused"):
            await connect(natsauth.with_credentials(url, "scheduler", "pw-predictor"), "t")
    finally:
        process.terminate()
        await process.wait()


def test_the_nats_cluster_profile_joins_three_servers_with_their_own_stores():
    services = load("compose.yaml")["services"]
    members = {n: s for n, s in services.items() if "nats-cluster" in s.get("profiles", [])}
    assert sorted(members) == ["nats-1", "nats-2", "nats-3"]
    stores = set()
    for name, member in members.items():
        command = member["command"]
        assert command[command.index("--name") + 1] == name
        assert command[command.index("--cluster_name") + 1] == "gpusched"
        routes = set(command[command.index("--routes") + 1].split(","))
        assert routes == {f"nats://{other}:6222" for other in members if other != name}
        assert member["environment"] == services["nats"]["environment"]
        assert "./compose.nats.conf:/etc/nats/gpusched.conf:ro" in member["volumes"]
        stores.add(next(v for v in member["volumes"] if v.endswith(":/data")))
        assert "healthcheck" in member
    assert len(stores) == 3
    env = services["scheduler"]["environment"]
    assert interpolate(env["NATS_URL"], {}) == "nats://nats:4222"
    assert interpolate(env["GPUSCHED_NATS_REPLICAS"], {}) == ""
