"""The admission service: NATS connection, stores and the HTTP server, started and
stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterable
from types import TracebackType

import structlog
from aiohttp import web
from nats.aio.client import Client

from gpusched.libs.common.bus import Stores, close_connection, connect
from gpusched.libs.common.tasks import STOP_TASKS_S, close_within
from gpusched.services.admission.app import make_app
from gpusched.services.admission.config import AdmissionConfig

log = structlog.get_logger("gpusched.admission")

NATS_CLIENT_NAME = "gpusched-admission"
#: requests still running at shutdown get this long before they are cancelled
SHUTDOWN_TIMEOUT_S = 5.0
#: the longest the HTTP server's cleanup may take: its requests get SHUTDOWN_TIMEOUT_S,
#: then the app's background tasks are stopped (up to STOP_TASKS_S)
CLEANUP_S = SHUTDOWN_TIMEOUT_S + STOP_TASKS_S + 5.0


class AdmissionService:
    """``async with AdmissionService(config) as service:`` serves the HTTP API at
    ``service.url`` until the block ends.

    ``models`` overrides the model names jobs may use (default: the performance model of
    ``config.data_dir``)."""

    def __init__(self, config: AdmissionConfig, *, models: Iterable[str] | None = None) -> None:
        self.config = config
        self._models = tuple(models) if models is not None else None
        self._nc: Client | None = None
        self._runner: web.AppRunner | None = None
        self.app: web.Application | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the admission service is not running")
        host = self.config.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> AdmissionService:
        self._nc = await connect(self.config.nats_url, NATS_CLIENT_NAME)
        try:
            stores = await Stores.open(self._nc)
            self.app = make_app(self.config, self._nc, stores, models=self._models)
            self._runner = web.AppRunner(
                self.app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                # aiohttp's own default keeps an idle connection an hour
                keepalive_timeout=self.config.keepalive_s,
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.config.host, self.config.port)
            await site.start()
            self.port = _bound_port(self._runner, self.config.port)
        except BaseException:
            await self._close()
            raise
        log.info("admission service listening", url=self.url, open=self.config.open)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        """Each step bounded (libs/common/tasks.py): one that hangs is logged and the
        rest still close."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await close_within(runner.cleanup(), "admission: HTTP server cleanup", CLEANUP_S)
        if self._nc is not None:
            nc, self._nc = self._nc, None
            await close_connection(nc, "admission")
        self.port = None


def _bound_port(runner: web.AppRunner, configured: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return configured


async def serve(config: AdmissionConfig) -> None:
    """Runs the service until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    async with AdmissionService(config):
        await stop.wait()
