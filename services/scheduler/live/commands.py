"""Node commands: the live scheduler's requests to node agents (start, stop, resize,
reallocate a run), each sent with retries on ``gpusched.node.<node>.command``.

Each command runs beside the actor, as a task the actor owns (``spawn``), and what the
actor must know of its outcome comes back to it as a message (``tell``): a start's or a
resize's result (``StartResult``), a stop that was not confirmed (``StopFailed``). A
failed reallocation is only logged: the run keeps its previous allocation.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec.structs import replace
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.retry import backoff, retry
from gpusched.libs.common.schemas import (
    CommandReply,
    JobRecord,
    Placement,
    ReallocateJob,
    ResizeJob,
    StartJob,
    StopJob,
)
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live.messages import Message, StartResult, StopFailed

#: the commands the scheduler sends a node agent
NodeCommand = StartJob | StopJob | ResizeJob | ReallocateJob


class NodeCommands:
    """Sends commands to node agents for the actor whose ``spawn`` and ``tell`` it is
    given: its tasks are the actor's (cancelled when it stops), its answers messages."""

    def __init__(
        self, nc: Client, config: SchedulerConfig, log: Any,
        spawn: Callable[[Awaitable[None]], None], tell: Callable[[Message], None],
    ) -> None:
        self.nc = nc
        self.config = config
        self.log = log
        self.spawn = spawn
        self.tell = tell

    def start(self, record: JobRecord, placement: list[Placement]) -> None:
        """Start the record's run on ``placement``; a ``StartResult`` tells how it went."""
        self.spawn(self._send_starts(record, placement))

    def stop(self, node: str, job_id: str, run_id: int, reason: str) -> None:
        """Stop the run on ``node``; a ``StopFailed`` tells of a stop not confirmed."""
        command = StopJob(job_id=job_id, run_id=run_id, reason=reason)  # type: ignore[arg-type]

        async def send() -> None:
            error = await self.command(node, command)
            if error:
                self.tell(StopFailed(job_id, run_id, error))

        self.spawn(send())

    def resize(
        self, job_id: str, run_id: int, new_run_id: int, part: Placement, batch_size: int,
        accum_steps: int,
    ) -> None:
        """Resize run ``run_id`` in place on ``part``'s node into run ``new_run_id``; a
        ``StartResult`` of the new run tells how it went."""
        command = ResizeJob(
            job_id=job_id,
            run_id=run_id,
            new_run_id=new_run_id,
            gpus=part.gpus,
            batch_size=batch_size,
            accum_steps=accum_steps,
        )
        node = part.node

        async def send() -> None:
            self.tell(StartResult(job_id, new_run_id, await self.command(node, command)))

        self.spawn(send())

    def reallocate(self, record: JobRecord) -> None:
        """Re-pin the record's run on each of its nodes to that node's share of its CPU
        cores and host memory, in proportion to the job's GPUs there."""
        for part in record.placement:
            command = ReallocateJob(
                job_id=record.id,
                run_id=record.run_id,
                cpus=node_share(record.cpus, part, record.placement) or 0.0,
                mem_gb=node_share(record.mem_gb, part, record.placement) or 0.0,
            )
            self.spawn(self._send_reallocation(part.node, command))

    async def _send_reallocation(self, node: str, command: ReallocateJob) -> None:
        error = await self.command(node, command)
        if error:
            # the run keeps its previous allocation; the next round may try again
            self.log.warning("reallocation failed", job_id=command.job_id, node=node,
                             error=error)

    async def _send_starts(self, record: JobRecord, placement: list[Placement]) -> None:
        """Runs beside the actor; reports back as a message. The leader part starts
        first: for a process job across nodes its reply says where the ranks meet."""
        spec = record.current_spec
        commands = [
            StartJob(
                job_id=record.id,
                run_id=record.run_id,
                spec=spec,
                total_iterations=record.total_iterations,
                gpus=part.gpus,
                accum_steps=record.accum_steps,
                co_runners=record.shares_with,
                resume_iteration=record.progress.iteration,
                nodes=len(placement),
                leader=i == 0,
                cpus=node_share(record.cpus, part, placement),
                mem_gb=node_share(record.mem_gb, part, placement),
            )
            for i, part in enumerate(placement)
        ]
        error, reply = await self.request(placement[0].node, commands[0])
        errors = [f"{placement[0].node}: {error}"] if error else []
        if not errors and len(placement) > 1:
            followers = commands[1:]
            if reply is not None and reply.rendezvous:
                first_ranks = itertools.accumulate(len(p.gpus) for p in placement)
                followers = [
                    replace(command, rendezvous=reply.rendezvous, first_rank=first,
                            world_size=spec.gpus)
                    for command, first in zip(followers, first_ranks, strict=False)
                ]
            results = await asyncio.gather(
                *(self.command(part.node, cmd)
                  for part, cmd in zip(placement[1:], followers, strict=True))
            )
            errors = [f"{p.node}: {e}" for p, e in zip(placement[1:], results, strict=True) if e]
            if errors:
                for part, result in zip(placement, ["", *results], strict=True):
                    if not result:
                        await self.command(part.node, StopJob(
                            job_id=record.id, run_id=record.run_id, reason="lost"))
        unanswered = bool(errors) and reply is None and len(placement) == 1
        self.tell(StartResult(record.id, record.run_id, "; ".join(errors), unanswered))

    async def command(self, node: str, command: NodeCommand) -> str:
        """Send with retries; '' on success, else why it failed."""
        error, _ = await self.request(node, command)
        return error

    async def request(
        self, node: str, command: NodeCommand
    ) -> tuple[str, CommandReply | None]:
        """Send with retries: why it failed ('' on success), and the reply if any."""
        data = codec.encode(command)

        async def ask() -> CommandReply:
            reply = await self.nc.request(
                subjects.node_command(node), data,
                timeout=self.config.command_timeout_s, headers=codec.headers(),
            )
            return codec.decode(reply.data, CommandReply)

        attempts = itertools.islice(backoff(0.05, 0.5), self.config.command_retries)
        try:
            answer = await retry(ask, delays=attempts)
        except Exception as exc:
            return f"no answer ({type(exc).__name__})", None
        return ("" if answer.ok else (answer.error or "refused")), answer


def node_share(amount: float | None, part: Placement, placement: list[Placement]) -> float | None:
    """A node's part of a job's CPUs or memory: in proportion to the job's GPUs there."""
    if amount is None:
        return None
    gpus = sum(len(p.gpus) for p in placement)
    return amount * len(part.gpus) / gpus
