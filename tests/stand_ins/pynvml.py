"""A stand-in for nvidia-ml-py: the only fake of the suite, for GPUs this machine lacks.

Put its folder first on ``PYTHONPATH`` and describe the GPUs in ``GPUSCHED_FAKE_NVML``
(a JSON list of ``{"name", "uuid", "memory_mib"}``). Every call that opens, closes or
reads NVML appends a line (``init``, ``shutdown``, ``read``) to the file named by
``GPUSCHED_FAKE_NVML_LOG``, so a test can count them.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    pass


def _log(event: str) -> None:
    path = os.environ.get("GPUSCHED_FAKE_NVML_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(f"{os.getpid()} {event}\n")


def _gpus() -> list[dict[str, Any]]:
    return list(json.loads(os.environ.get("GPUSCHED_FAKE_NVML", "[]")))


def nvmlInit() -> None:
    _log("init")


def nvmlShutdown() -> None:
    _log("shutdown")


def nvmlDeviceGetCount() -> int:
    _log("read")
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> dict[str, Any]:
    return _gpus()[index]


def nvmlDeviceGetMemoryInfo(handle: dict[str, Any]) -> SimpleNamespace:
    total = int(handle["memory_mib"]) * 2**20
    used = 512 * 2**20
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(gpu=7, memory=3)


def nvmlDeviceGetUUID(handle: dict[str, Any]) -> str:
    return str(handle["uuid"])


def nvmlDeviceGetName(handle: dict[str, Any]) -> str:
    return str(handle["name"])


def nvmlDeviceGetPowerUsage(handle: dict[str, Any]) -> int:
    return 71_000


def nvmlDeviceGetTemperature(handle: dict[str, Any], sensor: int) -> int:
    raise NVMLError("not supported on this board")
