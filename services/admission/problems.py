"""RFC 9457 problem details: the one shape of every error the HTTP API returns."""

from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus

import msgspec
from aiohttp import web

PROBLEM_CONTENT_TYPE = "application/problem+json"
#: problem types are relative references resolved against the API's base URL
TYPE_BASE = "/problems/"


class Problem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``application/problem+json`` (RFC 9457) with two extension members: ``field``
    names the offending request field or parameter, ``quota`` the GPU quota that a
    submission would exceed."""

    type: str
    title: str
    status: int
    detail: str
    field: str | None = None
    instance: str | None = None
    quota: int | None = None
    #: the valid choices, when the field takes one of a fixed set (known models, states)
    allowed: list[str] | None = None


class ProblemError(Exception):
    """Raised anywhere in a request; the middleware turns it into the response."""

    def __init__(
        self,
        status: int,
        kind: str,
        detail: str,
        *,
        field: str | None = None,
        quota: int | None = None,
        allowed: list[str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.kind = kind
        self.detail = detail
        self.field = field
        self.quota = quota
        self.allowed = allowed
        self.headers = dict(headers or {})

    def problem(self, instance: str | None = None) -> Problem:
        return Problem(
            type=TYPE_BASE + self.kind,
            title=title(self.status),
            status=self.status,
            detail=self.detail,
            field=self.field,
            instance=instance,
            quota=self.quota,
            allowed=self.allowed,
        )


_encoder = msgspec.json.Encoder()


def title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def response(problem: Problem, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=problem.status,
        body=_encoder.encode(problem),
        headers={"Content-Type": PROBLEM_CONTENT_TYPE, **(headers or {})},
    )


_AT = re.compile(r" - at `(?:key` in `)?\$(?P<path>[^`]*)`$")
_NAMED = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]+)`")


def field_of(error: msgspec.ValidationError) -> str | None:
    """The request field a msgspec error is about: ``at `$.gpus``` -> ``gpus``,
    ``at `$.command[0]``` -> ``command[0]``, a dict value ``$.labels[...]`` -> ``labels``,
    a dict key ``at `key` in `$.labels``` -> ``labels``, and ``unknown field `x``` /
    ``missing required field `x``` -> ``x``."""
    message = str(error)
    path = ""
    at = _AT.search(message)
    if at is not None:
        path = at.group("path").replace("[...]", "").lstrip(".")
    named = _NAMED.search(message)
    if named is not None:
        path = f"{path}.{named.group('name')}" if path else named.group("name")
    return path or None


def message_of(error: msgspec.MsgspecError) -> str:
    """msgspec's message without the ``- at `$...``` suffix (the field says where)."""
    return _AT.sub("", str(error))
