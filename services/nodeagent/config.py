"""The node agent's settings, validated when built (a bad value names its field)."""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
JOBS_MODES = ("simulated", "process")
JobsMode = Literal["simulated", "process"]

#: a node name travels inside subjects and KV keys
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: "V100-32GB", "A100-80GB", "H100 80GB": the memory size in a GPU model's name
GPU_MEMORY_IN_NAME = re.compile(r"(\d+)\s*GB\b", re.IGNORECASE)


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
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        if self.data_dir is not None:
            data_dir = Path(self.data_dir)
            if not data_dir.is_dir():
                raise ValueError(f"data_dir: {str(data_dir)!r} is not a directory")
            object.__setattr__(self, "data_dir", data_dir)
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
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field_name, variable in ENVIRONMENT.items():
            text = env.get(variable, "").strip()
            if not text:
                continue
            parse, looks_like = _PARSERS.get(field_name, (str, "text"))
            try:
                values[field_name] = parse(text)
            except ValueError:
                raise ValueError(
                    f"{variable} (field {field_name}): expected {looks_like}, got {text!r}"
                ) from None
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


#: field -> environment variable read by ``NodeAgentConfig.from_env``
ENVIRONMENT: dict[str, str] = {
    "nats_url": "NATS_URL",
    "name": "GPUSCHED_NODE_NAME",
    "gpus": "GPUSCHED_NODE_GPUS",
    "gpu_model": "GPUSCHED_NODE_GPU_MODEL",
    "gpu_mem_mb": "GPUSCHED_NODE_GPU_MEM_MB",
    "cpus": "GPUSCHED_NODE_CPUS",
    "host_mem_gb": "GPUSCHED_NODE_HOST_MEM_GB",
    "net_gbps": "GPUSCHED_NODE_NET_GBPS",
    "heartbeat_s": "GPUSCHED_NODEAGENT_HEARTBEAT_S",
    "telemetry_s": "GPUSCHED_NODEAGENT_TELEMETRY_S",
    "progress_s": "GPUSCHED_NODEAGENT_PROGRESS_S",
    "work_dir": "GPUSCHED_WORK_DIR",
    "jobs_mode": "GPUSCHED_JOBS_MODE",
    "time_scale": "GPUSCHED_TIME_SCALE",
    "data_dir": "GPUSCHED_DATA_DIR",
    "kill_grace_s": "GPUSCHED_NODEAGENT_KILL_GRACE_S",
    "preempt_grace_s": "GPUSCHED_NODEAGENT_PREEMPT_GRACE_S",
    "metrics_port": "GPUSCHED_NODEAGENT_METRICS_PORT",
    "advertise_host": "GPUSCHED_NODEAGENT_HOST",
}


def _path(text: str) -> Path:
    return Path(text).expanduser()


#: how a variable's text becomes a field's value, and what the text should look like
_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "gpus": (int, "an integer"),
    "gpu_mem_mb": (int, "an integer"),
    "cpus": (int, "an integer"),
    "host_mem_gb": (float, "a number"),
    "net_gbps": (float, "a number"),
    "heartbeat_s": (float, "a number"),
    "telemetry_s": (float, "a number"),
    "progress_s": (float, "a number"),
    "work_dir": (_path, "a path"),
    "time_scale": (float, "a number"),
    "data_dir": (_path, "a path"),
    "kill_grace_s": (float, "a number"),
    "preempt_grace_s": (float, "a number"),
    "metrics_port": (int, "an integer"),
}
