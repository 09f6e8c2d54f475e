"""structlog, configured once: readable on a TTY, JSON lines otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time, not the one seen at configuration
    (a test runner or an embedding program may swap it and close the old one)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    name = (level or os.environ.get("GPUSCHED_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelNamesMapping().get(name, logging.INFO)
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=_CurrentStderr())
