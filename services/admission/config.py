"""The admission service's settings, validated when built."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpusched.libs.common import settings
from gpusched.libs.common.settings import DEFAULT_NATS_URL, Setting, load

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 65536
#: an idle keep-alive connection is closed after this long (nginx's default)
DEFAULT_KEEPALIVE_S = 75.0
MAX_KEEPALIVE_S = 86400.0
#: the tenant of every request when no tokens are configured
OPEN_TENANT = "default"

_TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


@dataclass(frozen=True)
class AdmissionConfig:
    nats_url: str
    host: str = "127.0.0.1"
    #: 0 picks a free port (the service's ``url`` tells which)
    port: int = DEFAULT_PORT
    #: bearer token -> tenant; empty runs the API open, every request as ``OPEN_TENANT``
    tokens: Mapping[str, str] = field(default_factory=dict)
    #: tenant -> most GPUs its unfinished jobs may hold together; absent = unlimited
    quotas: Mapping[str, int] = field(default_factory=dict)
    #: tenants whose tokens export every tenant's finished jobs (GET /v1/history/export);
    #: every other route shows them their own jobs only, like any tenant
    operators: frozenset[str] = frozenset()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: research data for the performance model (which model names are known)
    data_dir: Path | None = None
    #: seconds an HTTP connection may stay idle (before its first request, or between
    #: requests) before the service closes it
    keepalive_s: float = DEFAULT_KEEPALIVE_S

    def __post_init__(self) -> None:
        if not self.nats_url or not self.nats_url.startswith(_NATS_SCHEMES):
            raise ValueError(
                f"nats_url: must start with one of {', '.join(_NATS_SCHEMES)}, "
                f"got {self.nats_url!r}"
            )
        if not self.host:
            raise ValueError("host: required")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"port: must be an integer, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be within 0..65535, got {self.port}")
        tokens = dict(self.tokens)
        for token, tenant in tokens.items():
            if not isinstance(token, str) or not token or any(c.isspace() for c in token):
                raise ValueError("tokens: a token must be a non-empty string without spaces")
            _check_tenant("tokens", tenant)
        quotas = dict(self.quotas)
        for tenant, gpus in quotas.items():
            _check_tenant("quotas", tenant)
            if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
                raise ValueError(
                    f"quotas: the quota of tenant {tenant!r} must be a whole number of "
                    f"GPUs >= 0, got {gpus!r}"
                )
        if isinstance(self.operators, str):
            raise ValueError("operators: a collection of tenant names, not one string")
        operators = frozenset(self.operators)
        for tenant in sorted(operators, key=str):
            _check_tenant("operators", tenant)
            if tokens and tenant not in tokens.values():
                raise ValueError(f"operators: tenant {tenant!r} has no token")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int):
            raise ValueError(f"max_body_bytes: must be an integer, got {self.max_body_bytes!r}")
        if not 1024 <= self.max_body_bytes <= 64 * 1024 * 1024:
            raise ValueError(
                f"max_body_bytes: must be within 1024..67108864, got {self.max_body_bytes}"
            )
        keepalive = self.keepalive_s
        if isinstance(keepalive, bool) or not isinstance(keepalive, int | float) or not (
            0 < keepalive <= MAX_KEEPALIVE_S
        ):
            raise ValueError(
                f"keepalive_s: must be a number of seconds > 0 and <= {MAX_KEEPALIVE_S:g}, "
                f"got {keepalive!r}"
            )
        data_dir = Path(self.data_dir) if self.data_dir is not None else None
        if data_dir is not None and not data_dir.is_dir():
            raise ValueError(f"data_dir: {data_dir} is not a directory")
        # copies, so a caller mutating its mapping later cannot change a running service
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "quotas", quotas)
        object.__setattr__(self, "operators", operators)
        object.__setattr__(self, "data_dir", data_dir)

    @property
    def open(self) -> bool:
        """No tokens: anyone may call the API, as tenant ``OPEN_TENANT``."""
        return not self.tokens

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AdmissionConfig:
        """Settings from ``NATS_URL``, ``GPUSCHED_HTTP_HOST``, ``GPUSCHED_HTTP_PORT``,
        ``GPUSCHED_TOKENS`` ("tok=tenant,tok2=tenant2"), ``GPUSCHED_TOKENS_FILE`` (YAML or
        JSON: ``{"tokens": {tok: tenant}, "quotas": {tenant: gpus}, "operators":
        [tenant]}``), ``GPUSCHED_QUOTAS`` ("tenant=8,other=16"), ``GPUSCHED_OPERATORS``
        ("ops,admin"), ``GPUSCHED_MAX_BODY_BYTES``, ``GPUSCHED_HTTP_KEEPALIVE_S`` and
        ``GPUSCHED_DATA_DIR``."""
        env = os.environ if environ is None else environ
        tokens: dict[str, str] = {}
        quotas: dict[str, int] = {}
        operators: set[str] = set()
        tokens_file = TOKENS_FILE.read(env)
        if tokens_file is not None:
            file_tokens, file_quotas = read_tokens_file(tokens_file)
            tokens.update(file_tokens)
            quotas.update(file_quotas)
            operators.update(read_operators(tokens_file))
        operators.update(
            name.strip() for name in env.get("GPUSCHED_OPERATORS", "").split(",") if name.strip()
        )
        for token, tenant in _pairs("GPUSCHED_TOKENS", env.get("GPUSCHED_TOKENS", "")):
            if tokens.get(token, tenant) != tenant:
                raise ValueError(
                    "GPUSCHED_TOKENS: a token is given to two tenants "
                    f"({tokens[token]!r} in GPUSCHED_TOKENS_FILE, {tenant!r} here)"
                )
            tokens[token] = tenant
        for tenant, raw in _pairs("GPUSCHED_QUOTAS", env.get("GPUSCHED_QUOTAS", "")):
            quotas[tenant] = settings.integer().parse("GPUSCHED_QUOTAS", raw)
        values: dict[str, Any] = {"nats_url": DEFAULT_NATS_URL, **load(ENVIRONMENT, env)}
        return cls(tokens=tokens, quotas=quotas, operators=frozenset(operators), **values)


#: field -> the variable ``AdmissionConfig.from_env`` reads it from (tokens and quotas,
#: which merge a file with two variables, are read by ``from_env`` itself)
ENVIRONMENT: dict[str, Setting[Any]] = {
    "nats_url": Setting("NATS_URL", settings.text()),
    "host": Setting("GPUSCHED_HTTP_HOST", settings.text()),
    "port": Setting("GPUSCHED_HTTP_PORT", settings.integer()),
    "max_body_bytes": Setting("GPUSCHED_MAX_BODY_BYTES", settings.integer()),
    "keepalive_s": Setting(
        "GPUSCHED_HTTP_KEEPALIVE_S", settings.number(0, MAX_KEEPALIVE_S, above=True)
    ),
    "data_dir": Setting("GPUSCHED_DATA_DIR", settings.path()),
}
TOKENS_FILE = Setting("GPUSCHED_TOKENS_FILE", settings.path())


def read_tokens_file(path: Path) -> tuple[dict[str, str], dict[str, int]]:
    """``{"tokens": {token: tenant}, "quotas": {tenant: gpus}}`` from a YAML or JSON file
    (JSON is YAML, so one parser reads both); its ``operators`` are `read_operators`'."""
    document = _tokens_document(path)
    where = f"GPUSCHED_TOKENS_FILE {path}"
    raw_tokens = document.get("tokens") or {}
    raw_quotas = document.get("quotas") or {}
    if not isinstance(raw_tokens, dict):
        raise ValueError(f"{where}: tokens: must map token -> tenant")
    if not isinstance(raw_quotas, dict):
        raise ValueError(f"{where}: quotas: must map tenant -> GPUs")
    tokens: dict[str, str] = {}
    for token, tenant in raw_tokens.items():
        if not isinstance(token, str) or not isinstance(tenant, str):
            raise ValueError(f"{where}: tokens: tokens and tenants must be strings")
        tokens[token] = tenant
    quotas: dict[str, int] = {}
    for tenant, gpus in raw_quotas.items():
        if not isinstance(tenant, str):
            raise ValueError(f"{where}: quotas: tenant names must be strings")
        if isinstance(gpus, bool) or not isinstance(gpus, int):
            raise ValueError(f"{where}: quotas.{tenant}: must be a whole number of GPUs")
        quotas[tenant] = gpus
    return tokens, quotas


def read_operators(path: Path) -> list[str]:
    """The ``operators`` of a tokens file: tenants whose tokens export every tenant's
    finished jobs."""
    raw = _tokens_document(path).get("operators") or []
    if not isinstance(raw, list) or not all(isinstance(name, str) for name in raw):
        raise ValueError(f"GPUSCHED_TOKENS_FILE {path}: operators: must list tenant names")
    return raw


def _tokens_document(path: Path) -> dict[Any, Any]:
    where = f"GPUSCHED_TOKENS_FILE {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    try:
        document: Any = (
            json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        )
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{where}: not valid YAML or JSON: {exc}") from exc
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ValueError(f"{where}: must hold a mapping with 'tokens' and 'quotas'")
    unknown = set(document) - {"tokens", "quotas", "operators"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))}")
    return document


def _pairs(variable: str, raw: str) -> list[tuple[str, str]]:
    pairs = []
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        # tenants hold no "=", tokens may (base64 padding): split at the last one
        key, sep, value = item.rpartition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{variable}: expected 'key=value' items separated by commas")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _check_tenant(where: str, tenant: object) -> None:
    if not isinstance(tenant, str) or not _TENANT.match(tenant):
        raise ValueError(
            f"{where}: tenant {tenant!r} must be 1-64 letters, digits or '_.@-'"
        )
