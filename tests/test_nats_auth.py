"""NATS with the users `gpusched up` generates: a real nats-server per test, started with
the generated configuration. A denied publish is dropped by the server and reported to
the client asynchronously, so each test proves both: the violation reaches the client's
error callback, and an authorised subscriber, which does receive a later allowed
message on the same subject, never saw the denied one."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, natsauth, subjects
from gpusched.libs.common.bus import Stores, connect, credentials, settle
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.natsauth import Credentials, nodeagent_user
from gpusched.libs.common.schemas import CommandReply, JobSpec, StartJob, StopJob
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.config import NodeAgentConfig

NODES = ("node-0", "node-1")
#: a request the server drops gets no answer; this is how long a client waits for one
DENIED_REQUEST_S = 1.0


@pytest.fixture
def creds() -> Credentials:
    return Credentials.generate(NODES)


@pytest.fixture
def server(tmp_path: Path, creds: Credentials) -> Iterator[NatsServer]:
    with NatsServer(store_dir=tmp_path / "nats", users=list(creds.users.values())) as running:
        yield running


class Client_:
    """A connection as one user, keeping the errors the server reported to it."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def violation(self, subject: str) -> None:
        def seen() -> bool:
            return any("permissions violation" in e.lower() and subject.lower() in e.lower()
                       for e in self.errors)

        await wait_until(seen, timeout_s=30)


@pytest.fixture
async def as_user(server: NatsServer, creds: Credentials) -> AsyncIterator:
    opened: list[Client] = []

    async def open_as(user: str) -> Client_:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await connect(creds.url(user, server.url), f"test-{user}", error_cb=on_error)
        opened.append(nc)
        return Client_(nc, errors)

    yield open_as
    for nc in opened:
        await nc.close()


async def collect(client: Client_, subject: str) -> list[Msg]:
    received: list[Msg] = []

    async def on_message(msg: Msg) -> None:
        received.append(msg)
        if msg.reply:
            await msg.respond(b"")

    await client.nc.subscribe(subject, cb=on_message)
    await settle(client.nc)
    return received


async def assert_dropped(
    publisher: Client_, subject: str, listener: Client_, marker_from: Client_
) -> None:
    """``publisher``'s StartJob on ``subject`` is refused: the violation reaches its error
    callback, and ``listener`` gets only an allowed marker published afterwards. The
    subscriber gets messages in the order the server processed them, so once the
    marker arrived, anything published before it would have arrived too."""
    received = await collect(listener, subject)
    await publisher.nc.publish(subject, start_job())
    await publisher.violation(subject)
    await settle(publisher.nc)
    await marker_from.nc.publish(subject, b"marker")
    await wait_until(lambda: any(m.data == b"marker" for m in received), timeout_s=30)
    assert [m.data for m in received] == [b"marker"]


def start_job() -> bytes:
    spec = JobSpec(name="evil", model="resnet50", batch_size=32, iterations=10,
                   command=["sh", "-c", "id"])
    return codec.encode(StartJob(job_id="j1", run_id=1, spec=spec, gpus=[0],
                                 total_iterations=10))


async def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(server, creds):
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)
    wrong = natsauth.with_credentials(server.url, "scheduler", "not-the-password")
    with pytest.raises(ConnectionError) as refused:
        await connect(wrong, "test-wrong")
    assert "not-the-password" not in str(refused.value)
    assert "scheduler:***@" in str(refused.value)


async def test_a_node_agent_cannot_command_another_node_nor_its_own(as_user):
    agent = await as_user(nodeagent_user("node-0"))
    other = await as_user(nodeagent_user("node-1"))
    scheduler = await as_user("scheduler")
    await assert_dropped(agent, subjects.node_command("node-1"), other, scheduler)
    await assert_dropped(agent, subjects.node_command("node-0"), agent, scheduler)


async def test_admission_cannot_start_a_job_on_a_node(as_user):
    admission = await as_user("admission")
    agent = await as_user(nodeagent_user("node-0"))
    scheduler = await as_user("scheduler")
    await assert_dropped(admission, subjects.node_command("node-0"), agent, scheduler)


async def test_a_node_agent_cannot_read_job_records_nor_open_the_stores(as_user):
    admission = await as_user("admission")
    admin_stores = await Stores.open(admission.nc)
    await admin_stores.jobs.create("j1", b"secret record")
    agent = await as_user(nodeagent_user("node-0"))
    js = agent.nc.jetstream(timeout=DENIED_REQUEST_S)
    denied_get = f"$JS.API.STREAM.MSG.GET.KV_{subjects.JOBS_BUCKET}"
    with pytest.raises(nats.errors.TimeoutError):
        await js.get_last_msg(f"KV_{subjects.JOBS_BUCKET}", f"$KV.{subjects.JOBS_BUCKET}.j1")
    await agent.violation(denied_get)
    with pytest.raises(Exception):  # noqa: B017 - a watcher needs a consumer: denied too
        await js.pull_subscribe(f"$KV.{subjects.JOBS_BUCKET}.>",
                                stream=f"KV_{subjects.JOBS_BUCKET}")
    await agent.violation(f"$JS.API.CONSUMER.CREATE.KV_{subjects.JOBS_BUCKET}")
    # what the services do at start, the agent may not: no stream is looked up or made
    with pytest.raises(nats.errors.TimeoutError):
        await Stores.open(agent.nc)
    await agent.violation(f"$JS.API.STREAM.CREATE.{subjects.JOBS_STREAM}")
    # its own registration is allowed, another node's is not
    await js.publish(f"$KV.{subjects.NODES_BUCKET}.node-0", b"{}")
    with pytest.raises(nats.errors.TimeoutError):
        await js.publish(f"$KV.{subjects.NODES_BUCKET}.node-1", b"{}",
                         timeout=DENIED_REQUEST_S)
    await agent.violation(f"$KV.{subjects.NODES_BUCKET}.node-1")


async def test_a_node_agent_serves_its_commands_as_a_micro_service_within_its_permissions(
    as_user, tmp_path
):
    agent = await as_user(nodeagent_user("node-0"))
    config = NodeAgentConfig(name="node-0", gpus=2, work_dir=tmp_path / "work")
    await Stores.open((await as_user("scheduler")).nc)  # the services make the streams
    async with NodeAgent(config, nc=agent.nc):
        scheduler = await as_user("scheduler")
        reply = await scheduler.nc.request(subjects.node_command("node-0"),
                                           codec.encode(StopJob(job_id="j1", run_id=1)),
                                           timeout=5, headers=codec.headers())
        assert codec.decode(reply.data, CommandReply).ok
        await settle(agent.nc)
    # the service's $SRV subscriptions and its replies were all allowed
    assert not [e for e in agent.errors if "permissions violation" in e.lower()], agent.errors


def test_the_generated_configuration_and_credentials_are_private_from_creation(
    tmp_path, creds
):
    path = tmp_path / "private.json"
    natsauth.write_private(path, "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    natsauth.write_private(path, "{}")  # a new file replaces one with a looser mode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "password" not in repr(creds) and all(
        u.password not in repr(u) for u in creds.users.values()
    )


def test_credentials_travel_in_the_url_or_in_the_environment(tmp_path):
    options = credentials("nats://a:p%40ss@h1:4222,nats://h2:4222", environ={})
    assert options == {"servers": ["nats://h1:4222", "nats://h2:4222"], "user": "a",
                       "password": "p@ss", "inbox_prefix": "_INBOX_a"}
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    options = credentials("nats://h:4222", environ={"NATS_USER": "b",
                                                   "NATS_PASSWORD_FILE": str(secret)})
    assert (options["user"], options["password"]) == ("b", "from-file")
    assert credentials("nats://h:4222", environ={}) == {"servers": ["nats://h:4222"]}
    assert natsauth.redact("nats://a:p@h:1,nats://a:p@g:2") == "nats://a:***@h:1,nats://a:***@g:2"


#: the job's command: saves its whole environment, then reports itself done
DUMP_ENV = r"""
import json, os, sys
with open(os.path.join(os.environ["GPUSCHED_CHECKPOINT_DIR"], "env.json"), "w") as f:
    json.dump(dict(os.environ), f)
total = int(os.environ["GPUSCHED_TOTAL_ITERATIONS"])
with open(os.environ["GPUSCHED_PROGRESS_FILE"], "a") as f:
    f.write(json.dumps({"event": "done", "iteration": total}) + "\n")
"""


async def test_a_whole_cluster_with_nats_auth_runs_a_job_whose_process_sees_no_secrets(
    tmp_path, monkeypatch
):
    state = tmp_path / "state"
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(state))
    # what a node agent run by compose holds: none of it may reach the job
    monkeypatch.setenv("NATS_USER", "nodeagent-node-0")
    monkeypatch.setenv("NATS_PASSWORD", "agent-password-in-env")
    monkeypatch.setenv("NATS_URL", "nats://agent:agent-password-in-env@nats:4222")
    monkeypatch.setenv("GPUSCHED_TOKENS", "api-token-in-env=default")
    config = UpConfig(
        nodes=1, gpus_per_node=2, policy="fifo", port=0, state_dir=state,
        jobs_mode="process", heartbeat_s=0.2, time_scale=0.01,
    )
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"}
    ) as session:
        assert cluster.credentials is not None and "@" not in cluster.nats_url
        script = tmp_path / "dump_env.py"
        script.write_text(DUMP_ENV)
        body = {"name": "env", "model": "resnet50", "batch_size": 32, "iterations": 5,
                "command": [sys.executable, str(script)]}
        async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
            assert response.status == 201, await response.text()
            job_id = (await response.json())["id"]

        async def finished() -> dict | None:
            async with session.get(f"{cluster.url}/v1/jobs/{job_id}") as response:
                job = dict(await response.json())
            return job if job["state"] in ("SUCCEEDED", "FAILED") else None

        job = await wait_until(finished, timeout_s=120, every_s=0.1)
        assert job["state"] == "SUCCEEDED", job
        up = json.loads((state / "up.json").read_text())
        secrets = [u.password for u in cluster.credentials.users.values()]
        secrets += [cluster.token, "agent-password-in-env", "api-token-in-env"]
        for private in (state / "up.json", state / "nats" / "nats.conf"):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
        assert up["nats_url"] == cluster.connect_url("tap")
    env = json.loads((state / "work" / job_id / "ckpt" / "env.json").read_text())
    assert not [k for k in env if k.startswith("NATS_") or "TOKEN" in k or "PASSWORD" in k]
    assert not [k for k, v in env.items() if any(s in v for s in secrets)]
    assert env["GPUSCHED_JOB_ID"] == job_id and env["PATH"] == os.environ["PATH"]
