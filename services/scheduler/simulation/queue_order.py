"""A queue kept in a policy's fixed queue order (``QueueSort``), so a driver hands the
policy its queue already sorted and no decision sorts it again."""

from __future__ import annotations

from bisect import bisect_left

from gpusched.libs.core.snapshot import JobView
from gpusched.services.scheduler.policies.base import QueueSort


class SortedQueue:
    """The queue kept in a policy's fixed queue order, so no decision sorts it again."""

    def __init__(self, sort: QueueSort | None) -> None:
        self.sort = sort
        self.order = sort.name if sort else "arrival"
        self._keys: list[tuple] = []
        self._views: list[JobView] = []
        #: each queued job's key, as worked out when it joined
        self._key_of: dict[str, tuple] = {}

    def add(self, view: JobView) -> None:
        if self.sort is None:
            return
        key = self._key_of[view.job_id] = self.sort.key(view)
        i = bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._views.insert(i, view)

    def remove(self, view: JobView) -> None:
        if self.sort is None:
            return
        i = bisect_left(self._keys, self._key_of.pop(view.job_id))
        del self._keys[i]
        del self._views[i]

    def views(self, arrival: dict[str, JobView]) -> tuple[JobView, ...]:
        return tuple(self._views) if self.sort else tuple(arrival.values())
