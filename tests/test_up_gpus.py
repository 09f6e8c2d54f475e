"""`gpusched up` on a machine with GPUs, and node agents joining from other machines.

The GPUs come from a stand-in ``pynvml`` module (tests/stand_ins/pynvml.py), the only
fake here: it stands for hardware this machine lacks. Everything else is real: the
command in a subprocess, its nats-server with per-user permissions, the HTTP API, and
node agents started as `gpusched service nodeagent` processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from gpusched.libs.common.embedded import wait_until
from gpusched.services.cli.main import app
from gpusched.services.cli.up import LocalCluster, UpConfig, plan_nodes
from gpusched.services.nodeagent.gpus import NvmlGpu

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
#: two boards as NVML names them
BOARDS = [
    {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-11111111-2222-3333-4444-555555555555",
     "memory_mib": 81559},
    {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-66666666-7777-8888-9999-000000000000",
     "memory_mib": 81559},
]
#: the job's command: saves its environment, then reports itself done
DUMP_ENV = r"""
import json, os
# each of the job's processes (one per rank) writes it whole, then
# renames it into place: a reader never sees two writes interleaved
folder = os.environ["GPUSCHED_CHECKPOINT_DIR"]
mine = os.path.join(folder, f"env-{os.getpid()}.json")
with open(mine, "w") as f:
    json.dump(dict(os.environ), f)
os.replace(mine, os.path.join(folder, "env.json"))
total = int(os.environ["GPUSCHED_TOTAL_ITERATIONS"])
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    f.write(json.dumps({"event": "done", "iteration": total}) + "\n")
"""
#: a command's whole run: start, one job, stop; seconds on a quiet machine are single
#: digits, the limit leaves a wide margin for a busy one
PROCESS_WAIT_S = 180.0


def nvml_gpu(index: int, name: str = "NVIDIA A100-SXM4-40GB") -> NvmlGpu:
    return NvmlGpu(index, f"GPU-{index}", name, 40960.0, 0.0, 40960.0, 0.0, 0.0, 0.0)


# ---- what `up` plans --------------------------------------------------------------------


def test_up_with_no_flags_takes_the_gpus_nvml_found_and_runs_real_processes_on_them():
    plan = plan_nodes(UpConfig(), [nvml_gpu(0), nvml_gpu(1)], "")
    assert [g.uuid for g in plan.real_gpus] == ["GPU-0", "GPU-1"]
    assert plan.emulated_nodes == 0 and plan.jobs_mode == "process"
    assert plan.node_names == [plan.real_node]
    assert "2 real GPUs (NVIDIA A100-SXM4-40GB)" in plan.banner("fifo")


def test_up_without_nvml_emulates_and_says_why():
    plan = plan_nodes(UpConfig(), None, "nvidia-ml-py is not installed")
    assert not plan.real_gpus
    assert (plan.emulated_nodes, plan.emulated_gpus_per_node) == (2, 4)
    assert plan.jobs_mode == "simulated"
    assert "nvidia-ml-py is not installed" in plan.why
    assert "--emulate-gpus" in plan.why


def test_emulation_asked_for_wins_over_real_gpus():
    plan = plan_nodes(UpConfig(gpus_per_node=2, nodes=3), [nvml_gpu(0)], "")
    assert not plan.real_gpus
    assert (plan.emulated_nodes, plan.emulated_gpus_per_node) == (3, 2)
    assert plan.node_names == ["node-0", "node-1", "node-2"]
    assert plan_nodes(UpConfig(nodes=0), [nvml_gpu(0)], "").node_names == []


def test_emulating_zero_gpus_is_a_one_line_error_naming_the_flag(tmp_path):
    result = CliRunner().invoke(
        app, ["up", "--emulate-gpus", "0", "--state-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--emulate-gpus" in lines[0], result.output


# ---- `up` on a machine whose NVML finds GPUs ----------------------------------------------


async def read_banner(process: asyncio.subprocess.Process) -> dict[str, str]:
    """The banner's labelled lines, up to its last one."""
    assert process.stdout is not None
    lines: dict[str, str] = {}
    while line := (await process.stdout.readline()).decode():
        if line.startswith("gpusched is up"):
            lines["up"] = line.strip()
        elif line.startswith("  "):
            label, _, value = line.strip().partition(" ")
            lines.setdefault(label, value.strip())
        if line.startswith("Ctrl-C"):
            break
    return lines


async def submit_and_wait(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        async with session.post(f"{url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            job_id = (await response.json())["id"]

        async def finished() -> dict[str, Any] | None:
            async with session.get(f"{url}/v1/jobs/{job_id}") as response:
                job = dict(await response.json())
            return job if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        return dict(await wait_until(finished, timeout_s=PROCESS_WAIT_S, every_s=0.2))


async def cluster_view(url: str, token: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as session, session.get(
        f"{url}/v1/cluster"
    ) as response:
        return dict(await response.json())


async def test_up_with_no_flags_registers_the_nvml_gpus_as_real_and_gives_jobs_their_uuids(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    nvml_log = tmp_path / "nvml.log"
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), str(ROOT)]),
        "GPUSCHED_STATE_DIR": str(state), "GPUSCHED_FAKE_NVML": json.dumps(BOARDS),
        "GPUSCHED_FAKE_NVML_LOG": str(nvml_log),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", "up", "--port", "0",
        "--no-metrics", "--policy", "fifo", "--state-dir", str(state),
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        banner = await asyncio.wait_for(read_banner(process), PROCESS_WAIT_S)
        assert "2 real GPUs (NVIDIA H100 80GB HBM3)" in banner["up"], banner
        assert "real torch processes" in banner["up"]
        up = json.loads((state / "up.json").read_text())
        script = tmp_path / "dump_env.py"
        script.write_text(DUMP_ENV)
        job = await submit_and_wait(up["url"], up["token"], {
            "name": "env", "model": "resnet50", "batch_size": 32, "iterations": 5, "gpus": 2,
            "command": [sys.executable, str(script)],
        })
        assert job["state"] == "SUCCEEDED", job
        view = await cluster_view(up["url"], up["token"])

        def reads() -> int:
            return sum(" read" in line for line in nvml_log.read_text().splitlines())

        # a reading after the agent's first: the one NVML handle serves every reading
        assert await wait_until(lambda: reads() > 2, timeout_s=PROCESS_WAIT_S)
    finally:
        process.send_signal(signal.SIGINT)
        await process.wait()
    assert process.returncode == 0
    [node] = view["nodes"]
    assert node["emulated"] is False
    assert [(g["model"], g["uuid"]) for g in node["gpus"]] == [
        (b["name"], b["uuid"]) for b in BOARDS
    ]
    job_env = json.loads((state / "work" / job["id"] / "ckpt" / "env.json").read_text())
    assert job_env["CUDA_VISIBLE_DEVICES"] == ",".join(b["uuid"] for b in BOARDS)
    # NVML is opened once by `up` to look and once by the agent for its whole life,
    # however many telemetry readings it took
    events = [line.split()[1] for line in nvml_log.read_text().splitlines()]
    assert events.count("init") == 2, events
    assert events.count("read") > events.count("init")
    assert events.count("shutdown") == 2


# ---- joining ----------------------------------------------------------------------------


def gpusched(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusched.services.cli.main", *args],
        cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=PROCESS_WAIT_S,
    )


def join_environment(command: str) -> tuple[dict[str, str], list[str]]:
    """The variables and arguments of the command `node add` prints."""
    words = shlex.split(command)
    assignments = [w for w in words if "=" in w and not w.startswith("-")][:1]
    env = dict(a.split("=", 1) for a in assignments)
    rest = words[len(assignments):]
    assert rest[:3] == ["gpusched", "service", "nodeagent"], command
    return env, rest[3:]


@pytest.fixture
async def cluster(tmp_path: Path):
    config = UpConfig(
        nodes=1, gpus_per_node=1, policy="fifo", port=0, state_dir=tmp_path / "state",
        heartbeat_s=0.2, time_scale=0.01, metrics_port=None,
    )
    async with LocalCluster(config) as running:
        yield running


async def test_a_node_agent_with_a_minted_credential_joins_and_runs_a_job(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    state = cluster.config.state_dir
    added = await asyncio.to_thread(gpusched, "node", "add", "gpu-2", "--state-dir", str(state))
    assert added.returncode == 0, added.stderr
    command = added.stdout.strip().splitlines()[-1].strip()
    env, args = join_environment(command)
    assert env["NATS_URL"].startswith("nats://nodeagent-gpu-2:")
    assert args == ["--name", "gpu-2"]
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", "service", "nodeagent", *args,
        "--gpus", "2",
        env={**os.environ, **env, "GPUSCHED_WORK_DIR": str(tmp_path / "joined"),
             "GPUSCHED_TIME_SCALE": "0.01", "GPUSCHED_NODEAGENT_HOST": "127.0.0.1"},
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        async def joined() -> bool:
            view = await cluster_view(cluster.url, cluster.token)
            return "gpu-2" in {n["name"] for n in view["nodes"]}

        await wait_until(joined, timeout_s=PROCESS_WAIT_S, every_s=0.2)
        # only the joined node has two GPUs
        job = await submit_and_wait(cluster.url, cluster.token, {
            "name": "wide", "model": "resnet18", "batch_size": 32, "iterations": 20,
            "gpus": 2,
        })
    finally:
        agent.send_signal(signal.SIGTERM)
        await agent.wait()
    assert job["state"] == "SUCCEEDED", job
    assert {p["node"] for p in job["placement"]} == {"gpu-2"}


async def test_a_join_without_a_valid_credential_or_under_another_name_is_refused(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    state = cluster.config.state_dir
    server = cluster.nats_url
    host_port = server.split("//", 1)[1]
    cases = {
        "no credential": ({"NATS_URL": server}, ["--name", "gpu-3"]),
        "unknown node": ({"NATS_URL": f"nats://nodeagent-gpu-3:guess@{host_port}"},
                         ["--name", "gpu-3"]),
    }
    for case, (env, args) in cases.items():
        done = await asyncio.to_thread(gpusched, "service", "nodeagent", *args, env=env)
        assert done.returncode == 1, (case, done.stderr)
        assert "refused the credentials" in done.stderr, (case, done.stderr)
        assert "gpusched node add" in done.stderr, (case, done.stderr)
    added = await asyncio.to_thread(gpusched, "node", "add", "gpu-4", "--state-dir", str(state))
    env, _ = join_environment(added.stdout.strip().splitlines()[-1].strip())
    wrong = await asyncio.to_thread(
        gpusched, "service", "nodeagent", "--name", "node-0", env=env
    )
    assert wrong.returncode == 2 and "--name" in wrong.stderr, wrong.stderr
    for used in ("node-0", "gpu-4"):
        again = await asyncio.to_thread(
            gpusched, "node", "add", used, "--state-dir", str(state)
        )
        assert again.returncode == 2, again.stdout
        assert "already in use" in again.stderr and "NAME" in again.stderr, again.stderr
    bad = await asyncio.to_thread(gpusched, "node", "add", "a.b", "--state-dir", str(state))
    assert bad.returncode == 2 and "NAME" in bad.stderr


def test_adding_a_node_with_no_cluster_running_says_so(tmp_path: Path) -> None:
    done = gpusched("node", "add", "gpu-9", "--state-dir", str(tmp_path))
    assert done.returncode == 2
    assert "no running `gpusched up`" in done.stderr


# ---- what an earlier `up` left ------------------------------------------------------------


async def test_a_restarted_up_counts_the_jobs_it_resumes_and_fresh_starts_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(nodes=1, gpus_per_node=1, policy="fifo", port=0,
                      state_dir=tmp_path / "state", metrics_port=None)
    async with LocalCluster(config) as first:
        assert first.resumed_jobs == 0
        async with aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {first.token}"}
        ) as session:
            body = {"name": "long", "model": "resnet50", "batch_size": 32,
                    "iterations": 10_000_000}
            async with session.post(f"{first.url}/v1/jobs", json=body) as response:
                assert response.status == 201
                job_id = (await response.json())["id"]
    async with LocalCluster(config) as again:
        assert again.resumed_jobs == 1
    fresh = UpConfig(nodes=1, gpus_per_node=1, policy="fifo", port=0,
                     state_dir=tmp_path / "state", metrics_port=None, fresh=True)
    async with LocalCluster(fresh) as clean:
        assert clean.resumed_jobs == 0
        async with aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {clean.token}"}
        ) as session, session.get(f"{clean.url}/v1/jobs/{job_id}") as response:
            assert response.status == 404
