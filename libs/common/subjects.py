"""Every NATS subject, stream and bucket name, as pure builders.

Subjects follow ``gpusched.<area>.<id>.<event>`` with dot-free ids, so
``gpusched.job.*.state`` or ``gpusched.node.*.telemetry`` can be tapped directly. What a
node agent publishes lies under its node, ``gpusched.node.<node>.…`` (a job's progress
and exit: ``gpusched.node.<node>.job.<id>.<event>``), so the server's permissions let a
node speak only for itself and readers take the sender from the subject.
docs/subjects.md lists them all with their payloads.
"""

from __future__ import annotations

PREFIX = "gpusched"

#: JetStream stream holding durable work for the scheduler from the services: submissions
#: and cancels (admission) and the predictor's predicted sizes. No node agent may publish
#: into it, so no node can claim one of its ``Nats-Msg-Id`` (docs/security.md)
JOBS_STREAM = "GPUSCHED_JOBS"
JOBS_STREAM_SUBJECTS = (
    f"{PREFIX}.job.*.submitted",
    f"{PREFIX}.job.*.cancel",
    f"{PREFIX}.job.*.predicted_size",
)
#: the exits node agents store, each under its node's own subjects: a stream of its own,
#: so that the duplicate window a node can write to holds no service's message ids
EXITS_STREAM = "GPUSCHED_EXITS"
SCHEDULER_CONSUMER = "scheduler"

JOBS_BUCKET = "gpusched_jobs"
NODES_BUCKET = "gpusched_nodes"
LEASE_BUCKET = "gpusched_lease"
#: one key per job that is not finished, so a new leader reads only those
LIVE_BUCKET = "gpusched_live"
#: in LIVE_BUCKET: present once the index holds every unfinished job of the store
LIVE_INDEX_COMPLETE_KEY = "_complete"
#: what the predictor has learned (key ``PREDICTOR_LEARNED_KEY``), kept across restarts
PREDICTOR_BUCKET = "gpusched_predictor"
#: admission's per-tenant GPU quota ledgers (services/admission/quota.py)
QUOTA_BUCKET = "gpusched_quota"
PREDICTOR_LEARNED_KEY = "learned"
#: in PREDICTOR_BUCKET: jobs' epoch histories (the progress predictor's data)
PREDICTOR_HISTORIES_KEY = "progress_histories"
#: in PREDICTOR_BUCKET: the size forest's training rows and its error figures
PREDICTOR_SIZES_KEY = "size_rows"
#: in PREDICTOR_BUCKET: the measured profile of every GPU type (docs/profiles.md)
PREDICTOR_MEASURED_KEY = "measured_profiles"
SCHEDULER_LEASE_KEY = "scheduler"


def _id(value: str) -> str:
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(f"id {value!r} may not be empty or hold dots, spaces or wildcards")
    return value


def job_submitted(job_id: str) -> str:
    return f"{PREFIX}.job.{_id(job_id)}.submitted"


def job_cancel(job_id: str) -> str:
    return f"{PREFIX}.job.{_id(job_id)}.cancel"


def job_exit(node: str, job_id: str) -> str:
    """Stored in EXITS_STREAM by the node agent of ``node`` when a run it leads ends:
    only that node's user may publish it."""
    return f"{PREFIX}.node.{_id(node)}.job.{_id(job_id)}.exit"


def job_predicted_size(job_id: str) -> str:
    """Published durably by the predictor: a submitted job's predicted iterations."""
    return f"{PREFIX}.job.{_id(job_id)}.predicted_size"


def job_state(job_id: str) -> str:
    return f"{PREFIX}.job.{_id(job_id)}.state"


def job_progress(node: str, job_id: str) -> str:
    """Published by the node agent of ``node`` about a run it leads."""
    return f"{PREFIX}.node.{_id(node)}.job.{_id(job_id)}.progress"


def job_progress_from_any_node(job_id: str) -> str:
    """One job's progress, whichever node reports it (the subject names the node)."""
    return f"{PREFIX}.node.*.job.{_id(job_id)}.progress"


def node_of(subject: str) -> str | None:
    """The node a ``gpusched.node.<node>.…`` subject names: who published it, since only
    that node's user may publish there (libs/common/natsauth.py). None for any other."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != PREFIX or parts[1] != "node":
        return None
    return parts[2]


def job_of(subject: str) -> str | None:
    """The job a ``gpusched.node.<node>.job.<id>.<event>`` subject names; None else."""
    parts = subject.split(".")
    if len(parts) != 6 or node_of(subject) is None or parts[3] != "job":
        return None
    return parts[4]


def matches_sender(subject: str, node: str, job_id: str | None = None) -> bool:
    """Whether a node's report published on ``subject`` names the node its subject names
    (and, given ``job_id``, the job): a report whose payload claims another node or job
    than its subject is not to be believed."""
    if node != node_of(subject):
        return False
    return job_id is None or job_id == job_of(subject)


def node_command(node: str) -> str:
    return f"{PREFIX}.node.{_id(node)}.command"


def node_profile(node: str) -> str:
    """NATS micro endpoint of a node agent: measure a model's CPU profile there."""
    return f"{PREFIX}.node.{_id(node)}.profile"


def cpu_profile_measured(model: str) -> str:
    """Published by the predictor whenever it stores a model's measured CPU profile."""
    return f"{PREFIX}.model.{_id(model)}.cpu_profile"


def node_compute_profile(node: str) -> str:
    """NATS micro endpoint of a node agent: GENIE's profiling run of a model there."""
    return f"{PREFIX}.node.{_id(node)}.compute_profile"


def compute_profile_measured(model: str) -> str:
    """Published by the predictor whenever it stores a model's compute profile."""
    return f"{PREFIX}.model.{_id(model)}.compute_profile"


def node_gpu_profile(node: str) -> str:
    """NATS micro endpoint of a node agent: measure a model on its GPU type now."""
    return f"{PREFIX}.node.{_id(node)}.gpu_profile"


def node_measured_profile(node: str) -> str:
    """Requested by a node agent: figures it measured on its GPU type, for the predictor
    to store (it answers a CommandReply)."""
    return f"{PREFIX}.node.{_id(node)}.measured_profile"


def gpu_profile_stored(gpu_type: str) -> str:
    """Published by the predictor whenever it stores figures of a GPU type: the type's
    whole measured profile."""
    return f"{PREFIX}.gpu.{_id(gpu_type)}.measured_profile"


def node_heartbeat(node: str) -> str:
    return f"{PREFIX}.node.{_id(node)}.heartbeat"


def node_telemetry(node: str) -> str:
    return f"{PREFIX}.node.{_id(node)}.telemetry"


def scheduler_decision(instance: str) -> str:
    return f"{PREFIX}.scheduler.{_id(instance)}.decision"


def scheduler_status(instance: str) -> str:
    """NATS micro endpoint: is this instance leading, and how busy it is (JSON)."""
    return f"{PREFIX}.scheduler.{_id(instance)}.status"


#: predictor endpoints (NATS micro, group ``gpusched.predictor``)
PREDICTOR_GROUP = f"{PREFIX}.predictor"
PREDICT_ITERATIONS = f"{PREDICTOR_GROUP}.iterations"
PREDICT_THROUGHPUT = f"{PREDICTOR_GROUP}.throughput"
PREDICT_SLOWDOWN = f"{PREDICTOR_GROUP}.slowdown"
#: a running job's remaining iterations (RemainingRequest -> Prediction)
PREDICT_REMAINING = f"{PREDICTOR_GROUP}.remaining"
#: a model's measured CPU/memory profile (CpuProfileRequest -> CpuProfile)
PREDICT_CPU_PROFILE = f"{PREDICTOR_GROUP}.cpu_profile"
#: the size forest's error: each finished job's prediction at submission against its truth
PREDICT_SIZE_ERROR = f"{PREDICTOR_GROUP}.size_error"
#: a model's compute profile (ComputeProfileRequest -> ComputeProfile)
PREDICT_COMPUTE_PROFILE = f"{PREDICTOR_GROUP}.compute_profile"
#: a GPU type's measured profile (MeasuredProfileRequest -> MeasuredProfile)
PREDICT_MEASURED_PROFILE = f"{PREDICTOR_GROUP}.measured_profile"

ALL_JOB_STATES = f"{PREFIX}.job.*.state"
ALL_JOB_SUBMISSIONS = f"{PREFIX}.job.*.submitted"
ALL_JOB_PROGRESS = f"{PREFIX}.node.*.job.*.progress"
ALL_JOB_EXITS = f"{PREFIX}.node.*.job.*.exit"
EXITS_STREAM_SUBJECTS = (ALL_JOB_EXITS,)
ALL_JOB_PREDICTED_SIZES = f"{PREFIX}.job.*.predicted_size"
ALL_CPU_PROFILES = f"{PREFIX}.model.*.cpu_profile"
ALL_COMPUTE_PROFILES = f"{PREFIX}.model.*.compute_profile"
ALL_NODE_MEASURED_PROFILES = f"{PREFIX}.node.*.measured_profile"
ALL_GPU_PROFILES = f"{PREFIX}.gpu.*.measured_profile"
ALL_HEARTBEATS = f"{PREFIX}.node.*.heartbeat"
ALL_TELEMETRY = f"{PREFIX}.node.*.telemetry"
EVERYTHING = f"{PREFIX}.>"
