"""Stopping background tasks: a cancellation swallowed once does not stop the stop."""

from __future__ import annotations

import asyncio

from gpusched.libs.common import tasks
from gpusched.libs.common.tasks import cancel_and_wait


async def test_a_loop_that_swallows_one_cancellation_is_still_stopped(monkeypatch):
    monkeypatch.setattr(tasks, "GRACE_S", 0.05)
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # as nats-py's flush does, the first time
                swallowed += 1
                if swallowed > 1:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), timeout=600)
    assert task.cancelled()
    assert swallowed == 2


async def test_a_task_finishing_its_cleanup_is_cancelled_once_and_not_cut_short():
    cleaned = asyncio.Event()

    async def tidy() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # a release that takes a moment
            cleaned.set()

    task = asyncio.create_task(tidy())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert cleaned.is_set()
