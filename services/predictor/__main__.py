"""``python -m gpusched.services.predictor``: run the predictor until SIGINT or SIGTERM, with
its settings from the environment (see :meth:`PredictorConfig.from_env`)."""

from __future__ import annotations

import asyncio
import signal
import sys

from gpusched.libs.common.logging import configure_logging
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import run


async def _main(config: PredictorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(config, stop)


def main() -> None:
    configure_logging()
    try:
        config = PredictorConfig.from_env()
    except ValueError as exc:
        sys.exit(f"predictor: {exc}")
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
