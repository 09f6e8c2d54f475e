"""Actors: one object owns its state and reads one inbox; nothing else touches it.

An actor is an async context manager: entering starts its loop, leaving lets it finish
what is queued and awaits it, so no background task outlives its owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog

from gpusched.libs.common.tasks import cancel_and_wait

M = TypeVar("M")

_STOP = object()


class Actor(Generic[M]):
    name = "actor"

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._timers: set[asyncio.Task[None]] = set()
        self.log = structlog.get_logger(f"gpusched.{self.name}")

    def tell(self, message: M) -> None:
        self._inbox.put_nowait(message)

    async def handle(self, message: M) -> None:
        raise NotImplementedError

    async def on_start(self) -> None:
        """Runs inside the actor's task before the first message."""

    async def on_stop(self) -> None:
        """Runs inside the actor's task after the last message."""

    def every(self, seconds: float, message: Callable[[], M]) -> None:
        """Send ``message()`` to the inbox every ``seconds`` while the actor runs."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(seconds)
                self.tell(message())

        self.spawn(tick())

    def spawn(self, work: Awaitable[None]) -> None:
        """A helper task owned by this actor, cancelled when it stops."""

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("actor helper task failed")

        task = asyncio.ensure_future(run())
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _loop(self) -> None:
        await self.on_start()
        while True:
            message = await self._inbox.get()
            if message is _STOP:
                break
            try:
                await self.handle(message)
            except Exception:
                self.log.exception("actor message failed", message=type(message).__name__)
        await self.on_stop()

    async def __aenter__(self) -> Actor[M]:
        self._task = asyncio.create_task(self._loop(), name=self.name)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(*self._timers)
        if self._task is not None:
            self._inbox.put_nowait(_STOP)
            await self._task
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
