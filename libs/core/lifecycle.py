"""The states of a job's life, one vocabulary from the wire to the policies.

Job records and state events carry these values (their strings are the wire encoding,
so stored records decode unchanged); a policy's ``JobView`` is ``RUNNING`` while the job
holds GPUs, else ``QUEUED``; the simulator walks its jobs through the same states (a job
no placement fits ends ``FAILED``). The live scheduler tells apart finer steps of a job
it drives (starting, stopping): those are its own ``Phase``, inside these states.
"""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def waiting(self) -> bool:
        return self in (JobState.QUEUED, JobState.PREEMPTED)


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
