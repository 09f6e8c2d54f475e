"""Whether a start can run on this node, and as what kind of run.

The command types hold every constraint one field can carry (``gpusched.libs.common.schemas``):
a command that breaks one is not decoded. What is left here depends on the node (the
GPUs it has, the models its ground truth knows, its jobs mode) or on several fields at
once (distinct GPUs, ranks that fit the job's world size).

Each problem is one line that starts with the field it is about, so a refused command
names what to change.
"""

from __future__ import annotations

from gpusched.libs.common.schemas import StartJob
from gpusched.services.nodeagent.gpus import GpuInventory
from gpusched.services.nodeagent.residents import RunKind


def start_problem(start: StartJob, inventory: GpuInventory, node: str) -> str:
    """Why this start cannot run here, or ''."""
    # a list type cannot say its items are distinct; a set would drop the repeat silently
    indices = inventory.indices
    seen: set[int] = set()
    for index in start.gpus:
        if index in seen:
            return f"gpus: GPU {index} is given twice"
        seen.add(index)
        if index not in indices:
            return (
                f"gpus: GPU {index} does not exist on {node} "
                f"(it has GPUs {gpu_ranges(sorted(indices))})"
            )
    if start.rendezvous and start.world_size < start.first_rank + len(start.gpus):
        return (
            f"world_size: {start.world_size} ranks cannot hold ranks {start.first_rank}.."
            f"{start.first_rank + len(start.gpus) - 1} of this part"
        )
    return ""


def run_kind(
    start: StartJob, known_models: frozenset[str], jobs_mode: str
) -> tuple[RunKind | None, str]:
    """The kind of run this start makes, or None and why it cannot run."""
    if not start.leader:
        # a part of a process job across nodes runs its ranks; any other holds its GPUs
        kind, _ = _leader_kind(start, known_models, jobs_mode)
        return ("process" if kind == "process" and start.rendezvous else "held"), ""
    return _leader_kind(start, known_models, jobs_mode)


def _leader_kind(
    start: StartJob, known_models: frozenset[str], jobs_mode: str
) -> tuple[RunKind | None, str]:
    if start.spec.command:
        return "process", ""
    model = start.spec.model
    known = model in known_models
    if jobs_mode == "simulated":
        if known or start.emulated_iteration_s is not None:
            return "simulated", ""
        return None, (
            f"spec.model: {model!r} has no ground-truth profile, so a simulated run "
            "needs emulated_iteration_s (or the job a command)"
        )
    if known:
        return "process", ""
    return None, (
        f"spec.model: {model!r} is not a built-in model and the job gives no command"
    )


def gpu_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    start = previous = None
    for index in indices:
        if start is None or previous is None:
            start = previous = index
        elif index == previous + 1:
            previous = index
        else:
            parts.append(f"{start}-{previous}" if previous != start else str(start))
            start = previous = index
    if start is not None and previous is not None:
        parts.append(f"{start}-{previous}" if previous != start else str(start))
    return ", ".join(parts) or "none"
