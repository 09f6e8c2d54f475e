"""Resizing a running job: which resize commands apply, and the start that replaces it.

The node preempts the old run (it checkpoints) and starts the successor built here from
the iteration it saved. A retried resize is answered ``ok`` without a second restart.
"""

from __future__ import annotations

from collections.abc import Container

import msgspec

from gpusched.libs.common.schemas import CommandReply, ResizeJob, StartJob, split_problem
from gpusched.services.nodeagent.residents import Run


def answer_without_resizing(
    resize: ResizeJob,
    run: Run | None,
    ended: Container[tuple[str, int]],
    node: str,
    closing: bool,
) -> CommandReply | None:
    """The reply to a resize that is a retry or cannot apply to what runs here, or None
    when ``run`` is to be resized."""
    job_id = resize.job_id
    if resize.new_run_id <= resize.run_id:
        return CommandReply(
            False, f"new_run_id: must be above run_id {resize.run_id}, got {resize.new_run_id}"
        )
    if run is not None and run.run_id == resize.new_run_id:
        return CommandReply(True)  # a retried command: the new run runs already
    if (job_id, resize.new_run_id) in ended:
        return CommandReply(True)  # it ran to its end already; its exit is reported
    if run is None or run.run_id != resize.run_id:
        where = f"as run {run.run_id}" if run is not None else "at all"
        return CommandReply(False, f"run_id: job {job_id} does not run on {node} {where}")
    if run.successor is not None:
        if run.successor.run_id == resize.new_run_id:
            return CommandReply(True)  # a retry while the old run checkpoints
        return CommandReply(
            False, f"new_run_id: job {job_id} is being resized to run {run.successor.run_id}"
        )
    if closing:
        return CommandReply(False, f"node agent {node} is shutting down")
    return None


def resize_problem(start: StartJob, resize: ResizeJob) -> str:
    """Why the run started by ``start`` cannot take this shape, or ''."""
    if start.nodes > 1 or not start.leader:
        return (
            f"job_id: job {resize.job_id} spans {start.nodes} nodes; move it with "
            "a stop and a start"
        )
    return split_problem(resize.batch_size, len(resize.gpus), resize.accum_steps)


def resized(start: StartJob, resize: ResizeJob, known_models: frozenset[str]) -> StartJob:
    """The start of the run that replaces ``start`` with the new shape."""
    spec = msgspec.structs.replace(
        start.spec,
        batch_size=resize.batch_size,
        gpus=len(resize.gpus),
        # the learning rate keeps scaling from the batch it was given for
        base_batch_size=start.spec.base_batch_size or start.spec.batch_size,
    )
    return msgspec.structs.replace(
        start,
        run_id=resize.new_run_id,
        spec=spec,
        gpus=list(resize.gpus),
        accum_steps=resize.accum_steps,
        co_runners=list(resize.co_runners),
        # a speed given for the old shape says nothing about the new one
        emulated_iteration_s=None
        if spec.model in known_models
        else start.emulated_iteration_s,
    )
