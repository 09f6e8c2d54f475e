"""Reading the predictor's requests and answering them in their encoding: MessagePack,
or JSON when the payload starts with ``{``. A request that cannot be read answers 400
with why (header values hold one line); every answer is counted by endpoint and code."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.micro.request import Request, ServiceError

from gpusched.libs.common import codec
from gpusched.libs.common.schemas import SCHEMA_VERSION
from gpusched.services.predictor.metrics import PredictorMetrics

JSON_HEADERS = {"Content-Type": "application/json", codec.SCHEMA_HEADER: str(SCHEMA_VERSION)}

R = TypeVar("R", bound=msgspec.Struct)


class BadRequest(ValueError):
    """A request payload that cannot be read as a PredictRequest."""


def decode_as(data: bytes, headers: dict[str, str] | None, kind: type[R]) -> tuple[R, bool]:
    """A request of type ``kind`` and whether it came as JSON. Raises :class:`BadRequest`."""
    schema = (headers or {}).get(codec.SCHEMA_HEADER)
    if schema is not None and schema != str(SCHEMA_VERSION):
        raise BadRequest(
            f"{codec.SCHEMA_HEADER}: schema {schema!r} is not supported; this service speaks "
            f"{SCHEMA_VERSION}"
        )
    as_json = data.lstrip()[:1] == b"{"
    if not data.strip():
        raise BadRequest(
            "empty request: send a PredictRequest as MessagePack or JSON "
            '(e.g. {"model": "resnet50", "batch_size": 64})'
        )
    try:
        if as_json:
            return msgspec.json.decode(data, type=kind), True
        return codec.decode(data, kind), False
    except msgspec.DecodeError as exc:
        encoding = "JSON" if as_json else "MessagePack"
        raise BadRequest(f"bad {kind.__name__} ({encoding}): {exc}") from None


def decode_or_400(request: Request, kind: type[R]) -> tuple[R, bool]:
    """``decode_as`` for a service endpoint: a bad request answers 400 with why."""
    try:
        return decode_as(request.data, request.headers, kind)
    except BadRequest as exc:
        raise ServiceError("400", one_line(str(exc))) from None


def one_line(text: str) -> str:
    """Header values may not hold line breaks."""
    return " ".join(text.split())


async def serve(
    metrics: PredictorMetrics,
    endpoint: str,
    request: Request,
    work: Callable[[], Awaitable[tuple[msgspec.Struct, bool]]],
) -> None:
    """Answer what ``work`` returns (a reply and whether the request was JSON) in the
    request's encoding, counting the reply code; ``work`` raises ServiceError."""
    started = time.perf_counter()
    code = "200"
    try:
        reply, as_json = await work()
    except ServiceError as exc:
        code = exc.code
        raise
    finally:
        metrics.requests.labels(endpoint, code).inc()
        metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)
    if as_json:
        await request.respond(msgspec.json.encode(reply), headers=JSON_HEADERS)
    else:
        await request.respond(codec.encode(reply), headers=codec.headers())
