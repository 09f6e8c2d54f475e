"""A job's own command gets the standard PyTorch distributed environment, one process per
GPU: an unmodified torch.distributed script (gloo, env://) runs across the GPUs and nodes
the scheduler gave it, through the real scheduler, node agents and nats-server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobSpec, JobState, StartJob
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import discover
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.nodeagent.worker.launch import rank_environment
from gpusched.services.scheduler.live import SchedulerService
from tests.limits import process_limit_s
from tests.live import fast_scheduler, spec, store_job, wait_state
from tests.test_live_scheduling import nodes

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from env://
total = torch.ones(1)
dist.all_reduce(total)
seen = {name: os.environ[name] for name in
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GPUSCHED_NODE")}
seen["sum"] = total.item()
seen["progress_file"] = os.environ["GPUSCHED_PROGRESS_FILE"]
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank-{seen['RANK']}.json")
with open(out, "w") as handle:
    json.dump(seen, handle)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("count", "gpus"), [(2, 1), (1, 2)], ids=["two-nodes", "one-node"])
async def test_a_torch_distributed_script_runs_one_rank_per_gpu_with_the_right_ranks(
    nats_server, stores: Stores, tmp_path: Path, count: int, gpus: int
):
    script = tmp_path / "script" / "allreduce.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    async with nodes(nats_server.url, tmp_path, count=count, gpus=gpus, jobs_mode="process"
                     ), SchedulerService(fast_scheduler(nats_server.url)):
        job_id = await store_job(stores, spec(gpus=2, iterations=1,
                                              command=[sys.executable, str(script)]))
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, JobState.FAILED,
                                timeout_s=process_limit_s(2))
    assert done.state is JobState.SUCCEEDED, done.error
    seen = [json.loads((script.parent / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(s["RANK"], s["WORLD_SIZE"], s["sum"]) for s in seen] == [
        ("0", "2", 2.0), ("1", "2", 2.0)
    ]
    per_node = str(2 // count)
    assert {s["LOCAL_WORLD_SIZE"] for s in seen} == {per_node}
    assert [s["LOCAL_RANK"] for s in seen] == (["0", "0"] if count == 2 else ["0", "1"])
    assert len({s["GPUSCHED_NODE"] for s in seen}) == count
    # on one node the launcher leaves the progress file to rank 0 alone
    assert seen[0]["progress_file"].endswith(".jsonl")
    if count == 1:
        assert seen[1]["progress_file"] == "/dev/null"


def start(command: list[str] | None, gpus: list[int], **fields: object) -> StartJob:
    job = JobSpec(name="t", model="resnet50", batch_size=8, iterations=1, gpus=4,
                  command=command, tensor_parallel=2)
    return StartJob(job_id="j", run_id=1, spec=job, total_iterations=1, gpus=gpus,
                    **fields)  # type: ignore[arg-type]


def test_a_command_on_several_gpus_runs_through_the_launcher_with_the_torch_variables(
    tmp_path: Path,
):
    config = NodeAgentConfig(name="node-1", gpus=4, work_dir=tmp_path)
    inventory = discover("node-1", 4, config.gpu_model, config.gpu_mem_mb, None)
    plan = process_plan(
        start(["python", "train.py"], [0, 1], nodes=2, leader=False,
              rendezvous="tcp://10.0.0.7:29511", first_rank=2, world_size=4),
        config, inventory,
    )
    launcher = "gpusched.services.nodeagent.worker.launch"
    assert plan.argv[1:] == ("-m", launcher, "python", "train.py")
    assert {name: plan.env[name] for name in (
        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "GPUSCHED_DATA_PARALLEL", "GPUSCHED_TENSOR_PARALLEL", "GPUSCHED_PIPELINE_PARALLEL",
    )} == {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511", "RANK": "2", "WORLD_SIZE": "4",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GPUSCHED_DATA_PARALLEL": "2",
           "GPUSCHED_TENSOR_PARALLEL": "2", "GPUSCHED_PIPELINE_PARALLEL": "1"}
    second = rank_environment(plan.env, 1)
    assert (second["RANK"], second["LOCAL_RANK"]) == ("3", "1")
    assert second["GPUSCHED_PROGRESS_FILE"] == "/dev/null"

    # the built-in worker gets the degrees, not the torch variables; one GPU, no launcher
    worker = process_plan(start(None, [0, 1, 2, 3]), config, inventory)
    assert worker.argv[1:] == ("-m", "gpusched.services.nodeagent.worker")
    assert "MASTER_ADDR" not in worker.env and worker.env["GPUSCHED_DATA_PARALLEL"] == "2"
    single = process_plan(start(["python", "train.py"], [3]), config, inventory)
    assert single.argv == ("python", "train.py") and single.env["RANK"] == "0"
