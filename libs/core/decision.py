"""What a policy decides: starts, preemptions, resizes, and why every other job waits."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpusched.libs.core.cluster import HostUse
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.snapshot import JobView, Snapshot


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    gpu_ids: tuple[int, ...]
    #: gradient-accumulation steps: the job runs sub-batches of batch/(gpus*accum_steps)
    accum_steps: int = 1
    #: resident jobs this one will share GPUs with (empty: exclusive)
    shares_with: tuple[str, ...] = ()
    #: CPU cores for the whole job (split over its nodes in proportion to its GPUs
    #: there); None: the GPU-proportional share of its nodes
    cpus: float | None = None
    #: host memory in GB for the whole job, split likewise; None: the proportional share
    mem_gb: float | None = None
    #: an elastic start: the job starts with this global batch on ``len(gpu_ids)`` GPUs
    #: instead of the shape it asked for; None: the shape it asked for
    batch_size: int | None = None


@dataclass(frozen=True, slots=True)
class Preempt:
    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Resize:
    """Restart a running job with a new shape from its checkpoint (an elastic policy's
    move). The GPUs are global ids; the job keeps its progress."""

    job_id: str
    gpu_ids: tuple[int, ...]
    batch_size: int
    accum_steps: int = 1
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reallocate:
    """Change a running job's CPU cores and host memory (whole job, split over its nodes
    in proportion to its GPUs there) without moving it; it keeps its GPUs and progress."""

    job_id: str
    cpus: float
    mem_gb: float
    reason: str = ""


_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class Decision:
    starts: tuple[Start, ...] = ()
    preemptions: tuple[Preempt, ...] = ()
    resizes: tuple[Resize, ...] = ()
    #: CPU/memory changes of running jobs, applied before the starts (see ``in_order``)
    reallocations: tuple[Reallocate, ...] = ()
    #: why each examined job stays pending
    reasons: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    #: why every other pending job waits (the policy stopped looking once nothing could fit)
    default_reason: str = "waiting for the next scheduling round"
    #: the policy wants to decide again at this time even if nothing else happens
    wake_at: float | None = None

    def why(self, job_id: str) -> str:
        """A readable reason for a job the decision leaves pending."""
        return self.reasons.get(job_id, self.default_reason)

    @property
    def changes_anything(self) -> bool:
        return bool(self.starts or self.preemptions or self.resizes or self.reallocations)

    def in_order(self) -> Iterator[Preempt | Resize | Reallocate | Start]:
        """The decision's changes in the one order every driver applies them: what frees
        GPUs first (preemptions), then the CPU/memory reallocations (a job dropping to
        its fair share makes the room a resize or a start is given), then the resizes
        (which may shrink) and the starts. ``decision_problems`` checks in this order
        too."""
        yield from self.preemptions
        yield from self.reallocations
        yield from self.resizes
        yield from self.starts

    def apply(
        self,
        *,
        start: Callable[[Start], object],
        preempt: Callable[[Preempt], object],
        resize: Callable[[Resize], object],
        reallocate: Callable[[Reallocate], object],
    ) -> None:
        """Hand each change, in ``in_order``'s order, to the driver's step for its kind:
        the one way both drivers (the simulator and the live core) apply a checked
        decision."""
        for change in self.in_order():
            if isinstance(change, Start):
                start(change)
            elif isinstance(change, Preempt):
                preempt(change)
            elif isinstance(change, Resize):
                resize(change)
            else:
                reallocate(change)

    @property
    def shared_pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple((s.job_id, other) for s in self.starts for other in s.shares_with)


@dataclass(slots=True)
class _Shape:
    """What booking a job's GPUs depends on: its current shape and whether it shares."""

    model: str
    batch_size: int
    gpus: int
    allow_sharing: bool


@dataclass(slots=True)
class _Held:
    gpu_ids: tuple[int, ...]
    mem_mb: float
    #: the job's CPU cores and host memory GB; None: the GPU-proportional share
    cpus: float | None = None
    mem_gb: float | None = None


class _Booking:
    """The snapshot's GPUs as a decision changes them, action by action, in the order a
    driver applies it. Only what the decision touches is copied, so checking costs the
    size of the decision rather than of the cluster."""

    def __init__(
        self,
        snapshot: Snapshot,
        memory: PerformanceModel,
        own_allocations: bool,
        track_host: bool = True,
    ) -> None:
        self.snapshot = snapshot
        #: whether some running job of the snapshot holds an allocation of its own
        self.own_allocations = own_allocations
        #: False: every job, before and after, holds the proportional share, which never
        #: overcommits a node's CPUs or memory, so they are not counted
        self.track_host = track_host
        self.memory = memory
        self.load: dict[int, int] = {}
        self.mem_used: dict[int, float] = {}
        self.residents: dict[int, list[str]] = {}
        #: jobs whose state the decision changed: held GPUs, or None once they wait again
        self.held: dict[str, _Held | None] = {}
        self.shapes: dict[str, _Shape] = {}
        #: CPU and host memory per node, built on the first start or reallocation
        self.host: HostUse | None = None
        self._holders: dict[int, int] | None = None
        #: the snapshot's running jobs by GPU, in the snapshot's order: built on the
        #: first GPU a start would share, one pass over the running jobs for them all
        self._snapshot_residents: dict[int, list[str]] | None = None
        if track_host and snapshot.node_cpus_used and snapshot.node_mem_used:
            self.host_use()

    # ---- what the snapshot says, as changed so far ----------------------------------
    def view(self, job_id: str) -> JobView | None:
        try:
            return self.snapshot.job(job_id)
        except KeyError:
            return None

    def is_running(self, job_id: str) -> bool:
        if job_id in self.held:
            return self.held[job_id] is not None
        view = self.view(job_id)
        return view is not None and view.running

    def is_pending(self, job_id: str) -> bool:
        if job_id in self.held:
            return self.held[job_id] is None
        view = self.view(job_id)
        return view is not None and not view.running

    def shape(self, job_id: str) -> _Shape:
        shape = self.shapes.get(job_id)
        if shape is None:
            view = self.snapshot.job(job_id)
            shape = self.shapes[job_id] = _Shape(
                view.model, view.batch_size, view.gpus, view.allow_sharing
            )
        return shape

    def held_by(self, job_id: str) -> _Held:
        held = self.held.get(job_id)
        if held is not None:
            return held
        view = self.snapshot.job(job_id)
        per_gpu = view.batch_size / (view.gpus * max(1, view.accum_steps))
        mem_mb = self.memory.gpu_memory_mb(view.model, per_gpu)
        return _Held(view.gpu_ids, mem_mb, view.cpus, view.mem_gb)

    def host_use(self) -> HostUse:
        """Per-node CPU and host memory as the decision has changed them so far: from
        the snapshot's totals where the driver gives them, else summed over its jobs."""
        if self.host is None:
            snapshot = self.snapshot
            if snapshot.node_cpus_used and snapshot.node_mem_used:
                # built before the first change, so every change goes through it
                self.host = HostUse(
                    snapshot.cluster,
                    snapshot.node_cpus_used,
                    snapshot.node_mem_used,
                    self._snapshot_share_holders,
                )
            else:
                jobs = [
                    (view.gpu_ids, view.cpus, view.mem_gb)
                    for view in snapshot.running
                    if view.job_id not in self.held
                ]
                jobs.extend(
                    (h.gpu_ids, h.cpus, h.mem_gb) for h in self.held.values() if h is not None
                )
                self.host = HostUse.of_jobs(snapshot.cluster, jobs)
        return self.host

    def _snapshot_share_holders(self, gpu: int) -> int:
        """Running jobs of the snapshot holding the proportional share of ``gpu``."""
        load = self.snapshot.gpu_load[gpu]
        if not load:
            return 0
        if not self.own_allocations:
            return load  # every running job holds the proportional share
        if self._holders is None:
            self._holders = {}
            for view in self.snapshot.running:
                if view.cpus is None and view.mem_gb is None:
                    for held in view.gpu_ids:
                        self._holders[held] = self._holders.get(held, 0) + 1
        return self._holders.get(gpu, 0)

    def gpu_residents(self, gpu: int) -> list[str]:
        """The jobs on a GPU now; read from the snapshot only for a GPU a start would
        share (the jobs the decision moved are left out: they are added where placed)."""
        residents = self.residents.get(gpu)
        if residents is None:
            if self.gpu_load(gpu):
                by_gpu = self._snapshot_residents
                if by_gpu is None:
                    by_gpu = self._snapshot_residents = {}
                    for view in self.snapshot.running:
                        for held_gpu in view.gpu_ids:
                            by_gpu.setdefault(held_gpu, []).append(view.job_id)
                held = self.held
                residents = [job_id for job_id in by_gpu.get(gpu, ()) if job_id not in held]
            else:
                residents = []
            self.residents[gpu] = residents
        return residents

    def gpu_load(self, gpu: int) -> int:
        return self.load.get(gpu, self.snapshot.gpu_load[gpu])

    def gpu_mem(self, gpu: int) -> float:
        return self.mem_used.get(gpu, self.snapshot.gpu_mem_used[gpu])

    # ---- changes --------------------------------------------------------------------
    def release(self, job_id: str) -> None:
        held = self.held_by(job_id)
        if self.host is not None:
            self.host.add(held.gpu_ids, held.cpus, held.mem_gb, -1)
        for gpu in held.gpu_ids:
            residents = self.residents.get(gpu)
            if residents is not None:
                residents.remove(job_id)
            load = self.load[gpu] = self.gpu_load(gpu) - 1
            # an idle GPU holds nothing: no rounding left over from the jobs it held
            self.mem_used[gpu] = 0.0 if load == 0 else self.gpu_mem(gpu) - held.mem_mb
        self.held[job_id] = None

    def place(self, job_id: str, gpu_ids: tuple[int, ...], mem_mb: float) -> None:
        for gpu in gpu_ids:
            self.gpu_residents(gpu).append(job_id)
            self.load[gpu] = self.gpu_load(gpu) + 1
            self.mem_used[gpu] = self.gpu_mem(gpu) + mem_mb
        self.held[job_id] = _Held(gpu_ids, mem_mb)

    def allocate(self, job_id: str, cpus: float | None, mem_gb: float | None) -> list[str]:
        """Give a job that holds its GPUs (just placed, or running) this CPU/memory
        allocation; refused, and left as it was, where a node would go beyond its own."""
        problems = [
            f"gave {job_id} {value!r} {what}"
            for what, value in (("CPUs", cpus), ("GB of host memory", mem_gb))
            if value is not None and not (value >= 0 and math.isfinite(value))
        ]
        if problems:
            return problems
        if not self.track_host:
            return []  # only shares, before and after (see __init__)
        held = self.held_by(job_id)
        host = self.host_use()
        if cpus == held.cpus and mem_gb == held.mem_gb:
            return host.overcommitted(job_id, held.gpu_ids)
        host.add(held.gpu_ids, held.cpus, held.mem_gb, -1)
        host.add(held.gpu_ids, cpus, mem_gb, +1)
        problems = host.overcommitted(job_id, held.gpu_ids)
        if problems:
            host.add(held.gpu_ids, cpus, mem_gb, -1)
            host.add(held.gpu_ids, held.cpus, held.mem_gb, +1)
            return problems
        self.held[job_id] = _Held(held.gpu_ids, held.mem_mb, cpus, mem_gb)
        return []

    # ---- the actions ----------------------------------------------------------------
    def preempt(self, preempt: Preempt) -> list[str]:
        if not self.is_running(preempt.job_id):
            return [f"preempted {preempt.job_id}, which is not running"]
        self.release(preempt.job_id)
        return []

    def resize(self, resize: Resize) -> list[str]:
        job_id = resize.job_id
        if not self.is_running(job_id):
            return [f"resized {job_id}, which is not running"]
        if resize.batch_size < 1 or not resize.gpu_ids:
            return [f"resized {job_id} to batch {resize.batch_size} on GPUs {resize.gpu_ids}"]
        shape = self.shape(job_id)
        self.release(job_id)
        self.shapes[job_id] = _Shape(
            shape.model, resize.batch_size, len(resize.gpu_ids), shape.allow_sharing
        )
        return self.start(Start(job_id, resize.gpu_ids, resize.accum_steps))

    def start(self, start: Start) -> list[str]:
        job_id = start.job_id
        if not self.is_pending(job_id):
            return [f"started {job_id}, which is not pending"]
        gpu_ids = start.gpu_ids
        if start.batch_size is not None:
            if start.batch_size < 1 or not gpu_ids:
                return [f"started {job_id} with batch {start.batch_size} on GPUs {gpu_ids}"]
            asked = self.shape(job_id)
            self.shapes[job_id] = _Shape(
                asked.model, start.batch_size, len(gpu_ids), asked.allow_sharing
            )
        shape = self.shape(job_id)
        problems: list[str] = []
        if len(set(gpu_ids)) != shape.gpus or len(gpu_ids) != shape.gpus:
            problems.append(f"gave {job_id} GPUs {gpu_ids}; it needs {shape.gpus} distinct")
        cluster = self.snapshot.cluster
        if cluster.mixed and len(kinds := cluster.types_of(gpu_ids)) > 1:
            names = ", ".join(cluster.gpu_types[k] for k in sorted(kinds))
            problems.append(f"gave {job_id} GPUs {gpu_ids} of several types ({names}); "
                            "a job runs on GPUs of one type")
        accum = start.accum_steps
        mem: float | None = None
        if accum < 1 or shape.batch_size // shape.gpus // accum < 1:
            problems.append(f"gave {job_id} accum_steps {accum}")
        else:
            mem = self.memory.gpu_memory_mb(shape.model, shape.batch_size / (shape.gpus * accum))
        problems.extend(self._gpu_problems(job_id, shape, gpu_ids, mem))
        if not problems and mem is not None:
            self.place(job_id, gpu_ids, mem)
            if self.host is not None:
                self.host.add(gpu_ids, None, None, +1)
            problems.extend(self.allocate(job_id, start.cpus, start.mem_gb))
        return problems

    def reallocate(self, reallocate: Reallocate) -> list[str]:
        if not self.is_running(reallocate.job_id):
            return [f"reallocated {reallocate.job_id}, which is not running"]
        return self.allocate(reallocate.job_id, reallocate.cpus, reallocate.mem_gb)

    def _gpu_problems(
        self, job_id: str, shape: _Shape, gpu_ids: tuple[int, ...], mem: float | None
    ) -> list[str]:
        snapshot = self.snapshot
        capacity = snapshot.cluster.gpu_mem_mb
        problems: list[str] = []
        for gpu in gpu_ids:
            if not 0 <= gpu < len(snapshot.gpu_load):
                problems.append(f"placed {job_id} on unknown GPU {gpu}")
                continue
            if self.gpu_load(gpu) >= snapshot.max_jobs_per_gpu:
                problems.append(f"placed {job_id} on full GPU {gpu}")
                continue
            residents = self.gpu_residents(gpu) if self.gpu_load(gpu) else []
            if residents and not (
                shape.allow_sharing and all(self.shape(r).allow_sharing for r in residents)
            ):
                problems.append(f"shared GPU {gpu} with a job that forbids it")
                continue
            if mem is not None and self.gpu_mem(gpu) + mem > capacity[gpu] + MEM_SLACK_MB:
                problems.append(
                    f"overcommitted GPU {gpu}: {self.gpu_mem(gpu) + mem:.0f} MiB "
                    f"> {capacity[gpu]} MiB"
                )
        return problems


#: memory a GPU may appear to exceed by: float rounding of the per-job sums
MEM_SLACK_MB = 1e-6


def decision_problems(
    snapshot: Snapshot, decision: Decision, memory: PerformanceModel | None = None
) -> list[str]:
    """Why ``decision`` cannot be applied to the cluster ``snapshot`` shows; empty when it
    can. Actions are taken in the order the drivers apply them (preemptions,
    reallocations, resizes, starts), each against the GPUs, CPUs and memory the earlier
    ones left, so a preempted job may start again and two starts may not book one GPU beyond
    ``snapshot.max_jobs_per_gpu``. A
    resize is a release and a start with the new shape. A job that forbids sharing must
    be alone on its GPUs, and no GPU may hold more memory than it has, as ``memory``
    sizes jobs (default: ``snapshot.estimates``; it must be the model the snapshot's
    ``gpu_mem_used`` was summed with). Problems read as a sentence after the policy's
    name, e.g. "started j3, which is not pending"."""
    own = snapshot.own_allocations
    if own is None:
        own = any(v.cpus is not None or v.mem_gb is not None for v in snapshot.running)
    track_host = (
        own
        or bool(decision.reallocations)
        or any(s.cpus is not None or s.mem_gb is not None for s in decision.starts)
    )
    booking = _Booking(snapshot, memory or snapshot.estimates, own, track_host)
    problems: list[str] = []
    for preempt in decision.preemptions:
        problems.extend(booking.preempt(preempt))
    # a reallocation that fits before the resizes and starts is taken first (a job
    # dropping to its fair share makes the room a resize or a start is given); one that
    # fits only once they are in (rare) is tried again after them
    later = [r for r in decision.reallocations if booking.reallocate(r)]
    for resize in decision.resizes:
        problems.extend(booking.resize(resize))
    for start in decision.starts:
        problems.extend(booking.start(start))
    for reallocate in later:
        problems.extend(booking.reallocate(reallocate))
    return problems
