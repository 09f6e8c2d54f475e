"""The node agent against a real nats-server: registration, heartbeats, telemetry,
commands and simulated runs, exits stored in JetStream."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, NotFoundError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    CommandReply,
    Heartbeat,
    JobExit,
    JobProgressEvent,
    JobSpec,
    NodeInfo,
    StartJob,
    StopJob,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.shape import JobShape
from gpusched.services.nodeagent.agent import AgentSnapshot, NodeAgent
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import emulated_uuid

TRUTH = ProfilePerformanceModel.builtin()
NODE = "node-a"
#: long enough that a job started with it never finishes during a test
FOREVER = 10**9


def agent_config(nats_url: str, work_dir: Path, **overrides: Any) -> NodeAgentConfig:
    """A four-GPU node reporting every 50 ms."""
    settings: dict[str, Any] = {
        "nats_url": nats_url,
        "name": NODE,
        "gpus": 4,
        "heartbeat_s": 0.05,
        "telemetry_s": 0.05,
        "progress_s": 0.05,
        "work_dir": work_dir,
        "exit_flush_s": 5.0,
    }
    settings.update(overrides)
    return NodeAgentConfig(**settings)


#: process runs: fast progress polling, a quick kill, time for the worker to checkpoint
PROCESS_TIMINGS: dict[str, Any] = {
    "progress_poll_s": 0.02, "kill_grace_s": 0.3, "preempt_grace_s": 20.0
}


@pytest.fixture
def config(nats_server: NatsServer, tmp_path: Path) -> NodeAgentConfig:
    return agent_config(nats_server.url, tmp_path / "work")


@pytest.fixture
async def agent(config: NodeAgentConfig, stores: Stores) -> AsyncIterator[NodeAgent]:
    # the services create the streams an agent stores into: an agent may not
    async with NodeAgent(config) as running:
        yield running


def start(job_id: str, run_id: int = 1, gpus: tuple[int, ...] = (0,), **changes: Any) -> StartJob:
    spec = JobSpec(
        name=job_id,
        model=changes.pop("model", "resnet50"),
        batch_size=changes.pop("batch_size", 64),
        gpus=len(gpus),
        iterations=changes.get("total_iterations", FOREVER),
    )
    values: dict[str, Any] = {"total_iterations": FOREVER, "spec": spec, **changes}
    return StartJob(job_id=job_id, run_id=run_id, gpus=list(gpus), **values)


async def send(nc: Client, command: StartJob | StopJob, node: str = NODE) -> CommandReply:
    reply = await nc.request(
        subjects.node_command(node), codec.encode(command), timeout=5, headers=codec.headers()
    )
    return codec.decode(reply.data, CommandReply)


async def stored_exit(
    stores: Stores, job_id: str, timeout_s: float = 10.0, node: str = NODE
) -> JobExit:
    async def last() -> JobExit | None:
        try:
            msg = await stores.js.get_last_msg(
                subjects.EXITS_STREAM, subjects.job_exit(node, job_id)
            )
        except (NotFoundError, TimeoutError):
            return None
        except Exception as exc:  # the server may still be coming back
            if "Timeout" in type(exc).__name__ or "NoResponders" in type(exc).__name__:
                return None
            raise
        exit = codec.decode(msg.data, JobExit)
        assert msg.headers is not None
        # the node's, the job's and the run's, and a part nobody else can guess
        prefix, nonce = msg.headers["Nats-Msg-Id"].rsplit("-", 1)
        assert prefix == f"{node}-{job_id}-{exit.run_id}-exit" and len(nonce) == 16
        return exit

    return await wait_until(last, timeout_s)


async def exits_stored(stores: Stores, job_id: str, node: str = NODE) -> int:
    subject = subjects.job_exit(node, job_id)
    info = await stores.js.stream_info(subjects.EXITS_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


class Inbox:
    """Every message on a subject, decoded."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.items: list[Any] = []
        self.raw: list[dict[str, Any]] = []

    async def receive(self, msg: Any) -> None:
        assert msg.headers and msg.headers.get("Content-Type") == codec.CONTENT_TYPE
        self.raw.append(msgspec.msgpack.decode(msg.data))
        self.items.append(codec.decode(msg.data, self.kind))


async def listen(nc: Client, subject: str, kind: type) -> Inbox:
    inbox = Inbox(kind)
    await nc.subscribe(subject, cb=inbox.receive)
    await nc.flush()
    return inbox


# ---- registration and reports ---------------------------------------------------------


async def test_an_agent_registers_its_gpus_sends_heartbeats_and_deregisters_on_exit(
    config: NodeAgentConfig, nc: Client, stores: Stores
):
    beats = await listen(nc, subjects.node_heartbeat(NODE), Heartbeat)
    async with NodeAgent(config):
        entry = await stores.nodes.get(NODE)
        assert entry.value is not None
        info = codec.decode(entry.value, NodeInfo)
        assert info.name == NODE and info.emulated
        assert [g.index for g in info.gpus] == [0, 1, 2, 3]
        assert [g.uuid for g in info.gpus] == [emulated_uuid(NODE, i) for i in range(4)]
        assert {g.memory_mb for g in info.gpus} == {32768}
        await wait_until(lambda: len(beats.items) >= 3)
        assert all(b.node == NODE and b.running == [] for b in beats.items)
    with pytest.raises(KeyNotFoundError):
        await stores.nodes.get(NODE)


async def test_telemetry_carries_dcgm_field_names_and_the_memory_of_resident_jobs(
    agent: NodeAgent, nc: Client
):
    samples = await listen(nc, subjects.node_telemetry(NODE), dict)
    assert (await send(nc, start("mem", gpus=(1,), accum_steps=2))).ok
    expected_mb = TRUTH.gpu_memory_mb("resnet50", 64 / 2)

    def gpu_one_in_use() -> dict[str, Any] | None:
        for sample in samples.raw:
            gpu = sample["gpus"][1]
            if sample["jobs"] and gpu["DCGM_FI_DEV_GPU_UTIL"] == 100.0:
                return gpu
        return None

    gpu = await wait_until(gpu_one_in_use)
    assert set(gpu) >= {
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP",
    }
    assert gpu["DCGM_FI_DEV_FB_USED"] == pytest.approx(expected_mb, abs=0.1)
    assert gpu["DCGM_FI_DEV_FB_FREE"] == pytest.approx(32768 - expected_mb, abs=0.1)
    assert samples.raw[-1]["gpus"][0]["DCGM_FI_DEV_GPU_UTIL"] == 0.0


# ---- simulated runs ----------------------------------------------------------------------


async def test_a_simulated_job_advances_at_the_ground_truth_speed_to_a_succeeded_exit(
    config: NodeAgentConfig, nc: Client, stores: Stores
):
    scale = 0.0005
    progress = await listen(nc, subjects.job_progress(NODE, "sim"), JobProgressEvent)
    async with NodeAgent(dataclasses.replace(config, time_scale=scale)):
        reply = await send(nc, start("sim", total_iterations=4000, resume_iteration=1000))
        assert reply.ok
        exit = await stored_exit(stores, "sim")
    assert (exit.outcome, exit.iteration, exit.node, exit.run_id) == ("succeeded", 4000, NODE, 1)
    assert await exits_stored(stores, "sim") == 1
    measured = [e.iteration_s for e in progress.items if e.iteration_s is not None]
    assert measured, "no progress event measured a speed"
    # reported in the job's own seconds: the ground truth, whatever the time scale
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    assert measured[0] == pytest.approx(alone, rel=1e-6)
    first = progress.items[0]
    assert first.progress.iteration >= 1000 and first.co_runners == []
    assert (first.model, first.batch_size, first.gpus, first.node) == ("resnet50", 64, 1, NODE)


async def test_a_start_on_a_gpu_the_node_lacks_is_refused(agent: NodeAgent, nc: Client):
    reply = await send(nc, start("far", gpus=(0, 9)))
    assert not reply.ok and "GPU 9" in reply.error and "0-3" in reply.error
    twice = await send(nc, start("twice", gpus=(1, 1)))
    assert not twice.ok and "twice" in twice.error
    assert (await agent.snapshot()).running == {}


async def test_a_repeated_start_of_the_same_run_is_idempotent(
    agent: NodeAgent, nc: Client, stores: Stores
):
    command = start("again")
    assert (await send(nc, command)).ok
    assert (await send(nc, command)).ok
    assert (await agent.snapshot()).running == {"again": 1}
    other_run = await send(nc, start("again", run_id=2))
    assert not other_run.ok and "run 1" in other_run.error
    assert (await send(nc, StopJob(job_id="again", run_id=1, reason="preempt"))).ok
    await stored_exit(stores, "again")
    # a start retried after its run ended does not run it a second time
    assert (await send(nc, command)).ok
    assert (await agent.snapshot()).running == {}
    assert await exits_stored(stores, "again") == 1


async def test_a_preempted_simulated_job_exits_stopped_at_the_iteration_reached(
    agent: NodeAgent, nc: Client, stores: Stores
):
    progress = await listen(nc, subjects.job_progress(NODE, "pre"), JobProgressEvent)
    assert (await send(nc, start("pre", emulated_iteration_s=0.005))).ok
    await wait_until(lambda: any(e.progress.iteration >= 5 for e in progress.items))
    seen = max(e.progress.iteration for e in progress.items)
    assert (await send(nc, StopJob(job_id="pre", run_id=1, reason="preempt"))).ok
    exit = await stored_exit(stores, "pre")
    assert exit.outcome == "stopped" and seen <= exit.iteration < FOREVER
    # stopping a run the node does not have (any more) is fine
    assert (await send(nc, StopJob(job_id="pre", run_id=1, reason="cancel"))).ok
    assert (await send(nc, StopJob(job_id="never", run_id=4))).ok


async def test_a_colocated_simulated_job_runs_slower_by_the_ground_truth_slowdown(
    config: NodeAgentConfig, nc: Client
):
    progress = await listen(nc, subjects.ALL_JOB_PROGRESS, JobProgressEvent)
    alone = TRUTH.iteration_time("resnet50", 64, 1, 1)
    slowdown = TRUTH.colocation_slowdown(JobShape("resnet50", 64, 1, 1), JobShape("bert", 32, 1, 1))
    bert_alone = TRUTH.iteration_time("bert", 32, 1, 1)
    bert_slowdown = TRUTH.colocation_slowdown(
        JobShape("bert", 32, 1, 1), JobShape("resnet50", 64, 1, 1)
    )
    assert slowdown > 1.0

    def measured(job: str, value: float, co_runners: list[str]) -> bool:
        return any(
            e.job_id == job and e.co_runners == co_runners and e.iteration_s is not None
            and e.iteration_s == pytest.approx(value, rel=1e-6)
            for e in progress.items
        )

    async with NodeAgent(dataclasses.replace(config, time_scale=0.01)) as agent:
        assert (await send(nc, start("res", gpus=(0,)))).ok
        await wait_until(lambda: measured("res", alone, []))
        assert (await send(nc, start("brt", gpus=(0,), model="bert", batch_size=32))).ok
        await wait_until(lambda: measured("res", alone * slowdown, ["brt"]))
        await wait_until(lambda: measured("brt", bert_alone * bert_slowdown, ["res"]))
        # a job on another GPU does not slow it
        assert (await send(nc, start("aside", gpus=(1,), model="bert", batch_size=32))).ok
        assert (await send(nc, StopJob(job_id="brt", run_id=1, reason="cancel"))).ok
        progress.items.clear()
        await wait_until(lambda: measured("res", alone, []))
        assert (await agent.snapshot()).running == {"res": 1, "aside": 1}


async def test_the_exit_is_delivered_when_nats_restarts_in_between(
    agent: NodeAgent, nats_server: NatsServer, nc: Client, stores: Stores
):
    assert (await send(nc, start("survivor", emulated_iteration_s=0.002,
                               total_iterations=50))).ok
    nats_server.stop()

    async def exit_waiting() -> AgentSnapshot | None:
        snapshot = await agent.snapshot()
        return snapshot if snapshot.undelivered_exits else None

    snapshot = await wait_until(exit_waiting)
    assert snapshot.undelivered_exits == ("survivor",) and snapshot.running == {}
    nats_server.start()
    exit = await stored_exit(stores, "survivor", timeout_s=20)
    assert (exit.outcome, exit.iteration) == ("succeeded", 50)
    assert await exits_stored(stores, "survivor") == 1


async def test_a_node_registers_again_after_nats_restarts(
    agent: NodeAgent, nats_server: NatsServer, nc: Client, stores: Stores
):
    await stores.nodes.delete(NODE)
    nats_server.restart()

    async def registered() -> bool:
        # short timeouts: a request sent while this client is still reconnecting is lost
        try:
            nodes = await nc.jetstream(timeout=0.25).key_value(subjects.NODES_BUCKET)
            entry = await nodes.get(NODE)
        except Exception:
            return False
        return entry.value is not None and codec.decode(entry.value, NodeInfo).name == NODE

    assert await wait_until(registered, timeout_s=20)


async def test_stopping_the_agent_preempts_its_jobs_and_reports_where_they_were(
    config: NodeAgentConfig, nc: Client, stores: Stores
):
    progress = await listen(nc, subjects.job_progress(NODE, "held"), JobProgressEvent)
    async with NodeAgent(config):
        assert (await send(nc, start("held", emulated_iteration_s=0.005))).ok
        await wait_until(lambda: any(e.progress.iteration >= 2 for e in progress.items))
    exit = await stored_exit(stores, "held", timeout_s=1)
    assert exit.outcome == "stopped" and exit.iteration >= 2
    with pytest.raises(KeyNotFoundError):
        await stores.nodes.get(NODE)


async def test_an_undecodable_command_is_refused_naming_the_field(agent: NodeAgent, nc: Client):
    bad = codec.encode({"type": "stop", "job_id": "x", "run_id": "seven"})
    reply = await nc.request(subjects.node_command(NODE), bad, timeout=5)
    answer = codec.decode(reply.data, CommandReply)
    assert not answer.ok and "run_id" in answer.error


async def test_a_command_of_another_schema_version_is_refused(agent: NodeAgent, nc: Client):
    stop = codec.encode(StopJob(job_id="x", run_id=1))
    reply = await nc.request(subjects.node_command(NODE), stop, timeout=5,
                             headers=codec.headers({codec.SCHEMA_HEADER: "99"}))
    answer = codec.decode(reply.data, CommandReply)
    assert not answer.ok and "schema version 99" in answer.error


async def test_the_command_endpoint_is_a_nats_micro_service_named_with_its_node(
    agent: NodeAgent, nc: Client
):
    info = json.loads((await nc.request("$SRV.INFO.gpusched-nodeagent", b"", timeout=5)).data)
    assert (info["name"], info["metadata"]) == ("gpusched-nodeagent", {"node": NODE})
    assert {(e["name"], e["subject"]) for e in info["endpoints"]} == {
        ("command", subjects.node_command(NODE)),
        ("profile", subjects.node_profile(NODE)),
        ("compute_profile", subjects.node_compute_profile(NODE)),
        ("gpu_profile", subjects.node_gpu_profile(NODE)),
    }
    ping = json.loads((await nc.request("$SRV.PING.gpusched-nodeagent", b"", timeout=5)).data)
    assert (ping["name"], ping["id"], ping["metadata"]) == (
        "gpusched-nodeagent", info["id"], {"node": NODE}
    )
    # refusals are CommandReplies, not micro errors: the scheduler decodes the body
    reply = await nc.request(subjects.node_command(NODE), b"\xc1", timeout=5)
    assert not (reply.headers or {}).get("Nats-Service-Error")
    assert not codec.decode(reply.data, CommandReply).ok


async def test_a_simulated_job_of_an_unknown_model_needs_its_speed_given(
    agent: NodeAgent, nc: Client, stores: Stores
):
    refused = await send(nc, start("odd", model="my-own-net"))
    assert not refused.ok and "my-own-net" in refused.error
    given = start("odd", model="my-own-net", emulated_iteration_s=0.001, total_iterations=20)
    assert (await send(nc, given)).ok
    assert (await stored_exit(stores, "odd")).outcome == "succeeded"


async def test_a_part_that_is_not_the_leader_holds_its_gpus_and_reports_no_exit(
    agent: NodeAgent, nc: Client, stores: Stores
):
    beats = await listen(nc, subjects.node_heartbeat(NODE), Heartbeat)
    assert (await send(nc, start("wide", gpus=(2, 3), leader=False, nodes=2))).ok
    await wait_until(lambda: any(
        [r.job_id for r in b.running] == ["wide"] for b in beats.items
    ))
    assert (await send(nc, StopJob(job_id="wide", run_id=1, reason="lost"))).ok
    snapshot = await agent.snapshot()
    assert snapshot.running == {} and snapshot.undelivered_exits == ()
    assert await exits_stored(stores, "wide") == 0


async def test_an_emulated_cluster_runs_an_agent_per_node(nats_server: NatsServer, nc: Client,
                                                         stores: Stores, tmp_path: Path):
    beats = await listen(nc, subjects.ALL_HEARTBEATS, Heartbeat)
    cluster = EmulatedCluster.of(
        nats_server.url, 3, gpus_per_node=2, heartbeat_s=0.05, telemetry_s=0.05,
        progress_s=0.05, work_dir=tmp_path,
    )
    async with cluster:
        assert cluster.names == ["node-0", "node-1", "node-2"]
        for name in cluster.names:
            info = codec.decode((await stores.nodes.get(name)).value or b"", NodeInfo)
            assert len(info.gpus) == 2 and info.cpus == 8
        await wait_until(lambda: {b.node for b in beats.items} == set(cluster.names))
        assert (await send(nc, start("c1", emulated_iteration_s=0.001, total_iterations=5),
                           node="node-2")).ok
        assert (await stored_exit(stores, "c1", node="node-2")).node == "node-2"
    for name in cluster.names:
        with pytest.raises(KeyNotFoundError):
            await stores.nodes.get(name)
