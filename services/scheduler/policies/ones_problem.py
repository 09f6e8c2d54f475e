"""One ONES decision's jobs as the arrays its repair reads (job index = row): each job's
sizes and predicted seconds at each, who holds every GPU now, which running jobs may stay
on their block, the order padding fills jobs in and how far it may grow them."""

from __future__ import annotations

import numpy as np

from gpusched.libs.core.placement import FREE
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies.ones_jobs import SearchJob, worth_growing
from gpusched.services.scheduler.policies.ones_moves import contiguous

#: no job: an idle GPU in a layout
NONE = FREE


class SearchProblem:
    """One decision's jobs as arrays the repair reads (job index = row)."""

    def __init__(self, snapshot: Snapshot, jobs: list[SearchJob], restart_s: float = 0.0) -> None:
        self.jobs = jobs
        self.cluster = snapshot.cluster
        self.total = total = snapshot.cluster.total_gpus
        self.node_of = np.asarray(snapshot.cluster.gpu_node, dtype=np.int64)
        count = len(jobs)
        self.rows = np.arange(count)
        width = max((len(job.sizes) for job in jobs), default=1)
        #: each job's sizes, ascending, padded past its largest with more than the cluster
        self.ladder = np.full((count, width), total + 1, dtype=np.int64)
        #: predicted remaining seconds at each of those sizes
        self.seconds = np.zeros((count, width))
        for i, job in enumerate(jobs):
            self.ladder[i, : len(job.sizes)] = job.sizes
            self.seconds[i, : len(job.sizes)] = [job.cost[n][0] for n in job.sizes]
        self.frozen = np.array([job.kind == "frozen" for job in jobs], dtype=bool)
        self.current = np.array([job.current for job in jobs], dtype=np.int64)
        #: the job on every GPU now (NONE: idle)
        self.occupancy = np.full(total, NONE, dtype=np.int64)
        keepable = np.zeros(count, dtype=bool)
        for i, job in enumerate(jobs):
            ids = job.view.gpu_ids
            if job.view.running and (self.occupancy[list(ids)] == NONE).all():
                # a job on a contiguous block stays there while it keeps its size
                keepable[i] = contiguous(ids)
                self.occupancy[list(ids)] = i
        self.keepable = keepable
        #: first GPU of the contiguous block a keepable job runs on (-1: none)
        self.home = np.array(
            [min(job.view.gpu_ids) if keepable[i] else -1 for i, job in enumerate(jobs)],
            dtype=np.int64,
        )
        self.id_rank = np.argsort(np.argsort(np.array([j.view.job_id for j in jobs], dtype=object)))
        #: the changeable jobs (new and running), shortest predicted remaining time on
        #: one GPU first: the order padding fills them in
        self.order = sorted(
            (i for i, j in enumerate(jobs) if j.kind != "frozen"),
            key=lambda i: (jobs[i].one_gpu_s, jobs[i].view.job_id),
        )
        self.changeable = np.array(self.order, dtype=np.int64)
        #: padding fills every job first up to the GPUs it asked for (at least its
        #: smallest size: a preempted job restarts at half what it held), then to its cap;
        #: a running job grows only to sizes that save more than the restart costs
        worth = [worth_growing(jobs[i], restart_s) for i in self.order]
        self.asked_limit = np.array(
            [
                max(min(jobs[i].asked_gpus, top), jobs[i].sizes[0])
                for i, top in zip(self.order, worth, strict=True)
            ],
            dtype=np.int64,
        )
        self.cap_limit = np.array(worth, dtype=np.int64)
        self._own: dict[int, np.ndarray] = {}
        #: ``Ones._layout``'s answers by the sizes asked
        self.laid: dict[bytes, np.ndarray] = {}

    def own(self, i: int) -> np.ndarray:
        """Prefix sums over GPUs of job ``i``'s GPUs now (the overlap of a block)."""
        found = self._own.get(i)
        if found is None:
            mask = np.zeros(self.total + 1, dtype=np.int64)
            mask[np.asarray(self.jobs[i].view.gpu_ids, dtype=np.int64) + 1] = 1
            found = self._own[i] = np.cumsum(mask)
        return found
