"""Stopping background tasks for certain.

nats-py swallows a task's cancellation in places (``Client.flush`` and the drain catch
``CancelledError`` and carry on), so a loop cancelled while inside such a call goes on
to its next iteration, and one ``cancel()`` then waits forever. ``cancel_and_wait``
cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib

#: what a cancelled task gets to finish on its own (its ``finally`` blocks may await:
#: a lease release, a drain) before it is cancelled again
GRACE_S = 5.0
#: then, seconds between two cancels of a task that is still running
RECANCEL_S = 0.5


async def cancel_and_wait(*tasks: asyncio.Task[object] | asyncio.Future[object]) -> None:
    """Cancel every task and return once all have ended; one still running after
    ``GRACE_S`` is cancelled again, and again. Their outcome is dropped: a stopping owner
    has no use for it."""
    pending = {task for task in tasks if not task.done()}
    wait_s = GRACE_S
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait_s)
        wait_s = RECANCEL_S
    for task in tasks:
        if task.done() and not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()
