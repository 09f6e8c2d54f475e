"""What a process run is given: its command, its files and the environment contract.

The variables are named in ``gpusched.libs.sdk.context`` (what the worker and users' code read);
on top of them the process inherits only the allow-list of ``runs.run_environment``.
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import urlsplit

from gpusched.libs.common.embedded import free_port
from gpusched.libs.common.schemas import JobSpec, StartJob
from gpusched.libs.sdk import context as job_env
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.gpus import GpuInventory
from gpusched.services.nodeagent.jobuser import JobUser
from gpusched.services.nodeagent.runs import ProcessPlan, run_environment
from gpusched.services.nodeagent.worker.registry import ARCHITECTURE_ENV


def process_plan(
    start: StartJob,
    config: NodeAgentConfig,
    inventory: GpuInventory,
    cores: tuple[int, ...] = (),
    user: JobUser | None = None,
) -> ProcessPlan:
    """``cores``: the machine's cores the process is pinned to (empty: not pinned);
    ``user``: who it runs as (None: the agent's own user)."""
    spec = start.spec
    job_dir = config.work_dir / start.job_id
    checkpoint_dir = job_dir / "ckpt"
    # the parts of a job across nodes may share a work directory: one name per part
    part = "" if start.leader else f"-{config.name}"
    progress_file = job_dir / f"progress-{start.run_id}{part}.jsonl"
    contract: dict[str, Any] = {
        job_env.JOB_ID: start.job_id,
        job_env.RUN_ID: start.run_id,
        job_env.MODEL: spec.model,
        job_env.BATCH_SIZE: spec.batch_size,
        job_env.ACCUM_STEPS: start.accum_steps,
        job_env.GPUS: ",".join(str(i) for i in start.gpus),
        job_env.DEVICE: "cpu" if inventory.emulated else "cuda",
        job_env.TOTAL_ITERATIONS: start.total_iterations,
        job_env.START_ITERATION: start.resume_iteration,
        job_env.CHECKPOINT_DIR: checkpoint_dir,
        job_env.CHECKPOINT_EVERY: spec.checkpoint_every,
        job_env.PROGRESS_FILE: progress_file,
        job_env.NODE: config.name,
        "PYTHONUNBUFFERED": "1",
    }
    for variable, option in (
        (job_env.DATASET_SIZE, spec.dataset_size),
        (job_env.BASE_LR, spec.base_lr),
        (job_env.MAX_LR, spec.max_lr),
        (job_env.BASE_BATCH_SIZE, spec.base_batch_size),
    ):
        if option is not None:
            contract[variable] = option
    ranks = start.world_size if start.rendezvous else len(start.gpus)
    contract.update(parallel_degrees(spec, ranks))
    if spec.command:
        contract.update(torch_distributed_env(start, ranks))
    if start.rendezvous:
        contract[job_env.RENDEZVOUS] = start.rendezvous
        contract[job_env.FIRST_RANK] = start.first_rank
        contract[job_env.WORLD_SIZE] = start.world_size
    allocated = start.cpus is not None or start.mem_gb is not None
    allocation_file = job_dir / f"allocation-{start.run_id}{part}.json" if allocated else None
    if allocated:
        contract[job_env.ALLOCATION_FILE] = allocation_file
        if cores:
            contract[job_env.CPUS] = ",".join(str(core) for core in cores)
        if start.mem_gb is not None:
            contract[job_env.MEM_GB] = start.mem_gb
    if user is not None:
        # caches and dot-files land in the job's own directory, not the agent's home
        contract["HOME"] = job_dir
    if not inventory.emulated:
        by_index = {g.index: g.uuid for g in inventory.gpus}
        contract["CUDA_VISIBLE_DEVICES"] = ",".join(by_index[i] for i in start.gpus)
    if not spec.command and config.worker_architecture is not None:
        contract[ARCHITECTURE_ENV] = config.worker_architecture
    if not spec.command:
        argv: tuple[str, ...] = (sys.executable, "-m", "gpusched.services.nodeagent.worker")
    elif len(start.gpus) > 1:
        # one process per GPU, as the built-in worker runs one rank per GPU
        argv = (sys.executable, "-m", "gpusched.services.nodeagent.worker.launch", *spec.command)
    else:
        argv = tuple(spec.command)
    return ProcessPlan(
        node=config.name,
        job_id=start.job_id,
        run_id=start.run_id,
        argv=argv,
        env=run_environment(contract),
        progress_file=progress_file,
        log_file=job_dir / f"run-{start.run_id}{part}.log",
        checkpoint_dir=checkpoint_dir,
        total_iterations=start.total_iterations,
        start_iteration=start.resume_iteration,
        kill_grace_s=config.kill_grace_s,
        preempt_grace_s=config.preempt_grace_s,
        poll_s=config.progress_poll_s,
        cores=cores,
        mem_gb=start.mem_gb,
        allocation_file=allocation_file,
        user=user,
        job_dir=job_dir,
    )


def parallel_degrees(spec: JobSpec, ranks: int) -> dict[str, int]:
    """The job's (data, tensor, pipeline) degrees for ``ranks`` processes: data-parallel
    replicas are what the ranks leave over tensor x pipeline (a resize changes them); when
    tensor x pipeline does not divide the ranks, the spec's ``data_parallel`` (or 1) goes
    as it is and the worker refuses the product."""
    model_parallel = spec.tensor_parallel * spec.pipeline_parallel
    replicas = (
        ranks // model_parallel
        if ranks and ranks % model_parallel == 0
        else (spec.data_parallel or 1)
    )
    return {
        job_env.DATA_PARALLEL: replicas,
        job_env.TENSOR_PARALLEL: spec.tensor_parallel,
        job_env.PIPELINE_PARALLEL: spec.pipeline_parallel,
    }


def torch_distributed_env(start: StartJob, ranks: int) -> dict[str, Any]:
    """The standard PyTorch variables (``env://``) for a job's own command: where rank 0
    listens (the job's rendezvous across nodes, else a free local port), this node's first
    rank, the ranks of the whole job and of this node. With several GPUs here the launcher
    (``worker.launch``) sets ``RANK`` and ``LOCAL_RANK`` for each of its processes."""
    if start.rendezvous:
        where = urlsplit(start.rendezvous)
        host, port = where.hostname or "127.0.0.1", where.port or free_port()
    else:
        host, port = "127.0.0.1", free_port()
    return {
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "RANK": start.first_rank,
        "WORLD_SIZE": max(ranks, 1),
        "LOCAL_RANK": 0,
        "LOCAL_WORLD_SIZE": len(start.gpus),
    }
