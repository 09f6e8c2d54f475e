"""``python -m gpusched.services.scheduler``: one scheduler instance (leader or hot standby),
configured from the environment (see ``SchedulerConfig.from_env``), until SIGINT or
SIGTERM; a leader releases its lease on the way out so a standby takes over at once.
With ``GPUSCHED_SCHEDULER_METRICS_PORT`` set it serves its Prometheus metrics there."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from gpusched.libs.common.logging import configure_logging
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import SchedulerService
from gpusched.services.scheduler.live.metrics import MetricsServer, endpoint_from_env


async def serve(config: SchedulerConfig, metrics: tuple[str, int] | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        service = await stack.enter_async_context(SchedulerService(config))
        if metrics is not None:
            await stack.enter_async_context(MetricsServer(service.metrics.registry, *metrics))
        await stop.wait()


def main() -> None:
    configure_logging()
    try:
        config = SchedulerConfig.from_env()
        metrics = endpoint_from_env()
    except ValueError as exc:
        print(f"gpusched scheduler: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(config, metrics))


if __name__ == "__main__":
    main()
