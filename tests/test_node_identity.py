"""A node speaks only for itself and for the runs the scheduler gave it. Most tests run a
`gpusched up` cluster of two emulated nodes (LocalCluster: real nats-server with the
users `up` generates, real admission, scheduler, predictor and node agents) and forge,
with one node agent's real NATS credentials, what such a user could once do to another
node's jobs: claim the message ids of a cancel or of another run's exits, speak in a
heartbeat, telemetry or registration for another node, list every job id through a
stream's information, and report progress and a succeeded exit for a job it does not
run. Each forgery is refused by the server or dropped by its reader, and the test shows
it changed nothing. The last two hand a leader's scheduler what another node listed or
stored about a run, as its sweep meets it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import pytest
from nats.aio.msg import Msg
from nats.js.errors import ServerError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import connect, settle
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.natsauth import kv_stream, nodeagent_user
from gpusched.libs.common.schemas import (
    GpuInfo,
    GpuTelemetry,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobState,
    NodeInfo,
    Progress,
    RunningJob,
    Telemetry,
)
from gpusched.services.admission.ids import idempotent_job_id
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.scheduler.live import Beat, Sweep
from tests.test_live_http import events_until_done, job_record, submit
from tests.test_nats_auth import DENIED_REQUEST_S, Client_
from tests.test_scheduler_hardening import (
    NODE,
    idle_scheduler,
    record_of,
    register_node,
    store_exit,
    store_running_job,
    succeeded,
)

TOKEN = "node-identity-token"
NODES = ("node-0", "node-1")
#: iterations no job reaches during a test
LONG = 100_000_000
#: a loss no real run reports: what forged reports carry
FORGED_LOSS = -7.0


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalCluster]:
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=2, gpus_per_node=2, policy="fifo", port=0, state_dir=tmp_path / "state",
        token=TOKEN, time_scale=0.01, heartbeat_s=0.2,
    )
    async with LocalCluster(config) as running:
        assert running.credentials is not None
        assert sorted(running.plan.node_names) == list(NODES)
        yield running


@pytest.fixture
async def api(cluster: LocalCluster) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        yield session


@pytest.fixture
async def as_user(cluster: LocalCluster) -> AsyncIterator[Any]:
    """Connect as one of the cluster's NATS users, with its real password."""
    opened: list[nats.aio.client.Client] = []

    async def open_as(user: str) -> Client_:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await connect(cluster.connect_url(user), f"test-{user}", error_cb=on_error)
        opened.append(nc)
        return Client_(nc, errors)

    yield open_as
    for nc in opened:
        await nc.close()


def long_job(**fields: Any) -> dict[str, Any]:
    return {"name": "victim", "model": "resnet50", "batch_size": 64, "iterations": LONG,
            **fields}


async def running_job(api: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """A job that runs for the whole test, once it runs: its record."""
    job_id = await submit(api, url, long_job())

    async def running() -> dict[str, Any] | None:
        record = await job_record(api, url, job_id)
        return record if record["state"] == "RUNNING" else None

    return await wait_until(running, timeout_s=60, every_s=0.05)


async def ended(api: aiohttp.ClientSession, url: str, job_id: str) -> dict[str, Any]:
    async def final() -> dict[str, Any] | None:
        record = await job_record(api, url, job_id)
        return record if record["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    return await wait_until(final, timeout_s=60, every_s=0.05)


def other(node: str) -> str:
    return NODES[1 - NODES.index(node)]


def refused(cluster: LocalCluster, kind: str) -> float:
    """The scheduler's count of node reports of ``kind`` it dropped."""
    assert cluster.scheduler is not None
    value = cluster.scheduler.metrics.registry.get_sample_value(
        "gpusched_scheduler_reports_refused_total", {"kind": kind}
    )
    return value or 0.0


async def follow(api: aiohttp.ClientSession, url: str, into: list[dict[str, Any]]) -> None:
    """Append every event of the server-sent stream at ``url`` to ``into``."""
    async with api.get(url, timeout=aiohttp.ClientTimeout(total=None)) as response:
        assert response.status == 200
        kind = ""
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                into.append({"event": kind, **json.loads(line.split(":", 1)[1])})


async def cancel(api: aiohttp.ClientSession, url: str, job_id: str) -> None:
    async with api.delete(f"{url}/v1/jobs/{job_id}") as response:
        assert response.status == 202, await response.text()


# ---- message ids --------------------------------------------------------------------


async def test_a_node_cannot_drop_a_tenants_cancel_by_claiming_its_message_id(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    job = await running_job(api, cluster.url)
    job_id = job["id"]
    forger = await as_user(nodeagent_user("node-0"))
    js = forger.nc.jetstream(timeout=DENIED_REQUEST_S)
    claim = {"Nats-Msg-Id": f"{job_id}-cancel"}
    # the subjects of the jobs stream are the services' alone
    for subject in (f"gpusched.job.{job_id}.exit", subjects.job_cancel(job_id)):
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subject, b"garbage", headers=claim)
        await forger.violation(subject)
    # its own exit subject is stored in a stream of its own: the id claims nothing there
    ack = await js.publish(subjects.job_exit("node-0", job_id), b"garbage", headers=claim)
    assert ack.stream == subjects.EXITS_STREAM

    await cancel(api, cluster.url, job_id)

    assert (await ended(api, cluster.url, job_id))["state"] == "CANCELLED"


async def test_a_job_whose_message_ids_were_claimed_beforehand_still_runs_once(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    key = "claimed-before-submission"
    job_id = idempotent_job_id("default", key)  # known before the job exists
    forger = await as_user(nodeagent_user("node-0"))
    js = forger.nc.jetstream()
    ids = [job_id, f"{job_id}-cancel", f"{job_id}-predicted_size",
           *(f"{job_id}-{run}-exit" for run in (1, 2)),
           *(f"{node}-{job_id}-{run}-exit" for node in NODES for run in (1, 2))]
    for msg_id in ids:
        ack = await js.publish(subjects.job_exit("node-0", job_id), b"garbage",
                               headers={"Nats-Msg-Id": msg_id})
        assert ack.stream == subjects.EXITS_STREAM and not ack.duplicate

    async with api.post(f"{cluster.url}/v1/jobs", headers={"Idempotency-Key": key},
                        json=long_job(iterations=20)) as response:
        assert response.status == 201, await response.text()
        assert (await response.json())["id"] == job_id
    record = await ended(api, cluster.url, job_id)

    assert record["state"] == "SUCCEEDED"
    assert (record["run_id"], record["attempts"]) == (1, 0)
    assert [c["state"] for c in record["history"]].count("RUNNING") == 1


# ---- a node's own reports -------------------------------------------------------------


async def test_a_heartbeat_speaking_for_another_node_changes_nothing_of_it(
    cluster: LocalCluster, as_user: Any
):
    tap = await as_user("tap")
    commands: list[tuple[str, dict[str, Any]]] = []

    async def command(msg: Msg) -> None:
        commands.append((msg.subject, msgspec.msgpack.decode(msg.data)))

    await tap.nc.subscribe("gpusched.node.*.command", cb=command)
    await settle(tap.nc)
    forger = await as_user(nodeagent_user("node-0"))
    forged = Heartbeat(node="node-1", at=time.time(),
                       running=[RunningJob("forged-run", 1, Progress())])
    await forger.nc.publish(subjects.node_heartbeat("node-0"), codec.encode(forged),
                            headers=codec.headers())
    # its own beat, listing a run nobody started there: the scheduler stops it on node-0,
    # and handles beats in the order they came, so the forged one was handled before
    marker = Heartbeat(node="node-0", at=time.time(),
                       running=[RunningJob("marker-run", 1, Progress())])
    await forger.nc.publish(subjects.node_heartbeat("node-0"), codec.encode(marker),
                            headers=codec.headers())

    def stopped(job_id: str) -> list[str]:
        return [subject for subject, body in commands
                if body.get("type") == "stop" and body.get("job_id") == job_id]

    assert await wait_until(lambda: stopped("marker-run"), timeout_s=30) == [
        subjects.node_command("node-0")
    ]
    assert stopped("forged-run") == []
    assert refused(cluster, "heartbeat") == 1


async def test_telemetry_speaking_for_another_node_does_not_replace_its_readings(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    later = time.time() + 3600  # newer than anything the real agents send this hour

    def sample(node: str, util: float) -> bytes:
        gpus = [GpuTelemetry(index=i, uuid=f"forged-{i}", util=util, fb_used_mib=1.0,
                             fb_free_mib=1.0, power_w=1.0, temp_c=1.0) for i in range(2)]
        return codec.encode(Telemetry(node=node, at=later, gpus=gpus))

    forger = await as_user(nodeagent_user("node-0"))
    await forger.nc.publish(subjects.node_telemetry("node-0"), sample("node-1", 99.5),
                            headers=codec.headers())
    # its own readings, after: admission reads one subscription in order
    await forger.nc.publish(subjects.node_telemetry("node-0"), sample("node-0", 12.25),
                            headers=codec.headers())

    async def readings() -> dict[str, list[float]] | None:
        async with api.get(f"{cluster.url}/v1/cluster") as response:
            view = await response.json()
        utils = {n["name"]: [(g["telemetry"] or {}).get("DCGM_FI_DEV_GPU_UTIL")
                             for g in n["gpus"]] for n in view["nodes"]}
        return utils if utils.get("node-0") == [12.25, 12.25] else None

    utils = await wait_until(readings, timeout_s=30, every_s=0.05)
    assert 99.5 not in utils["node-1"]


async def test_a_registration_naming_another_node_or_erasing_the_registry_is_refused(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    forger = await as_user(nodeagent_user("node-0"))
    js = forger.nc.jetstream()
    own_key = f"$KV.{subjects.NODES_BUCKET}.node-0"
    # a rollup on its own key would purge every key of the bucket's stream
    with pytest.raises(ServerError):
        await js.publish(own_key, b"", headers={"Nats-Rollup": "all"})
    impostor = NodeInfo(name="node-1", cpus=99, host_mem_gb=1.0,
                        gpus=[GpuInfo(i, f"forged-{i}", "H100", 80_000) for i in range(8)])
    await js.publish(own_key, codec.encode(impostor), headers=codec.headers())
    # node-1 registers again, after: admission mirrors the bucket in its order
    real = await as_user(nodeagent_user("node-1"))
    again = NodeInfo(name="node-1", cpus=5, host_mem_gb=1.0,
                     gpus=[GpuInfo(i, f"real-{i}", "V100-32GB", 32_768) for i in range(2)])
    await real.nc.jetstream().publish(f"$KV.{subjects.NODES_BUCKET}.node-1",
                                      codec.encode(again), headers=codec.headers())

    async def nodes() -> list[dict[str, Any]] | None:
        async with api.get(f"{cluster.url}/v1/cluster") as response:
            view = await response.json()
        named = [n for n in view["nodes"] if n["name"] == "node-1"]
        return view["nodes"] if [n["cpus"] for n in named] == [5] else None

    listed = await wait_until(nodes, timeout_s=30, every_s=0.05)
    assert sorted(n["name"] for n in listed) == list(NODES)
    assert 99 not in [n["cpus"] for n in listed]


# ---- what a node may read -----------------------------------------------------------


async def test_a_node_agent_cannot_list_the_job_ids_in_a_streams_information(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    job_id = (await running_job(api, cluster.url))["id"]
    streams = [subjects.JOBS_STREAM, subjects.EXITS_STREAM,
               kv_stream(subjects.JOBS_BUCKET), kv_stream(subjects.LIVE_BUCKET)]
    # what the question reveals to a user allowed to ask it: every job id
    scheduler = (await as_user("scheduler")).nc.jetstream()
    listed = await scheduler.stream_info(kv_stream(subjects.LIVE_BUCKET), subjects_filter=">")
    assert f"$KV.{subjects.LIVE_BUCKET}.{job_id}" in (listed.state.subjects or {})

    forger = await as_user(nodeagent_user("node-0"))
    js = forger.nc.jetstream(timeout=DENIED_REQUEST_S)
    for stream in streams:
        with pytest.raises(nats.errors.TimeoutError):
            await js.stream_info(stream, subjects_filter=">")
        await forger.violation(f"$JS.API.STREAM.INFO.{stream}")


# ---- another node's job ---------------------------------------------------------------


async def test_forged_progress_and_a_succeeded_exit_from_another_node_do_not_end_its_job(
    cluster: LocalCluster, api: aiohttp.ClientSession, as_user: Any
):
    job = await running_job(api, cluster.url)
    job_id, run_id = job["id"], job["run_id"]
    holder = job["placement"][0]["node"]
    stranger = other(holder)
    events = asyncio.create_task(
        events_until_done(api, f"{cluster.url}/v1/jobs/{job_id}/events")
    )
    dashboard: list[dict[str, Any]] = []
    watching = asyncio.create_task(follow(api, f"{cluster.url}/v1/dashboard/events", dashboard))
    forger = await as_user(nodeagent_user(stranger))
    js = forger.nc.jetstream(timeout=DENIED_REQUEST_S)

    def progress(node: str) -> bytes:
        return codec.encode(JobProgressEvent(
            job_id=job_id, run_id=run_id, node=node, model="resnet50", batch_size=64, gpus=1,
            progress=Progress(iteration=LONG, loss=FORGED_LOSS, at=time.time()),
        ))

    def finished(node: str) -> bytes:
        return codec.encode(JobExit(
            job_id=job_id, run_id=run_id, node=node, outcome="succeeded", exit_code=0,
            iteration=LONG, at=time.time(), progress=Progress(iteration=LONG, loss=FORGED_LOSS),
        ))

    # as itself, and claiming to be the node that runs the job
    for claimed in (stranger, holder):
        await forger.nc.publish(subjects.job_progress(stranger, job_id), progress(claimed),
                                headers=codec.headers())
        await js.publish(subjects.job_exit(stranger, job_id), finished(claimed),
                         headers=codec.headers())
    # the subjects of the node that runs it are that node's alone
    for subject in (subjects.job_progress(holder, job_id), subjects.job_exit(holder, job_id)):
        await forger.nc.publish(subject, progress(holder), headers=codec.headers())
        await forger.violation(subject)

    await settle(forger.nc)
    forged_by = time.time()
    await wait_until(lambda: refused(cluster, "progress") == 2 and refused(cluster, "exit") == 2,
                     timeout_s=30)
    assert (await job_record(api, cluster.url, job_id))["state"] == "RUNNING"
    # the dashboard gets every progress event on one subscription, in the server's order:
    # one the holder sent after the forgeries comes after them
    await wait_until(lambda: [e for e in dashboard if e["event"] == "progress"
                              and e["progress"]["at"] > forged_by], timeout_s=30)
    watching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watching
    shown = [e for e in dashboard if e["event"] == "progress"]
    assert shown and all(e["node"] == holder for e in shown)
    assert all(e["progress"]["loss"] != FORGED_LOSS for e in shown)
    await cancel(api, cluster.url, job_id)
    record = await ended(api, cluster.url, job_id)
    seen = await asyncio.wait_for(events, 60)

    assert record["state"] == "CANCELLED"
    assert record["progress"]["loss"] != FORGED_LOSS
    shown = [e for e in seen if e["event"] == "progress"]
    assert all(e["node"] == holder and e["progress"]["loss"] != FORGED_LOSS for e in shown)
    assert json.dumps(FORGED_LOSS) not in json.dumps(seen)


# ---- the scheduler's picture of a run -----------------------------------------------


async def test_another_nodes_listing_of_a_run_does_not_keep_it_alive(nats_server, nc, stores):
    await register_node(stores)
    await register_node(stores, "n2")
    job_id = await store_running_job(stores)  # on NODE
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        await asyncio.sleep(1.0)  # longer than the grace since the load
        # NODE is alive but lists nothing; n2 lists NODE's run as its own
        for beat in (Heartbeat(node=NODE, at=time.time()),
                     Heartbeat(node="n2", at=time.time(),
                               running=[RunningJob(job_id, 1, Progress())])):
            scheduler.liveness.saw(beat, arrived=time.time())
            await scheduler.handle(Beat(beat))
        await scheduler.handle(Sweep())
        record = await record_of(stores, job_id)
        assert record.state is JobState.QUEUED
        assert "no longer reports it running" in record.history[-1].reason


async def test_an_exit_stored_by_another_node_is_not_taken_for_a_lost_runs_end(
    nats_server, nc, stores
):
    await register_node(stores)
    job_id = await store_running_job(stores)  # on NODE
    async with idle_scheduler(
        nats_server.url, nc, stores, node_timeout_s=60.0, missing_job_grace_s=0.5
    ) as scheduler:
        # n2 stores a succeeded exit of NODE's run under its own subject, claiming NODE
        await store_exit(stores, succeeded(job_id, 1), node="n2")
        scheduler.liveness.saw(Heartbeat(node=NODE, at=time.time()), arrived=time.time())
        await asyncio.sleep(1.0)  # longer than the grace: NODE no longer lists the run
        await scheduler.handle(Sweep())
        record = await record_of(stores, job_id)
        assert record.state is JobState.QUEUED
        assert [c.state for c in record.history].count(JobState.SUCCEEDED) == 0
