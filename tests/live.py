"""Builders for live-service tests: store jobs the way admission does, read them back."""

from __future__ import annotations

import itertools
import time
from typing import Any

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.schemas import JobRecord, JobSpec, JobState, JobSubmitted, StateChange
from gpusched.services.scheduler.config import SchedulerConfig

_ids = itertools.count()


def fast_scheduler(nats_url: str, **overrides: Any) -> SchedulerConfig:
    """Timings short enough for tests, long enough not to flap on a busy 2-core machine."""
    settings: dict[str, Any] = {
        "nats_url": nats_url,
        "policy": "fifo",
        "instance": f"sched-{next(_ids)}",
        "lease_ttl_s": 1.5,
        "lease_renew_s": 0.3,
        "decide_every_s": 0.2,
        "node_timeout_s": 2.0,
        "missing_job_grace_s": 2.0,
        "retry_backoff_s": 0.1,
        "command_timeout_s": 1.0,
        "progress_write_s": 0.2,
    }
    settings.update(overrides)
    return SchedulerConfig(**settings)


def spec(**fields: Any) -> JobSpec:
    values: dict[str, Any] = {"name": "test", "model": "resnet50", "batch_size": 32,
                              "iterations": 10}
    values.update(fields)
    return JobSpec(**values)


async def store_job(stores: Stores, job_spec: JobSpec, job_id: str | None = None,
                    tenant: str = "default") -> str:
    job_id = job_id or f"job{next(_ids)}"
    now = time.time()
    record = JobRecord(
        id=job_id, tenant=tenant, spec=job_spec,
        total_iterations=job_spec.iterations or 1, submitted_at=now,
        history=[StateChange(JobState.QUEUED, now, "submitted")],
        pending_reason="waiting for the scheduler",
    )
    await stores.mark_live(job_id)
    await stores.jobs.create(job_id, codec.encode(record))
    await stores.js.publish(
        subjects.job_submitted(job_id), codec.encode(JobSubmitted(job_id, now)),
        headers=codec.headers({"Nats-Msg-Id": job_id}),
    )
    return job_id


async def record(stores: Stores, job_id: str) -> JobRecord:
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    return codec.decode(entry.value, JobRecord)


async def wait_state(stores: Stores, job_id: str, *states: JobState,
                     timeout_s: float = 15.0) -> JobRecord:
    async def reached() -> JobRecord | None:
        current = await record(stores, job_id)
        return current if current.state in states else None

    try:
        result: JobRecord = await wait_until(reached, timeout_s=timeout_s, every_s=0.05)
    except TimeoutError:
        current = await record(stores, job_id)
        raise AssertionError(
            f"{job_id} stayed {current.state} ({current.pending_reason!r}), "
            f"wanted {[s.value for s in states]}"
        ) from None
    return result
