"""What the live scheduler announces on NATS without waiting for anyone: each change of
a job's state (``gpusched.job.<id>.state``) and each decision that did something
(``gpusched.scheduler.<instance>.decision``). They are news for the dashboard and
clients, never the record of anything (the job records are), so a failed publish is
dropped.
"""

from __future__ import annotations

import contextlib
import time

from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import DecisionSummary, JobState, JobStateEvent, Placement


class Publisher:
    def __init__(self, nc: Client, instance: str) -> None:
        self.nc = nc
        self.instance = instance

    async def job_state(
        self, job_id: str, state: JobState, reason: str, placement: list[Placement]
    ) -> None:
        """The job's state, and its placement, as its record held them."""
        event = JobStateEvent(
            job_id=job_id, state=state, at=time.time(), reason=reason, placement=placement
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.job_state(job_id), codec.encode(event), headers=codec.headers()
            )

    async def decision(self, summary: DecisionSummary) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(
                subjects.scheduler_decision(self.instance),
                codec.encode(summary),
                headers=codec.headers(),
            )
