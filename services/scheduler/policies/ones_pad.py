"""ONES between generations (``ones.py``): a decision pads the kept best individual,
queued jobs onto idle GPUs at their start size and idle GPUs to running jobs past their
gate, and writes the new places into it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpusched.libs.core.decision import Decision, Resize, Start
from gpusched.libs.core.placement import (
    TAKEN,
    ContiguousGpus,
)
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies.ones_jobs import (
    SearchJob,
    worth_growing,
)
from gpusched.services.scheduler.policies.ones_moves import resize_to
from gpusched.services.scheduler.policies.ones_problem import NONE

if TYPE_CHECKING:
    from gpusched.services.scheduler.policies.ones import Ones


def pad(ones: Ones, snapshot: Snapshot) -> Decision:
    """A decision between generations: the kept best individual, as carried out,
    padded as repair pads a candidate. The queued jobs the search sees go onto idle
    GPUs at their start size (shortest predicted remaining time on one GPU first;
    ONES's new jobs enter only by padding), then idle GPUs left go to the running
    jobs past their gate in the same order, each up to the GPUs it asked for, then
    up to its cap, where the growth saves more than its restart. Nothing moves that
    the search placed, and nothing is preempted: those wait for the next generation.
    The kept best individual takes the new places, so the next generation breeds
    from the schedule as it stands."""
    ones._check_basis(snapshot)
    now = snapshot.now
    reasons: dict[str, str] = {}
    pending, behind = ones._window(snapshot, reasons)
    default = ones._default_reason(snapshot, behind)
    assert ones._last_search is not None  # between searches
    wake = ones._next_wake
    if wake is None or wake <= now:
        wake = ones._last_search + ones._interval
    left = snapshot.free_gpus
    if left == 0:
        return Decision(reasons=reasons, default_reason=default, wake_at=wake)
    cluster = snapshot.cluster
    owner = np.where(np.asarray(snapshot.gpu_load, dtype=np.int64) > 0, TAKEN, NONE)
    node_of = np.asarray(cluster.gpu_node, dtype=np.int64)
    new = [j for v in pending if (j := ones._search_job(snapshot, v, reasons)) is not None]
    new.sort(key=lambda j: (j.one_gpu_s, j.view.job_id))
    starts: list[Start] = []
    line = ContiguousGpus(cluster, owner, node_of)  # takes GPUs in ``owner``
    for job in new:
        view = job.view
        limit = max(min(job.asked_gpus, job.sizes[-1]), job.sizes[0])
        gpus: tuple[int, ...] = ()
        for n in reversed([n for n in job.sizes if n <= min(limit, left)]):
            if n == 1:
                start = line.take_tightest(TAKEN)
                gpus = () if start is None else (start,)
            else:
                block = line.best_block(n)
                if block is not None:
                    line.take_block(block, n, TAKEN)
                    gpus = tuple(range(block, block + n))
            if gpus:
                break
        if not gpus:
            reasons[view.job_id] = (
                f"needs {job.sizes[0]} GPU{'s' if job.sizes[0] > 1 else ''}; none is "
                "idle until the next generation of the search"
            )
            continue
        left -= len(gpus)
        _, accum, batch = job.cost[len(gpus)]
        elastic = len(gpus) != view.gpus or batch != view.batch_size
        starts.append(Start(view.job_id, gpus, accum, batch_size=batch if elastic else None))
    resizes = grown(ones, snapshot, owner, left) if left > 0 else []
    placed = [(s.job_id, s.gpu_ids) for s in starts] + [(r.job_id, r.gpu_ids) for r in resizes]
    for job_id, gpu_ids in placed:
        keep_in_best(ones, snapshot, job_id, gpu_ids)
    return Decision(
        starts=tuple(starts),
        resizes=tuple(resizes),
        reasons=reasons,
        default_reason=default,
        wake_at=wake,
    )

def grown(ones: Ones, snapshot: Snapshot, owner: np.ndarray, left: int) -> list[Resize]:
    """Resizes that give ``left`` idle GPUs (FREE in ``owner``, which this marks as
    it gives them) to the running jobs past their gate: in order of predicted
    remaining time on one GPU, each up to the GPUs it asked for, then each up to its
    cap (``worth_growing``), on a contiguous block that overlaps its GPUs most. A
    job's own GPUs stay its own: no other job of this decision lands on them."""
    now = snapshot.now
    if len(ones._padding_jobs) > 4 * len(snapshot.running) + 64:
        ones._padding_jobs.clear()
    jobs: list[SearchJob] = []
    unused: dict[str, str] = {}
    for view in snapshot.running:
        if now - view.started_at < ones.settling_s(view):
            continue  # frozen: it may not change yet
        key = (view.job_id, view.gpus, view.batch_size, view.started_at, "running")
        job = ones._padding_jobs.get(key)
        if job is None:
            found = ones._search_job(snapshot, view, unused)
            if found is None:
                continue
            job = ones._padding_jobs[key] = found
        if job.sizes[-1] > view.gpus:
            jobs.append(job)
    if not jobs:
        return []
    jobs.sort(key=lambda j: (j.one_gpu_s, j.view.job_id))
    cluster = snapshot.cluster
    node_of = np.asarray(cluster.gpu_node, dtype=np.int64)
    held = {j.view.job_id: tuple(j.view.gpu_ids) for j in jobs}
    for first_pass in (True, False):
        for job in jobs:
            if left == 0:
                break
            worth = worth_growing(job, ones.restart_s)
            limit = max(min(job.asked_gpus, worth), job.sizes[0]) if first_pass else worth
            view = job.view
            now_held = held[view.job_id]
            have = len(now_held)
            room = min(max(limit, have), have + left)
            fitting = [n for n in job.sizes if have < n <= room]
            if not fitting:
                continue
            mine = sorted({*view.gpu_ids, *now_held})
            owner[mine] = NONE
            own = np.zeros(len(owner) + 1, dtype=np.int64)
            own[np.asarray(view.gpu_ids, dtype=np.int64) + 1] = 1
            own = np.cumsum(own)
            line = ContiguousGpus(cluster, owner, node_of)
            for n in reversed(fitting):
                block = line.best_block(n, own)
                if block is not None:
                    held[view.job_id] = tuple(range(block, block + n))
                    left -= n - have
                    break
            owner[list(held[view.job_id])] = TAKEN
            owner[list(view.gpu_ids)] = TAKEN  # its own GPUs stay its own
    return [
        resize_to(job, held[job.view.job_id], "idle between generations")
        for job in jobs
        if held[job.view.job_id] != tuple(job.view.gpu_ids)
    ]

def keep_in_best(ones: Ones, snapshot: Snapshot, job_id: str, gpus: tuple[int, ...]) -> None:
    """Write ``job_id`` on ``gpus`` (and off any other GPU) in the kept best
    individual."""
    if not ones._population or len(ones._population[0]) != snapshot.cluster.total_gpus:
        return  # the next generation starts from the schedule as it stands anyway
    ids = ones._population_ids
    best = ones._population[0]
    try:
        index = ids.index(job_id)
    except ValueError:
        index = len(ids)
        ids.append(job_id)
    best[best == index] = NONE
    best[list(gpus)] = index
