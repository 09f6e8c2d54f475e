"""The exit outbox: every run of a leader part ends with exactly one stored JobExit.

An exit is published to the exits stream under the node's own subject
(``gpusched.node.<node>.job.<id>.exit``) and retried (0.1 s doubling to 2 s) until the
server stores it, so a NATS restart in between delays it and loses nothing; a retry after
a lost acknowledgement is deduplicated by its ``Nats-Msg-Id``, which holds a random part
drawn once per exit so that no other publisher can claim it first. Until it is stored,
its run is listed in the node's heartbeats as exiting.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from nats.js import JetStreamContext

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.schemas import JobExit, RunRef
from gpusched.libs.common.tasks import cancel_and_wait
from gpusched.services.nodeagent.metrics import Metrics
from gpusched.services.nodeagent.runs import RunEnd

#: one attempt to store a JobExit or the registration
PUBLISH_TIMEOUT_S = 2.0
EXIT_RETRY_FIRST_S = 0.1
EXIT_RETRY_MAX_S = 2.0


def job_exit(node: str, job_id: str, run_id: int, end: RunEnd) -> JobExit:
    return JobExit(
        job_id=job_id,
        run_id=run_id,
        node=node,
        outcome=end.outcome,
        exit_code=end.exit_code,
        iteration=end.iteration,
        stderr_tail=end.stderr_tail,
        at=time.time(),
        progress=end.progress,
    )


def exit_msg_id(node: str, exit: JobExit, nonce: str) -> str:
    """An exit's ``Nats-Msg-Id``: its node, job and run, and ``nonce``, drawn once per
    exit and kept by its retries. JetStream drops a message whose id the stream saw in
    its duplicate window from any publisher, so an id another node could guess would
    let that node drop this exit by storing the id first."""
    return f"{node}-{exit.job_id}-{exit.run_id}-exit-{nonce}"


class ExitOutbox:
    """The exits of one node on their way to JetStream."""

    def __init__(self, js: JetStreamContext, node: str, log: Any, metrics: Metrics) -> None:
        self._js = js
        self._node = node
        self._log = log
        self._metrics = metrics
        self._deliveries: dict[asyncio.Task[None], str] = {}
        #: the run of each exit being delivered, listed in heartbeats until it is stored
        self._exiting: dict[asyncio.Task[None], RunRef] = {}

    @property
    def exiting(self) -> list[RunRef]:
        return list(self._exiting.values())

    @property
    def undelivered(self) -> tuple[str, ...]:
        """Job ids whose JobExit JetStream has not stored yet."""
        return tuple(sorted(self._deliveries.values()))

    def deliver(self, exit: JobExit) -> None:
        msg_id = exit_msg_id(self._node, exit, secrets.token_hex(8))
        task = asyncio.create_task(self._publish(exit, msg_id), name=f"exit-{exit.job_id}")
        self._deliveries[task] = exit.job_id
        self._exiting[task] = RunRef(exit.job_id, exit.run_id)
        task.add_done_callback(self._deliveries.pop)
        task.add_done_callback(self._exiting.pop)

    async def _publish(self, exit: JobExit, msg_id: str) -> None:
        """Store the exit in JetStream, retrying until it is taken: the server may be
        restarting. A retry after a lost acknowledgement is deduplicated by its id."""
        data = codec.encode(exit)
        headers = codec.headers({"Nats-Msg-Id": msg_id})
        log = self._log.bind(job_id=exit.job_id, run_id=exit.run_id)
        began = time.monotonic()
        delay = EXIT_RETRY_FIRST_S
        attempts = 0
        while True:
            try:
                await self._js.publish(
                    subjects.job_exit(self._node, exit.job_id), data, headers=headers,
                    timeout=PUBLISH_TIMEOUT_S,
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempts += 1
                self._metrics.exit_retries.inc()
                log.warning("exit not stored yet; retrying", attempt=attempts, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, EXIT_RETRY_MAX_S)
        self._metrics.exit_delivery_seconds.observe(time.monotonic() - began)
        log.info("exit delivered", outcome=exit.outcome, iteration=exit.iteration,
                 attempts=attempts + 1)

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every exit to be stored; give up on the rest."""
        pending = set(self._deliveries)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            self._log.error("exit never delivered", job_id=self._deliveries.get(task))
        await cancel_and_wait(*late)
