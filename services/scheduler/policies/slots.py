"""The slot index of SJF-BSBF: GPUs holding one resident job each, grouped by alike
residents and ordered by the residents' remaining time, and which of them are new since
an earlier decision.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot
from gpusched.services.scheduler.policies.sharing import BenefitWindow


@dataclass(slots=True)
class SlotGroup:
    """GPUs holding one resident each, whose residents are alike (model, batch, memory),
    of one GPU type (``gpu_type``, an index in ``Cluster.gpu_types``)."""

    key: tuple
    resident: JobView
    mem_used_mb: float
    gpu_mem_mb: int
    gpu_type: int = 0
    remaining: list[float] = field(default_factory=list)
    slots: list[tuple[float, int, JobView]] = field(default_factory=list)

    def indices(self, window: BenefitWindow | None) -> Iterator[int]:
        """Slot indices in ascending E_b, only those where sharing pays (all if no window)."""
        n = len(self.remaining)
        if window is None:
            yield from range(n)
            return
        i = bisect_right(self.remaining, window.low1)
        while i < n and self.remaining[i] <= window.high1:
            yield i
            i += 1
        yield from range(max(i, bisect_right(self.remaining, window.low2)), n)

    def remove(self, index: int) -> None:
        del self.remaining[index]
        del self.slots[index]


def build_groups(snapshot: Snapshot) -> list[SlotGroup]:
    return SlotIndex().build(snapshot)


class SlotIndex:
    """Builds a decision's slot groups and tells whether any slot is new.

    ``epoch`` grows whenever a decision's shareable slots (GPU, resident view, memory in
    use) are not all among the previous decision's. While it stands still, slots have
    only gone away, so a queued job that found no partner before finds none now either
    (its resident partners only progress, and a resident entering a benefit window is
    announced by a wake-up time). A driver that rebuilds its views every round (the live
    scheduler) simply gets a new epoch every round.

    ``born`` holds, per GPU of the last build's slots, the epoch at which that slot
    (resident view and memory) first appeared, so a queued job last searched at epoch
    ``e`` need only be tried against the slots born after ``e``.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.born: dict[int, int] = {}
        #: the GPUs taken from the last build's slots since it was made
        self.taken: set[int] = set()
        #: the last build's groups, and its slots newest first (made when first asked for)
        self._groups: list[SlotGroup] = []
        self._by_birth: list[tuple[int, float, int, SlotGroup]] | None = None
        self._slots: dict[int, tuple[JobView, float]] = {}
        self._basis = ModelBasis()

    def build(self, snapshot: Snapshot) -> list[SlotGroup]:
        groups: dict[tuple, SlotGroup] = {}
        now = snapshot.now
        load = snapshot.gpu_load
        mem_used = snapshot.gpu_mem_used
        gpu_mem = snapshot.cluster.gpu_mem_mb
        kinds = snapshot.cluster.gpu_type
        old = self._slots
        slots: dict[int, tuple[JobView, float]] = {}
        old_born = self.born
        born: dict[int, int] = {}
        new: list[int] = []
        fresh = self._basis.moved(snapshot)
        if fresh:
            old = {}
        for job in snapshot.running:
            ids = job.gpu_ids
            if not job.allow_sharing or (len(ids) == 1 and load[ids[0]] != 1):
                continue
            e_b = -1.0
            for gpu in ids:
                if load[gpu] != 1:
                    continue
                if e_b < 0.0:
                    e_b = job.est_remaining_s - (now - job.as_of) * job.progress_rate
                    if e_b < 0.0:
                        e_b = 0.0
                used = mem_used[gpu]
                slots[gpu] = (job, used)
                before = old.get(gpu)
                if before is None or before[0] is not job or before[1] != used:
                    new.append(gpu)
                else:
                    born[gpu] = old_born[gpu]
                key: tuple = (job.model, job.batch_size, job.gpus, job.accum_steps, gpu_mem[gpu])
                if kinds[gpu]:  # a GPU of another type than the first: a group of its own
                    key = (*key, kinds[gpu])
                group = groups.get(key)
                if group is None:
                    group = groups[key] = SlotGroup(key, job, used, gpu_mem[gpu], kinds[gpu])
                group.slots.append((e_b, gpu, job))
        if new or fresh:
            self.epoch += 1
            for gpu in new:
                born[gpu] = self.epoch
        self.born = born
        self.taken = set()
        self._slots = slots
        ordered = [groups[k] for k in sorted(groups, key=repr)]
        for group in ordered:
            group.slots.sort(key=_slot_order)
            group.remaining = [slot[0] for slot in group.slots]
        self._groups = ordered
        self._by_birth = None
        return ordered

    @property
    def by_birth(self) -> list[tuple[int, float, int, SlotGroup]]:
        """(epoch of birth, E_b, GPU, group) of the last build's slots, newest first.
        Made on first use: the slots taken since the build (gone from their groups) are
        in ``taken``, which every reader skips anyway."""
        if self._by_birth is None:
            born = self.born
            found = [
                (born[gpu], e_b, gpu, group)
                for group in self._groups
                for e_b, gpu, _ in group.slots
            ]
            found.sort(key=_birth_order)
            self._by_birth = found
        return self._by_birth

    def born_since(self, since: int) -> Iterator[tuple[float, int, SlotGroup]]:
        """(E_b, GPU, group) of the slots born after epoch ``since`` still open, newest
        first."""
        taken = self.taken
        for born, e_b, gpu, group in self.by_birth:
            if born <= since:
                return
            if gpu not in taken:
                yield e_b, gpu, group


def _birth_order(item: tuple[int, float, int, SlotGroup]) -> tuple[int, int]:
    return (-item[0], item[2])


def _slot_order(slot: tuple[float, int, JobView]) -> tuple[float, int]:
    return (slot[0], slot[1])
