"""The predictor's settings, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.libs.common import settings
from gpusched.libs.common.settings import DEFAULT_NATS_URL, Setting, load
from gpusched.services.predictor.model import DEFAULT_HISTORY_WEIGHT

NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


@dataclass(frozen=True)
class PredictorConfig:
    nats_url: str = DEFAULT_NATS_URL
    #: research profiles overriding the built-in ones (see gpusched.libs.core.groundtruth)
    data_dir: Path | None = None
    #: weight of each new measurement in the moving averages, in (0, 1]
    history_weight: float = DEFAULT_HISTORY_WEIGHT
    #: serve Prometheus metrics on this port (0: any free port; None: not at all)
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    #: how often what was learned is saved to KV when it changed (and always on stop)
    save_every_s: float = 5.0
    #: measure a model's CPU/memory profile on the node where a job of it first starts,
    #: when none was measured yet (see services/nodeagent/cpu_profiling.py)
    profile_cpu: bool = False
    #: how long a node may take to measure one
    profile_timeout_s: float = 300.0
    #: GENIE: have the node where a job of a model without a compute profile first runs
    #: measure it (see services/nodeagent/compute_profiling.py)
    profile_compute: bool = False
    #: start with the profiles the project measured on GPUs (libs/core/builtin/measured/)
    #: for the models a GPU type's nodes have not measured yet
    shipped_profiles: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nats_url, str) or not self.nats_url.startswith(NATS_SCHEMES):
            raise ValueError(
                f"nats_url must start with one of {', '.join(NATS_SCHEMES)}, got {self.nats_url!r}"
            )
        if self.data_dir is not None:
            data_dir = Path(self.data_dir)
            if not data_dir.is_dir():
                raise ValueError(f"data_dir {str(data_dir)!r} is not a directory")
            object.__setattr__(self, "data_dir", data_dir)
        weight = self.history_weight
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or not 0 < weight <= 1
        ):
            raise ValueError(f"history_weight must be a number in (0, 1], got {weight!r}")
        port = self.metrics_port
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise ValueError(f"metrics_port must be an integer in [0, 65535], got {port!r}")
        if not self.metrics_host:
            raise ValueError("metrics_host must not be empty")
        every = self.save_every_s
        if isinstance(every, bool) or not isinstance(every, int | float) or not every > 0:
            raise ValueError(f"save_every_s must be a number > 0, got {every!r}")
        if not isinstance(self.profile_cpu, bool):
            raise ValueError(f"profile_cpu must be true or false, got {self.profile_cpu!r}")
        if not isinstance(self.shipped_profiles, bool):
            raise ValueError(
                f"shipped_profiles must be true or false, got {self.shipped_profiles!r}"
            )
        if not isinstance(self.profile_compute, bool):
            raise ValueError(
                f"profile_compute must be true or false, got {self.profile_compute!r}"
            )
        limit = self.profile_timeout_s
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
            raise ValueError(f"profile_timeout_s must be a number > 0, got {limit!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PredictorConfig:
        """NATS_URL, GPUSCHED_DATA_DIR, GPUSCHED_PREDICTOR_HISTORY_WEIGHT,
        GPUSCHED_PREDICTOR_METRICS_PORT, GPUSCHED_PREDICTOR_METRICS_HOST,
        GPUSCHED_PREDICTOR_SAVE_EVERY_S, GPUSCHED_PREDICTOR_PROFILE_CPU,
        GPUSCHED_PREDICTOR_PROFILE_TIMEOUT_S, GPUSCHED_PREDICTOR_PROFILE_COMPUTE and
        GPUSCHED_PREDICTOR_SHIPPED_PROFILES; unset
        or empty variables keep the defaults."""
        return cls(**load(ENVIRONMENT, environ))


#: field -> the variable ``PredictorConfig.from_env`` reads it from
ENVIRONMENT: dict[str, Setting[Any]] = {
    "nats_url": Setting("NATS_URL", settings.text()),
    "data_dir": Setting("GPUSCHED_DATA_DIR", settings.path()),
    "history_weight": Setting("GPUSCHED_PREDICTOR_HISTORY_WEIGHT", settings.number()),
    "metrics_port": Setting("GPUSCHED_PREDICTOR_METRICS_PORT", settings.integer()),
    "metrics_host": Setting("GPUSCHED_PREDICTOR_METRICS_HOST", settings.text()),
    "save_every_s": Setting("GPUSCHED_PREDICTOR_SAVE_EVERY_S", settings.number()),
    "profile_cpu": Setting("GPUSCHED_PREDICTOR_PROFILE_CPU", settings.boolean()),
    "profile_timeout_s": Setting("GPUSCHED_PREDICTOR_PROFILE_TIMEOUT_S", settings.number()),
    "profile_compute": Setting("GPUSCHED_PREDICTOR_PROFILE_COMPUTE", settings.boolean()),
    "shipped_profiles": Setting("GPUSCHED_PREDICTOR_SHIPPED_PROFILES", settings.boolean()),
}
