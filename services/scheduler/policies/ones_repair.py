"""ONES's repair of a candidate (``ones.py``): sizes onto the doubling ladder, padded in
two passes, laid out contiguously with few moves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpusched.libs.core.placement import (
    ContiguousGpus,
)
from gpusched.services.scheduler.policies.ones_problem import NONE, SearchProblem

if TYPE_CHECKING:
    from gpusched.services.scheduler.policies.ones import Ones

#: how often repair is repeated to reach a schedule it leaves as it is
REPAIR_ROUNDS = 4

def repair(ones: Ones, problem: SearchProblem, genes: np.ndarray) -> np.ndarray:
    for _ in range(REPAIR_ROUNDS):
        fixed = repair_once(ones, problem, genes)
        if np.array_equal(fixed, genes):
            break
        genes = fixed
    return genes

def repair_once(ones: Ones, p: SearchProblem, genes: np.ndarray) -> np.ndarray:
    jobs = p.jobs
    held = np.bincount(genes[genes >= 0], minlength=len(jobs))
    # the largest size on the ladder a job's genes hold (its smallest if none fits)
    fits = (p.ladder <= held[:, None]).sum(axis=1)
    sized = np.where(fits > 0, p.ladder[p.rows, np.maximum(fits - 1, 0)], p.ladder[:, 0])
    sized = np.where(held > 0, sized, 0)
    sized[p.frozen] = p.current[p.frozen]
    free = p.total - int(sized.sum())
    # too many GPUs asked: the jobs with the longest to go give way first
    if free < 0:
        size: list[int] = sized.tolist()
        for i in reversed(p.order):
            while free < 0 and size[i] > 0:
                smaller = [n for n in jobs[i].sizes if n < size[i]]
                nxt = smaller[-1] if smaller else 0
                free += size[i] - nxt
                size[i] = nxt
            if free >= 0:
                break
        sized = np.array(size, dtype=np.int64)
    # padding, shortest predicted remaining time first: every job up to the GPUs it
    # asked for (new jobs from their start size), then up to its cap
    for limits in (p.asked_limit, p.cap_limit):
        if free == 0:
            break
        now = sized[p.changeable]
        if limits is p.cap_limit:
            limits = np.where(now > 0, limits, 0)  # growth is for jobs padded in
        gaps = np.maximum(limits - now, 0)
        if int(gaps.sum()) <= free:
            # room for every job to reach its limit: the walk below would give it
            fitting = (p.ladder[p.changeable] <= np.maximum(limits, now)[:, None]).sum(axis=1)
            reached = np.where(
                fitting > 0, p.ladder[p.changeable, np.maximum(fitting - 1, 0)], 0
            )
            reached = np.maximum(reached, now)
            free -= int((reached - now).sum())
            sized[p.changeable] = reached
            continue
        for k, i in enumerate(p.order):
            if free == 0:
                break
            have = int(sized[i])
            room = min(max(int(limits[k]), have), have + free)
            if room <= have:
                continue
            fitting = [n for n in jobs[i].sizes if have < n <= room]
            if fitting:
                free -= fitting[-1] - have
                sized[i] = fitting[-1]
    return layout(ones, p, sized)

def layout(ones: Ones, p: SearchProblem, size: np.ndarray) -> np.ndarray:
    """Contiguous GPUs for every job of ``size``, moving as few as possible: frozen
    jobs and jobs that keep their size stay where they run; the rest, largest first,
    take the free block that overlaps their current GPUs most, then spans the fewest
    nodes, then fits the tightest free run. A job no block holds shrinks, or waits.
    It depends on the decision and ``size`` alone, so each size is laid out once a
    decision (candidates of a generation often repair to the same sizes)."""
    key = size.tobytes()
    laid = p.laid.get(key)
    if laid is None:
        laid = p.laid[key] = lay_out(ones, p, size)
    return laid.copy()

def lay_out(ones: Ones, p: SearchProblem, size: np.ndarray) -> np.ndarray:
    stays = p.frozen | (p.keepable & (size == p.current))
    occ = np.where(np.append(stays, False)[p.occupancy], p.occupancy, NONE)
    movers = np.flatnonzero((size > 0) & ~stays)
    if len(movers) == 0:
        return occ
    movers = movers[np.lexsort((p.id_rank[movers], -size[movers]))]
    line = ContiguousGpus(p.cluster, occ, p.node_of)  # lays jobs out in ``occ``
    short = False
    for i in movers.tolist():
        job = p.jobs[i]
        if size[i] == 1 and not job.view.gpu_ids:
            line.take_tightest(i)  # where best_block(1) would put it
            continue
        own = p.own(i) if job.view.gpu_ids else None
        for n in reversed([n for n in job.sizes if n <= size[i]]):
            block = line.best_block(n, own)
            if block is not None:
                line.take_block(block, n, i)
                break
        else:
            n = 0
        if n < size[i]:
            short = True
    if short:
        return compacted(ones, p, size, occ)
    return occ

def compacted(ones: Ones, p: SearchProblem, size: np.ndarray, occ: np.ndarray) -> np.ndarray:
    """Every job of ``size`` laid out again, largest first, each on the free block
    that overlaps its current GPUs most (frozen jobs stay): for a job that grows
    where no free block holds it though the GPUs are there, the jobs that keep
    their size may move (a restart each, which the fitness charges). ``occ`` if
    some job still finds no block."""
    placed = np.flatnonzero((size > 0) & ~p.frozen)
    placed = placed[np.lexsort((p.id_rank[placed], -size[placed]))].tolist()
    for keep_own in (True, False):
        again = np.where(np.append(p.frozen, False)[p.occupancy], p.occupancy, NONE)
        line = ContiguousGpus(p.cluster, again, p.node_of)  # lays jobs out in ``again``
        for i in placed:
            n = int(size[i])
            own = p.own(i) if keep_own and p.jobs[i].view.gpu_ids else None
            home = p.home[i]
            if own is not None and n == p.current[i] and home >= 0 and line.is_free(home, n):
                # its own contiguous block, free: the only block of the most overlap
                block: int | None = home
            elif n == 1 and own is None:
                if line.take_tightest(i) is None:
                    break
                continue
            else:
                block = line.best_block(n, own)
            if block is None:
                break
            line.take_block(block, n, i)
        else:
            return again
    return occ

# ---- the search -------------------------------------------------------------------
