"""The clocks of simulated runs: how fast each advances alone and next to its co-runners.

A simulated run advances at the ground truth's iteration time times the worst
co-location slowdown on its GPUs, scaled by the node's time scale. Whenever a run joins
or leaves a GPU, the speed of every simulated run there is recomputed and its finish
timer set again; the timer sends :class:`SimulatedFinish` to the node's actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass

from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.shape import JobShape
from gpusched.services.nodeagent.residents import Run, sharing
from gpusched.services.nodeagent.runs import SimulatedProgress


@dataclass(frozen=True, slots=True)
class SimulatedFinish:
    """A simulated run's finish timer fired; stale unless ``version`` is still its own."""

    job_id: str
    run_id: int
    version: int


class SimulatedClocks:
    """Sets up and retimes the simulated runs of one node."""

    def __init__(
        self,
        truth: ProfilePerformanceModel,
        known_models: frozenset[str],
        time_scale: float,
        tell: Callable[[SimulatedFinish], None],
    ) -> None:
        self.truth = truth
        self.known_models = known_models
        self.time_scale = time_scale
        self.tell = tell

    def prepare(self, run: Run) -> str:
        """Give a new simulated run its clock; why it cannot run, or ''."""
        start, spec = run.start, run.start.spec
        if start.emulated_iteration_s is not None:
            run.alone_s = start.emulated_iteration_s
        else:
            try:
                run.alone_s = self.truth.iteration_time(
                    spec.model, spec.batch_size, spec.gpus, start.nodes, start.accum_steps
                )
            except ValueError as exc:
                return f"nodes: {exc}"
        now = asyncio.get_running_loop().time()
        wall_s = run.alone_s * self.time_scale
        run.clock = SimulatedProgress(start.resume_iteration, start.total_iterations, wall_s, now)
        run.measured_from = (run.clock.iteration, now / self.time_scale)
        return ""

    def slowdown(self, run: Run, runs: Collection[Run]) -> float:
        """The ground-truth slowdown from the worst co-runner on any of its GPUs."""
        spec = run.start.spec
        worst = 1.0
        for other in sharing(run, runs):
            o = other.start.spec
            if spec.model not in self.known_models or o.model not in self.known_models:
                continue
            worst = max(
                worst,
                self.truth.colocation_slowdown(
                    JobShape(spec.model, spec.batch_size, spec.gpus, run.start.accum_steps),
                    JobShape(o.model, o.batch_size, o.gpus, other.start.accum_steps),
                ),
            )
        return worst

    def retime(self, runs: Collection[Run], gpus: list[int]) -> None:
        """Recompute the speed of every simulated run on these GPUs (someone came or
        went), and when each finishes."""
        loop = asyncio.get_running_loop()
        touched = set(gpus)
        for run in runs:
            if run.clock is None or not touched.intersection(run.start.gpus):
                continue
            slowdown = self.slowdown(run, runs)
            if slowdown == run.slowdown and run.finish_timer is not None:
                continue
            now = loop.time()
            run.slowdown = slowdown
            run.clock.change_speed(run.alone_s * slowdown * self.time_scale, now)
            run.version += 1
            if run.finish_timer is not None:
                run.finish_timer.cancel()
            run.finish_timer = loop.call_at(
                run.clock.finishes_at(),
                self.tell,
                SimulatedFinish(run.job_id, run.run_id, run.version),
            )
