"""The node agent's settings, validated when built (a bad value names its field)."""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpusched.libs.common import settings
from gpusched.libs.common.settings import DEFAULT_NATS_URL, Setting, load
from gpusched.services.nodeagent.jobuser import job_user_problem
from gpusched.services.nodeagent.worker.registry import ARCHITECTURE_CHOICES, ArchitectureChoice

NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
JOBS_MODES = ("simulated", "process")
JobsMode = Literal["simulated", "process"]

#: a node name travels inside subjects and KV keys
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: "V100-32GB", "A100-80GB", "H100 80GB": the memory size in a GPU model's name
GPU_MEMORY_IN_NAME = re.compile(r"(\d+)\s*GB\b", re.IGNORECASE)


def node_name_problem(name: str) -> str:
    """Why ``name`` cannot name a node ('' when it can)."""
    if not NAME_PATTERN.match(name):
        return f"node name {name!r}: 1-64 letters, digits, '-' or '_' (it is part of subjects)"
    return ""


def default_node_name() -> str:
    """The host name, made safe for subjects: anything but letters, digits, '-' and '_'
    becomes '-' (so ``gpu01.example.com`` is ``gpu01-example-com``)."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()).strip("-")[:64]
    return cleaned or "node"


def default_work_dir() -> Path:
    return Path(tempfile.gettempdir()) / "gpusched" / "work"


def physical_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def gpu_memory_from_model(gpu_model: str) -> int | None:
    """MiB a GPU of this model holds, read from its name ("V100-32GB" -> 32768)."""
    match = GPU_MEMORY_IN_NAME.search(gpu_model)
    return int(match.group(1)) * 1024 if match else None


@dataclass(frozen=True)
class NodeAgentConfig:
    nats_url: str = DEFAULT_NATS_URL
    #: the node's id in subjects and in the nodes bucket
    name: str = field(default_factory=default_node_name)
    #: None: discover real GPUs with NVML, emulating 8 when it finds none; a number:
    #: emulate that many GPUs even where real ones exist
    gpus: int | None = None
    #: model and memory of emulated GPUs (memory read from the model name when not given)
    gpu_model: str = "V100-32GB"
    gpu_mem_mb: int | None = None
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    host_mem_gb: float = field(default_factory=physical_memory_gb)
    net_gbps: float = 100.0
    heartbeat_s: float = 1.0
    telemetry_s: float = 1.0
    #: one JobProgressEvent per running leader job this often
    progress_s: float = 1.0
    #: how often a process run's progress file is read
    progress_poll_s: float = 0.25
    #: checkpoints, progress files and run logs live under work_dir/<job_id>/
    work_dir: Path = field(default_factory=default_work_dir)
    #: simulated: built-in-model jobs compute nothing and advance at the ground-truth
    #: speed; process: they run the torch worker. A job with a command always runs it.
    jobs_mode: JobsMode = "simulated"
    #: what the built-in worker trains (GPUSCHED_WORKER_ARCHITECTURE of its runs): "real"
    #: architectures, their "stand-in"s, or "auto" (real on a GPU); None: the worker's own
    #: default (auto), or the variable where this agent's environment sets it
    worker_architecture: ArchitectureChoice | None = None
    #: wall seconds per ground-truth second for simulated jobs (0.001: a 1000x faster run)
    time_scale: float = 1.0
    #: research profiles for the ground truth (None: the built-in profiles)
    data_dir: Path | None = None
    #: SIGTERM to SIGKILL on a cancel or a lost run
    kill_grace_s: float = 10.0
    #: SIGTERM to SIGKILL on a preemption: time for the worker to checkpoint
    preempt_grace_s: float = 60.0
    #: on shutdown, how long undelivered exit reports are retried before giving up
    exit_flush_s: float = 30.0
    #: serve Prometheus metrics on this port (0: any free port; None: not at all)
    metrics_port: int | None = None
    #: the address other nodes reach this one at, for the ranks of jobs across nodes
    advertise_host: str = field(default_factory=socket.gethostname)
    #: passes over the CPU counts of a CPU profile (services/nodeagent/cpu_profiling.py);
    #: each point keeps its fastest pass
    cpu_profile_rounds: int = 2
    #: measure a model on the node's GPU type the first time a run of it starts here,
    #: where the predictor holds no figures of it (services/nodeagent/gpu_profiling.py)
    measure_profiles: bool = True
    #: who job processes run as: a user name, a uid, "auto" (the system user
    #: gpusched-job, created where missing) or "self" (the agent's own user, with a
    #: warning); switching needs root (services/nodeagent/jobuser.py)
    job_user: str = "self"

    def __post_init__(self) -> None:
        if not isinstance(self.nats_url, str) or not self.nats_url.startswith(NATS_SCHEMES):
            raise ValueError(
                f"nats_url: must start with one of {', '.join(NATS_SCHEMES)}, "
                f"got {self.nats_url!r}"
            )
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise ValueError(
                f"name: must be 1-64 letters, digits, '-' or '_' (it is part of NATS "
                f"subjects), got {self.name!r}"
            )
        if self.gpus is not None:
            _check_int("gpus", self.gpus, low=1, high=1024)
        if not isinstance(self.gpu_model, str) or not self.gpu_model.strip():
            raise ValueError(f"gpu_model: must be a non-empty name, got {self.gpu_model!r}")
        if self.gpu_mem_mb is None:
            derived = gpu_memory_from_model(self.gpu_model)
            if derived is None:
                raise ValueError(
                    f"gpu_mem_mb: required when gpu_model {self.gpu_model!r} does not "
                    "name its memory (like 'V100-32GB')"
                )
            object.__setattr__(self, "gpu_mem_mb", derived)
        else:
            _check_int("gpu_mem_mb", self.gpu_mem_mb, low=1, high=10_000_000)
        _check_int("cpus", self.cpus, low=1, high=1_000_000)
        for name in (
            "host_mem_gb", "net_gbps", "heartbeat_s", "telemetry_s", "progress_s",
            "progress_poll_s", "time_scale", "kill_grace_s", "preempt_grace_s",
            "exit_flush_s",
        ):
            _check_positive(name, getattr(self, name))
        if self.jobs_mode not in JOBS_MODES:
            raise ValueError(
                f"jobs_mode: must be one of {', '.join(JOBS_MODES)}, got {self.jobs_mode!r}"
            )
        problem = job_user_problem(self.job_user)
        if problem:
            raise ValueError(problem)
        if self.worker_architecture not in (None, *ARCHITECTURE_CHOICES):
            raise ValueError(
                f"worker_architecture: must be one of {', '.join(ARCHITECTURE_CHOICES)}, "
                f"got {self.worker_architecture!r}"
            )
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        if self.data_dir is not None:
            data_dir = Path(self.data_dir)
            if not data_dir.is_dir():
                raise ValueError(f"data_dir: {str(data_dir)!r} is not a directory")
            object.__setattr__(self, "data_dir", data_dir)
        _check_int("cpu_profile_rounds", self.cpu_profile_rounds, low=1, high=100)
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, low=0, high=65535)
        if not isinstance(self.advertise_host, str) or not re.fullmatch(
            r"[A-Za-z0-9.:_\[\]-]{1,253}", self.advertise_host
        ):
            raise ValueError(
                f"advertise_host: must be a host name or address, got {self.advertise_host!r}"
            )

    @property
    def emulated_gpu_mem_mb(self) -> int:
        assert self.gpu_mem_mb is not None  # filled in by __post_init__
        return self.gpu_mem_mb

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> NodeAgentConfig:
        """Settings from the environment (see ``ENVIRONMENT``); unset or empty variables
        keep the defaults, and ``overrides`` that are not None win over both."""
        values = load(ENVIRONMENT, environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


#: field -> the variable ``NodeAgentConfig.from_env`` reads it from
ENVIRONMENT: dict[str, Setting[Any]] = {
    "nats_url": Setting("NATS_URL", settings.text()),
    "name": Setting("GPUSCHED_NODE_NAME", settings.text()),
    "gpus": Setting("GPUSCHED_NODE_GPUS", settings.integer()),
    "gpu_model": Setting("GPUSCHED_NODE_GPU_MODEL", settings.text()),
    "gpu_mem_mb": Setting("GPUSCHED_NODE_GPU_MEM_MB", settings.integer()),
    "cpus": Setting("GPUSCHED_NODE_CPUS", settings.integer()),
    "host_mem_gb": Setting("GPUSCHED_NODE_HOST_MEM_GB", settings.number()),
    "net_gbps": Setting("GPUSCHED_NODE_NET_GBPS", settings.number()),
    "heartbeat_s": Setting("GPUSCHED_NODEAGENT_HEARTBEAT_S", settings.number()),
    "telemetry_s": Setting("GPUSCHED_NODEAGENT_TELEMETRY_S", settings.number()),
    "progress_s": Setting("GPUSCHED_NODEAGENT_PROGRESS_S", settings.number()),
    "work_dir": Setting("GPUSCHED_WORK_DIR", settings.path()),
    "jobs_mode": Setting("GPUSCHED_JOBS_MODE", settings.text()),
    "worker_architecture": Setting("GPUSCHED_NODEAGENT_ARCHITECTURE", settings.text()),
    "time_scale": Setting("GPUSCHED_TIME_SCALE", settings.number()),
    "data_dir": Setting("GPUSCHED_DATA_DIR", settings.path()),
    "kill_grace_s": Setting("GPUSCHED_NODEAGENT_KILL_GRACE_S", settings.number()),
    "preempt_grace_s": Setting("GPUSCHED_NODEAGENT_PREEMPT_GRACE_S", settings.number()),
    "metrics_port": Setting("GPUSCHED_NODEAGENT_METRICS_PORT", settings.integer()),
    "advertise_host": Setting("GPUSCHED_NODEAGENT_HOST", settings.text()),
    "cpu_profile_rounds": Setting("GPUSCHED_NODEAGENT_CPU_PROFILE_ROUNDS", settings.integer()),
    "measure_profiles": Setting("GPUSCHED_NODEAGENT_MEASURE_PROFILES", settings.boolean()),
    "job_user": Setting("GPUSCHED_JOB_USER", settings.text()),
}
