"""The middleware every request of the admission app passes: it authenticates the
tenant (except on public routes), turns every error into a problem response (a
``ProblemError``, an aiohttp HTTP exception, NATS away or the store failing, anything
else as a 500) and counts each answered request in the metrics."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import nats.errors
import structlog
from aiohttp import hdrs, web
from nats.aio.client import Client

from gpusched.services.admission import problems
from gpusched.services.admission.auth import Authenticator
from gpusched.services.admission.config import AdmissionConfig
from gpusched.services.admission.http import PUBLIC_ROUTES, TENANT, store_failed, unavailable
from gpusched.services.admission.metrics import UNMATCHED_ROUTE, Metrics
from gpusched.services.admission.problems import ProblemError

log = structlog.get_logger("gpusched.admission")

#: the status (nginx's) of a request whose client closed its connection before the
#: answer; it never reaches the client, which is gone
CLIENT_CLOSED_REQUEST = 499

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MiddlewareParts(Protocol):
    """What the middleware reads of the admission API (app.py's ``AdmissionApi``): its
    config (the body limit), the authenticator, the connection and the metrics."""

    config: AdmissionConfig
    auth: Authenticator
    nc: Client
    metrics: Metrics


class ErrorMiddleware:
    def __init__(self, api: MiddlewareParts) -> None:
        self.api = api

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = UNMATCHED_ROUTE
        try:
            match = request.match_info
            if match.http_exception is not None:
                raise match.http_exception
            resource = match.route.resource
            route = resource.canonical if resource is not None else UNMATCHED_ROUTE
            if route not in PUBLIC_ROUTES:
                request[TENANT] = self.api.auth.tenant(request.headers.get(hdrs.AUTHORIZATION))
            response = await handler(request)
        except ProblemError as exc:
            response = problems.response(exc.problem(request.path), exc.headers)
        except web.HTTPException as exc:
            response = self._http_problem(request, exc)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("nats unavailable", path=request.path, error=repr(exc))
            failure = (
                store_failed(exc, "nothing was changed, try again")
                if self.api.nc.is_connected else unavailable()
            )
            response = problems.response(failure.problem(request.path), failure.headers)
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                # the client closed its connection (e.g. mid-body): nobody to answer, and
                # no fault of the service; not counted as a request answered
                log.info("client went away", method=request.method, path=request.path,
                         error=str(exc))
                return web.Response(status=CLIENT_CLOSED_REQUEST)
            log.exception("request failed", method=request.method, path=request.path)
            response = problems.response(
                ProblemError(500, "internal", "the server failed; see its log").problem(
                    request.path
                )
            )
        self.api.metrics.observe(
            request.method, route, response.status, time.perf_counter() - started
        )
        return response

    def _http_problem(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        headers = {
            name: value
            for name, value in exc.headers.items()
            if name not in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH)
        }
        if exc.status == 404:
            detail = f"no such resource: {request.path}"
            kind = "not-found"
        elif exc.status == 405:
            detail = f"{request.method} is not allowed here; allowed: {headers.get('Allow', '')}"
            kind = "method-not-allowed"
        elif exc.status == 413:
            detail = f"the body is larger than {self.api.config.max_body_bytes} bytes"
            kind = "payload-too-large"
        else:
            detail = exc.text or exc.reason
            kind = exc.reason.lower().replace(" ", "-")
        problem = ProblemError(exc.status, kind, detail).problem(request.path)
        return problems.response(problem, headers)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
