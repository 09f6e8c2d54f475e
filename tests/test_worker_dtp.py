"""A job with tensor or pipeline parallelism trains the (d, t, p) MLP: real worker processes
on gloo, ranks across two emulated nodes, shards checkpointed and resumed, and the same
weights as one process training the unsplit MLP on the whole batch."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import free_port
from gpusched.libs.common.schemas import JobState
from gpusched.services.nodeagent.worker.catalog import ModelSpec, cpu_cost_for
from gpusched.services.nodeagent.worker.degrees import Degrees, DegreesError, degrees_for
from gpusched.services.nodeagent.worker.dtp import build_stage, new_groups, unsplit_mlp
from gpusched.services.nodeagent.worker.pipeline import DataSet, DecodedCache, InputPipeline
from gpusched.services.nodeagent.worker.training import make_optimizer
from gpusched.services.nodeagent.worker.zoo import SyntheticData
from gpusched.services.scheduler.live import SchedulerService
from tests.limits import process_limit_s
from tests.live import fast_scheduler, spec, store_job, wait_state
from tests.test_live_scheduling import nodes
from tests.test_worker_parallel import Job
from tests.test_worker_process import REPOSITORY, job_env, progress

MLP = ModelSpec.for_model("mlp")
DATASET_SIZE = 256
BATCH = 32
LR = 0.4
#: four ranks at once, twice over (a run and its resumption)
FOUR_RANKS_S = process_limit_s(4)


def dtp_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    values = {
        "GPUSCHED_BATCH_SIZE": str(BATCH), "GPUSCHED_ACCUM_STEPS": "1",
        "GPUSCHED_BASE_LR": str(LR), "GPUSCHED_DATASET_SIZE": str(DATASET_SIZE),
        "GPUSCHED_CHECKPOINT_EVERY": "5",
    }
    return job_env(tmp_path, **{**values, **overrides})


async def run_parts(tmp_path: Path, parts: list[dict[str, str]], name: str) -> None:
    """One worker per node, started together; all must exit 0."""
    jobs = [Job(env, tmp_path / f"{name}-{i}.txt") for i, env in enumerate(parts)]
    try:
        for job in jobs:
            assert await job.exit_code() == 0, job.output
    finally:
        for job in jobs:
            job.kill()


def two_nodes(env: dict[str, str], **degrees: str) -> list[dict[str, str]]:
    """The job on two emulated nodes of 2 GPUs: ranks 0-1 and 2-3, one rendezvous."""
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    shared = {**env, **degrees, "GPUSCHED_GPUS": "0,1", "GPUSCHED_RENDEZVOUS": rendezvous,
              "GPUSCHED_WORLD_SIZE": "4"}
    follower = {**shared, "GPUSCHED_FIRST_RANK": "2",
                "GPUSCHED_PROGRESS_FILE": env["GPUSCHED_PROGRESS_FILE"] + ".node-1"}
    return [{**shared, "GPUSCHED_FIRST_RANK": "0"}, follower]


def losses(path: Path) -> list[float]:
    return [line["loss"] for line in progress(path) if line["event"] == "progress"]


def unsplit_training(model: str, iterations: int) -> dict[str, torch.Tensor]:
    """The same MLP in one process, trained on the whole batch of every iteration."""
    torch.manual_seed(0)
    net = unsplit_mlp(MLP, 0, 1)
    optimizer = make_optimizer(net, LR)
    pipeline = InputPipeline(DataSet(0, DATASET_SIZE, cpu_cost_for(model)), DecodedCache(0))
    data = SyntheticData(MLP, 0, pipeline)
    for iteration in range(iterations):
        inputs, targets = data.batch(iteration, BATCH)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(inputs), targets).backward()
        optimizer.step()
    return {name: value.detach() for name, value in net.state_dict().items()}


def assembled_weights(checkpoint_dir: Path, tensor: int, blocks: int) -> dict[str, torch.Tensor]:
    """The unsplit MLP's state dict put together from the (stage 0, tensor i) shards."""
    meta = torch.load(checkpoint_dir / "checkpoint.pt", weights_only=True)
    shards = [
        torch.load(checkpoint_dir / meta["shards"] / f"stage0-tensor{i}.pt",
                   weights_only=True)["model"]
        for i in range(tensor)
    ]
    whole: dict[str, torch.Tensor] = {}
    for b in range(blocks):
        # nn.Sequential of unsplit_mlp: Linear, ReLU, Linear (+ ReLU between blocks)
        first, second = 4 * b, 4 * b + 2
        whole[f"{first}.weight"] = torch.cat([s[f"{b}.w1"] for s in shards])
        whole[f"{first}.bias"] = torch.cat([s[f"{b}.b1"] for s in shards])
        whole[f"{second}.weight"] = torch.cat([s[f"{b}.w2"] for s in shards], dim=1)
        whole[f"{second}.bias"] = shards[0][f"{b}.b2"]
    return whole


async def test_a_2x2x1_job_across_two_nodes_trains_like_the_unsplit_mlp_and_resumes_on_one(
    tmp_path: Path,
):
    env = dtp_env(tmp_path, GPUSCHED_TOTAL_ITERATIONS="15")
    await run_parts(tmp_path, two_nodes(env, GPUSCHED_DATA_PARALLEL="2",
                                        GPUSCHED_TENSOR_PARALLEL="2"), "first")
    lines = progress(tmp_path / "progress.jsonl")
    assert (lines[-1]["event"], lines[-1]["iteration"]) == ("done", 15)
    # only rank 0 (on the first node) reports
    assert progress(Path(env["GPUSCHED_PROGRESS_FILE"] + ".node-1")) == []
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in (checkpoints / "dtp-15").iterdir()) == [
        "stage0-tensor0.pt", "stage0-tensor1.pt"
    ]

    # resized: the same job resumes on one node with one replica of two tensor ranks
    resumed = {**env, "GPUSCHED_GPUS": "0,1", "GPUSCHED_TOTAL_ITERATIONS": "30",
               "GPUSCHED_TENSOR_PARALLEL": "2"}
    await run_parts(tmp_path, [resumed], "second")
    lines = progress(tmp_path / "progress.jsonl")
    assert (lines[-1]["event"], lines[-1]["iteration"]) == ("done", 30)
    falling = losses(tmp_path / "progress.jsonl")
    assert falling[-1] < 0.85 * falling[0], falling
    assert [p.name for p in checkpoints.glob("dtp-*")] == ["dtp-30"]

    reference = unsplit_training("bert", 30)
    saved = assembled_weights(checkpoints, tensor=2, blocks=2)
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        # summation order differs (micro-batches, replicas, shards): close, not bitwise
        assert torch.allclose(saved[name], tensor, rtol=1e-4, atol=1e-5), name


async def test_a_1x2x2_job_trains_with_two_stages_of_two_tensor_ranks(tmp_path: Path):
    env = dtp_env(tmp_path, GPUSCHED_GPUS="0,1,2,3", GPUSCHED_TOTAL_ITERATIONS="30",
                  GPUSCHED_TENSOR_PARALLEL="2", GPUSCHED_PIPELINE_PARALLEL="2",
                  GPUSCHED_ACCUM_STEPS="4")
    await run_parts(tmp_path, [env], "run")
    lines = progress(tmp_path / "progress.jsonl")
    assert (lines[-1]["event"], lines[-1]["iteration"]) == ("done", 30)
    falling = losses(tmp_path / "progress.jsonl")
    assert falling[-1] < 0.85 * falling[0], falling
    shards = sorted(p.name for p in (tmp_path / "checkpoints" / "dtp-30").iterdir())
    assert shards == [f"stage{s}-tensor{t}.pt" for s in (0, 1) for t in (0, 1)]
    # two stages of one block each: the same weights as the unsplit MLP's training
    reference = unsplit_training("bert", 30)
    meta = torch.load(tmp_path / "checkpoints" / "checkpoint.pt", weights_only=True)
    for stage in (0, 1):
        parts = [
            torch.load(tmp_path / "checkpoints" / meta["shards"] / f"stage{stage}-tensor{t}.pt",
                       weights_only=True)["model"]
            for t in (0, 1)
        ]
        first = torch.cat([p["0.w1"] for p in parts])
        assert torch.allclose(first, reference[f"{4 * stage}.weight"], rtol=1e-4, atol=1e-5)


def _tensor_parallel_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        degrees = Degrees(1, 2, 1)
        position = degrees.position(rank)
        groups = new_groups(degrees, position)
        stage = build_stage(MLP, 7, degrees, position, groups.tensor)
        inputs = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
        outputs = stage(inputs)
        outputs.square().sum().backward()
        torch.save({"outputs": outputs.detach(),
                    "w1_grad": stage[0].w1.grad, "w2_grad": stage[0].w2.grad},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_tensor_parallel_mlp_computes_the_unsplit_mlps_outputs_and_gradients(
    tmp_path: Path,
):
    mp.spawn(_tensor_parallel_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    whole = unsplit_mlp(MLP, 7, 1)
    inputs = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    expected = whole(inputs)
    expected.square().sum().backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for got in ranks:
        assert torch.allclose(got["outputs"], expected, rtol=1e-5, atol=1e-6)
    first, second = whole[0], whole[2]
    assert first.weight.grad is not None and second.weight.grad is not None
    assert torch.allclose(torch.cat([r["w1_grad"] for r in ranks]), first.weight.grad,
                          rtol=1e-5, atol=1e-6)
    assert torch.allclose(torch.cat([r["w2_grad"] for r in ranks], dim=1), second.weight.grad,
                          rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"GPUSCHED_GPUS": "0,1,2", "GPUSCHED_TENSOR_PARALLEL": "2"}, "GPUSCHED_TENSOR_PARALLEL"),
        ({"GPUSCHED_GPUS": "0,1,2,3", "GPUSCHED_TENSOR_PARALLEL": "2",
          "GPUSCHED_PIPELINE_PARALLEL": "3"}, "GPUSCHED_PIPELINE_PARALLEL"),
        ({"GPUSCHED_GPUS": "0,1,2,3", "GPUSCHED_TENSOR_PARALLEL": "2",
          "GPUSCHED_DATA_PARALLEL": "3"}, "GPUSCHED_DATA_PARALLEL"),
    ],
)
def test_degrees_whose_product_is_not_the_ranks_are_refused_in_one_line_naming_the_field(
    tmp_path: Path, overrides: dict[str, str], variable: str
):
    env = dtp_env(tmp_path, **overrides)
    done = subprocess.run(
        [sys.executable, "-m", "gpusched.services.nodeagent.worker"], cwd=REPOSITORY, env=env,
        capture_output=True, text=True, timeout=process_limit_s(1),
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpusched worker: error: {variable}:"), lines
    assert not (tmp_path / "checkpoints").exists()


def test_ranks_are_laid_out_tensor_first_then_stages_then_replicas():
    degrees = degrees_for(8, None, tensor=2, pipeline=2)
    assert degrees == Degrees(2, 2, 2)
    assert [degrees.rank(**vars_of(degrees.position(r))) for r in range(8)] == list(range(8))
    assert degrees.tensor_group(1, 0) == [4, 5]
    assert degrees.pipeline_group(0, 1) == [1, 3]
    assert degrees.data_group(1, 0) == [2, 6]
    with pytest.raises(DegreesError, match=r"^GPUSCHED_DATA_PARALLEL:"):
        degrees_for(8, 3, tensor=2, pipeline=2)


def vars_of(position: Any) -> dict[str, int]:
    return {"replica": position.replica, "stage": position.stage,
            "tensor_index": position.tensor_index}


async def test_a_2x2x1_job_submitted_to_two_emulated_nodes_finishes_with_a_falling_loss(
    nats_server, stores: Stores, tmp_path: Path
):
    async with nodes(nats_server.url, tmp_path, count=2, gpus=2, jobs_mode="process"
                     ), SchedulerService(fast_scheduler(nats_server.url)):
        job_id = await store_job(stores, spec(
            model="ncf", gpus=4, data_parallel=2, tensor_parallel=2, batch_size=BATCH,
            iterations=30, checkpoint_every=10, base_lr=LR, dataset_size=DATASET_SIZE,
        ))
        done = await wait_state(stores, job_id, JobState.SUCCEEDED, JobState.FAILED,
                                timeout_s=process_limit_s(4))
    assert done.state is JobState.SUCCEEDED, done.error
    assert len(done.placement) == 2
    falling = losses(tmp_path / "work" / job_id / "progress-1.jsonl")
    assert falling[-1] < 0.85 * falling[0], falling
    log = (tmp_path / "work" / job_id / "run-1.log").read_text()
    trained = [json.loads(line) for line in log.splitlines()
               if line.startswith("{") and '"training"' in line]
    assert sorted((t["rank"], t["replica"], t["tensor_index"]) for t in trained) == [
        (0, 0, 0), (1, 0, 1)
    ]
