"""The retry helper: one attempt per delay, the delay waited after each failure."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import pytest

from gpusched.libs.common import retry as retry_module
from gpusched.libs.common.retry import backoff, retry


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waited: list[float] = []

    async def sleep(delay: float) -> None:
        waited.append(delay)

    monkeypatch.setattr(retry_module.asyncio, "sleep", sleep)
    return waited


def failing(times: int) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def call() -> str:
        calls.append(len(calls) + 1)
        if len(calls) <= times:
            raise ConnectionError(f"attempt {len(calls)}")
        return "done"

    return calls, call


def test_backoff_doubles_up_to_its_ceiling():
    assert list(itertools.islice(backoff(0.1, 0.5), 5)) == [0.1, 0.2, 0.4, 0.5, 0.5]


@pytest.mark.parametrize(("first", "ceiling", "factor"), [(0, 1, 2), (2, 1, 2), (0.1, 1, 0.5)])
def test_backoff_refuses_nonsense(first: float, ceiling: float, factor: float):
    with pytest.raises(ValueError, match="backoff"):
        backoff(first, ceiling, factor).__next__()


async def test_a_call_is_retried_until_it_succeeds_waiting_after_each_failure(waits):
    calls, call = failing(3)
    heard: list[tuple[int, str]] = []

    result = await retry(
        call, delays=backoff(0.1, 2.0), on_failure=lambda n, exc: heard.append((n, str(exc)))
    )

    assert result == "done" and calls == [1, 2, 3, 4]
    assert waits == [0.1, 0.2, 0.4]
    assert heard == [(1, "attempt 1"), (2, "attempt 2"), (3, "attempt 3")]


async def test_bounded_attempts_raise_the_last_failure_after_its_wait(waits):
    calls, call = failing(10)

    with pytest.raises(ConnectionError, match="attempt 3"):
        await retry(call, delays=itertools.islice(backoff(0.05, 0.5), 3))

    assert calls == [1, 2, 3] and waits == [0.05, 0.1, 0.2]


async def test_a_cancellation_is_not_retried():
    calls: list[int] = []

    async def call() -> None:
        calls.append(1)
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retry(call, delays=backoff(0.01, 0.01))
    assert calls == [1]
