"""``--profile``: mean iteration time and memory of a zoo model or a real architecture over a
list of batch sizes.

Meant for a GPU machine, to measure the project's own profiles; on a CPU it measures the
CPU. Each batch size gets a fresh model so that memory peaks do not carry over.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from typing import Any

import torch

from gpusched.libs.sdk import resident_set_mb
from gpusched.services.nodeagent.worker.architectures import AnySpec, description
from gpusched.services.nodeagent.worker.training import Trainer, TrainingOptions


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch(
    spec: AnySpec,
    batch_size: int,
    *,
    device: str,
    accum_steps: int,
    warmup: int,
    repeats: int,
    options: TrainingOptions,
) -> dict[str, Any]:
    """One measurement; an out-of-memory batch yields an ``error`` entry instead."""
    result: dict[str, Any] = {"batch_size": batch_size, "accum_steps": accum_steps}
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = Trainer(
            spec, batch_size=batch_size, accum_steps=accum_steps, device=device, options=options
        )
        for iteration in range(warmup):
            trainer.step(iteration)
        durations: list[float] = []
        for iteration in range(warmup, warmup + repeats):
            _synchronize(trainer.device)
            started = time.perf_counter()
            trainer.step(iteration)
            _synchronize(trainer.device)
            durations.append(time.perf_counter() - started)
    except torch.cuda.OutOfMemoryError:
        result["error"] = "out of memory"
        return result
    mean = statistics.fmean(durations)
    # what one all-reduce of the gradients carries (GENIE's model size)
    result["parameter_bytes"] = sum(
        p.numel() * p.element_size() for p in trainer.net.parameters() if p.requires_grad
    )
    result["mean_iteration_s"] = mean
    result["stdev_iteration_s"] = statistics.stdev(durations) if len(durations) > 1 else 0.0
    # a busy machine's pauses land in the mean; the median is the iteration's own work
    result["median_iteration_s"] = statistics.median(durations)
    result["samples_per_s"] = batch_size / mean if mean > 0 else None
    if on_cuda:
        result["gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["gpu_mem_mb"] = resident_set_mb()
    return result


def profile(
    spec: AnySpec,
    batch_sizes: list[int],
    *,
    model_name: str,
    device: str,
    accum_steps: int = 1,
    warmup: int = 3,
    repeats: int = 10,
    options: TrainingOptions | None = None,
) -> dict[str, Any]:
    """The whole report printed by ``--profile``, as a JSON-ready dict."""
    if not batch_sizes:
        raise ValueError("batch_sizes must not be empty")
    for batch_size in batch_sizes:
        if batch_size < 1 or batch_size % accum_steps:
            raise ValueError(
                f"batch_sizes: {batch_size} must be >= 1 and divisible by accum_steps {accum_steps}"
            )
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    options = options or TrainingOptions()
    on_cuda = torch.device(device).type == "cuda"
    device_name = torch.cuda.get_device_name() if on_cuda else platform.processor()
    return {
        "model": model_name,
        **description(spec),
        "device": device,
        "device_name": device_name or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats": repeats,
        "memory": "max_memory_allocated" if on_cuda else "process_rss",
        "results": [
            profile_batch(
                spec,
                batch_size,
                device=device,
                accum_steps=accum_steps,
                warmup=warmup,
                repeats=repeats,
                options=options,
            )
            for batch_size in batch_sizes
        ],
    }
