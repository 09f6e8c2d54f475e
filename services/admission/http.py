"""What the API's modules (app.py, middleware.py, submission.py, jobs.py, ops.py) and the
dashboard's (dashboard.py) share: the tenant a request was authenticated as, the routes
anyone may call, JSON and event-stream responses, the answer while the message bus is
away, and the answer when the store fails a call while it is reachable."""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from aiohttp import hdrs, web

from gpusched.libs.common import codec
from gpusched.services.admission.probe import store_error
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
#: JetStream's error code for a store out of room (its limit, or its disk)
INSUFFICIENT_RESOURCES = 10023
#: when to try again after the store refused a write: a full disk takes a while to free
STORE_RETRY_AFTER = "5"

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


def store_failed(exc: Exception, outcome: str) -> ProblemError:
    """The 503 of a NATS call that failed while connected: the store is full, did not
    answer, or refused the write; ``outcome`` says what became of the request."""
    if getattr(exc, "err_code", None) == INSUFFICIENT_RESOURCES:
        kind, why = "store-full", "the job store is full (JetStream: insufficient resources)"
    elif isinstance(exc, TimeoutError):
        kind, why = "store-unavailable", (
            "the job store did not answer in time (its disk may be full, or a NATS server "
            "down)"
        )
    else:
        kind, why = "store-unwritable", f"the job store refused the write ({store_error(exc)})"
    return ProblemError(503, kind, f"{why}; {outcome}",
                        headers={hdrs.RETRY_AFTER: STORE_RETRY_AFTER})


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
