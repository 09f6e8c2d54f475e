"""The node's GPUs: real ones read through NVML, or emulated ones.

Every pynvml call lives in :class:`Nvml` (initialised once per agent, read every
telemetry tick), which returns plain values (or None where NVML is unavailable), so the
rest of the agent never touches the library. Emulated GPUs
get deterministic UUIDs and report what their resident jobs would use: memory from the
ground-truth model, full utilisation while occupied, and power and temperature to match.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpusched.libs.common.schemas import GpuInfo, GpuTelemetry
from gpusched.libs.core.extras import NVIDIA, missing_message

log = structlog.get_logger("gpusched.nodeagent.gpus")

#: GPUs an agent emulates when it was given no count and NVML finds none
DEFAULT_EMULATED_GPUS = 8
#: namespace of emulated GPU UUIDs: the same node name and index always give the same UUID
EMULATED_UUID_NAMESPACE = uuid.UUID("5d1f6c8e-3b0a-4d6e-9a57-6f0b1c2d3e4f")
#: board power limits (W) by model-name fragment, for plausible emulated power draw
TDP_W = (("H200", 700.0), ("H100", 700.0), ("A100", 400.0), ("V100", 300.0),
         ("A10", 150.0), ("L4", 72.0), ("T4", 70.0))
DEFAULT_TDP_W = 300.0
IDLE_POWER_FRACTION = 0.15
BUSY_POWER_FRACTION = 0.85
IDLE_TEMP_C = 34.0
BUSY_TEMP_C = 68.0


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    """One real GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    memory_total_mib: float
    memory_used_mib: float
    memory_free_mib: float
    util_percent: float
    power_w: float
    temp_c: float

    def info(self) -> GpuInfo:
        return GpuInfo(
            index=self.index, uuid=self.uuid, model=self.name,
            memory_mb=int(self.memory_total_mib),
        )

    def telemetry(self) -> GpuTelemetry:
        return GpuTelemetry(
            index=self.index,
            uuid=self.uuid,
            util=self.util_percent,
            fb_used_mib=self.memory_used_mib,
            fb_free_mib=self.memory_free_mib,
            power_w=self.power_w,
            temp_c=self.temp_c,
        )


class Nvml:
    """NVML held open for an agent's life: initialised once by :meth:`open`, read as
    often as the telemetry tick asks, shut down by :meth:`close`. Blocking calls: use
    them from a thread in async code."""

    def __init__(self, library: Any) -> None:
        self._nvml = library
        self._open = True

    @classmethod
    def open(cls) -> Nvml | None:
        """NVML initialised, or None where pynvml is missing or no driver answers (the
        reason is logged; :func:`nvml_absence` says it in words)."""
        try:
            import pynvml
        except ImportError:
            why = missing_message("pynvml", NVIDIA, "reading real NVIDIA GPUs")
            log.warning("nvml unavailable", error=why)
            return None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            log.debug("nvml unavailable", error=str(exc))
            return None
        return cls(pynvml)

    def read(self) -> list[NvmlGpu] | None:
        """Every GPU NVML sees, with its current readings; None when the query fails."""
        if not self._open:
            return None
        pynvml = self._nvml
        try:
            return [_read_gpu(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:
            log.warning("nvml query failed", error=str(exc))
            return None

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvml shutdown failed", error=str(exc))


def _read_gpu(pynvml: Any, index: int) -> NvmlGpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)

    def optional(read: Any, *args: Any) -> float:
        # power, temperature and utilisation are unsupported on some boards: read as 0
        try:
            return float(read(handle, *args))
        except pynvml.NVMLError:
            return 0.0

    try:
        util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        util = 0.0
    return NvmlGpu(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_mib=memory.total / 2**20,
        memory_used_mib=memory.used / 2**20,
        memory_free_mib=memory.free / 2**20,
        util_percent=util,
        power_w=optional(pynvml.nvmlDeviceGetPowerUsage) / 1000.0,
        temp_c=optional(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
    )


def read_nvml() -> list[NvmlGpu] | None:
    """One reading of every GPU NVML sees (NVML opened and closed around it); None where
    pynvml is missing or no driver answers. An agent holds an :class:`Nvml` instead."""
    nvml = Nvml.open()
    if nvml is None:
        return None
    try:
        return nvml.read()
    finally:
        nvml.close()


def nvml_absence() -> str:
    """Why this machine has no NVML GPUs, in words a banner can print."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return f"NVML did not start ({exc or type(exc).__name__}): no NVIDIA driver here"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:
        return f"NVML could not count GPUs ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvml shutdown failed", error=str(exc))
    return "NVML found no GPU" if count == 0 else f"NVML found {count} GPUs"


def _text(value: str | bytes) -> str:
    # older pynvml releases return bytes
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """What the node registers: its GPUs and whether they are emulated."""

    gpus: tuple[GpuInfo, ...]
    emulated: bool

    @property
    def indices(self) -> frozenset[int]:
        return frozenset(g.index for g in self.gpus)


def emulated_uuid(node: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(EMULATED_UUID_NAMESPACE, f'{node}/{index}')}"


def emulated_gpus(node: str, count: int, model: str, memory_mb: int) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(index=i, uuid=emulated_uuid(node, i), model=model, memory_mb=memory_mb)
        for i in range(count)
    )


def discover(
    node: str, count: int | None, model: str, memory_mb: int,
    nvml: list[NvmlGpu] | None = None,
) -> GpuInventory:
    """Emulated GPUs when ``count`` is given; else the real ones in ``nvml`` (read
    with :func:`read_nvml`), falling back to ``DEFAULT_EMULATED_GPUS`` emulated ones."""
    if count is None and nvml:
        return GpuInventory(tuple(g.info() for g in nvml), emulated=False)
    return GpuInventory(
        emulated_gpus(node, count or DEFAULT_EMULATED_GPUS, model, memory_mb), emulated=True
    )


def tdp_w(model: str) -> float:
    upper = model.upper()
    for fragment, watts in TDP_W:
        if fragment in upper:
            return watts
    return DEFAULT_TDP_W


def emulated_telemetry(
    gpus: Iterable[GpuInfo], used_mb: Mapping[int, float], busy: Iterable[int]
) -> list[GpuTelemetry]:
    """Readings of emulated GPUs: ``used_mb`` by index is the memory their resident jobs
    hold, ``busy`` the indices with at least one job on them."""
    occupied = set(busy)
    samples = []
    for gpu in gpus:
        used = min(float(gpu.memory_mb), max(0.0, used_mb.get(gpu.index, 0.0)))
        is_busy = gpu.index in occupied
        tdp = tdp_w(gpu.model)
        # a per-board offset of a few percent, so that identical boards do not plot as one
        spread = (zlib.crc32(gpu.uuid.encode()) % 1000) / 1000.0 - 0.5
        fraction = BUSY_POWER_FRACTION if is_busy else IDLE_POWER_FRACTION
        samples.append(
            GpuTelemetry(
                index=gpu.index,
                uuid=gpu.uuid,
                util=100.0 if is_busy else 0.0,
                fb_used_mib=round(used, 1),
                fb_free_mib=round(gpu.memory_mb - used, 1),
                power_w=round(tdp * fraction * (1 + 0.04 * spread), 1),
                temp_c=round((BUSY_TEMP_C if is_busy else IDLE_TEMP_C) + 2 * spread, 1),
            )
        )
    return samples
