"""The job store: the live scheduler's reads and writes of job records in KV, and of
the index of unfinished jobs beside them.

A record is written only at the revision the scheduler last read (compare-and-set): a
record changed by another writer (a second leader during a lease handover) raises
``RecordConflict``, and a write that failed without a verdict (a timeout, a store that
cannot write) raises ``RecordUnsure``. Either way the actor reads the record back
(``read``) and takes the stored one as the truth. What to do with what was read is the
actor's; this module only moves records in and out of the store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobExit, JobRecord
from gpusched.services.scheduler.live.state import LiveJob


class RecordConflict(Exception):
    """A job record changed under the scheduler: another writer (a second leader during
    a lease handover) got there first. The write is dropped, never forced."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: record changed by another writer")
        self.job_id = job_id


class RecordUnsure(RecordConflict):
    """A write of a job record failed without a verdict (a timeout, a store that cannot
    write): it may be stored or not. The job is read back as after a conflict, so no
    step of it is left half taken (a start whose record was not written)."""

    def __init__(self, job_id: str, error: Exception) -> None:
        super().__init__(job_id)
        self.args = (f"job {job_id}: record write failed: {error!r}",)


class JobStore:
    """Job records and the live index over the scheduler's ``Stores``. Every call goes
    through ``stores`` as it is at the time of the call (tests put faults there)."""

    def __init__(self, stores: Stores, log: Any) -> None:
        self.stores = stores
        self.log = log

    async def read(self, job_id: str) -> tuple[JobRecord, int] | None:
        """The stored record and its revision; None when there is none."""
        try:
            entry = await self.stores.jobs.get(job_id)
        except KeyNotFoundError:
            return None
        if not entry.value or entry.revision is None:
            return None
        return codec.decode(entry.value, JobRecord), entry.revision

    async def write(self, job: LiveJob, record: JobRecord) -> None:
        """Compare-and-set the record. A conflict means someone else wrote it since we
        read it; their record stands and ``RecordConflict`` makes the actor read it back
        (see its ``_resync``)."""
        data = codec.encode(record)
        try:
            job.revision = await self.stores.jobs.update(job.id, data, last=job.revision)
        except KeyWrongLastSequenceError:
            raise RecordConflict(job.id) from None
        except Exception as exc:
            # a timeout may have stored it or not: ``_resync`` reads what is stored
            raise RecordUnsure(job.id, exc) from exc
        job.record = record

    async def unfinished(self) -> list[tuple[str, JobRecord, int]]:
        """Read the unfinished jobs only: the live index, not every job ever stored
        (the index is built first where the store has none yet)."""
        if not await self.stores.live_index_complete():
            await self._build_live_index()
        keys = await self.stores.live_job_ids()
        records = await asyncio.gather(*(self.read(key) for key in keys))
        return [
            (key, *stored) for key, stored in zip(keys, records, strict=True)
            if stored is not None
        ]

    async def _build_live_index(self) -> None:
        """Once per store, written before the index existed: enter every unfinished job."""
        keys = await self.stores.job_ids()
        self.log.info("building the index of unfinished jobs", stored=len(keys))
        for key in keys:
            stored = await self.read(key)
            if stored is not None and not stored[0].state.terminal:
                await self.stores.mark_live(key)
        await self.stores.mark_live_index_complete()

    async def live_job_ids(self) -> list[str]:
        return await self.stores.live_job_ids()

    async def live_mark(self, job_id: str) -> tuple[float, int] | None:
        """When the job entered the index, and the entry's revision (None: not in it)."""
        return await self.stores.live_mark(job_id)

    async def mark_live(self, job_id: str) -> None:
        await self.stores.mark_live(job_id)

    async def unmark_live(self, job_id: str, revision: int | None = None) -> None:
        """Take the job out of the index (only the entry at ``revision`` where given);
        a failure is left to the next rescan."""
        try:
            await self.stores.unmark_live(job_id, revision)
        except Exception as exc:  # the next rescan tries again
            self.log.debug("could not unmark a finished job", job_id=job_id, error=str(exc))

    async def stored_exit(self, job: LiveJob) -> JobExit | None:
        """The exit of the job's current run if its leading node stored one that we have
        not handled yet (it waits in the exits stream behind other work). Only that
        node's subject is read: no other node can publish there."""
        if not job.record.placement:
            return None
        leader = job.record.placement[0].node
        try:
            raw = await self.stores.js.get_last_msg(
                subjects.EXITS_STREAM, subjects.job_exit(leader, job.id)
            )
        except NotFoundError:
            return None
        if not raw.data:
            return None
        try:
            exit = codec.decode(raw.data, JobExit)
        except msgspec.DecodeError:
            return None
        return exit if exit.run_id == job.record.run_id and exit.node == leader else None
