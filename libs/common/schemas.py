"""Everything that crosses the wire, as msgspec structs.

MessagePack on NATS, JSON on HTTP. Every NATS message carries ``Content-Type:
application/msgpack`` and ``Gpusched-Schema: <SCHEMA_VERSION>`` headers (see ``codec``).
Validation constraints live on the types, so a decode error names the bad field.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, Literal

import msgspec

# job records and events carry the core's job states: one vocabulary, and its users
# may import it from here with the rest of the wire
from gpusched.libs.core.lifecycle import JobState

SCHEMA_VERSION = 1

#: ids travel inside subjects, so they may hold no dots, spaces or wildcards
IdStr = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Label = Annotated[str, msgspec.Meta(max_length=256)]

#: the bounds of a job spec's numbers; every numeric field has both ends, so no value
#: beyond 64 bits (or far beyond what a cluster holds) is ever stored
MAX_GPUS = 4096
MAX_BATCH_SIZE = 1_048_576
MAX_ITERATIONS = 1_000_000_000
MAX_DATASET_SIZE = 1_000_000_000_000
#: 2100-01-01T00:00:00Z, the latest deadline a job spec may give
#: bounds of one node's CPU and host-memory allocation in a command
MAX_CPUS = 65_536
MAX_HOST_MEM_GB = 1_048_576
MAX_DEADLINE = 4_102_444_800.0
GpuCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_SIZE)]
IterationCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_ITERATIONS)]
#: where a job's predicted size comes from (services/predictor/sizes.py)
PredictionSource = Literal["forest", "declared"]
#: a size the predictor's forest learned (the scheduler believes it); else ``declared``
SOURCE_FOREST: PredictionSource = "forest"
MAX_LEARNING_RATE = 1000.0
LearningRate = Annotated[float, msgspec.Meta(gt=0, le=MAX_LEARNING_RATE)]


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a user submits. ``iterations`` or ``epochs`` (with ``dataset_size``) says how
    long the job runs; ``command`` replaces the built-in training worker."""

    name: Name
    model: Name
    gpus: GpuCount = 1
    batch_size: BatchSize
    iterations: IterationCount | None = None
    epochs: Annotated[float, msgspec.Meta(gt=0, le=100_000)] | None = None
    dataset_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_DATASET_SIZE)] | None = None
    command: Annotated[list[Label], msgspec.Meta(min_length=1, max_length=256)] | None = None
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    #: seconds since the epoch
    deadline: Annotated[float, msgspec.Meta(ge=0, le=MAX_DEADLINE)] | None = None
    allow_sharing: bool = True
    labels: Annotated[dict[Label, Label], msgspec.Meta(max_length=64)] = {}
    data_parallel: GpuCount | None = None
    tensor_parallel: GpuCount = 1
    pipeline_parallel: GpuCount = 1
    min_batch_size: BatchSize | None = None
    max_batch_size: BatchSize | None = None
    cpus_per_gpu: Annotated[float, msgspec.Meta(gt=0, le=1024)] | None = None
    mem_gb_per_gpu: Annotated[float, msgspec.Meta(gt=0, le=65536)] | None = None
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    #: iterations between checkpoints
    checkpoint_every: IterationCount = 50
    #: the built-in worker's learning rate at a global batch of ``base_batch_size``
    #: (default: the batch of the job's first run); it scales linearly with the global
    #: batch a resize gives the job, up to ``max_lr``, and ramps to each new rate over an
    #: epoch
    base_lr: LearningRate | None = None
    max_lr: LearningRate | None = None
    base_batch_size: BatchSize | None = None


class StateChange(msgspec.Struct, frozen=True):
    state: JobState
    at: float
    reason: str = ""


class Placement(msgspec.Struct, frozen=True):
    node: str
    #: GPU indices on that node
    gpus: list[int]


class Progress(msgspec.Struct, frozen=True):
    iteration: int = 0
    samples_per_s: float = 0.0
    loss: float | None = None
    gpu_mem_mb: float = 0.0
    at: float = 0.0
    #: what the built-in worker reports besides (None: not reported): epochs done
    #: (fractional), held-out accuracy after the last whole epoch, learning rate
    epoch: float | None = None
    accuracy: float | None = None
    lr: float | None = None
    #: the global batch and GPU count of the run whose speed ``samples_per_s`` is (None:
    #: not said, as before nodes stamped it)
    batch_size: int | None = None
    gpus: int | None = None


class JobRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The stored truth about one job (KV bucket ``JOBS_BUCKET``, key = job id)."""

    id: IdStr
    tenant: str
    spec: JobSpec
    #: iterations the job runs (from ``iterations`` or ``epochs``)
    total_iterations: int
    state: JobState = JobState.QUEUED
    submitted_at: float
    history: list[StateChange] = []
    pending_reason: str = ""
    placement: list[Placement] = []
    accum_steps: int = 1
    shares_with: list[str] = []
    progress: Progress = Progress()
    attempts: int = 0
    preemptions: int = 0
    exit_code: int | None = None
    error: str = ""
    #: bumped on every start, so a stale exit report from an earlier run is ignored
    run_id: int = 0
    #: a cancel was asked for while the job ran; it ends CANCELLED once stopped
    cancel_requested: bool = False
    #: the global batch and GPU count the job runs with since a resize (None: the spec's)
    batch_size: int | None = None
    gpus: int | None = None
    #: the CPU cores and host memory (GB) of the whole job's allocation while it runs
    #: (None: the GPU-proportional share)
    cpus: float | None = None
    mem_gb: float | None = None
    #: jobs with a deadline only, written by the scheduler: when it expects the job to
    #: finish (seconds since the epoch) and the run time alone it still needs (seconds)
    est_end_at: float | None = None
    est_run_s: float | None = None
    #: the iterations the predictor predicted at submission (``SizePredicted``), written
    #: by the scheduler; ``prediction_source`` ``forest`` (the scheduler believes it) or
    #: ``declared`` (the job's own figure). None: no prediction has arrived
    predicted_iterations: float | None = None
    prediction_source: PredictionSource | None = None

    @property
    def current_spec(self) -> JobSpec:
        """The spec with the shape the job runs with now (a resize may have changed it)."""
        if self.batch_size is None and self.gpus is None:
            return self.spec
        # the learning rate scales from the batch the job was submitted with, also when
        # an elastic start or a resize gave it another one
        return msgspec.structs.replace(
            self.spec,
            batch_size=self.batch_size or self.spec.batch_size,
            gpus=self.gpus or self.spec.gpus,
            base_batch_size=self.spec.base_batch_size or self.spec.batch_size,
        )


class GpuInfo(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    model: str
    memory_mb: int


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A node agent's registration (KV bucket ``NODES_BUCKET``, key = node name)."""

    name: IdStr
    gpus: list[GpuInfo]
    cpus: int
    host_mem_gb: float
    net_gbps: float = 100.0
    emulated: bool = True
    started_at: float = 0.0
    #: wall seconds per second of the jobs' own time on this node: its emulated jobs run
    #: ``--time-scale`` times as long as profiled (1.0 where jobs run as real processes)
    time_scale: float = 1.0


class RunningJob(msgspec.Struct, frozen=True):
    job_id: str
    run_id: int
    progress: Progress


class JobProgressEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``gpusched.job.<id>.progress``, about once a second while a job runs: the
    measured speed with the context the predictor needs to learn from it."""

    job_id: str
    run_id: int
    node: str
    model: str
    batch_size: int
    gpus: int
    nodes: int = 1
    accum_steps: int = 1
    co_runners: list[str] = []
    #: seconds per iteration measured over the last interval (None until known)
    iteration_s: float | None = None
    progress: Progress


class RunRef(msgspec.Struct, frozen=True):
    job_id: str
    run_id: int


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Sent by every agent each second: what really runs there."""

    node: str
    at: float
    running: list[RunningJob] = []
    #: runs that ended whose exit is still on its way to the jobs stream: the scheduler
    #: must not take them for lost
    exiting: list[RunRef] = []


class GpuTelemetry(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU's sample, fields named as NVIDIA's DCGM exporter names them."""

    index: int
    uuid: str
    util: float = msgspec.field(name="DCGM_FI_DEV_GPU_UTIL")
    fb_used_mib: float = msgspec.field(name="DCGM_FI_DEV_FB_USED")
    fb_free_mib: float = msgspec.field(name="DCGM_FI_DEV_FB_FREE")
    power_w: float = msgspec.field(name="DCGM_FI_DEV_POWER_USAGE")
    temp_c: float = msgspec.field(name="DCGM_FI_DEV_GPU_TEMP")


class Telemetry(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    at: float
    gpus: list[GpuTelemetry] = []
    jobs: list[RunningJob] = []


# ---- commands: scheduler -> node agent (request/reply) ------------------------------

#: a GPU's index on its node
GpuIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GPUS)]
#: the GPUs a command names on the receiving node: at least one (whether they are
#: distinct and exist there is the node's check: msgspec has no constraint for either)
GpuIndices = Annotated[list[GpuIndex], msgspec.Meta(min_length=1, max_length=MAX_GPUS)]
#: every accumulation step holds at least one sample of the batch
AccumSteps = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_SIZE)]
RunId = PositiveInt
#: CPU cores of an allocation on one node (fractions allowed: a share of a core)
CpuCount = Annotated[float, msgspec.Meta(ge=0, le=MAX_CPUS)]
#: host memory of an allocation on one node, in GB
HostMemGb = Annotated[float, msgspec.Meta(ge=0, le=MAX_HOST_MEM_GB)]
StopReason = Literal["preempt", "cancel", "lost"]


@functools.cache
def _field_types(struct: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, f.type) for f in msgspec.structs.fields(struct))


class _CheckedCommand(msgspec.Struct, frozen=True, kw_only=True):
    """A command checks its constraints when built, not only when decoded, so that an
    invalid one cannot be sent either: msgspec checks ``Meta`` constraints only while
    decoding, so each field is checked here against its own annotated type."""

    def __post_init__(self) -> None:
        for name, annotated in _field_types(type(self)):
            try:
                msgspec.convert(getattr(self, name), annotated)
            except msgspec.ValidationError as exc:
                message = str(exc)
                where = f"`$.{name}"
                raise msgspec.ValidationError(
                    message.replace("`$", where, 1) if " - at `$" in message
                    else f"{message} - at {where}`"
                ) from None


class StartJob(_CheckedCommand, frozen=True, kw_only=True, tag="start"):
    job_id: IdStr
    run_id: RunId
    spec: JobSpec
    total_iterations: PositiveInt
    #: GPU indices on the receiving node
    gpus: GpuIndices
    accum_steps: AccumSteps = 1
    co_runners: list[IdStr] = []
    #: iteration to resume from (the last checkpoint the scheduler knows of)
    resume_iteration: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: how many nodes the whole job spans; the part with ``leader`` reports progress
    #: and the exit, the others hold their GPUs until stopped
    nodes: GpuCount = 1
    leader: bool = True
    #: overrides the agent's ground truth for a simulated job: seconds per iteration
    emulated_iteration_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: a process job across nodes: where its ranks meet (the leader's reply gives it to
    #: the other parts), this part's first global rank, and the ranks of the whole job
    rendezvous: str = ""
    first_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    world_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: this node's part of the job's CPU cores and host memory (None: no allocation
    #: given, the process may use any core)
    cpus: CpuCount | None = None
    mem_gb: HostMemGb | None = None


class StopJob(_CheckedCommand, frozen=True, kw_only=True, tag="stop"):
    job_id: IdStr
    run_id: RunId
    #: preempt: checkpoint first; cancel: just stop
    reason: StopReason = "cancel"


class ResizeJob(_CheckedCommand, frozen=True, kw_only=True, tag="resize"):
    """Restart a running job on this node with a new shape, from its checkpoint.

    The agent preempts run ``run_id`` (it checkpoints) and starts ``new_run_id`` with
    ``batch_size`` and ``gpus`` from the iteration it saved. Only the new run reports an
    exit. A job that spans several nodes is moved by a stop and a start instead.
    """

    job_id: IdStr
    run_id: RunId
    new_run_id: RunId
    #: GPU indices on the receiving node for the new run
    gpus: GpuIndices
    #: the new global batch
    batch_size: BatchSize
    accum_steps: AccumSteps = 1
    co_runners: list[IdStr] = []


class ReallocateJob(_CheckedCommand, frozen=True, kw_only=True, tag="reallocate"):
    """Change a running run's CPU cores and host memory on this node, without a restart:
    a process run is pinned to the new cores and told the new memory bound."""

    job_id: IdStr
    run_id: RunId
    #: this node's part of the job's new allocation
    cpus: CpuCount
    mem_gb: HostMemGb


#: what a node agent's command endpoint decodes: a union tagged by ``type``
Command = StartJob | StopJob | ResizeJob | ReallocateJob


class CommandReply(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    #: the leader part of a process job across nodes: where the other parts' ranks meet
    rendezvous: str = ""


class JobExit(msgspec.Struct, frozen=True, kw_only=True):
    """Published durably by an agent when a job's process ends."""

    job_id: str
    run_id: int
    node: str
    outcome: Literal["succeeded", "failed", "stopped"]
    exit_code: int | None = None
    iteration: int = 0
    stderr_tail: str = ""
    at: float
    #: the run's last progress as it ended (its final iteration, loss and the rest);
    #: None where the run reported none (a simulated run, a command without progress)
    progress: Progress | None = None


class CancelRequest(msgspec.Struct, frozen=True):
    job_id: str
    tenant: str
    at: float


class JobSubmitted(msgspec.Struct, frozen=True):
    job_id: str
    at: float


class SizePredicted(msgspec.Struct, frozen=True, kw_only=True):
    """``gpusched.job.<id>.predicted_size``, stored in the jobs stream: the iterations the
    predictor predicts for a submitted job, ``forest`` for a template its size forest has
    learned, else ``declared`` (the job's own figure)."""

    job_id: IdStr
    iterations: Annotated[float, msgspec.Meta(gt=0)]
    source: PredictionSource
    at: float


class JobStateEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``gpusched.job.<id>.state``: every transition and every new pending reason."""

    job_id: str
    state: JobState
    at: float
    reason: str = ""
    placement: list[Placement] = []


class DecisionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """``gpusched.scheduler.<instance>.decision``: what one scheduling round did."""

    at: float
    policy: str
    started: list[str] = []
    preempted: list[str] = []
    resized: list[str] = []
    pending: int = 0
    decide_ms: float = 0.0


class Lease(msgspec.Struct, frozen=True):
    holder: str
    at: float


# ---- predictor -----------------------------------------------------------------------


class PredictRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: Name
    batch_size: PositiveInt
    gpus: PositiveInt = 1
    nodes: PositiveInt = 1
    accum_steps: PositiveInt = 1
    cpus_per_gpu: Annotated[float, msgspec.Meta(gt=0)] | None = None
    mem_gb_per_gpu: Annotated[float, msgspec.Meta(gt=0)] | None = None
    iterations: PositiveInt | None = None
    partner: Name | None = None
    partner_batch_size: PositiveInt | None = None
    partner_gpus: PositiveInt = 1
    partner_accum_steps: PositiveInt = 1
    #: what is known of a job at submission, read by ``iterations`` (the size forest,
    #: services/predictor/sizes.py); ``iterations`` above is the declared figure
    tenant: Label = ""
    name: Label = ""
    dataset: Label = ""
    tensor_parallel: PositiveInt = 1
    pipeline_parallel: PositiveInt = 1
    #: the GPU type the job runs on (a measured profile's key, docs/profiles.md): its
    #: measured figures time the job where the predictor holds them; '' for none
    gpu_type: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")] = ""


class SizeErrorReport(msgspec.Struct, frozen=True, kw_only=True):
    """``gpusched.predictor.size_error``: each finished job's iterations predicted at its
    submission against those it ran, over the newest ``window`` scored jobs. Ratios
    (0.25 is 25 %); null before any job was scored."""

    scored_jobs: int = 0
    #: scored jobs whose prediction was a fallback (the declared figure), not the forest
    fallback_jobs: int = 0
    mape: float | None = None
    within_10: float | None = None
    within_25: float | None = None
    within_50: float | None = None
    #: jobs predicted at submission and not finished yet
    pending_jobs: int = 0
    training_rows: int = 0
    retrains: int = 0
    window: int = 0


class Prediction(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    #: what was predicted: "iterations", "throughput" or "slowdown"
    kind: str
    value: float
    #: seconds per iteration behind a throughput answer
    iteration_s: float | None = None
    samples_per_s: float | None = None
    #: where the figure came from: "profile" or "profile+history" for throughput and
    #: slowdown; "forest", "declared", "history" or "default" for iterations
    source: str = "profile"


class RemainingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """How many iterations a running job has left (``gpusched.predictor.remaining``):
    ``planned`` is the plain estimate (its iterations less those done)."""

    job_id: Name
    model: Name
    batch_size: PositiveInt
    iteration: Annotated[int, msgspec.Meta(ge=0)] = 0
    planned: Annotated[float, msgspec.Meta(ge=0)]


class CpuProfilePoint(msgspec.Struct, frozen=True, array_like=True):
    """One CPU count of a measured profile: seconds per training sample with the data
    set's decoded samples cached, and with every sample decoded again."""

    cpus: PositiveInt
    cached_sample_s: Annotated[float, msgspec.Meta(gt=0)]
    uncached_sample_s: Annotated[float, msgspec.Meta(gt=0)]


class CpuProfile(msgspec.Struct, frozen=True, kw_only=True):
    """A model's CPU and memory sensitivity as a node measured it with the real worker on
    one GPU (see services/nodeagent/cpu_profiling.py); libs/common/cpu_sensitivity.py
    derives Synergy's best-case vector and speed-ups from it."""

    model: Name
    node: str
    measured_at: float
    #: the measuring node's CPUs, GPUs and host memory: its fair share per GPU
    node_cpus: PositiveInt
    node_gpus: PositiveInt
    node_mem_gb: Annotated[float, msgspec.Meta(gt=0)]
    #: host memory the worker holds besides its cache, and what caching the whole data
    #: set of the default size takes
    resident_gb: Annotated[float, msgspec.Meta(ge=0)]
    dataset_gb: Annotated[float, msgspec.Meta(ge=0)]
    #: by CPU count, most first (all the node's cores, then halved down to one)
    points: Annotated[list[CpuProfilePoint], msgspec.Meta(min_length=1)]


class CpuProfileRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask for a model's measured profile: the predictor answers the stored one (404 if
    none) unless ``node`` is given and it has none or ``refresh`` is set, in which case
    that node measures it first. A node agent measures on every request."""

    model: Name
    node: Name | None = None
    refresh: bool = False


class LinkPoint(msgspec.Struct, frozen=True, array_like=True):
    """One all-reduce size of a link measurement: the bytes and the best time of it."""

    nbytes: PositiveInt
    seconds: Annotated[float, msgspec.Meta(gt=0)]


class LinkProfile(msgspec.Struct, frozen=True, kw_only=True):
    """All-reduces of a few sizes between two ranks on one node (see
    services/nodeagent/compute_profiling.py); libs/core/platform.py fits them.
    ``shared_machine``: the cluster's nodes are emulated on this one machine, so traffic
    between them crosses the same loopback and the measurement stands for both links."""

    node: str
    measured_at: float
    backend: str
    address: str
    shared_machine: bool
    points: Annotated[list[LinkPoint], msgspec.Meta(min_length=2)]


class ComputePoint(msgspec.Struct, frozen=True, array_like=True):
    """Mean compute seconds per iteration of one worker at a per-GPU batch."""

    batch_size: PositiveInt
    iteration_s: Annotated[float, msgspec.Meta(gt=0)]


class ComputeProfile(msgspec.Struct, frozen=True, kw_only=True):
    """GENIE's profiling run of a model on one GPU (see
    services/nodeagent/compute_profiling.py): compute time per iteration at a batch and
    its half, and the model's parameter bytes (the gradients an all-reduce carries);
    ``links``: the link measurement the predictor holds, from this or an earlier run."""

    model: Name
    node: str
    measured_at: float
    device: str
    iterations: PositiveInt
    points: Annotated[list[ComputePoint], msgspec.Meta(min_length=1)]
    model_bytes: PositiveInt
    links: LinkProfile | None = None


class ComputeProfileRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask for a model's compute profile: the predictor answers the stored one (404 if
    none) unless ``node`` is given and it has none or ``refresh`` is set, in which case
    that node measures it first at ``batch_size`` (else the model's default); a node
    agent measures on every request, and its links too when ``links`` is set."""

    model: Name
    node: Name | None = None
    batch_size: BatchSize | None = None
    iterations: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    links: bool = False
    refresh: bool = False


class MeasuredPoint(msgspec.Struct, frozen=True, kw_only=True):
    """A model measured on one device at ``batch_size`` samples per iteration: seconds
    per iteration and peak memory (MiB) of the worker (docs/profiles.md)."""

    batch_size: BatchSize
    iteration_s: Annotated[float, msgspec.Meta(gt=0)]
    memory_mb: Annotated[float, msgspec.Meta(ge=0)]


class MeasuredModel(msgspec.Struct, frozen=True, kw_only=True):
    """One model's measured points on a GPU type and what measured them: the
    architecture trained (``real``, the worker's ``stand-in``, or ``emulated``: taken
    from the ground truth on a node with emulated GPUs), the device, torch's version,
    when (ISO 8601, UTC) and on which node."""

    architecture: Literal["real", "stand-in", "emulated"]
    device: Name
    torch: Label = ""
    measured_at: Name
    node: Label = ""
    points: Annotated[list[MeasuredPoint], msgspec.Meta(min_length=1)]


class MeasuredProfile(msgspec.Struct, frozen=True, kw_only=True):
    """The measured profile of one GPU type (``gpu_name`` as NVML names it, ``gpu_type``
    its normalised key): the file format of docs/profiles.md as a message."""

    format: Literal["gpusched-measured-profile"] = "gpusched-measured-profile"
    version: Literal[1] = 1
    gpu_name: Name
    gpu_type: IdStr
    models: Annotated[dict[Name, MeasuredModel], msgspec.Meta(min_length=1)]


class MeasuredProfileRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the predictor for a GPU type's measured profile: the whole of it, or only
    ``model``'s figures (404 when it has none, or none at ``batch_size`` when given)."""

    gpu_type: IdStr
    model: Name | None = None
    batch_size: BatchSize | None = None


class GpuProfileRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask a node agent to measure ``model`` on its GPU type now, at ``batch_sizes``
    (per-GPU batches; empty: the model's default batch and its half), ``repeats`` timed
    iterations each; it answers the figures and hands them to the predictor."""

    model: Name
    batch_sizes: Annotated[list[BatchSize], msgspec.Meta(max_length=32)] = []
    repeats: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10


def split_problem(batch_size: int, gpus: int, accum_steps: int) -> str:
    """Why a global batch cannot give every GPU a sample in each accumulation step, or ''."""
    if gpus * accum_steps < 1 or batch_size // (gpus * accum_steps) < 1:
        return (
            f"batch_size: {batch_size} leaves no sample per GPU for "
            f"{gpus} GPUs x {accum_steps} accumulation steps"
        )
    return ""


def now() -> float:
    return time.time()
