"""Whether a start can run on this node, and as what kind of run.

Each problem is one line that starts with the field it is about, so a refused command
names what to change.
"""

from __future__ import annotations

from libs.common.schemas import StartJob
from services.nodeagent.config import NAME_PATTERN
from services.nodeagent.gpus import GpuInventory
from services.nodeagent.residents import RunKind


def start_problem(start: StartJob, inventory: GpuInventory, node: str) -> str:
    """Why this start cannot run here, or ''."""
    if not NAME_PATTERN.match(start.job_id):
        return f"job_id: {start.job_id!r} must be 1-64 letters, digits, '-' or '_'"
    if not start.gpus:
        return "gpus: no GPU given"
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
    if start.total_iterations < 1:
        return f"total_iterations: must be >= 1, got {start.total_iterations}"
    if start.resume_iteration < 0:
        return f"resume_iteration: must be >= 0, got {start.resume_iteration}"
    if start.accum_steps < 1:
        return f"accum_steps: must be >= 1, got {start.accum_steps}"
    if start.nodes < 1:
        return f"nodes: must be >= 1, got {start.nodes}"
    if start.emulated_iteration_s is not None and not start.emulated_iteration_s > 0:
        return f"emulated_iteration_s: must be > 0, got {start.emulated_iteration_s}"
    if start.rendezvous and (
        start.first_rank < 0 or start.world_size < start.first_rank + len(start.gpus)
    ):
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
