"""Node agents on other machines joining the cluster ``gpusched up`` started.

Each joining node gets a NATS user of its own (``nodeagent-<node>``) with the same
permissions as ``up``'s own agents: its node's subjects only. Its password is minted
here, kept in ``<state_dir>/joined-nodes.json`` (readable by its owner only) so that the
node can join again after ``up`` restarts, and handed over as the one command the other
machine runs. ``gpusched node add NAME`` admits one while ``up`` runs: it rewrites the
servers' users file and has them reload it (SIGHUP); nobody already connected notices.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shlex
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from gpusched.libs.common.embedded import NatsServer, reload_users
from gpusched.libs.common.natsauth import Credentials, password, write_private
from gpusched.services.nodeagent.config import node_name_problem

#: what a joined machine runs; ``{url}`` carries the node's user and password
JOIN_COMMAND = "NATS_URL={url} gpusched service nodeagent --name {node}"


class JoinError(ValueError):
    """A join that cannot be admitted; the message names the field."""


class Joins:
    """The joined nodes of the cluster whose state lives in ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)

    @property
    def nodes_file(self) -> Path:
        return self.state_dir / "joined-nodes.json"

    @property
    def credentials_file(self) -> Path:
        """Every NATS user's password while ``up`` runs (as private as the server's own
        configuration, which holds the same)."""
        return self.state_dir / "nats" / "credentials.json"

    @property
    def servers_file(self) -> Path:
        """The running servers' users files and process ids; absent when none runs."""
        return self.state_dir / "nats" / "servers.json"

    # ---- read by ``up`` at start ------------------------------------------------------
    def passwords(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.nodes_file.read_text()))
        except FileNotFoundError:
            return {}

    def nodes(self) -> list[str]:
        return sorted(self.passwords())

    def admit(self, names: Iterable[str], *, taken: Iterable[str] = ()) -> dict[str, str]:
        """Every joined node's password, with ``names`` admitted (a name joined before
        keeps its password); a name of ``taken`` (this machine's own nodes) is refused."""
        own = set(taken)
        with self._locked():
            joined = self.passwords()
            for name in names:
                if name in own:
                    raise JoinError(f"join: {name!r} is one of this machine's own nodes")
                joined.setdefault(name, password())
            if joined:
                write_private(self.nodes_file, json.dumps(joined, sort_keys=True))
            # a node of an earlier run's joins that is now a local node speaks as it
            return {name: secret for name, secret in joined.items() if name not in own}

    def publish(
        self, credentials: Credentials, servers: Sequence[NatsServer], public_url: str
    ) -> None:
        """Say where the running servers are, so that ``node add`` can admit more."""
        write_private(self.credentials_file, credentials.to_json())
        write_private(self.servers_file, json.dumps({
            "url": public_url,
            "servers": [{"users_file": str(s.users_file), "pid": s.pid} for s in servers],
        }))

    def withdraw(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.servers_file.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.credentials_file.unlink()

    # ---- ``gpusched node add`` ----------------------------------------------------------
    def add(self, name: str) -> str:
        """Admit ``name`` to the running cluster; returns the command that joins it."""
        problem = node_name_problem(name)
        if problem:
            raise JoinError(f"NAME: {problem}")
        with self._locked():
            try:
                running = json.loads(self.servers_file.read_text())
                credentials = Credentials.from_json(self.credentials_file.read_text())
            except FileNotFoundError:
                raise JoinError(
                    f"no running `gpusched up` with NATS users in {self.state_dir} "
                    "(start one, or give its --state-dir)"
                ) from None
            if credentials.has_node(name):
                raise JoinError(f"NAME: node name {name!r} is already in use in this cluster")
            joined = self.passwords()
            joined[name] = password()
            credentials = credentials.with_nodes({name: joined[name]})
            write_private(self.nodes_file, json.dumps(joined, sort_keys=True))
            write_private(self.credentials_file, credentials.to_json())
            users = list(credentials.users.values())
            for server in running["servers"]:
                with contextlib.suppress(ProcessLookupError):
                    reload_users(Path(server["users_file"]), server["pid"], users)
        return self.join_command(name, credentials, running["url"])

    def join_command(self, node: str, credentials: Credentials, public_url: str) -> str:
        url = credentials.nodeagent_url(node, public_url)
        return JOIN_COMMAND.format(url=shlex.quote(url), node=shlex.quote(node))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".joins.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
