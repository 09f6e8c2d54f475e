"""The job SDK: what a training script needs to run under gpusched (see docs/sdk.md)."""

from gpusched.libs.sdk.context import (
    ENV_VARIABLES,
    REQUIRED_UNDER_GPUSCHED,
    JobContext,
    JobEnvironmentError,
    resident_set_mb,
    save_atomically,
)

__all__ = [
    "ENV_VARIABLES",
    "REQUIRED_UNDER_GPUSCHED",
    "JobContext",
    "JobEnvironmentError",
    "resident_set_mb",
    "save_atomically",
]
