"""Stopping background tasks, and closing steps, for certain.

nats-py swallows a task's cancellation in places (``Client.flush`` and the drain catch
``CancelledError`` and carry on), and so does Python 3.11's ``asyncio.wait_for`` when
the future it waits on completes in the same loop iteration as the cancel (a reply
arriving just as its task is cancelled): a loop cancelled while inside such a call goes
on to its next iteration, and one ``cancel()`` then waits forever. ``cancel_and_wait``
cancels again until the task has ended, and gives up after ``STOP_TASKS_S``.

Neither ``asyncio.timeout`` nor ``asyncio.wait_for`` bounds an await on something that
ignores its cancellation: both cancel it and then wait for it to end. ``close_within``
runs one closing step (an HTTP runner's cleanup, a NATS drain, a micro service's stop)
as a task of its own and stops waiting for it at its limit, whatever the step does, so
that its owner goes on closing the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import structlog

log = structlog.get_logger("gpusched.tasks")

#: what a cancelled task gets to finish on its own (its ``finally`` blocks may await:
#: a lease release, a drain) before it is cancelled again
GRACE_S = 5.0
#: then, seconds between two cancels of a task that is still running
RECANCEL_S = 0.5
#: the longest ``cancel_and_wait`` waits, all its cancels together, before it leaves
#: the tasks still running (cancelled) and returns
STOP_TASKS_S = 30.0
#: the longest one closing step may take before ``close_within`` goes on without it
CLOSE_STEP_S = 15.0


def _name(task: asyncio.Future[object]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


def _drop_outcome(task: asyncio.Future[object]) -> None:
    """Retrieve a finished task's outcome, so that asyncio does not report it unread."""
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()


async def cancel_and_wait(
    *tasks: asyncio.Task[object] | asyncio.Future[object], limit_s: float | None = None
) -> bool:
    """Cancel every task and return once all have ended; one still running after
    ``GRACE_S`` is cancelled again, and again, up to ``limit_s`` (``STOP_TASKS_S``) in
    all: then the ones left running are logged and left, and it returns False. Their
    outcome is dropped: a stopping owner has no use for it."""
    limit = STOP_TASKS_S if limit_s is None else limit_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    pending = {task for task in tasks if not task.done()}
    wait_s = GRACE_S
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            log.warning(
                "tasks still running after being cancelled; going on without them",
                tasks=sorted(_name(task) for task in pending), limit_s=limit,
            )
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(wait_s, left))
        wait_s = RECANCEL_S
    for task in tasks:
        if task.done():
            _drop_outcome(task)
        else:
            task.add_done_callback(_drop_outcome)
    return not pending


async def close_within(step: Awaitable[object], what: str, limit_s: float | None = None) -> bool:
    """Await one closing step for up to ``limit_s`` (``CLOSE_STEP_S``). A step still
    running then is cancelled and left, with a log line naming ``what``; an error it
    raises is logged and not raised. True when it finished without error: either way
    its owner goes on closing."""
    limit = CLOSE_STEP_S if limit_s is None else limit_s
    task = asyncio.ensure_future(step)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_drop_outcome)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_drop_outcome)
        log.warning("closing step did not finish in time; going on without it",
                    step=what, limit_s=limit)
        return False
    if task.cancelled():
        log.debug("closing step cancelled", step=what)
        return False
    error = task.exception()
    if error is not None:
        log.debug("closing step failed", step=what, error=repr(error))
        return False
    return True
