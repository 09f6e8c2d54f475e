"""What every policy shares: the protocol, the priority pass, reasons and greedy exclusive
placement (the placement itself, and whether a job can run at all, are in
``gpusched.libs.core.placement``)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol, runtime_checkable

from gpusched.libs.core.decision import Decision, Start
from gpusched.libs.core.placement import FreeGpus, ShapeCache, place_exclusive
from gpusched.libs.core.snapshot import JobView, Snapshot

SortKey = Callable[[JobView], tuple]


@dataclass(frozen=True)
class QueueSort:
    """A fixed order of queued jobs (a key that does not change while a job waits).

    A driver that knows a policy's queue sort keeps its queue in that order and says so
    in ``Snapshot.queue_order``, so the policy need not sort a long queue every round.
    A policy may also name further fixed orders in ``Capabilities.extra_sorts``; a driver
    that keeps them passes them in ``Snapshot.orders`` (by name), and a policy must
    decide the same without them.
    """

    name: str
    key: SortKey


@dataclass(frozen=True)
class Capabilities:
    """What a policy tells its drivers besides its decisions: the simulator and the
    live scheduler, ``make_policy``, ``gpusched simulate`` and the notes under its
    results read these, and nothing else, off a policy. Each policy declares its own
    as ``capabilities``; the defaults are a plain policy's."""

    #: further fixed orders of the queue the policy can use; a driver may keep them and
    #: pass them in ``Snapshot.orders`` (see ``QueueSort``)
    extra_sorts: tuple[QueueSort, ...] = ()
    #: a running job that converges is given the remaining time a progress predictor
    #: sees in its epochs (ONES): the simulator trains one seeded with
    #: ``progress_seed``, the live scheduler asks the predictor service
    predicts_progress: bool = False
    progress_seed: int = 0
    #: its resizes and its predicted progress are only for jobs that declare elastic
    #: bounds (``auto``): a simulator whose trace has none trains no progress predictor
    #: (a torch model trained at every finish), and the notes say why nothing was resized
    sizes_only_elastic: bool = False
    #: orders a tenant's jobs by their priority (``by_priority``); False: a job with a
    #: priority is refused rather than silently ignored
    honours_priority: bool = True
    #: may start a job on GPUs a running job holds (``Start.shares_with``)
    shares_gpus: bool = False
    #: gives running jobs CPU cores and host memory of their own (``Reallocate``)
    tunes_cpu_mem: bool = False
    #: restarts running jobs in another shape (``Resize``)
    resizes: bool = False
    #: for a policy that orders jobs by deadline, what it does when no job has one (a
    #: clause after "so"); None: deadlines do not order its queue
    without_deadlines: str | None = None


#: what a policy that declares nothing more can do
PLAIN = Capabilities()


class Policy(Protocol):
    """A pure ``decide``, with what it declares to its drivers (``capabilities``).
    A policy may also be ``Scalable``, ``ResidentCapped`` or ``ReportsRho``."""

    @property
    def name(self) -> str: ...

    @property
    def preemptive(self) -> bool: ...

    @property
    def queue_sort(self) -> QueueSort | None:
        """The order the policy reads the queue in, if it is fixed."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    def decide(self, snapshot: Snapshot) -> Decision: ...


@runtime_checkable
class Scalable(Protocol):
    """A policy with durations of its own (thresholds, waits, restart costs)."""

    def scaled(self, time_scale: float) -> Policy:
        """This policy with its durations turned into wall seconds of a cluster that
        runs jobs ``1/time_scale`` times faster."""
        ...


@runtime_checkable
class ResidentCapped(Protocol):
    """A policy that shares GPUs and can cap how much it slows a running job."""

    @property
    def max_resident_slowdown(self) -> float | None: ...

    def with_max_resident_slowdown(self, cap: float) -> Policy:
        """This policy refusing partners it would slow by more than ``cap``."""
        ...


@runtime_checkable
class ReportsRho(Protocol):
    """A policy that works out A-SRPT's Lemma-1 factor over the jobs it started."""

    @property
    def rho(self) -> float: ...


def queue_in(snapshot: Snapshot, sort: QueueSort) -> Sequence[JobView]:
    """The queue in ``sort`` order: as the driver keeps it (``queue_order``, or one of
    ``orders``), else sorted now."""
    if snapshot.queue_order == sort.name:
        return snapshot.pending
    kept = snapshot.orders.get(sort.name)
    return kept if kept is not None else sorted(snapshot.pending, key=sort.key)


def ordered_pending(snapshot: Snapshot, sort: QueueSort) -> Sequence[JobView]:
    """The queue in ``sort`` order, sorting only if the driver has not already, with
    each tenant's jobs in priority order among the places they hold (``by_priority``)."""
    ordered = queue_in(snapshot, sort)
    return by_priority(ordered) if has_priorities(snapshot) else ordered


def has_priorities(snapshot: Snapshot) -> bool:
    """Whether some queued or running job has a priority other than 0 (the driver may
    say so in ``Snapshot.prioritized``, else every job is looked at)."""
    if snapshot.prioritized is not None:
        return snapshot.prioritized
    return any(job.priority for job in snapshot.pending) or any(
        job.priority for job in snapshot.running
    )


def by_priority(ordered: Sequence[JobView]) -> Sequence[JobView]:
    """``ordered`` with every tenant's places refilled by that tenant's own jobs, highest
    ``priority`` first and in ``ordered``'s order among equal priorities.

    Our rule, not a paper's: a priority is self-declared, so it orders one tenant's jobs
    among themselves and never moves another tenant's job. The places a tenant's jobs
    hold in a policy's order stay the tenant's; which of its jobs takes each follows its
    priorities. With every priority equal the order is ``ordered`` itself.
    """
    places: dict[str, list[int]] = {}
    for i, job in enumerate(ordered):
        places.setdefault(job.user, []).append(i)
    refilled: list[JobView] | None = None
    for indices in places.values():
        jobs = [ordered[i] for i in indices]
        first = jobs[0].priority
        if all(job.priority == first for job in jobs):
            continue
        jobs.sort(key=_higher_first)  # stable: the policy's order among equals
        if refilled is None:
            refilled = list(ordered)
        for i, job in zip(indices, jobs, strict=True):
            refilled[i] = job
    return ordered if refilled is None else refilled


def _higher_first(job: JobView) -> int:
    return -job.priority


def by_priority_ranked(
    running: Sequence[tuple[tuple, JobView]], pending: Sequence[tuple[tuple, JobView]]
) -> tuple[list[tuple[tuple, JobView]], list[tuple[tuple, JobView]]]:
    """``by_priority`` for a policy that ranks running and queued jobs together (each
    list ascending by a rank unique across both): the ranks stay where they are and a
    tenant's jobs, running or queued, take its ranks in priority order. So a tenant's
    queued job preempts its own running job only with a higher priority, and never the
    other way round. Returns the running and the queued jobs with their new ranks, each
    list ascending."""
    merged = list(heapq.merge(running, pending, key=itemgetter(0)))
    jobs = by_priority([job for _, job in merged])
    new_running: list[tuple[tuple, JobView]] = []
    new_pending: list[tuple[tuple, JobView]] = []
    for (rank, _), job in zip(merged, jobs, strict=True):
        (new_running if job.running else new_pending).append((rank, job))
    return new_running, new_pending


class LazyReasons(Mapping[str, str]):
    """Why pending jobs wait, written out only when someone asks.

    ``explicit`` holds the reasons a policy worked out during its decision; every other
    job of ``pending`` gets ``reason_of(job)`` (None: no reason of its own, the
    decision's default applies). A simulator asks about few jobs and a live scheduler
    about all of them, once per round, so a decision no longer formats a sentence for
    every job in a long queue.
    """

    __slots__ = ("_by_id", "_explicit", "_pending", "_reason_of")

    def __init__(
        self,
        explicit: dict[str, str],
        pending: Sequence[JobView],
        reason_of: Callable[[JobView], str | None],
    ) -> None:
        self._explicit = explicit
        self._pending = pending
        self._reason_of = reason_of
        self._by_id: dict[str, JobView] | None = None

    def _lookup(self, job_id: str) -> str | None:
        found = self._explicit.get(job_id)
        if found is not None:
            return found
        if self._by_id is None:
            self._by_id = {j.job_id: j for j in self._pending}
        job = self._by_id.get(job_id)
        return None if job is None else self._reason_of(job)

    def __getitem__(self, job_id: str) -> str:
        found = self._lookup(job_id)
        if found is None:
            raise KeyError(job_id)
        return found

    def get(self, job_id: str, default: str | None = None) -> str | None:  # type: ignore[override]
        found = self._lookup(job_id)
        return default if found is None else found

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, str) and self._lookup(job_id) is not None

    def __iter__(self) -> Iterator[str]:
        seen = set(self._explicit)
        yield from self._explicit
        for job in self._pending:
            if job.job_id not in seen and self._reason_of(job) is not None:
                yield job.job_id

    def __len__(self) -> int:
        return sum(1 for _ in self)


def no_room_reason(job: JobView, free: FreeGpus) -> str:
    return no_room_text(job.gpus, free.total, free.largest_block())


def no_room_text(gpus: int, idle: int, block: int) -> str:
    return (
        f"needs {gpus} GPU{'s' if gpus > 1 else ''}; {idle} idle, "
        f"largest idle block on one node {block}"
    )


def busy_reason(snapshot: Snapshot) -> str:
    return f"all {snapshot.cluster.total_gpus} GPUs are busy; waiting for a job to finish"


class SkippedReasons(Mapping[str, str]):
    """A greedy scan's reasons, the "needs N GPUs" sentences written only when asked
    for: a backfilling scan over a long queue skips most jobs, and a simulator asks why
    about few of them. Each skipped job keeps the idle GPUs and largest idle block of
    the moment it was skipped, so its sentence is the one the scan would have written
    (``text``; by default the "needs N GPUs" one); a job whose shape can never run says
    that instead (looked up when asked, too)."""

    __slots__ = ("_explicit", "_shapes", "_skipped", "_snapshot", "_text")

    def __init__(
        self,
        explicit: dict[str, str],
        skipped: dict[str, tuple[JobView, int, int]],
        shapes: ShapeCache,
        snapshot: Snapshot,
        text: Callable[[JobView, int, int], str] | None = None,
    ) -> None:
        self._explicit = explicit
        self._skipped = skipped
        self._shapes = shapes
        self._snapshot = snapshot
        self._text = text

    def __getitem__(self, job_id: str) -> str:
        found = self._explicit.get(job_id)
        if found is not None:
            return found
        job, idle, block = self._skipped[job_id]
        bad = self._shapes.unschedulable(job, self._snapshot)
        if bad:
            return bad
        return self._text(job, idle, block) if self._text else no_room_text(job.gpus, idle, block)

    def __iter__(self) -> Iterator[str]:
        yield from self._explicit
        yield from self._skipped

    def __len__(self) -> int:
        return len(self._explicit) + len(self._skipped)


def greedy_exclusive(
    snapshot: Snapshot,
    ordered: Iterable[JobView],
    *,
    backfill: bool,
    shapes: ShapeCache | None = None,
) -> Decision:
    """Start jobs in order on idle GPUs; with ``backfill`` skip those that do not fit.

    The scan stops once no GPU is idle: every job after that point shares one reason,
    so a decision over a long queue costs what it places, not the queue's length.
    ``shapes``, a cache the policy keeps, saves asking the performance model about a
    job shape again (one is made for this call otherwise).
    """
    shapes = shapes if shapes is not None else ShapeCache()
    free = FreeGpus(snapshot)
    starts: list[Start] = []
    explicit: dict[str, str] = {}
    skipped: dict[str, tuple[JobView, int, int]] = {}
    #: the largest idle block, worked out again only after a start changes it
    block = -1
    blocker: JobView | None = None
    for job in ordered:
        if free.total == 0:
            break
        if backfill and job.gpus > free.total:  # skipped: why is written when asked for
            if block < 0:
                block = free.largest_block()
            skipped[job.job_id] = (job, free.total, block)
            continue
        bad = shapes.unschedulable(job, snapshot)
        if bad:
            explicit[job.job_id] = bad
            continue
        start = place_exclusive(job, free, snapshot, shapes)
        if start is not None:
            starts.append(start)
            block = -1
            continue
        if block < 0:
            block = free.largest_block()
        skipped[job.job_id] = (job, free.total, block)
        if not backfill:
            blocker = job
            break
    default = busy_reason(snapshot)
    if blocker is not None:
        default = f"behind {blocker.job_id} in queue order, which needs {blocker.gpus} GPUs"
    reasons = SkippedReasons(explicit, skipped, shapes, snapshot) if skipped else explicit
    return Decision(starts=tuple(starts), reasons=reasons, default_reason=default)
