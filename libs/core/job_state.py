"""What a scheduler believes of a job, the same in both drivers (the simulator's
``services/scheduler/simulation/simulator.py`` and the live scheduler's
``services/scheduler/live/state.py``): the iterations it has left, and the view of it a
policy gets (``job_view``, over the fields each driver keeps in its own record).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched.libs.core.elastic import Elastic
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.size_predictor import OVERRUN_SHARE
from gpusched.libs.core.snapshot import JobView


def remaining_iterations(believed: float, done: float, stops_at: float | None = None) -> float:
    """The iterations a job is believed to have left after ``done``, when it is believed
    to run ``believed`` in all (a size predictor's figure, or the declared total).

    Our rule: what is left of the believed total, but at least `OVERRUN_SHARE` of it: a
    job that ran past its prediction is not believed finished (believed done, it would
    hold its GPUs at no cost).

    ``stops_at``: the iterations after which the run stops, where the driver knows them
    (the live scheduler: the job's declared total, which its worker never runs past; a
    simulated job's true length is the ground truth, which no scheduler reads). Then the
    belief never exceeds what is left of the run, and is exactly that where the believed
    total is the run's own (``believed >= stops_at``) or nothing is left.
    """
    if stops_at is not None:
        left = max(0.0, float(stops_at - done))
        if believed >= stops_at or left == 0:
            return left
        return min(left, max(believed - done, OVERRUN_SHARE * believed))
    return max(believed - done, OVERRUN_SHARE * believed)


@dataclass(frozen=True, slots=True)
class Run:
    """Where and how a job that holds GPUs runs: what its view says only while it holds
    them (being started or stopped included)."""

    gpu_ids: tuple[int, ...]
    accum_steps: int
    #: exclusive seconds of work done per wall second (1/slowdown; 0 while restoring a
    #: checkpoint, being started or being stopped)
    progress_rate: float
    #: when the current run began
    started_at: float
    #: CPU cores and host memory GB the whole job holds; None: the GPU-proportional share
    cpus: float | None = None
    mem_gb: float | None = None
    #: seconds one epoch of its data set takes at its current shape; None: unknown
    epoch_s: float | None = None


#: what a job that holds no GPUs has of a run: the view's defaults
_NO_RUN = Run(gpu_ids=(), accum_steps=1, progress_rate=0.0, started_at=0.0)


def job_view(
    *,
    job_id: str,
    submit_time: float,
    model: str,
    gpus: int,
    batch_size: int,
    allow_sharing: bool,
    deadline: float | None,
    user: str,
    priority: int,
    est_remaining_s: float,
    attained_gpu_s: float,
    as_of: float,
    queued_since: float,
    preemptions: int,
    run: Run | None = None,
    oracle_remaining_s: float | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    elastic: Elastic | None = None,
) -> JobView:
    """The job as a policy sees it, from the fields each driver keeps in its own record
    of a job (the simulator's ``SimJob``, the live scheduler's ``LiveJob``): RUNNING with
    ``run``'s fields while it holds GPUs, else QUEUED with no GPUs, one accumulation
    step, no progress, no start and the proportional share. ``est_remaining_s`` and
    ``attained_gpu_s`` are as of ``as_of`` (see ``JobView``); ``oracle_remaining_s`` only
    a simulator knows; ``elastic``, the bounds the job declares (None: none)."""
    held = _NO_RUN if run is None else run
    return JobView(
        job_id=job_id,
        submit_time=submit_time,
        model=model,
        gpus=gpus,
        batch_size=batch_size,
        est_remaining_s=est_remaining_s,
        attained_gpu_s=attained_gpu_s,
        as_of=as_of,
        allow_sharing=allow_sharing,
        deadline=deadline,
        oracle_remaining_s=oracle_remaining_s,
        state=JobState.QUEUED if run is None else JobState.RUNNING,
        gpu_ids=held.gpu_ids,
        accum_steps=held.accum_steps,
        progress_rate=held.progress_rate,
        queued_since=queued_since,
        started_at=held.started_at,
        preemptions=preemptions,
        cpus=held.cpus,
        mem_gb=held.mem_gb,
        epoch_s=held.epoch_s,
        user=user,
        priority=priority,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        elastic=elastic,
    )
