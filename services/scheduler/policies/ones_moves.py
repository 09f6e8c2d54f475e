"""Carrying out ONES's chosen layout: whether a running job's GPUs form one block (it
stays there while it keeps its size), the decision that puts every job where the layout
says, and the order of its resizes, each landing on GPUs already let go, with the jobs
caught in a cycle of moves to preempt instead."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from gpusched.libs.core.decision import Decision, Preempt, Resize, Start
from gpusched.services.scheduler.policies.ones_jobs import SearchJob


def contiguous(ids: Sequence[int]) -> bool:
    ordered = sorted(ids)
    return bool(ordered) and ordered[-1] - ordered[0] == len(ordered) - 1


def sequence_resizes(
    jobs: list[SearchJob],
    moves: list[tuple[int, tuple[int, ...]]],
    preempted: set[str],
) -> tuple[list[Resize], list[int]]:
    """Resizes in an order where each lands on GPUs already let go (a resize releases the
    job's old GPUs first); jobs caught in a cycle of moves are returned to be preempted."""
    holder: dict[int, int] = {}
    for i, job in enumerate(jobs):
        if job.view.running and job.view.job_id not in preempted:
            for g in job.view.gpu_ids:
                holder[g] = i
    waiting = list(moves)
    resizes: list[Resize] = []
    stuck: list[int] = []
    while waiting:
        k = next(
            (k for k, (i, gpus) in enumerate(waiting) if all(holder.get(g, i) == i for g in gpus)),
            -1,
        )
        if k < 0:
            # a cycle: preempt the smallest, which frees its GPUs for the others
            k = min(
                range(len(waiting)),
                key=lambda k: (len(waiting[k][1]), jobs[waiting[k][0]].view.job_id),
            )
            i, _ = waiting.pop(k)
            for g in jobs[i].view.gpu_ids:
                if holder.get(g) == i:
                    del holder[g]
            stuck.append(i)
            continue
        i, gpus = waiting.pop(k)
        job = jobs[i]
        for g in job.view.gpu_ids:
            if holder.get(g) == i:
                del holder[g]
        for g in gpus:
            holder[g] = i
        resizes.append(resize_to(job, gpus, "the best schedule found"))
    return resizes, stuck


def resize_to(job: SearchJob, gpus: tuple[int, ...], why: str) -> Resize:
    """``job`` on ``gpus``, at the batch and accumulation its cost there was found at."""
    _, accum, batch = job.cost[len(gpus)]
    return Resize(
        job.view.job_id, gpus, batch, accum, f"from {job.view.gpus} to {len(gpus)} GPUs, {why}"
    )


def decision_of(
    jobs: list[SearchJob],
    best: np.ndarray,
    reasons: dict[str, str],
    default_reason: str,
    wake_at: Callable[[bool], float | None],
) -> Decision:
    """The decision that carries out ``best`` (the job index on every GPU): starts,
    preemptions and resizes in an order that books no GPU twice, a reason for every job
    left waiting, and ``wake_at(changed)`` (``changed``: whether it changes anything).
    """
    placed: dict[int, tuple[int, ...]] = {}
    for gpu, i in enumerate(best.tolist()):
        if i >= 0:
            placed.setdefault(i, ())
            placed[i] += (gpu,)
    starts: list[Start] = []
    preemptions: list[Preempt] = []
    moves: list[tuple[int, tuple[int, ...]]] = []
    for i, job in enumerate(jobs):
        view = job.view
        gpus = placed.get(i)
        if not view.running:
            if gpus is None:
                reasons[view.job_id] = (
                    f"needs {view.gpus} GPU{'s' if view.gpus > 1 else ''}; the best "
                    "schedule found gives the GPUs to jobs with less predicted "
                    "remaining GPU time"
                )
            else:
                _, accum, batch = job.cost[len(gpus)]
                elastic = len(gpus) != view.gpus or batch != view.batch_size
                starts.append(
                    Start(view.job_id, gpus, accum, batch_size=batch if elastic else None)
                )
        elif gpus is None:
            preemptions.append(Preempt(view.job_id, "the best schedule found drops it for now"))
        elif gpus != tuple(sorted(view.gpu_ids)):
            moves.append((i, gpus))
    resizes, stuck = sequence_resizes(jobs, moves, {p.job_id for p in preemptions})
    for i in stuck:
        preemptions.append(
            Preempt(jobs[i].view.job_id, "its GPUs go to another job that changes size")
        )
    # a start waits for GPUs a resized job lets go until the next decision, so no
    # reader of the decision that takes starts before resizes sees a GPU booked twice
    dropped = {p.job_id for p in preemptions}
    still_held = {
        g
        for job in jobs
        if job.view.running and job.view.job_id not in dropped
        for g in job.view.gpu_ids
    }
    for start in [s for s in starts if still_held.intersection(s.gpu_ids)]:
        starts.remove(start)
        reasons[start.job_id] = "its GPUs are let go by a job that changes size"
    return Decision(
        starts=tuple(starts),
        preemptions=tuple(preemptions),
        resizes=tuple(resizes),
        reasons=reasons,
        default_reason=default_reason,
        wake_at=wake_at(bool(starts or preemptions or resizes)),
    )
