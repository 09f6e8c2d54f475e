"""Synergy live: on one node, the real scheduler with the synergy-fifo policy gives a
CPU-hungry job more cores than a CPU-light one, the node agent pins each real torch
worker to its cores, and each worker's input-pipeline processes and torch threads follow
them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import JobState
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.cores import machine_cores, real_cores
from gpusched.services.nodeagent.worker.pipeline import workers_for
from gpusched.services.scheduler.live import SchedulerService
from tests.limits import process_limit_s
from tests.live import fast_scheduler, record, spec, store_job, wait_state
from tests.test_nodeagent_service import FOREVER, PROCESS_TIMINGS

#: the node: 2 GPUs, 6 CPUs and 125 GB per GPU, so that the hungry job's best case
#: (9 CPUs, 125 GB) and the light one's (3 CPUs, 62.5 GB) both fit beside each other
GPUS, CPUS_PER_GPU, MEM_GB_PER_GPU = 2, 6, 125.0


def cpu_use(work_dir: Path, job_id: str) -> list[dict[str, Any]]:
    """The cores, torch threads and pipeline workers of every progress line so far."""
    path = work_dir / job_id / "progress-1.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = ("affinity", "threads", "data_workers")
    return [{key: line[key] for key in keys} for line in lines if "data_workers" in line]


async def test_synergy_gives_a_cpu_hungry_job_more_cores_and_its_worker_runs_on_them(
    nats_server: NatsServer, stores: Stores, tmp_path: Path
):
    work_dir = tmp_path / "work"
    cluster = EmulatedCluster.of(
        nats_server.url, 1, GPUS, cpus_per_gpu=CPUS_PER_GPU, host_mem_gb_per_gpu=MEM_GB_PER_GPU,
        work_dir=work_dir, jobs_mode="process", heartbeat_s=0.2, telemetry_s=0.5,
        progress_s=0.2, **PROCESS_TIMINGS,
    )  # fmt: skip
    truth = ProfilePerformanceModel.builtin()
    hungry_best = truth.cpu_mem_demand("resnet18")
    light_best = truth.cpu_mem_demand("ncf")
    assert hungry_best.cpus_per_gpu > CPUS_PER_GPU > light_best.cpus_per_gpu

    async with cluster, SchedulerService(fast_scheduler(nats_server.url, policy="synergy-fifo")):
        hungry = await store_job(
            stores, spec(model="resnet18", batch_size=8, iterations=FOREVER), "hungry"
        )
        light = await store_job(
            stores, spec(model="ncf", batch_size=8, iterations=FOREVER), "light"
        )
        for job_id in (hungry, light):
            await wait_state(stores, job_id, JobState.RUNNING, timeout_s=process_limit_s(2))

        # each got its best case: the hungry job above its fair share, the light below
        allocated = {job_id: await record(stores, job_id) for job_id in (hungry, light)}
        assert (allocated[hungry].cpus, allocated[hungry].mem_gb) == (
            hungry_best.cpus_per_gpu,
            hungry_best.mem_gb_per_gpu,
        )
        assert (allocated[light].cpus, allocated[light].mem_gb) == (
            light_best.cpus_per_gpu,
            light_best.mem_gb_per_gpu,
        )
        # the agent pinned each run to that many of the node's cores, none shared
        cores = (await cluster.agents[0].snapshot()).cores
        assert len(cores[hungry]) == hungry_best.cpus_per_gpu
        assert len(cores[light]) == light_best.cpus_per_gpu
        assert not set(cores[hungry]) & set(cores[light])

        # each worker runs on the machine's cores behind its node cores (emulated cores
        # wrap around the machine's), with one torch thread and one pipeline worker each
        machine = machine_cores()
        for job_id in (hungry, light):
            affinity = list(real_cores(cores[job_id], machine))
            expected = {
                "affinity": affinity,
                "threads": len(affinity),
                "data_workers": workers_for(len(affinity)),
            }
            await wait_until(
                lambda job_id=job_id, expected=expected: expected in cpu_use(work_dir, job_id),
                timeout_s=process_limit_s(2),
            )
            assert all(use == expected for use in cpu_use(work_dir, job_id)), job_id
