"""The submission path, ``POST /v1/jobs``: the request is checked (media type,
Idempotency-Key, body size, the spec, its deadline and priority), the tenant's GPUs are
reserved against its quota, the record is stored and indexed, and the submission is
published to the scheduler; an Idempotency-Key seen before replays its job, and a refused
submission withdraws what it stored and gives its reservation back."""

from __future__ import annotations

import asyncio
from typing import Protocol

import nats.errors
import structlog
from aiohttp import hdrs, web
from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, live_entry
from gpusched.libs.common.schemas import (
    JobRecord,
    JobSpec,
    JobState,
    JobSubmitted,
    StateChange,
    now,
)
from gpusched.services.admission import params
from gpusched.services.admission.capacity import MemoryOf, capacity_warnings
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.http import TENANT, json_response, store_failed, unavailable
from gpusched.services.admission.ids import idempotent_job_id, new_job_id
from gpusched.services.admission.leader import LeaderPolicy
from gpusched.services.admission.metrics import Metrics
from gpusched.services.admission.problems import ProblemError
from gpusched.services.admission.publisher import JetStreamWriter
from gpusched.services.admission.quota import QuotaExceeded, Quotas
from gpusched.services.admission.specs import ACCEPTED_TYPES, accepts, decode_spec, total_iterations
from gpusched.services.admission.state import JobIndex, KvMirror, NodeIndex
from gpusched.services.admission.views import submitted_job

log = structlog.get_logger("gpusched.admission")

PENDING_REASON = "waiting for the scheduler"
#: JetStream's error code for a compare-and-set that found a later revision
WRONG_LAST_SEQUENCE = 10071


class SubmissionParts(Protocol):
    """What the submission path reads of the admission API (app.py's ``AdmissionApi``):
    its config (the body limit), the model names and their GPU memory, the connection,
    stores, job and node indexes and the node mirror, the metrics, the quota ledgers,
    its JetStream writer, what the leader says of priorities, and its reads of a job's
    record from the store."""

    config: AdmissionConfig
    models: frozenset[str]
    memory_mb: MemoryOf | None
    nc: Client
    stores: Stores
    jobs: JobIndex
    nodes: NodeIndex
    node_mirror: KvMirror
    metrics: Metrics
    writer: JetStreamWriter
    leader_policy: LeaderPolicy

    @property
    def quotas(self) -> Quotas: ...

    async def read_record(self, job_id: str) -> JobRecord | None: ...

    async def is_stored(self, job_id: str) -> bool: ...


class Submissions:
    def __init__(self, api: SubmissionParts) -> None:
        self.api = api

    async def submit(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        if not accepts(request.content_type):
            raise ProblemError(
                415,
                "unsupported-media-type",
                f"send the job spec as {' or '.join(ACCEPTED_TYPES)}, "
                f"not {request.content_type}",
                field="Content-Type",
                headers={"Accept-Post": ", ".join(ACCEPTED_TYPES)},
            )
        key = request.headers.get("Idempotency-Key")
        if key is not None and not params.valid_idempotency_key(key):
            raise ProblemError(
                400,
                "invalid-header",
                "Idempotency-Key: must be 1-255 printable ASCII characters, not starting or "
                "ending with a space",
                field="Idempotency-Key",
            )
        length = request.content_length
        if length is not None and length > self.api.config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.api.config.max_body_bytes, actual_size=length
            )
        spec = decode_spec(await request.read(), request.content_type)
        iterations = total_iterations(spec, self.api.models)
        if not self.api.nc.is_connected:
            raise unavailable()
        return await self._admit(tenant, spec, iterations, key)

    async def _check_priority_honoured(self) -> None:
        """A priority the leading scheduler's policy cannot honour is refused, not
        stored to be ignored; without a leader's answer the job is taken (a policy that
        honours it may lead by the time it runs)."""
        honours, policy = await self.api.leader_policy.honours_priority()
        if honours is False:
            raise _priority_refused(str(policy))

    async def _admit(
        self, tenant: str, spec: JobSpec, iterations: int, key: str | None
    ) -> web.Response:
        job_id = idempotent_job_id(tenant, key) if key is not None else new_job_id()
        if key is not None and self.api.jobs.knows(job_id):
            stored = await self.api.read_record(job_id)
            if stored is not None:
                return await self._replay(stored, tenant, spec)
        _check_deadline(spec, now())
        if spec.priority:
            await self._check_priority_honoured()
        for attempt in range(3):
            if attempt and key is None:
                job_id = new_job_id()
            # True while this request may hold a reservation it has to give back
            owned = True
            try:
                try:
                    owned = await self.api.quotas.reserve(tenant, job_id, spec.gpus)
                except QuotaExceeded as exc:
                    owned = False
                    # the mirror may not have seen a job this key created a moment ago
                    stored = await self.api.read_record(job_id) if key is not None else None
                    if stored is None:
                        raise self._over_quota(tenant, exc.used, spec.gpus) from None
                    return await self._replay(stored, tenant, spec)
                at = now()
                record = JobRecord(
                    id=job_id,
                    tenant=tenant,
                    spec=spec,
                    total_iterations=iterations,
                    state=JobState.QUEUED,
                    submitted_at=at,
                    history=[StateChange(JobState.QUEUED, at, "submitted")],
                    pending_reason=PENDING_REASON,
                )
                data = codec.encode(record)
                try:
                    # indexed first: a record whose submission event the scheduler never
                    # takes (this instance dies before publishing, or the event of an
                    # attempt whose record was withdrawn is consumed before the retry's
                    # duplicate is dropped) is adopted by its periodic rescan
                    await self.api.writer.put(self.api.stores.live, job_id, live_entry())
                    # ids are built subject-safe here: no key check on the hot path
                    revision = await self.api.writer.create(self.api.stores.jobs, job_id, data)
                except KeyWrongLastSequenceError:
                    if key is None:
                        continue
                    stored = await self.api.read_record(job_id)
                    if stored is None:
                        continue
                    # the job this key created holds the reservation while it runs
                    owned = owned and stored.state.terminal
                    return await self._replay(stored, tenant, spec)
                except (nats.errors.Error, TimeoutError) as exc:
                    # refused (a full store, a timeout): nothing of it may stay, its
                    # index entry, or a record a create that got no answer stored
                    owned = await self._withdraw(job_id, None, data)
                    raise self._refused(job_id, "record not stored", exc, owned) from None
                self.api.jobs.apply(revision, job_id, data)
                try:
                    await self._publish_submitted(record)
                except (nats.errors.Error, TimeoutError) as exc:
                    # a record that could not be withdrawn keeps its reservation: the
                    # scheduler adopts it, or reconciliation frees it once it is gone
                    owned = await self._withdraw(job_id, revision, data)
                    raise self._refused(job_id, "submission not published", exc, owned) from None
                owned = False
                break
            finally:
                if owned:
                    await self._give_back(tenant, job_id)
        else:
            raise ProblemError(503, "conflict-retry", "could not store the job; try again")
        self.api.metrics.submitted(tenant)
        log.info("job submitted", job_id=job_id, tenant=tenant, model=spec.model,
                 gpus=spec.gpus, iterations=iterations)
        return json_response(
            submitted_job(record, now(), self._warnings(spec)), 201,
            {hdrs.LOCATION: f"/v1/jobs/{job_id}"},
        )

    def _warnings(self, spec: JobSpec) -> list[str]:
        """What the submitter should know at once: that no node registered today can
        hold the job (it waits all the same; nodes may join later). Nothing before the
        node registry has been read."""
        if not self.api.node_mirror.synced.is_set():
            return []
        return capacity_warnings(spec, self.api.nodes.nodes(), self.api.memory_mb)

    def _over_quota(self, tenant: str, used: int, gpus: int) -> ProblemError:
        quota = self.api.quotas.limit(tenant)
        return ProblemError(
            403,
            "quota-exceeded",
            f"gpus: tenant {tenant!r} holds {used} GPUs in unfinished jobs; {gpus} more "
            f"would exceed its quota of {quota}",
            field="gpus",
            quota=quota,
        )

    async def _give_back(self, tenant: str, job_id: str) -> None:
        """Releases a failed submission's reservation. The release is queued even when
        this request is cancelled; it is awaited only while NATS is reachable, so a
        failure answer is not held up by it."""
        released = self.api.quotas.release(tenant, job_id)
        if released is None or not self.api.nc.is_connected:
            return
        try:
            await asyncio.shield(released)
        except Exception as exc:
            log.warning("quota reservation not released; reconciliation will",
                        job_id=job_id, error=repr(exc))

    async def _replay(self, stored: JobRecord, tenant: str, spec: JobSpec) -> web.Response:
        if stored.tenant != tenant:
            raise ProblemError(
                409, "conflict", "Idempotency-Key: names another job", field="Idempotency-Key"
            )
        if stored.spec != spec:
            raise ProblemError(
                422,
                "idempotency-key-reused",
                "Idempotency-Key: was used before for a different job spec",
                field="Idempotency-Key",
            )
        if stored.state is JobState.QUEUED:
            # covers a crash between storing the record and publishing the submission;
            # the stream drops the duplicate by its Nats-Msg-Id otherwise
            await self._publish_submitted(stored)
        self.api.metrics.idempotent_replays.inc()
        return json_response(
            submitted_job(stored, now(), self._warnings(stored.spec)),
            200,
            {hdrs.LOCATION: f"/v1/jobs/{stored.id}", "Idempotent-Replayed": "true"},
        )

    async def _publish_submitted(self, record: JobRecord) -> None:
        await self.api.writer.publish(
            subjects.job_submitted(record.id),
            codec.encode(JobSubmitted(record.id, record.submitted_at)),
            headers=codec.headers({"Nats-Msg-Id": record.id}),
        )

    async def _withdraw(self, job_id: str, revision: int | None, data: bytes) -> bool:
        """Removes what a refused submission stored, so a failed request leaves nothing
        behind: its record (of ``revision``; after a create that got no answer, the one
        holding exactly ``data``, if any) and its entry in the index of unfinished
        jobs. True when no record of it is left; the entry of a record that stays
        stays too, so the scheduler adopts it."""
        try:
            if revision is None:
                try:
                    entry = await self.api.stores.jobs.get(job_id)
                except (KeyNotFoundError, KeyDeletedError):
                    entry = None
                if entry is not None and entry.value != data:
                    return False  # another request's record under this Idempotency-Key
                revision = entry.revision if entry is not None else None
            if revision is not None and not await self._remove_record(job_id, revision):
                return False
        except Exception as exc:
            log.error("could not withdraw a refused job", job_id=job_id, error=repr(exc))
            return False
        try:
            await self.api.stores.unmark_live(job_id)
        except Exception as exc:  # the scheduler drops an entry without a record later
            log.warning("refused job left in the index of unfinished jobs", job_id=job_id,
                        error=repr(exc))
        return True

    async def _remove_record(self, job_id: str, revision: int) -> bool:
        """Deletes the record of ``revision``; where the store takes no delete marker (it
        is full), purges it, which needs no room. False when a later revision (the
        scheduler's) stays."""
        try:
            await self.api.stores.jobs.delete(job_id, last=revision)
        except (nats.errors.Error, TimeoutError) as exc:
            if getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE:
                return False
            log.warning("record not deleted; purging it", job_id=job_id, error=repr(exc))
            await self.api.stores.purge_job(job_id, revision)
            if await self.api.is_stored(job_id):
                return False
        self.api.jobs.apply(revision + 1, job_id, None)
        return True

    def _refused(
        self, job_id: str, what: str, exc: Exception, withdrawn: bool
    ) -> ProblemError:
        log.warning(what, job_id=job_id, record_withdrawn=withdrawn, error=repr(exc))
        if not self.api.nc.is_connected:
            return unavailable()
        return store_failed(exc, "nothing was stored, try again" if withdrawn else
                            "the job may be stored: retry with the same Idempotency-Key")


def _priority_refused(policy: str) -> ProblemError:
    return ProblemError(
        422,
        "invalid-field",
        f"priority: the scheduler's policy {policy} does not honour priorities (it re-plans "
        "every job's size); submit with priority 0 or run a policy that orders by it",
        field="priority",
    )


def _check_deadline(spec: JobSpec, at: float) -> None:
    """A deadline already past cannot be met: refused, naming the field."""
    if spec.deadline is not None and spec.deadline <= at:
        raise ProblemError(
            422,
            "invalid-field",
            f"deadline: {spec.deadline:.0f} is in the past (now {at:.0f}, seconds since the "
            "epoch)",
            field="deadline",
        )
