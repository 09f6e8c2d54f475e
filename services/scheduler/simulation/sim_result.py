"""The result of a finished simulation (``simulator.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpusched.libs.core.lifecycle import JobState
from gpusched.services.scheduler.policies.base import (
    ReportsRho,
    ResidentCapped,
)
from gpusched.services.scheduler.simulation.results import (
    FINISHED,
    UNFINISHED,
    UNSCHEDULABLE,
    JobOutcome,
    SimResult,
    thin,
)
from gpusched.services.scheduler.simulation.sim_config import SimConfig as SimConfig

if TYPE_CHECKING:
    from gpusched.services.scheduler.simulation.simulator import Simulator


def result_of(sim: Simulator, origin: float, wall_s: float) -> SimResult:
    """What a finished simulation gives: every job's outcome and the summary figures."""
    outcomes: list[JobOutcome] = []
    last_finish = origin
    for spec in sim.specs:
        job = sim.jobs[spec.job_id]
        exclusive = job.exclusive_s
        if job.state is JobState.SUCCEEDED:
            assert job.finish_time is not None
            last_finish = max(last_finish, job.finish_time)
            state, reason = FINISHED, ""
        elif job.state is JobState.FAILED:  # the one way a simulated job fails
            state, reason = UNSCHEDULABLE, sim.unschedulable[spec.job_id]
        else:
            state = UNFINISHED
            reason = sim.last_decision.why(spec.job_id) if sim.last_decision else ""
        outcomes.append(
            JobOutcome(
                job_id=spec.job_id,
                model=spec.model,
                gpus=spec.gpus,
                submit_time=spec.submit_time,
                start_time=job.first_start,
                finish_time=job.finish_time,
                exclusive_s=exclusive,
                queue_s=job.queue_total,
                preemptions=job.preemptions,
                shared=job.shared,
                state=state,
                reason=reason,
                deadline=spec.deadline,
            )
        )
    makespan = last_finish - origin
    total = sim.cluster.total_gpus
    util = sim.busy_gpu_s / (total * makespan) if makespan > 0 else 0.0
    policy = sim.policy
    return SimResult(
        policy=sim.policy.name,
        total_gpus=total,
        jobs=tuple(outcomes),
        makespan_s=makespan,
        gpu_util=util,
        preemptions=sim.preemptions,
        resizes=sim.resizes,
        shared_pairs=sim.shared_pairs,
        wall_s=wall_s,
        decisions=sim.decisions,
        timeline=thin(sim.timeline, sim.config.timeline_points),
        max_resident_slowdown=(
            policy.max_resident_slowdown if isinstance(policy, ResidentCapped) else None
        ),
        prediction=sim.sizes.report() if sim.sizes is not None else None,
        rho=policy.rho if isinstance(policy, ReportsRho) else None,
        gpu_hours_by_type=sim.types.gpu_hours() if sim.types is not None else None,
    )
