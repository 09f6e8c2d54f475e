"""What the simulator keeps of a job while it runs a trace: its spec, its true and
estimated speeds, its state, where it runs and on what allocation, what it has done and
attained, and its times (queued, started, finished); ``version`` invalidates its pending
completion event when its speed changes."""

from __future__ import annotations

import math

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.progress import EpochRecord
from gpusched.libs.core.shape import JobShape
from gpusched.libs.core.snapshot import JobView


class SimJob:
    __slots__ = (
        "accum",
        "attained",
        "believed",
        "convergence",
        "cpu_mem_speedup",
        "cpus",
        "est_iter",
        "exclusive_iter",
        "exclusive_s",
        "finish_time",
        "first_start",
        "gpu_ids",
        "history",
        "iter_time",
        "last_settle",
        "mem_gb",
        "mem_mb",
        "overhead_left",
        "preemptions",
        "queue_total",
        "queued_since",
        "remaining",
        "samples_done",
        "shape",
        "shared",
        "spec",
        "started_at",
        "state",
        "version",
        "view",
    )

    def __init__(self, spec: JobSpec, est_iter: float, exclusive_iter: float) -> None:
        self.spec = spec
        self.est_iter = est_iter  # estimated seconds/iteration, consolidated, alone
        self.exclusive_iter = exclusive_iter  # true seconds/iteration, consolidated, alone
        self.remaining = float(spec.iterations)
        #: the iterations the scheduler believes the job runs in all, fixed at its
        #: submission (a size predictor's figure); None: it believes the truth
        self.believed: float | None = None
        #: seconds it needs alone at the shape it asked for (fixed at arrival)
        self.exclusive_s = spec.iterations * exclusive_iter
        #: the model's convergence curve, with the job's own length over the curve's;
        #: None when the job runs fixed iterations whatever its batch
        self.convergence: tuple[Convergence, float] | None = None
        #: samples processed, and what it reported after each epoch (jobs with a
        #: convergence curve, when the policy predicts progress from epochs)
        self.samples_done = 0.0
        self.history: list[EpochRecord] = []
        #: QUEUED, RUNNING, PREEMPTED (queued again), SUCCEEDED, or FAILED when no
        #: placement on the cluster fits it
        self.state = JobState.QUEUED
        self.gpu_ids: tuple[int, ...] = ()
        self.accum = 1
        #: the spec's shape at ``accum`` while it runs (what colocation slowdowns take),
        #: set when it starts: a running job's spec and accumulation change only by a
        #: new start
        self.shape: JobShape = spec.shape()
        self.mem_mb = 0.0
        #: CPU cores and host memory GB held while running; None: the proportional share
        self.cpus: float | None = None
        self.mem_gb: float | None = None
        #: speed at that allocation over the speed at the proportional share
        self.cpu_mem_speedup = 1.0
        self.iter_time = math.inf
        self.overhead_left = 0.0
        self.last_settle = 0.0
        self.attained = 0.0
        self.queued_since = spec.submit_time
        self.started_at = 0.0
        self.queue_total = 0.0
        self.first_start: float | None = None
        self.finish_time: float | None = None
        self.preemptions = 0
        self.shared = False
        self.version = 0
        self.view: JobView | None = None
