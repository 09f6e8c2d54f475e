"""Job ids: safe inside NATS subjects and KV keys, sortable by submission time."""

from __future__ import annotations

import hashlib
import re
import secrets
import time

#: what an id of any origin may look like (the schema's IdStr)
JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def new_job_id(now_s: float | None = None) -> str:
    """``j`` + milliseconds since the epoch (12 hex digits) + 8 random hex digits, so ids
    sort by submission time (to the millisecond)."""
    ms = int((time.time() if now_s is None else now_s) * 1000)
    return f"j{ms:012x}{secrets.token_hex(4)}"


def idempotent_job_id(tenant: str, key: str) -> str:
    """The same (tenant, Idempotency-Key) always names the same job; two tenants using
    the same key get different jobs. These ids do not sort by time."""
    digest = hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()
    return f"k{digest[:24]}"


def is_job_id(value: str) -> bool:
    return JOB_ID.fullmatch(value) is not None
