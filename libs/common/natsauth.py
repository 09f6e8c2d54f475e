"""Who may publish and subscribe to what on NATS: one user per kind of service (one per
node agent), with the subjects that service really uses and nothing else.

The permissions are built from the names in :mod:`gpusched.libs.common.subjects`; docs/security.md
lists them. :func:`server_authorization` renders them as the ``authorization`` block of a
nats-server configuration file, with generated passwords (``gpusched up``) or environment
references (compose). Every user gets its own reply inbox prefix (``_INBOX_<user>``), so
one service cannot read the replies meant for another.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from gpusched.libs.common import subjects

P = subjects.PREFIX
_JS = "$JS.API"
_USER_RE = re.compile(r"^[A-Za-z0-9_-]+$")

#: admission's own buckets (the per-tenant quota ledgers, services/admission/quota.py)
ADMISSION_BUCKETS = (subjects.QUOTA_BUCKET,)

#: the JetStream streams behind gpusched's KV buckets
_BUCKETS = (
    subjects.JOBS_BUCKET,
    subjects.NODES_BUCKET,
    subjects.LEASE_BUCKET,
    subjects.LIVE_BUCKET,
    subjects.PREDICTOR_BUCKET,
)


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_keys(bucket: str) -> str:
    return f"$KV.{bucket}.*"


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive (nats-py's ``inbox_prefix``)."""
    return f"_INBOX_{user}"


#: the streams ``Stores.open`` sees to: the jobs and exits streams, and the buckets'
_STREAMS = (subjects.JOBS_STREAM, subjects.EXITS_STREAM, *(kv_stream(b) for b in _BUCKETS))


def _open_stores() -> list[str]:
    """What ``Stores.open`` asks: look up (or create, identically) the jobs and exits
    streams and the KV buckets. Creating an existing stream with the same settings
    changes nothing; changing settings needs ``STREAM.UPDATE``, which only the scheduler
    and admission have (and the predictor, for the jobs stream). Node agents have none
    of it: a stream's INFO lists its subjects on request (every job id)."""
    return [f"{_JS}.STREAM.{action}.{s}" for s in _STREAMS for action in ("INFO", "CREATE")]


def _update_stores() -> list[str]:
    return [f"{_JS}.STREAM.UPDATE.{s}" for s in _STREAMS]


def _read_bucket(bucket: str) -> list[str]:
    """Get single values of a bucket."""
    stream = kv_stream(bucket)
    return [f"{_JS}.STREAM.MSG.GET.{stream}", f"{_JS}.DIRECT.GET.{stream}",
            f"{_JS}.DIRECT.GET.{stream}.>"]


def _own_bucket(bucket: str) -> list[str]:
    """Everything on a bucket only this service uses: create, read, write."""
    stream = kv_stream(bucket)
    return [
        kv_keys(bucket),
        *(f"{_JS}.STREAM.{action}.{stream}" for action in ("INFO", "CREATE", "UPDATE")),
        *_read_bucket(bucket),
    ]


def _consume(stream: str) -> list[str]:
    """Create, inspect, pull from and delete consumers of one stream (watchers, key
    listings, the scheduler's durable consumer), and answer their flow control."""
    return [
        f"{_JS}.CONSUMER.*.{stream}",
        f"{_JS}.CONSUMER.*.{stream}.>",
        f"{_JS}.CONSUMER.MSG.NEXT.{stream}.>",
        f"{_JS}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    #: may answer requests it received (reply subjects), once each
    allow_responses: bool = False


def admission() -> Permissions:
    """Stores job records and publishes submissions and cancels; reads records, nodes,
    telemetry, and a job's state and progress for its event stream."""
    return Permissions(
        publish=(
            f"{P}.job.*.submitted",
            f"{P}.job.*.cancel",
            kv_keys(subjects.JOBS_BUCKET),
            kv_keys(subjects.LIVE_BUCKET),
            # a refused submission's record and index entry removed from a full store,
            # which takes no delete marker (admission's Submissions._withdraw)
            *(f"{_JS}.STREAM.PURGE.{kv_stream(b)}"
              for b in (subjects.JOBS_BUCKET, subjects.LIVE_BUCKET)),
            *_open_stores(),
            *_update_stores(),
            *_read_bucket(subjects.JOBS_BUCKET),
            *_read_bucket(subjects.NODES_BUCKET),
            # the dashboard and GET /healthz: who leads (the lease, its bucket's TTL) and
            # what the leader says of itself
            *_read_bucket(subjects.LEASE_BUCKET),
            f"{P}.scheduler.*.status",
            # GET /v1/predictor/size-error
            subjects.PREDICT_SIZE_ERROR,
            *(p for b in ADMISSION_BUCKETS for p in _own_bucket(b)),
            *_consume(kv_stream(subjects.JOBS_BUCKET)),
            *_consume(kv_stream(subjects.NODES_BUCKET)),
        ),
        subscribe=(
            subjects.ALL_JOB_STATES,
            subjects.ALL_JOB_PROGRESS,
            subjects.ALL_TELEMETRY,
            f"{P}.scheduler.*.decision",
        ),
    )


def scheduler() -> Permissions:
    """Consumes the jobs stream, owns the job records, the lease and the live index,
    commands node agents, asks the predictor, and serves its status endpoint."""
    return Permissions(
        publish=(
            f"{P}.node.*.command",
            subjects.ALL_JOB_STATES,
            f"{P}.scheduler.*.decision",
            f"{subjects.PREDICTOR_GROUP}.>",
            kv_keys(subjects.JOBS_BUCKET),
            kv_keys(subjects.LEASE_BUCKET),
            kv_keys(subjects.LIVE_BUCKET),
            *_open_stores(),
            *_update_stores(),
            f"{_JS}.STREAM.PURGE.{kv_stream(subjects.LIVE_BUCKET)}",
            # the stored exit of a run its node no longer lists (LiveScheduler._lost)
            f"{_JS}.STREAM.MSG.GET.{subjects.EXITS_STREAM}",
            *(p for b in (subjects.JOBS_BUCKET, subjects.NODES_BUCKET, subjects.LEASE_BUCKET,
                          subjects.LIVE_BUCKET) for p in _read_bucket(b)),
            *_consume(subjects.JOBS_STREAM),
            *_consume(subjects.EXITS_STREAM),
            *(p for b in (subjects.JOBS_BUCKET, subjects.NODES_BUCKET, subjects.LIVE_BUCKET)
              for p in _consume(kv_stream(b))),
        ),
        subscribe=(
            subjects.ALL_HEARTBEATS,
            subjects.ALL_JOB_PROGRESS,
            subjects.ALL_CPU_PROFILES,
            subjects.ALL_COMPUTE_PROFILES,
            subjects.ALL_GPU_PROFILES,
            f"{P}.scheduler.*.status",
            "$SRV.>",
        ),
        allow_responses=True,
    )


def predictor() -> Permissions:
    """Serves predictions, learns from progress and state events and job records, and
    keeps what it learned in its own bucket."""
    return Permissions(
        publish=(
            # asks a node to measure a CPU profile, and tells schedulers what it stored
            f"{P}.node.*.profile",
            subjects.ALL_CPU_PROFILES,
            # and GENIE's compute profiles
            f"{P}.node.*.compute_profile",
            subjects.ALL_COMPUTE_PROFILES,
            # the measured profile of a GPU type it stored; a node's GPU type
            subjects.ALL_GPU_PROFILES,
            *_read_bucket(subjects.NODES_BUCKET),
            # it opens the stores first under ``gpusched up``: it may turn rollup headers
            # off on a node registry made before they were refused (bus._registry)
            f"{_JS}.STREAM.UPDATE.{kv_stream(subjects.NODES_BUCKET)}",
            # each submitted job's predicted size, stored in the jobs stream; it may
            # bring a stream made before that subject up to date (``gpusched up``
            # starts the predictor first)
            subjects.ALL_JOB_PREDICTED_SIZES,
            f"{_JS}.STREAM.UPDATE.{subjects.JOBS_STREAM}",
            kv_keys(subjects.PREDICTOR_BUCKET),
            *_open_stores(),
            *_read_bucket(subjects.JOBS_BUCKET),
            *_read_bucket(subjects.PREDICTOR_BUCKET),
        ),
        subscribe=(
            f"{subjects.PREDICTOR_GROUP}.>",
            subjects.ALL_JOB_PROGRESS,
            subjects.ALL_JOB_STATES,
            # each submission's size is predicted, and scored once the job succeeds
            subjects.ALL_JOB_SUBMISSIONS,
            # what node agents measured on their GPU types
            subjects.ALL_NODE_MEASURED_PROFILES,
            "$SRV.>",
        ),
        allow_responses=True,
    )


def nodeagent(node: str) -> Permissions:
    """Receives its own node's commands only; publishes its own heartbeats, telemetry
    and registration, and the progress and exits of the jobs it runs, all under its own
    node's subjects (what it says, it says as itself). It reads no job record, no other
    node's registration, no stream (not even a stream's information: it lists subjects),
    creates none, and cannot command any node."""
    return Permissions(
        publish=(
            subjects.node_heartbeat(node),
            subjects.node_telemetry(node),
            f"$KV.{subjects.NODES_BUCKET}.{node}",
            f"{P}.node.{subjects._id(node)}.job.*.progress",
            # stored in the exits stream, a plain publish the server acknowledges
            f"{P}.node.{subjects._id(node)}.job.*.exit",
            # its GPU type's measured figures: asks what is stored, hands in what it measured
            subjects.PREDICT_MEASURED_PROFILE,
            subjects.node_measured_profile(node),
        ),
        subscribe=(
            subjects.node_command(node),
            subjects.node_profile(node),
            subjects.node_compute_profile(node),
            subjects.node_gpu_profile(node),
            *_micro_discovery(NODEAGENT_SERVICE),
        ),
        allow_responses=True,
    )


#: the NATS micro service of every node agent (services/nodeagent/command_service.py)
NODEAGENT_SERVICE = "gpusched-nodeagent"


def _micro_discovery(service: str) -> list[str]:
    """What a NATS micro service listens to besides its endpoints: PING, INFO and STATS
    for all services, for its name, and for its name and instance id. It answers on
    the request's reply subject (``allow_responses``)."""
    return [
        subject
        for verb in ("PING", "INFO", "STATS")
        for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{service}", f"$SRV.{verb}.{service}.*")
    ]


#: the reply inbox of the NATS tools (``nats micro ls``, nats.js, nats-py's default)
DEFAULT_INBOX = "_INBOX"


def tap() -> Permissions:
    """``gpusched tap`` and an operator's NATS tools: reads every gpusched subject and
    may discover the services (``$SRV.PING``/``INFO``/``STATS``, what ``nats micro ls``
    and ``nats micro stats`` send, answered on the tools' default ``_INBOX``), but
    publishes to no endpoint: it can neither submit, command nor ask a prediction."""
    discovery = [
        subject
        for verb in ("PING", "INFO", "STATS")
        for subject in (f"$SRV.{verb}", f"$SRV.{verb}.>")
    ]
    return Permissions(
        publish=tuple(discovery),
        subscribe=(subjects.EVERYTHING, f"{DEFAULT_INBOX}.>"),
    )


# ---- users and credentials ----------------------------------------------------------

NODEAGENT_USER_PREFIX = "nodeagent-"


def nodeagent_user(node: str) -> str:
    return f"{NODEAGENT_USER_PREFIX}{subjects._id(node)}"


def node_of_user(user: str) -> str | None:
    """The node a node agent user speaks for; None for any other user."""
    if user.startswith(NODEAGENT_USER_PREFIX):
        return user[len(NODEAGENT_USER_PREFIX):]
    return None


def permissions_of(user: str) -> Permissions:
    """What a user of ``gpusched up`` may do, from its name alone."""
    node = node_of_user(user)
    if node is not None:
        return nodeagent(node)
    by_name = {"admission": admission, "scheduler": scheduler, "predictor": predictor,
               "tap": tap}
    if user not in by_name:
        raise ValueError(f"user {user!r}: not a gpusched user")
    return by_name[user]()


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    permissions: Permissions
    #: when True, ``password`` names an environment variable the server reads
    password_from_env: bool = field(default=False)

    def __post_init__(self) -> None:
        if not _USER_RE.match(self.name):
            raise ValueError(f"user {self.name!r}: only letters, digits, '-' and '_'")

    def __repr__(self) -> str:  # never show a password
        return f"NatsUser({self.name!r})"


def password() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Credentials:
    """One user per service kind and per node agent, with random passwords."""

    users: dict[str, NatsUser]

    @classmethod
    def generate(cls, nodes: Iterable[str]) -> Credentials:
        made = [
            NatsUser("admission", password(), admission()),
            NatsUser("scheduler", password(), scheduler()),
            NatsUser("predictor", password(), predictor()),
            NatsUser("tap", password(), tap()),
            *(NatsUser(nodeagent_user(n), password(), nodeagent(n)) for n in nodes),
        ]
        return cls({u.name: u for u in made})

    def url(self, user: str, server_url: str) -> str:
        """``server_url`` (one URL or several, comma-separated) with ``user``'s name and
        password in each."""
        found = self.users[user]
        return with_credentials(server_url, found.name, found.password)

    def nodeagent_url(self, node: str, server_url: str) -> str:
        return self.url(nodeagent_user(node), server_url)

    def has_node(self, node: str) -> bool:
        return nodeagent_user(node) in self.users

    def with_nodes(self, passwords: Mapping[str, str]) -> Credentials:
        """These credentials and a node agent user per ``node -> password``, with the
        same permissions as any node agent's (its own node's subjects only)."""
        added = {
            nodeagent_user(node): NatsUser(nodeagent_user(node), secret, nodeagent(node))
            for node, secret in passwords.items()
        }
        return Credentials({**self.users, **added})

    def to_json(self) -> str:
        """Every user's name and password, for a private file; the permissions follow
        from the names (see :meth:`from_json`)."""
        return json.dumps({name: user.password for name, user in sorted(self.users.items())})

    @classmethod
    def from_json(cls, text: str) -> Credentials:
        made = []
        for name, secret in json.loads(text).items():
            made.append(NatsUser(name, secret, permissions_of(name)))
        return cls({u.name: u for u in made})

    def __repr__(self) -> str:
        return f"Credentials({sorted(self.users)})"


# ---- URLs -----------------------------------------------------------------------------


def split_servers(url: str) -> list[str]:
    return [part.strip() for part in url.split(",") if part.strip()]


def with_credentials(url: str, user: str, secret: str) -> str:
    out = []
    for server in split_servers(url):
        parts = urlsplit(server)
        host = parts.netloc.rsplit("@", 1)[-1]
        netloc = f"{quote(user, safe='')}:{quote(secret, safe='')}@{host}"
        out.append(urlunsplit((parts.scheme, netloc, parts.path, "", "")))
    return ",".join(out)


def credentials_in(url: str) -> tuple[list[str], str | None, str | None]:
    """The server URLs without user information, and the user and password that the
    first URL carrying them names."""
    servers: list[str] = []
    user = secret = None
    for server in split_servers(url):
        parts = urlsplit(server)
        if parts.username is not None and user is None:
            user = unquote(parts.username)
            secret = unquote(parts.password) if parts.password is not None else None
        host = parts.netloc.rsplit("@", 1)[-1]
        servers.append(urlunsplit((parts.scheme, host, parts.path, "", "")))
    return servers, user, secret


def redact(url: str) -> str:
    """A URL fit for a log line: the password replaced by ``***``."""
    servers = []
    for server in split_servers(url):
        parts = urlsplit(server)
        host = parts.netloc.rsplit("@", 1)[-1]
        if parts.username is not None:
            host = f"{parts.username}:***@{host}" if parts.password is not None else f"***@{host}"
        servers.append(urlunsplit((parts.scheme, host, parts.path, "", "")))
    return ",".join(servers)


# ---- the server's configuration -------------------------------------------------------


def _q(value: str) -> str:
    return json.dumps(value)


def _list(values: Sequence[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


def _user_block(user: NatsUser) -> str:
    perms = user.permissions
    secret = f"${user.password}" if user.password_from_env else _q(user.password)
    # its own inbox: replies, and messages to itself (``bus.settle``)
    inbox = f"{inbox_prefix(user.name)}.>"
    publish = (*perms.publish, inbox)
    subscribe = (*perms.subscribe, inbox)
    lines = [
        "    {",
        f"      user: {_q(user.name)}",
        f"      password: {secret}",
        "      permissions: {",
        f"        publish: {{ allow: {_list(publish)} }}",
        f"        subscribe: {{ allow: {_list(subscribe)} }}",
    ]
    if perms.allow_responses:
        lines.append("        allow_responses: true")
    lines += ["      }", "    }"]
    return "\n".join(lines)


def server_authorization(users: Iterable[NatsUser]) -> str:
    """The ``authorization`` block of a nats-server configuration."""
    blocks = "\n".join(_user_block(u) for u in users)
    return f"authorization {{\n  users: [\n{blocks}\n  ]\n}}\n"


# ---- private files --------------------------------------------------------------------


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only, from the moment the file
    exists: a new file is made with mode 0600 (O_EXCL, never an existing file's mode)
    and moved over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


# ---- compose ----------------------------------------------------------------------------

#: the services of compose.yaml and their node names (node agents)
COMPOSE_NODES = ("node-1", "node-2")


def password_variable(user: str) -> str:
    """The environment variable holding ``user``'s password under compose."""
    return "NATS_" + user.upper().replace("-", "_") + "_PASSWORD"


def compose_users(nodes: Iterable[str] = COMPOSE_NODES) -> list[NatsUser]:
    made = [
        ("admission", admission()),
        ("scheduler", scheduler()),
        ("predictor", predictor()),
        *((nodeagent_user(n), nodeagent(n)) for n in nodes),
    ]
    return [NatsUser(name, password_variable(name), perms, password_from_env=True)
            for name, perms in made]


def compose_config(nodes: Iterable[str] = COMPOSE_NODES) -> str:
    """compose.nats.conf: the users of compose.yaml, their passwords read by nats-server
    from its environment. Regenerate with ``python -m gpusched.libs.common.natsauth``."""
    header = (
        "# gpusched's NATS users under compose (docs/security.md). Generated by\n"
        "#   python -m gpusched.libs.common.natsauth > compose.nats.conf\n"
        "# Passwords come from the nats container's environment (compose.yaml).\n"
    )
    return header + server_authorization(compose_users(nodes))


if __name__ == "__main__":
    import sys

    # the node names of compose's agents (default: compose.yaml's two)
    print(compose_config(sys.argv[1:] or COMPOSE_NODES), end="")
