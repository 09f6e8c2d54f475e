"""Calling something again after it failed, with waits that grow.

``retry(call, delays=backoff(0.1, 2.0))`` makes one attempt per delay and, after a failed
attempt, waits that attempt's delay: an endless ``backoff`` retries until the call
succeeds, ``backoff(...)`` cut with ``itertools.islice`` bounds the attempts (and, once the
last attempt fails and its wait is over, raises that attempt's exception). A cancellation
is never retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def backoff(first_s: float, max_s: float, factor: float = 2.0) -> Iterator[float]:
    """``first_s``, then each delay ``factor`` times the one before, never above ``max_s``."""
    if not 0 < first_s <= max_s or factor < 1:
        raise ValueError(
            f"backoff: expected 0 < first_s <= max_s and factor >= 1, got "
            f"{first_s}, {max_s}, {factor}"
        )
    delay = first_s
    while True:
        yield delay
        delay = min(delay * factor, max_s)


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    delays: Iterable[float],
    on_failure: Callable[[int, Exception], object] | None = None,
) -> T:
    """The result of the first attempt of ``call`` that does not raise; ``on_failure``
    hears of each failed one (its number from 1, the exception) before the wait."""
    failure: Exception | None = None
    for attempt, delay in enumerate(delays, start=1):
        try:
            return await call()
        except Exception as exc:
            failure = exc
            if on_failure is not None:
                on_failure(attempt, exc)
        await asyncio.sleep(delay)
    if failure is None:
        raise ValueError("retry: delays is empty, so no attempt was made")
    raise failure
