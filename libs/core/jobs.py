"""Jobs as submitted: the static facts a trace or a user gives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpusched.libs.core.elastic import Elastic, bounds_problem
from gpusched.libs.core.parallelism import Degrees
from gpusched.libs.core.shape import JobShape


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A training job as submitted.

    ``iterations`` is the ground truth: how many iterations of the global batch the job
    really runs. A scheduler never reads it; it sees a prediction instead. It need not
    be whole: a count derived from a trace's run time keeps its fraction, so the job
    takes exactly that run time (see ``gpusched.libs.core.workload.materialize``).
    """

    job_id: str
    submit_time: float
    model: str
    gpus: int
    batch_size: int
    iterations: float
    allow_sharing: bool = True
    deadline: float | None = None
    user: str = ""
    cpus_per_gpu: float | None = None
    mem_gb_per_gpu: float | None = None
    #: what the user calls the job (``user3-bert-finetune-v7``) and its data set; both
    #: optional, read by the size predictor (``gpusched.libs.core.size_predictor``)
    name: str = ""
    dataset: str = ""
    #: the iterations the user says the job runs (a guess; ``iterations`` is the truth);
    #: None: the trace gives none
    declared_iterations: float | None = None
    #: the tenant's own order of its jobs, -1000..1000 (see JobView.priority)
    priority: int = 0
    #: tensor and pipeline parallel degrees; data parallel = gpus / (tensor * pipeline)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    #: the elastic bounds the job declares (None: none); a job that declares any is
    #: elastic, and a policy that sizes jobs keeps it within them
    #: (``gpusched.libs.core.elastic``)
    min_gpus: int | None = None
    max_gpus: int | None = None
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    #: the four bounds as one value, None for a job that declares none (set from them)
    elastic: Elastic | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.job_id or "." in self.job_id or any(c.isspace() for c in self.job_id):
            raise ValueError(f"job_id {self.job_id!r} must be non-empty, without dots or spaces")
        if self.gpus < 1:
            raise ValueError(f"job {self.job_id}: gpus must be >= 1, got {self.gpus}")
        if self.batch_size < 1:
            raise ValueError(f"job {self.job_id}: batch_size must be >= 1, got {self.batch_size}")
        if not 0 < self.iterations < math.inf:
            raise ValueError(
                f"job {self.job_id}: iterations must be a finite number > 0, got {self.iterations}"
            )
        declared = self.declared_iterations
        if declared is not None and not 0 < declared < math.inf:
            raise ValueError(
                f"job {self.job_id}: declared_iterations must be a finite number > 0, "
                f"got {declared}"
            )
        if self.submit_time < 0:
            raise ValueError(f"job {self.job_id}: submit_time must be >= 0")
        if not -1000 <= self.priority <= 1000:
            raise ValueError(f"job {self.job_id}: priority must be -1000..1000: {self.priority}")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"job {self.job_id}: {name} must be >= 1")
        if self.gpus % (self.tensor_parallel * self.pipeline_parallel):
            raise ValueError(
                f"job {self.job_id}: tensor_parallel {self.tensor_parallel} x "
                f"pipeline_parallel {self.pipeline_parallel} must divide gpus {self.gpus}"
            )
        bounds = (self.min_gpus, self.max_gpus, self.min_batch_size, self.max_batch_size)
        problem = bounds_problem(self.gpus, self.batch_size, *bounds)
        if problem:
            raise ValueError(f"job {self.job_id}: {problem[1]}")
        object.__setattr__(self, "elastic", Elastic.of(*bounds))

    @property
    def degrees(self) -> Degrees:
        """Data, tensor and pipeline parallel degrees (data = gpus / (tensor x pipeline))."""
        return Degrees.of(self.gpus, self.tensor_parallel, self.pipeline_parallel)

    def shape(self, accum_steps: int = 1) -> JobShape:
        """This job's shape with each GPU's batch split into ``accum_steps`` sub-batches."""
        return JobShape(self.model, self.batch_size, self.gpus, accum_steps)
