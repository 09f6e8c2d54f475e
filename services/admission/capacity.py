"""Whether the registered nodes can hold a submitted job at all, today.

A job nothing can hold is still accepted (nodes may join later), but its submitter is
told at once. The rules are the scheduler's (``unschedulable_reason`` in
services/scheduler/policies/base.py; the accumulation steps in libs/core/shape.py): a
job may span nodes, so it needs at most the cluster's GPUs in all, and a GPU large
enough for its smallest sub-batch (the batch split over its GPUs and the most
accumulation steps that leave each step a sample).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpusched.libs.common.schemas import JobSpec, NodeInfo
from gpusched.libs.core.shape import accum_steps_choices

#: (model, per-GPU batch) -> MiB of GPU memory one GPU of the job holds
MemoryOf = Callable[[str, float], float]


def capacity_warnings(
    spec: JobSpec, nodes: Sequence[NodeInfo], memory_mb: MemoryOf | None = None
) -> list[str]:
    """Sentences saying why no placement on ``nodes`` can hold ``spec`` (empty: one
    can). ``memory_mb`` gives the job's GPU memory; without it memory is not checked."""
    if not nodes:
        return ["no node has registered yet: the job waits until one does"]
    registered = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} registered"
    total = sum(len(node.gpus) for node in nodes)
    if spec.gpus > total:
        largest = max(len(node.gpus) for node in nodes)
        return [
            f"the cluster cannot hold {spec.gpus} GPUs today: it has {total} in all, at "
            f"most {largest} on a node ({registered}); the job waits until nodes join"
        ]
    per_gpu = spec.batch_size // spec.gpus
    if per_gpu < 1:
        return [
            f"a batch of {spec.batch_size} cannot be split over {spec.gpus} GPUs (each "
            "takes a sample at least), so no placement can hold the job"
        ]
    biggest = max((gpu.memory_mb for node in nodes for gpu in node.gpus), default=0)
    if memory_mb is None or biggest <= 0:
        return []
    steps = max(accum_steps_choices(spec.batch_size, spec.gpus))
    smallest = spec.batch_size / (spec.gpus * steps)
    need = memory_mb(spec.model, smallest)
    if need <= biggest:
        return []
    return [
        f"no GPU can hold this job today: it needs {need:.0f} MiB per GPU even at a "
        f"sub-batch of {smallest:g}; the largest GPU has {biggest} MiB ({registered}); "
        "the job waits until a larger one joins"
    ]
