"""Stopping background tasks: a cancellation swallowed once does not stop the stop."""

from __future__ import annotations

import asyncio
import contextlib

from gpusched.libs.common import tasks
from gpusched.libs.common.tasks import cancel_and_wait, close_within


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


async def test_a_reply_arriving_as_its_task_is_cancelled_still_lets_the_task_be_stopped(
    monkeypatch,
):
    # Python 3.11's asyncio.wait_for returns a result that arrives in the loop iteration
    # its task is cancelled in, and the cancellation is lost: a periodic save waiting on
    # a KV put's acknowledgement then sleeps on as if never cancelled
    monkeypatch.setattr(tasks, "GRACE_S", 0.05)
    waiting = asyncio.Event()
    reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def saver() -> None:
        while True:
            if not reply.done():
                waiting.set()
                await asyncio.wait_for(reply, 5)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(saver())
    await waiting.wait()
    reply.set_result(None)
    assert await asyncio.wait_for(cancel_and_wait(task), timeout=60)
    assert task.cancelled()


async def test_a_task_that_ignores_every_cancellation_is_left_after_the_limit(monkeypatch):
    monkeypatch.setattr(tasks, "GRACE_S", 0.05)
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    began = asyncio.get_running_loop().time()
    assert not await asyncio.wait_for(cancel_and_wait(task, limit_s=0.3), timeout=60)
    assert 0.3 <= asyncio.get_running_loop().time() - began < 30
    assert not task.done()
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_a_closing_step_that_never_ends_is_given_up_at_its_limit():
    cancels = 0

    async def drain_like() -> None:  # as nats-py's drain: carries on after a cancel
        nonlocal cancels
        while cancels < 2:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1

    assert not await asyncio.wait_for(close_within(drain_like(), "a drain", 0.1), timeout=60)
    assert cancels == 1  # cancelled once, and left


async def test_a_closing_step_that_fails_or_finishes_in_time_is_reported_so():
    async def fails() -> None:
        raise RuntimeError("closed already")

    async def quick() -> None:
        await asyncio.sleep(0)

    assert not await close_within(fails(), "a close")
    assert await close_within(quick(), "a close")
