"""The query parameters and headers the API reads, each checked by one pattern that the
OpenAPI document publishes as it is, so the document and the service cannot disagree."""

from __future__ import annotations

import re

from gpusched.libs.common.schemas import JobState
from gpusched.services.admission.problems import ProblemError

MAX_PAGE = 1000
DEFAULT_PAGE = 50
#: ``limit``: a whole number written in ASCII digits (its range is checked after)
LIMIT_PATTERN = r"^[0-9]{1,9}$"
STATE_NAMES = [state.value for state in JobState]


def _any_case(word: str) -> str:
    """``abc`` -> ``[Aa][Bb][Cc]``: JSON Schema patterns have no case-insensitive flag."""
    return "".join(f"[{c.upper()}{c.lower()}]" for c in word)


_ONE_STATE = " *(?:" + "|".join(_any_case(name) for name in STATE_NAMES) + ")? *"
#: ``state``: state names in any case, separated by commas, spaces around them allowed
STATE_PATTERN = f"^{_ONE_STATE}(?:,{_ONE_STATE})*$"
#: ``Idempotency-Key``: 1-255 printable ASCII characters, not starting or ending with a
#: space (HTTP trims those from header values)
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e](?:[\x20-\x7e]{0,253}[\x21-\x7e])?$"

_limit = re.compile(LIMIT_PATTERN)
_states = re.compile(STATE_PATTERN)
_idempotency_key = re.compile(IDEMPOTENCY_KEY_PATTERN)


def valid_idempotency_key(key: str) -> bool:
    return _idempotency_key.fullmatch(key) is not None


def states(raw: list[str]) -> frozenset[JobState]:
    """The states named by the ``state`` parameters (none: every state)."""
    found: set[JobState] = set()
    for value in raw:
        if _states.fullmatch(value) is None:
            raise ProblemError(
                400,
                "invalid-parameter",
                f"state: {value!r} is not a comma-separated list of {', '.join(STATE_NAMES)}",
                field="state",
                allowed=STATE_NAMES,
            )
        found.update(JobState(item.strip().upper()) for item in value.split(",") if item.strip())
    return frozenset(found)


def limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE
    if _limit.fullmatch(raw) is None or not 1 <= int(raw) <= MAX_PAGE:
        raise ProblemError(
            400,
            "invalid-parameter",
            f"limit: must be a whole number within 1..{MAX_PAGE}, got {raw!r}",
            field="limit",
        )
    return int(raw)
