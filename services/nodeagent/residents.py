"""The runs a node's actor holds, and which of them share a GPU.

A :class:`Run` is the actor's record of one run: the start that made it, its simulated
clock or its process, the progress read so far and whether it is stopping or being
resized. Only the actor changes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from gpusched.libs.common.schemas import Progress, StartJob, StopReason
from gpusched.services.nodeagent.runs import ProcessRun, SimulatedProgress

RunKind = Literal["simulated", "process", "held"]


@dataclass(eq=False)
class Run:
    start: StartJob
    kind: RunKind
    log: Any
    #: ground-truth seconds per iteration running alone (simulated runs)
    alone_s: float = 0.0
    slowdown: float = 1.0
    clock: SimulatedProgress | None = None
    version: int = 0
    finish_timer: asyncio.TimerHandle | None = None
    process: ProcessRun | None = None
    pid: int | None = None
    #: latest progress of a process run (simulated runs compute theirs)
    progress: Progress = field(default_factory=Progress)
    #: (iteration, seconds) where the last progress event's measurement ended
    measured_from: tuple[float, float] | None = None
    #: (iteration, seconds) of progress lines read since the last progress event
    samples: list[tuple[int, float]] = field(default_factory=list)
    stopping: StopReason | None = None
    #: the run that replaces this one once it has checkpointed (a resize)
    successor: StartJob | None = None
    #: the node's CPU cores allocated to the run (empty: none allocated) and its host
    #: memory in GB (None: none allocated)
    cores: tuple[int, ...] = ()
    mem_gb: float | None = None

    @property
    def job_id(self) -> str:
        return self.start.job_id

    @property
    def run_id(self) -> int:
        return self.start.run_id


def sharing(run: Run, runs: Iterable[Run]) -> list[Run]:
    """The other runs on at least one of ``run``'s GPUs."""
    gpus = set(run.start.gpus)
    return [
        other for other in runs
        if other is not run and gpus.intersection(other.start.gpus)
    ]


def cores_taken(runs: Iterable[Run], but: str = "") -> set[int]:
    """The node's cores allocated to the runs, except job ``but``'s."""
    return {core for run in runs if run.job_id != but for core in run.cores}


def co_runners(run: Run, runs: Iterable[Run]) -> list[str]:
    return sorted(other.job_id for other in sharing(run, runs))
