"""What a trace says about a job (`TraceJob`), what loading a trace gives
(`LoadedTrace`), and the error a trace that cannot be read raises (`TraceError`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpusched.libs.core.elastic import bounds_problem

#: Largest time a trace may state, in seconds (about 317 years; Philly spans one). Near
#: 1e20 s two neighbouring floats are hours apart, so a short job there would end at the
#: very moment it starts; a larger value is refused as a malformed field.
MAX_TRACE_SECONDS = 1e10
#: Largest count (GPUs, batch size, iterations) a trace may state; beyond it a count
#: no longer fits the simulator's floating-point arithmetic with room to spare.
MAX_TRACE_COUNT = 10**12


class TraceError(ValueError):
    """A trace file that cannot be read: missing, malformed header, or a bad row."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job as a trace describes it.

    Exactly one of ``duration_s`` (exclusive run time, seconds) and ``iterations`` is
    set. ``submit_time`` and ``deadline`` are absolute seconds on the trace's clock,
    which starts at the first submission. ``line`` is the job's line in its source
    file (its position, for generated jobs), so messages can point back at it.
    """

    job_id: str
    submit_time: float
    gpus: int
    model: str | None = None
    batch_size: int | None = None
    duration_s: float | None = None
    iterations: int | None = None
    allow_sharing: bool = True
    deadline: float | None = None
    user: str = ""
    cpus_per_gpu: float | None = None
    mem_gb_per_gpu: float | None = None
    line: int = 0
    #: the tenant's own order of its jobs, -1000..1000 (see ``gpusched.libs.core.jobs.JobSpec``)
    priority: int = 0
    #: tensor and pipeline parallel degrees (their product divides ``gpus``)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    #: the elastic bounds of the global batch and of the GPU count the job declares
    #: (None: none given); see ``gpusched.libs.core.elastic``
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    min_gpus: int | None = None
    max_gpus: int | None = None
    #: seconds per iteration a live cluster measured for this job at its ``batch_size``
    #: and ``gpus``, on GPUs of ``measured_gpu_model`` (None: not measured / not known);
    #: kept from an export (docs/trace-format.md), not read by the simulator
    measured_iteration_s: float | None = None
    measured_gpu_model: str | None = None
    #: what really happened to the job on the live cluster that exported it (None: not
    #: known, e.g. an older export): seconds from its submission to its end, seconds of
    #: those it waited (queued or preempted), its final state and the policy that
    #: scheduled it; kept for `gpusched history whatif`, never read by the simulator
    live_jct_s: float | None = None
    live_queue_s: float | None = None
    live_state: str | None = None
    live_policy: str | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"trace job {self.job_id}: gpus must be >= 1, got {self.gpus}")
        if (self.duration_s is None) == (self.iterations is None):
            raise ValueError(
                f"trace job {self.job_id}: give exactly one of duration_s and iterations"
            )
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"trace job {self.job_id}: duration_s must be > 0")
        if self.iterations is not None and self.iterations < 1:
            raise ValueError(f"trace job {self.job_id}: iterations must be >= 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"trace job {self.job_id}: batch_size must be >= 1")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(f"trace job {self.job_id}: parallel degrees must be >= 1")
        if self.gpus % (self.tensor_parallel * self.pipeline_parallel):
            raise ValueError(
                f"trace job {self.job_id}: tensor_parallel x pipeline_parallel must divide gpus"
            )
        problem = bounds_problem(
            self.gpus,
            self.batch_size,
            self.min_gpus,
            self.max_gpus,
            self.min_batch_size,
            self.max_batch_size,
        )
        if problem:
            raise ValueError(f"trace job {self.job_id}: {problem[1]}")
        measured = self.measured_iteration_s
        if measured is not None and not 0 < measured < math.inf:
            raise ValueError(f"trace job {self.job_id}: measured_iteration_s must be > 0")
        for name, value in (("live_jct_s", self.live_jct_s), ("live_queue_s", self.live_queue_s)):
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"trace job {self.job_id}: {name} must be >= 0")
        if (
            self.live_jct_s is not None
            and self.live_queue_s is not None
            and self.live_queue_s > self.live_jct_s
        ):
            raise ValueError(f"trace job {self.job_id}: live_queue_s exceeds live_jct_s")


@dataclass
class LoadedTrace:
    jobs: list[TraceJob]
    #: malformed rows dropped because ``skip_bad_rows`` was set
    skipped_rows: int = 0
    notes: list[str] = field(default_factory=list)
    #: well-formed rows the format leaves out, by reason (e.g. ``"no GPU": 1088``)
    filtered: dict[str, int] = field(default_factory=dict)
