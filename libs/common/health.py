"""A heartbeat file saying that a service is alive and connected to NATS, for container
health checks: ``python -m gpusched.libs.common.health [--file PATH] [--max-age S]``.

With ``GPUSCHED_HEALTH_FILE`` set, every NATS client made by ``gpusched.libs.common.bus.connect``
is watched: every ``GPUSCHED_HEALTH_EVERY_S`` seconds (default 5) the file is rewritten,
as long as the process's event loop runs and each of its open clients is connected. A
stuck loop, or a client that lost NATS, stops the beats, and the check fails once the
file is older than ``--max-age`` (default 30 s). Without the variable nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from nats.aio.client import Client

from gpusched.libs.common import settings
from gpusched.libs.common.settings import Setting

FILE = Setting("GPUSCHED_HEALTH_FILE", settings.path())
EVERY_S = Setting("GPUSCHED_HEALTH_EVERY_S", settings.number(0, above=True))
DEFAULT_EVERY_S = 5.0
DEFAULT_MAX_AGE_S = 30.0

_clients: weakref.WeakSet[Client] = weakref.WeakSet()
_beats: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
    weakref.WeakKeyDictionary()
)


def watch(nc: Client, environ: Mapping[str, str] | None = None) -> None:
    """Count ``nc`` in this process's heartbeat, when ``GPUSCHED_HEALTH_FILE`` is set
    (a bad ``GPUSCHED_HEALTH_EVERY_S`` raises ``SettingError`` naming it)."""
    path = FILE.read(environ)
    if path is None:
        return
    every = EVERY_S.read(environ) or DEFAULT_EVERY_S
    _clients.add(nc)
    loop = asyncio.get_running_loop()
    beat = _beats.get(loop)
    if beat is None or beat.done():
        _beats[loop] = loop.create_task(_beat(path, every), name="health-file")


async def _beat(path: Path, every_s: float) -> None:
    while True:
        open_clients = [c for c in list(_clients) if not c.is_closed]
        if not open_clients:
            return  # the service stopped; a new client starts the beats again
        if all(c.is_connected for c in open_clients):
            _touch(path)
        await asyncio.sleep(every_s)


def _touch(path: Path) -> None:
    # written aside and moved into place: a check never reads a half-written file
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(f"{time.time()}\n")
    os.replace(partial, path)


def problem(path: Path, max_age_s: float, now: float | None = None) -> str | None:
    """Why the heartbeat at ``path`` says unhealthy, or None when it is fresh."""
    try:
        written = path.stat().st_mtime
    except FileNotFoundError:
        return f"no heartbeat at {path}: not connected to NATS yet, or not started"
    age = (time.time() if now is None else now) - written
    if age > max_age_s:
        return f"last heartbeat {age:.0f} s ago (more than {max_age_s:g} s): NATS lost or stuck"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpusched.libs.common.health", description=__doc__
    )
    parser.add_argument("--file", type=Path, default=None,
                        help="heartbeat file (default: GPUSCHED_HEALTH_FILE)")  # fmt: skip
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                        help="seconds a heartbeat stays fresh (default 30)")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.max_age > 0:
        parser.error("--max-age: must be > 0")
    try:
        path = args.file or FILE.read()
    except ValueError as exc:
        parser.error(str(exc))
    if path is None:
        parser.error("--file: required when GPUSCHED_HEALTH_FILE is not set")
    why = problem(path, args.max_age)
    if why is not None:
        print(f"unhealthy: {why}", file=sys.stderr)
        raise SystemExit(1)
    print("healthy")


if __name__ == "__main__":
    main()
