"""The live scheduler's settings, validated when built."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.libs.common import settings
from gpusched.libs.common.settings import DEFAULT_NATS_URL, Setting, load
from gpusched.services.scheduler.policies import POLICIES, UnknownPolicyError
from gpusched.services.scheduler.policies.sjf_bsbf import resident_cap_problem


def default_instance() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{host or 'scheduler'}-{os.getpid()}"


@dataclass(frozen=True)
class SchedulerConfig:
    nats_url: str
    policy: str = "auto"
    #: this instance's name in the lease and in decision subjects
    instance: str = field(default_factory=default_instance)
    #: a leader that stops renewing loses the lease after this long
    lease_ttl_s: float = 3.0
    lease_renew_s: float = 1.0
    #: a round runs at least this often even when nothing happens
    decide_every_s: float = 1.0
    command_timeout_s: float = 2.0
    command_retries: int = 3
    #: a node silent for this long is lost and its jobs are requeued
    node_timeout_s: float = 5.0
    #: a job its node stops reporting for this long is treated as gone
    missing_job_grace_s: float = 5.0
    #: first retry delay after a failed run; doubles per failure
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 60.0
    #: at most one progress write to a job's record this often
    progress_write_s: float = 5.0
    #: wall seconds per ground-truth second (emulated clusters run faster than real time)
    time_scale: float = 1.0
    data_dir: Path | None = None
    predictor_timeout_s: float = 0.3
    #: sjf-bsbf and sjf-ffs also refuse a partner they would slow by more than this
    #: (None: no cap, the rule as specified)
    max_resident_slowdown: float | None = None

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url: required")
        if self.policy.strip().lower() not in POLICIES:
            raise UnknownPolicyError(self.policy)
        if not self.instance or any(c in self.instance for c in ".*> "):
            raise ValueError(f"instance: {self.instance!r} may not hold dots, spaces or wildcards")
        for name in (
            "lease_ttl_s", "lease_renew_s", "decide_every_s", "command_timeout_s",
            "node_timeout_s", "missing_job_grace_s", "retry_backoff_s", "retry_backoff_max_s",
            "progress_write_s", "time_scale", "predictor_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError("lease_renew_s: must be shorter than lease_ttl_s")
        if self.command_retries < 1:
            raise ValueError("command_retries: must be >= 1")
        problem = resident_cap_problem(self.max_resident_slowdown)
        if problem:
            raise ValueError(f"max_resident_slowdown: {problem}")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> SchedulerConfig:
        """Settings from the environment (see ``ENVIRONMENT``); unset or empty variables
        keep the defaults, and ``overrides`` that are not None win over both."""
        values: dict[str, Any] = {"nats_url": DEFAULT_NATS_URL, **load(ENVIRONMENT, environ)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)



#: field -> the variable ``SchedulerConfig.from_env`` reads it from
ENVIRONMENT: dict[str, Setting[Any]] = {
    "nats_url": Setting("NATS_URL", settings.text()),
    "policy": Setting("GPUSCHED_POLICY", settings.text()),
    "time_scale": Setting("GPUSCHED_TIME_SCALE", settings.number()),
    "max_resident_slowdown": Setting("GPUSCHED_MAX_RESIDENT_SLOWDOWN", settings.number()),
    "data_dir": Setting("GPUSCHED_DATA_DIR", settings.path()),
}
