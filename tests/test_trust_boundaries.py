"""Input from outside a service, hostile or merely odd, at each door: the HTTP API (NUL
bytes and control characters in a spec, deep nesting, a client that hangs up mid-body,
idle connections), a node agent's command endpoint (a start whose process cannot be
started), the scheduler's heartbeat subscription (an invalid job id), the CLI (records
holding terminal escapes) and ``gpusched up``'s state directory. Real nats-server, real
services, real sockets and processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    CommandReply,
    Heartbeat,
    JobSpec,
    JobState,
    Progress,
    RunningJob,
    StartJob,
    StopJob,
)
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.admission.config import DEFAULT_KEEPALIVE_S
from gpusched.services.cli.client import Endpoint, call
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler, record, spec, store_job, wait_state
from tests.test_admission_api import Api, stream_count
from tests.test_cli_job_views import gpusched, rewrite
from tests.test_nodeagent_service import (
    NODE,
    PROCESS_TIMINGS,
    agent_config,
    listen,
    send,
    stored_exit,
)
from tests.test_scheduler_hardening import register_node, store_job_being_started

TOKEN = "tok-alpha"
TENANT = "alpha"
#: a command no process can be started with
NUL_COMMAND = ["echo", "a\x00b"]


def body(**fields: object) -> dict[str, object]:
    return {"name": "train", "model": "resnet50", "batch_size": 64, "iterations": 100,
            **fields}


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[AdmissionService]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens={TOKEN: TENANT})
    async with AdmissionService(config) as running:
        yield running


@pytest.fixture
async def api(service: AdmissionService) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as session:
        yield Api(session, service.url, TOKEN)


# ---------------------------------------------------------------------- the HTTP API


async def test_a_command_with_a_nul_byte_is_refused_naming_the_argument_and_nothing_is_stored(
    api: Api, stores: Stores
):
    answer = await api.submit(body(command=NUL_COMMAND))

    assert answer.status == 422
    assert answer.problem["field"] == "command[1]"
    assert "NUL" in answer.problem["detail"]
    assert await stores.job_ids() == []
    assert await stream_count(stores) == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "\x1b[31mred"}, "name"),
        ({"name": "two\nlines"}, "name"),
        ({"name": "c1 \x9b31m"}, "name"),
        ({"model": "resnet50\x00"}, "model"),
        ({"labels": {"team": "vision\x07"}}, "labels"),
        ({"labels": {"te\x1bam": "vision"}}, "labels"),
    ],
    ids=["escape in name", "line break in name", "C1 in name", "NUL in model",
         "bell in label value", "escape in label key"],
)
async def test_names_models_and_labels_with_control_characters_are_refused_naming_the_field(
    api: Api, stores: Stores, fields: dict[str, object], field: str
):
    answer = await api.submit(body(**fields))

    assert answer.status == 422, answer.body
    assert answer.problem["field"] == field
    assert "control characters" in answer.problem["detail"]
    assert await stores.job_ids() == []


async def test_a_yaml_spec_with_a_control_character_in_its_name_is_refused_too(api: Api):
    answer = await api.post_raw(
        'name: "a\\x1b[2Jb"\nmodel: resnet50\nbatch_size: 8\niterations: 5\n',
        "application/yaml",
    )

    assert (answer.status, answer.problem["field"]) == (422, "name")


async def test_text_beyond_ascii_and_line_breaks_inside_command_arguments_are_accepted(
    api: Api,
):
    answer = await api.submit(body(
        name="Übersetzung 日本語 — v2", labels={"équipe": "vision ✓"},
        command=["python", "-c", "import sys\nprint(sys.argv)\t# tab"],
    ))

    assert answer.status == 201, answer.body
    assert answer.body["spec"]["command"][2] == "import sys\nprint(sys.argv)\t# tab"


@pytest.mark.parametrize("depth", [1_000, 30_000])
async def test_json_nested_thousands_of_levels_deep_is_a_400_about_the_body(
    api: Api, stores: Stores, depth: int
):
    nested = "[" * depth + "]" * depth
    as_label = json.dumps(body())[:-1] + f', "labels": {nested}}}'

    for text in (nested, as_label):
        answer = await api.post_raw(text, "application/json")

        assert answer.status == 400, answer.body
        assert answer.problem["type"] == "/problems/malformed-body"
        assert "nested deeper than 16 levels" in answer.problem["detail"]
    assert await stores.job_ids() == []


async def test_brackets_inside_strings_do_not_count_as_nesting(api: Api):
    # gpus written 2.0 takes the slower path that measures the nesting first
    answer = await api.submit(body(gpus=2.0, labels={"note": "[" * 200 + "{" * 50}))

    assert answer.status == 201, answer.body
    assert answer.body["spec"]["gpus"] == 2


async def test_a_client_that_hangs_up_mid_body_is_logged_as_gone_and_not_as_a_failure(
    service: AdmissionService, api: Api
):
    host, port = service.url.removeprefix("http://").split(":")
    with structlog.testing.capture_logs() as logs:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            + b"Expect: 100-continue\r\n\r\n"
        )
        # "100 Continue": the service handles the request and now waits for its body
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        writer.write(b'{"name": "half')
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        await wait_until(lambda: any(e["event"] == "client went away" for e in logs),
                         timeout_s=30)

    gone = next(e for e in logs if e["event"] == "client went away")
    assert (gone["log_level"], gone["path"], gone["method"]) == ("info", "/v1/jobs", "POST")
    assert not [e for e in logs if e["log_level"] in ("warning", "error", "critical")], logs
    metrics = (await api.get("/metrics")).body.decode()
    answered = [line for line in metrics.splitlines()
                if line.startswith("gpusched_admission_requests_total{")]
    assert not [line for line in answered if 'method="POST"' in line], answered


async def test_an_idle_connection_is_closed_after_the_configured_keepalive(
    nats_server: NatsServer,
):
    assert AdmissionConfig(nats_url=nats_server.url).keepalive_s == DEFAULT_KEEPALIVE_S == 75
    keepalive_s = 0.5
    config = AdmissionConfig(nats_url=nats_server.url, port=0, keepalive_s=keepalive_s)
    async with AdmissionService(config) as running:
        host, port = running.url.removeprefix("http://").split(":")
        # one connection asks once and then idles; the other never says anything
        served = await asyncio.open_connection(host, int(port))
        silent = await asyncio.open_connection(host, int(port))
        served[1].write(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        opened = time.monotonic()

        async def until_closed(reader: asyncio.StreamReader) -> bytes:
            received = b""
            while chunk := await reader.read(65536):
                received += chunk
            return received

        # a wide margin over the keep-alive; without it the connections stay an hour
        answer, nothing = await asyncio.wait_for(
            asyncio.gather(until_closed(served[0]), until_closed(silent[0])),
            timeout=60 * keepalive_s,
        )
        idled = time.monotonic() - opened
        for _, writer in (served, silent):
            writer.close()

    assert answer.startswith(b"HTTP/1.1 200")
    assert nothing == b""
    assert idled >= keepalive_s


# ---------------------------------------------------------------------- node agent


async def test_a_start_with_a_nul_byte_sent_straight_to_a_node_agent_fails_saying_why(
    nats_server: NatsServer, nc: Client, stores: Stores, tmp_path: Path
):
    config = agent_config(nats_server.url, tmp_path / "work", **PROCESS_TIMINGS)
    beats = await listen(nc, subjects.node_heartbeat(NODE), Heartbeat)
    # a forged or old command: admission never lets such a spec in
    start = StartJob(
        job_id="nul", run_id=1, total_iterations=5, gpus=[0, 1],
        spec=JobSpec(name="nul", model="my-net", batch_size=2, gpus=2, iterations=5,
                     command=NUL_COMMAND),
    )
    solo = StartJob(
        job_id="nul-solo", run_id=3, total_iterations=5, gpus=[2],
        spec=JobSpec(name="nul", model="my-net", batch_size=2, iterations=5,
                     command=NUL_COMMAND),
    )
    async with NodeAgent(config) as agent:
        assert (await send(nc, start)).ok
        assert (await send(nc, solo)).ok
        exits = [await stored_exit(stores, "nul"), await stored_exit(stores, "nul-solo")]
        for exit in exits:
            assert (exit.outcome, exit.exit_code) == ("failed", None)
            assert "embedded null byte" in exit.stderr_tail
            assert exit.stderr_tail.startswith("cannot start ")
        assert exits[1].stderr_tail.startswith("cannot start 'echo': ValueError")
        assert (await agent.snapshot()).running == {}
        seen = len(beats.items)
        await wait_until(lambda: len(beats.items) > seen)
        assert all(not beat.running for beat in beats.items[seen:])
        # a cancel of the ended run is answered, and the GPUs take the next job
        assert (await send(nc, StopJob(job_id="nul-solo", run_id=3))).ok
        again = StartJob(
            job_id="after", run_id=1, total_iterations=1, gpus=[2],
            spec=JobSpec(name="ok", model="my-net", batch_size=2, iterations=1,
                         command=[sys.executable, "-c", "pass"]),
        )
        assert (await send(nc, again)).ok
        assert (await stored_exit(stores, "after")).outcome == "succeeded"
    # leaving the block stopped the agent: no run of it died unnoticed


async def test_a_stored_job_with_a_nul_byte_in_its_command_ends_failed_and_frees_its_gpu(
    nats_server: NatsServer, stores: Stores, tmp_path: Path
):
    node = EmulatedCluster.of(
        nats_server.url, 1, 1, work_dir=tmp_path / "work", heartbeat_s=0.2,
        telemetry_s=0.5, progress_s=0.1, progress_poll_s=0.05,
    )  # fmt: skip
    async with node, SchedulerService(fast_scheduler(nats_server.url)):
        # written around admission, as a record from before its check would be
        job_id = await store_job(stores, spec(command=NUL_COMMAND, max_retries=1))
        failed = await wait_state(stores, job_id, JobState.FAILED, timeout_s=60)
        # the one GPU is free again: the next job runs on it to its end
        next_id = await store_job(stores, spec(command=[sys.executable, "-c", "pass"]))
        done = await wait_state(stores, next_id, JobState.SUCCEEDED, timeout_s=60)

    assert failed.attempts == 2  # the first attempt and its one retry
    assert failed.placement == []
    assert "embedded null byte" in failed.error
    assert "embedded null byte" in failed.history[-1].reason
    assert done.attempts == 0


# ---------------------------------------------------------------------- scheduler


async def test_a_heartbeat_with_an_invalid_job_id_still_counts_for_its_other_runs(
    nats_server: NatsServer, nc: Client, stores: Stores
):
    await register_node(stores, "n1")
    # a run the previous leader started: it runs once its node lists it
    job_id = await store_job_being_started(stores)
    stops: list[StopJob] = []

    async def node_commands(msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError):  # a stop, not another command
            stops.append(codec.decode(msg.data, StopJob))
        await msg.respond(codec.encode(CommandReply(True)))

    await nc.subscribe(subjects.node_command("n1"), cb=node_commands)
    beat = Heartbeat(node="n1", at=0.0, running=[
        RunningJob("x" * 10_000, 1, Progress()),  # first, so nothing after it may be lost
        RunningJob(job_id, 1, Progress(iteration=3)),
        RunningJob("stray", 7, Progress()),  # runs there, unknown to the scheduler
    ])

    async def beating() -> None:
        while True:
            data = codec.encode(Heartbeat(node=beat.node, at=time.time(), running=beat.running))
            await nc.publish(subjects.node_heartbeat("n1"), data, headers=codec.headers())
            await asyncio.sleep(0.1)

    async with SchedulerService(fast_scheduler(nats_server.url)):
        beats = asyncio.create_task(beating())
        try:
            running = await wait_state(stores, job_id, JobState.RUNNING)
            await wait_until(lambda: stops, timeout_s=15)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats

    assert running.history[-1].reason == "started"
    assert {(s.job_id, s.run_id, s.reason) for s in stops} == {("stray", 7, "lost")}
    assert (await record(stores, job_id)).state is JobState.RUNNING


# ---------------------------------------------------------------------- CLI


#: markup rich would read, an escape sequence, and a bell; short enough for a dumb
#: terminal's 80 columns
ESCAPING_NAME = "[b]\x1b[1m\x07"


async def test_the_cli_prints_a_stored_records_control_characters_as_escapes(
    service: AdmissionService, stores: Stores
):
    # stored before admission refused such names
    job_id = await store_job(stores, spec(name=ESCAPING_NAME, labels={"k": "v\x1b[2J"}),
                             tenant=TENANT)
    await rewrite(stores, job_id, state=JobState.FAILED, error="boom\x1b[1A\x1b[2K\nline 2",
                  pending_reason="\x9b31m")
    shown_name = "[b]\\x1b[1m\\x07"

    code, listed, err = await gpusched(service, "jobs")
    assert code == 0, err
    code, one, err = await gpusched(service, "job", job_id)
    assert code == 0, err
    terminal = await _jobs_on_a_terminal(service)

    for out in (listed, one, terminal):
        assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
        assert shown_name in out, out
    assert "labels     k=v\\x1b[2J" in one
    assert "boom\\x1b[1A\\x1b[2K" in one and "line 2" in one


async def _jobs_on_a_terminal(service: AdmissionService) -> str:
    """``gpusched jobs`` with its output a terminal (a pseudo-terminal here): the rich
    table, which would read ``[bold]`` as markup and drop it."""
    leader, follower = pty.openpty()
    # rich takes a dumb terminal's size from COLUMNS only beside LINES (else 80 x 25)
    environment = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "dumb",
                   "GPUSCHED_URL": service.url, "GPUSCHED_TOKEN": TOKEN}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", "jobs",
        cwd=Path(__file__).resolve().parents[1], env=environment, stdout=follower,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    os.close(follower)
    received = bytearray()
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed: everything was read
            chunk = b""
        received.extend(chunk)
        if not chunk and not done.done():
            done.set_result(None)

    loop.add_reader(leader, readable)
    try:
        _, err = await process.communicate()
        await done
    finally:
        loop.remove_reader(leader)
        os.close(leader)
    assert process.returncode == 0, err.decode()
    return received.decode().replace("\r\n", "\n")


# ---------------------------------------------------------------------- up's state dir


async def test_up_with_another_state_dir_keeps_up_json_there_and_the_cli_still_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    default, elsewhere = tmp_path / "default", tmp_path / "elsewhere"
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(default))
    for variable in ("GPUSCHED_URL", "GPUSCHED_TOKEN", "NATS_URL"):
        monkeypatch.delenv(variable, raising=False)
    config = UpConfig(nodes=0, port=0, state_dir=elsewhere, metrics_port=None)

    async with LocalCluster(config) as cluster:
        written = json.loads((elsewhere / "up.json").read_text())
        pointer = json.loads((default / "up.json").read_text())
        endpoint = Endpoint.resolve(None, None)
        listed = await call(endpoint, "GET", "/v1/jobs")
        mode = (elsewhere / "up.json").stat().st_mode & 0o777

    assert (written["url"], written["token"]) == (cluster.url, cluster.token)
    assert written["state_dir"] == str(elsewhere.resolve())
    assert mode == 0o600
    # the default place names the state directory and holds no secret
    assert pointer == {"state_dir": str(elsewhere.resolve())}
    assert (endpoint.url, endpoint.token) == (cluster.url, cluster.token)
    assert endpoint.nats_url == written["nats_url"]
    assert listed == {"jobs": [], "next": None}
    assert not (elsewhere / "up.json").exists()
    assert not (default / "up.json").exists()
