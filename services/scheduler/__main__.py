"""``python -m services.scheduler``: one scheduler instance (leader or hot standby),
configured from the environment (see ``SchedulerConfig.from_env``), until SIGINT or
SIGTERM; a leader releases its lease on the way out so a standby takes over at once."""

from __future__ import annotations

import asyncio
import signal
import sys

from libs.common.logging import configure_logging
from services.scheduler.config import SchedulerConfig
from services.scheduler.live import SchedulerService


async def serve(config: SchedulerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SchedulerService(config):
        await stop.wait()


def main() -> None:
    configure_logging()
    try:
        config = SchedulerConfig.from_env()
    except ValueError as exc:
        print(f"gpusched scheduler: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
