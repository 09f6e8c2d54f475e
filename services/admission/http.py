"""What the API's routes (app.py) and the dashboard's (dashboard.py) share: the tenant a
request was authenticated as, the routes anyone may call, JSON and event-stream
responses, and the answer while the message bus is away."""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from aiohttp import hdrs, web

from gpusched.libs.common import codec
from gpusched.services.admission.problems import ProblemError

log = structlog.get_logger("gpusched.admission")

#: an idle event stream sends a comment this often, and re-reads the record in case a
#: terminal event was lost while NATS was away
KEEPALIVE_S = 15.0
#: progress events an event stream buffers for a slow reader before dropping them
MAX_BUFFERED_PROGRESS = 256
#: routes anyone may call (the dashboard's page and its assets hold no data)
PUBLIC_ROUTES = frozenset(
    {"/healthz", "/metrics", "/openapi.json", "/", "/dashboard.js", "/dashboard.css"}
)
EVENT_STREAM_HEADERS = {
    hdrs.CONTENT_TYPE: "text/event-stream",
    hdrs.CACHE_CONTROL: "no-cache",
    "X-Accel-Buffering": "no",
}
#: the tenant the middleware authenticated a request as
TENANT = web.RequestKey("tenant", str)
#: put into an event stream's queue when the server shuts down: the stream ends
STOP_STREAM = ("stop", b"")

_json = msgspec.json.Encoder()


def json_response(
    value: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=_json.encode(value),
        headers={hdrs.CONTENT_TYPE: "application/json", **(headers or {})},
    )


def unavailable() -> ProblemError:
    return ProblemError(
        503,
        "nats-unavailable",
        "the message bus is not reachable; nothing was changed, try again",
        headers={hdrs.RETRY_AFTER: "1"},
    )


def decode_event(data: bytes, kind: type[Any]) -> Any:
    """The event ``data`` holds, or None (logged) when it does not decode as ``kind``."""
    try:
        return codec.decode(data, kind)
    except msgspec.MsgspecError as exc:
        log.debug("undecodable event skipped", kind=kind.__name__, error=str(exc))
        return None


async def send_event(response: web.StreamResponse, event: str, data: bytes) -> None:
    """One server-sent event of type ``event``."""
    await response.write(b"event: " + event.encode() + b"\ndata: " + data + b"\n\n")
