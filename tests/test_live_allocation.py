"""CPU and memory allocations on a live node: the real torch worker, started by a node
agent on a real nats-server, runs pinned to the cores it was allocated with one torch
thread per core, and a reallocation re-pins it while it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    CommandReply,
    JobSpec,
    Placement,
    ReallocateJob,
    StartJob,
    StopJob,
)
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.cores import machine_cores, pick_cores, real_cores
from gpusched.services.nodeagent.gpus import discover
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.scheduler.live import _node_share
from tests.limits import process_limit_s
from tests.test_nodeagent_service import FOREVER, NODE, PROCESS_TIMINGS, agent_config, send


def training(job_id: str, gpu: int, cpus: float, mem_gb: float) -> StartJob:
    spec = JobSpec(name=job_id, model="ncf", batch_size=8, iterations=FOREVER)
    return StartJob(job_id=job_id, run_id=1, spec=spec, total_iterations=FOREVER, gpus=[gpu],
                    cpus=cpus, mem_gb=mem_gb)


def cpu_use(work_dir: Path, job_id: str) -> list[tuple[list[int], int]]:
    """(affinity, torch threads) of every progress line the worker wrote so far."""
    path = work_dir / job_id / "progress-1.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(line["affinity"], line["threads"]) for line in lines if "threads" in line]


async def reported(work_dir: Path, job_id: str, affinity: list[int], threads: int) -> None:
    await wait_until(lambda: (affinity, threads) in cpu_use(work_dir, job_id),
                     timeout_s=process_limit_s(2))


async def request(nc: Client, payload: dict[str, Any] | ReallocateJob) -> CommandReply:
    data = codec.encode(payload) if isinstance(payload, ReallocateJob) else (
        msgspec.msgpack.encode(payload)  # no command type would let it be built
    )
    reply = await nc.request(subjects.node_command(NODE), data, timeout=5,
                             headers=codec.headers())
    return codec.decode(reply.data, CommandReply)


async def test_process_runs_are_pinned_to_their_cores_and_reallocated_in_place(
    nats_server: NatsServer, nc: Client, tmp_path: Path
):
    work_dir = tmp_path / "work"
    config = agent_config(nats_server.url, work_dir, cpus=2, jobs_mode="process",
                          **PROCESS_TIMINGS)
    machine = machine_cores()
    first, second = real_cores((0,), machine), real_cores((1,), machine)
    async with NodeAgent(config) as agent:
        assert (await send(nc, training("a", 0, cpus=1.0, mem_gb=2.0))).ok
        assert (await send(nc, training("b", 1, cpus=1.0, mem_gb=3.0))).ok
        assert (await agent.snapshot()).cores == {"a": (0,), "b": (1,)}
        # each worker runs on its own core, with one torch thread
        await reported(work_dir, "a", list(first), 1)
        await reported(work_dir, "b", list(second), 1)
        env = json.loads((work_dir / "a" / "allocation-1.json").read_text())
        assert env == {"cpus": list(first), "mem_gb": 2.0}

        # an invalid reallocation is refused naming the field; one of a run not here too
        bad = {"type": "reallocate", "job_id": "a", "run_id": 1, "cpus": -1.0, "mem_gb": 1.0}
        refused = await request(nc, bad)
        assert not refused.ok and "$.cpus" in refused.error
        unknown = ReallocateJob(job_id="a", run_id=7, cpus=1.0, mem_gb=1.0)
        refused = await request(nc, unknown)
        assert not refused.ok and "run_id" in refused.error

        # b leaves; a grows to both cores without a restart
        assert (await send(nc, StopJob(job_id="b", run_id=1, reason="cancel"))).ok

        async def b_ended() -> bool:
            return "b" not in (await agent.snapshot()).running

        await wait_until(b_ended, timeout_s=process_limit_s(1))
        grown = ReallocateJob(job_id="a", run_id=1, cpus=2.0, mem_gb=4.0)
        assert (await request(nc, grown)).ok
        assert (await agent.snapshot()).cores == {"a": (0, 1)}
        both = sorted(set(first) | set(second))
        await reported(work_dir, "a", both, len(both))
        assert (await agent.snapshot()).running == {"a": 1}  # the same run, not restarted
        assert not (work_dir / "a" / "progress-2.jsonl").exists()


def test_cores_are_picked_lowest_first_and_shared_only_when_none_are_free():
    assert pick_cores(2.0, taken={0}, node_cores=4) == (1, 2)
    assert pick_cores(0.5, taken=set(), node_cores=4) == (0,)
    assert pick_cores(1.5, taken={0, 1, 2}, node_cores=4) == (0, 3)
    # an emulated node's cores wrap around the machine's
    assert real_cores((0, 1, 2, 3, 4), (5, 7)) == (5, 7)


def test_a_jobs_allocation_is_split_over_its_nodes_by_gpus():
    placement = [Placement("n0", [0, 1, 2]), Placement("n1", [0])]
    assert _node_share(8.0, placement[0], placement) == 6.0
    assert _node_share(8.0, placement[1], placement) == 2.0
    assert _node_share(None, placement[1], placement) is None


def test_the_worker_contract_carries_the_allocation(tmp_path: Path):
    config = agent_config("nats://127.0.0.1:1", tmp_path, cpus=4, gpus=2)
    inventory = discover(config.name, 2, "V100-32GB", 32768)
    plan = process_plan(training("c", 0, cpus=2.0, mem_gb=6.5), config, inventory, (0, 1))
    assert plan.env["GPUSCHED_CPUS"] == "0,1"
    assert plan.env["GPUSCHED_MEM_GB"] == "6.5"
    assert plan.cores == (0, 1)
    unallocated = msgspec.structs.replace(training("d", 0, 1.0, 1.0), cpus=None, mem_gb=None)
    plan = process_plan(unallocated, config, inventory)
    assert "GPUSCHED_CPUS" not in plan.env and plan.allocation_file is None
