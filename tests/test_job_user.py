"""Job processes run as a user of their own, in a directory of their own, and cannot read
the cluster's secrets: a real `gpusched up` cluster (LocalCluster) with process jobs,
a real job process, and the real files and /proc entries it tries to read.

Switching users needs root (the suite runs as root in CI); without it the tests that
switch are skipped, saying so, and the one that checks the warning runs anyway."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gpusched.libs.common.embedded import wait_until
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.nodeagent import jobuser
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.jobuser import JobUserError, resolve_job_user, start_warning

ROOT = Path(__file__).resolve().parents[1]
#: a uid with no passwd entry: nothing on the machine is owned by it
JOB_UID = 61234
#: the job's command: tries what a hostile tenant would, writes what it found, then
#: reports itself done
PROBE = r"""
import json, os, sys
found = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
         "cwd": os.getcwd(), "home": os.environ.get("HOME")}
for label, path in json.loads(sys.argv[1]).items():
    try:
        with open(path, "rb") as handle:
            handle.read(1)
        found[label] = "read"
    except OSError as exc:
        found[label] = type(exc).__name__
with open(os.path.join(os.environ["GPUSCHED_CHECKPOINT_DIR"], "probe.json"), "w") as f:
    json.dump(found, f)
total = int(os.environ["GPUSCHED_TOTAL_ITERATIONS"])
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    f.write(json.dumps({"event": "done", "iteration": total}) + "\n")
"""
#: a job of a few process starts; the limit is for a busy machine
JOB_WAIT_S = 180.0

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching job users needs root (the suite runs as root in CI)"
)


def system_python() -> str:
    """A Python any user may run (this one may lie in a private folder): the probe needs
    no more than the standard library."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate)
        if path.exists() and not jobuser.private_interpreter_at(path):
            return str(path)
    pytest.skip("no Python on this machine that another user may run")


@pytest.fixture
def passable_dir() -> Iterator[Path]:
    """A folder any user may enter (pytest's own tmp folders are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="gpusched-jobuser-"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@needs_root
async def test_a_job_runs_as_its_own_user_in_its_own_directory_and_reads_no_secret(
    passable_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = passable_dir / "state"
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(state))
    script = passable_dir / "probe.py"
    script.write_text(PROBE)
    script.chmod(0o644)
    config = UpConfig(
        nodes=1, gpus_per_node=1, policy="fifo", port=0, state_dir=state,
        jobs_mode="process", heartbeat_s=0.2, metrics_port=None, job_user=str(JOB_UID),
    )
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"}
    ) as session:
        secrets = {
            "up_json": str(state / "up.json"),
            "nats_conf": str(state / "nats" / "nats.conf"),
            "nats_users": str(state / "nats" / "users.conf"),
            "service_environ": f"/proc/{os.getpid()}/environ",
        }
        body = {"name": "probe", "model": "resnet18", "batch_size": 8, "iterations": 3,
                "command": [system_python(), str(script), json.dumps(secrets)]}
        async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            job_id = (await response.json())["id"]

        async def finished() -> dict | None:
            async with session.get(f"{cluster.url}/v1/jobs/{job_id}") as response:
                job = dict(await response.json())
            return job if job["state"] in ("SUCCEEDED", "FAILED") else None

        job = await wait_until(finished, timeout_s=JOB_WAIT_S, every_s=0.1)
        assert job["state"] == "SUCCEEDED", job
        job_dir = cluster.work_dir / job_id
    found = json.loads((job_dir / "ckpt" / "probe.json").read_text())
    assert (found["uid"], found["gid"]) == (JOB_UID, JOB_UID)
    assert 0 not in found["groups"], "the job kept the agent's groups"
    assert Path(found["cwd"]) == job_dir and Path(found["home"]) == job_dir
    for label in secrets:
        assert found[label] == "PermissionError", (label, found[label])
    mode = job_dir.stat()
    assert (mode.st_uid, stat.S_IMODE(mode.st_mode)) == (JOB_UID, 0o700)


@needs_root
def test_a_job_user_that_is_root_or_unknown_is_refused_naming_the_setting() -> None:
    with pytest.raises(JobUserError, match="job_user: uid 0 is root"):
        resolve_job_user("0")
    with pytest.raises(JobUserError, match="job_user: no user 'no-such-user-here'"):
        resolve_job_user("no-such-user-here")
    user, warning = resolve_job_user(str(JOB_UID))
    assert user is not None and (user.uid, user.gid) == (JOB_UID, JOB_UID) and not warning


def test_a_bad_job_user_setting_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="job_user: 'no way!'"):
        NodeAgentConfig(job_user="no way!")


def test_an_agent_that_cannot_switch_users_says_so_and_runs_jobs_as_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the effective uid stands for an agent started without root
    monkeypatch.setattr(jobuser.os, "geteuid", lambda: 1000)
    for setting in ("auto", "gpusched-job", str(JOB_UID)):
        user, warning = resolve_job_user(setting)
        assert user is None
        assert "not root" in warning and "secrets" in warning
        assert start_warning(setting) == warning
    user, warning = resolve_job_user("self")
    assert user is None and "as configured" in warning
