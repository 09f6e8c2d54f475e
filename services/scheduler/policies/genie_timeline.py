"""GENIE's waits for a less spread placement: when GPUs free up (``Timeline``, from the
running jobs' predicted ends and this decision's starts), where and until when a job
waits (``Plan``), and the plans kept across decisions (``PlansKept``)."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from gpusched.libs.core.decision import Start
from gpusched.libs.core.parallelism import consolidated
from gpusched.libs.core.placement import FreeGpus
from gpusched.libs.core.snapshot import JobView, Snapshot


def predicted_end(job: JobView, now: float) -> float:
    """When a running job should end: its remaining work at its progress rate (the
    estimate counts a consolidated placement's seconds; a spread one runs slower)."""
    left = job.remaining_s(now)
    rate = job.progress_rate
    return now + (left / rate if 0 < rate < 1 else left)


@dataclass(frozen=True)
class Plan:
    """Where a job waits for a less spread placement: from ``at`` on ``nodes``, finishing
    at ``finish``; ``spread`` nodes and ``finish_now`` if it started now."""

    at: float
    nodes: tuple[int, ...]
    finish: float
    spread: int
    finish_now: float
    #: whether both meet the job's deadline and the wait is chosen for its GPU-time
    for_gpu_time: bool


class PlansKept:
    """Where jobs chose to wait for a less spread placement, kept across decisions (our
    design): a decision that planned a wait holds the idle GPUs of the plan's nodes only
    while it is made, and the next one, with nothing spread to start, would let any job
    take them. Kept until the planned moment, the plan holds them at every decision
    for the job's turn: jobs ahead of it in the order are not held back, and jobs after
    it use them only if they end by then."""

    def __init__(self) -> None:
        self._plans: dict[str, Plan] = {}
        self._now = -math.inf

    @property
    def current(self) -> dict[str, Plan]:
        """The plans as the last ``live`` left them."""
        return self._plans

    def live(self, snapshot: Snapshot) -> dict[str, Plan]:
        """The plans whose moment has not come. A job leaves the queue by a start, which
        drops its plan (``remember``); a plan of a job gone otherwise is never asked for
        and lapses at its moment."""
        now = snapshot.now
        if now < self._now:  # time went back: another run
            self._plans.clear()
        self._now = now
        if self._plans:
            self._plans = {job_id: plan for job_id, plan in self._plans.items() if plan.at > now}
        return self._plans

    def remember(
        self, waiting: Iterable[tuple[JobView, Plan, list[int]]], starts: Iterable[Start]
    ) -> None:
        for job, plan, _ in waiting:
            self._plans[job.job_id] = plan
        for start in starts:
            self._plans.pop(start.job_id, None)


class Timeline:
    """When GPUs free up, from the running jobs' predicted ends (GPUs another job also
    holds never count as freed) and this decision's starts: per node, and for the whole
    cluster in time order. Built once per decision, when a start would be spread."""

    def __init__(self, snapshot: Snapshot, free: FreeGpus) -> None:
        now, load, node_of = snapshot.now, snapshot.gpu_load, snapshot.cluster.gpu_node
        self._free = free
        self._node_of = node_of
        self._idle = snapshot.node_free
        per_node: list[list[tuple[float, int]]] = [[] for _ in snapshot.node_free]
        for job in snapshot.running:
            # predicted_end, inlined: this runs for every running job
            rate = job.progress_rate
            left = job.est_remaining_s - (now - job.as_of) * rate
            end = now + (0.0 if left <= 0.0 else left / rate if 0 < rate < 1 else left)
            entry = (end, 1)
            for gpu in job.gpu_ids:  # one entry per GPU: merged by the walks below
                if load[gpu] == 1:
                    per_node[node_of[gpu]].append(entry)
        for releases in per_node:
            releases.sort()
        self._per_node = per_node
        #: nodes this decision's starts changed, and those starts' releases
        self._mine: list[tuple[float, dict[int, int]]] = []
        #: a changed node's releases, the running jobs' and this decision's, in order
        #: (its keys: the nodes this decision's starts changed)
        self._merged: dict[int, list[tuple[float, int]]] = {}
        #: GPU count -> (when each node first has that many idle, node), soonest first
        self._by_time: dict[int, list[tuple[float, int]]] = {}

    def started(self, start: Start, end: float) -> None:
        freed: dict[int, int] = {}
        for gpu in start.gpu_ids:
            freed[self._node_of[gpu]] = freed.get(self._node_of[gpu], 0) + 1
        self._mine.append((end, freed))
        for node, count in freed.items():
            merged = self._merged.get(node)
            if merged is None:
                merged = self._merged[node] = list(self._per_node[node])
            bisect.insort(merged, (end, count))

    @staticmethod
    def _when(idle: int, releases: Iterable[tuple[float, int]], gpus: int) -> float:
        if idle >= gpus:
            return -math.inf
        for end, count in releases:
            idle += count
            if idle >= gpus:
                return end
        return math.inf

    def one_node(self, gpus: int, held: set[int]) -> tuple[float, int] | None:
        """The soonest moment one node not in ``held`` has ``gpus`` idle, and the node."""
        order = self._by_time.get(gpus)
        if order is None:
            order = self._by_time[gpus] = sorted(
                (self._when(self._idle[node], releases, gpus), node)
                for node, releases in enumerate(self._per_node)
            )
        best: tuple[float, int] | None = None
        for at, node in order:
            if at == math.inf:
                break
            if node not in held and node not in self._merged:
                best = (at, node)
                break
        if self._merged:
            idle = self._free.free_per_node()
            for node in self._merged.keys() - held:
                at = self._when(idle[node], self._merged[node], gpus)
                if at < math.inf and (best is None or (at, node) < best):
                    best = (at, node)
        return best

    def nodes(self, gpus: int, most: int, held: set[int]) -> tuple[float, tuple[int, ...]] | None:
        """The soonest moment ``gpus`` idle GPUs lie on ``most`` nodes not in ``held``,
        and those nodes (a job wider than a node; walks the moments in time order)."""
        idle = self._free.free_per_node()
        for node in held:
            idle[node] = 0  # held for another job: never chosen
        events = sorted(
            chain(
                ((end, node, count) for node, ends in enumerate(self._per_node)
                 for end, count in ends),
                ((end, node, count) for end, freed in self._mine for node, count in freed.items()),
            )
        )  # fmt: skip
        total = sum(idle)
        for at, node, count in events:
            if node in held:
                continue
            idle[node] += count
            total += count
            # where FreeGpus.take would put it spans the fewest nodes whose idle GPUs
            # hold it, taken most idle first: at most ``most`` of them exactly when the
            # ``most`` nodes with the most idle GPUs hold it (looked at before the
            # placement itself, which costs a sort of the nodes)
            if total < gpus or (most < len(idle) and sum(heapq.nlargest(most, idle)) < gpus):
                continue
            ranks = consolidated(gpus, idle)
            if ranks is not None and len(chosen := tuple(dict.fromkeys(ranks))) <= most:
                return at, chosen
        return None
