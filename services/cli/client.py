"""Where the CLI finds a running cluster, and a small HTTP client for its API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.libs.common import settings
from gpusched.libs.common.settings import Setting

STATE_DIR = Setting("GPUSCHED_STATE_DIR", settings.path())
XDG_STATE_HOME = Setting("XDG_STATE_HOME", settings.path())
API_URL = Setting("GPUSCHED_URL", settings.text())
API_TOKEN = Setting("GPUSCHED_TOKEN", settings.text())
NATS_URL = Setting("NATS_URL", settings.text())


def state_dir() -> Path:
    explicit = STATE_DIR.read()
    if explicit is not None:
        return explicit
    base = XDG_STATE_HOME.read() or Path.home() / ".local" / "state"
    return base / "gpusched"


def up_file() -> Path:
    """Where the CLI looks for a running ``gpusched up``: ``up.json`` in the default
    state directory. ``up`` writes there the API address, a token, the NATS URL and its
    state directory; when started with another ``--state-dir`` it writes all that in
    that directory instead, and here only ``{"state_dir": ...}``, naming it."""
    return state_dir() / "up.json"


def read_up_file() -> dict[str, Any]:
    """What the running ``gpusched up`` wrote for the CLI, following the pointer of an
    ``up`` with another state directory; empty when there is none."""
    saved = _read_json(up_file())
    pointed = saved.get("state_dir")
    if "url" not in saved and pointed:
        saved = _read_json(Path(pointed) / "up.json")
    return saved


def _read_json(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str
    nats_url: str

    @classmethod
    def resolve(cls, url: str | None, token: str | None, nats_url: str | None = None) -> Endpoint:
        saved = read_up_file()
        return cls(
            url=(url or API_URL.read() or saved.get("url")
                 or "http://127.0.0.1:8080").rstrip("/"),
            token=token or API_TOKEN.read() or saved.get("token") or "",
            nats_url=nats_url or NATS_URL.read() or saved.get("nats_url")
            or settings.DEFAULT_NATS_URL,
        )


class ApiError(Exception):
    """A problem+json answer, or no answer at all."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field

    def __str__(self) -> str:
        message = str(self.args[0])
        # the API's details start with the field they are about ("batch_size: ..."); say
        # it once
        named = self.field is None or message.startswith(f"{self.field}:")
        where = "" if named else f"field {self.field}: "
        return f"{where}{message} (HTTP {self.status})" if self.status else message


async def call(
    endpoint: Endpoint,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    content_type: str = "application/json",
    params: dict[str, str] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Any:
    import aiohttp  # here, not above: `gpusched decode` and `tap` start without it

    headers = {"Accept": "application/json", **(extra_headers or {})}
    if endpoint.token:
        headers["Authorization"] = f"Bearer {endpoint.token}"
    if body is not None:
        headers["Content-Type"] = content_type
    try:
        async with aiohttp.ClientSession() as session, session.request(
            method, endpoint.url + path, data=body, headers=headers, params=params,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response:
            text = await response.text()
            payload: Any = json.loads(text) if text else None
            if response.status >= 400:
                detail = payload if isinstance(payload, dict) else {}
                raise ApiError(
                    response.status,
                    str(detail.get("detail") or detail.get("title") or text or response.reason),
                    detail.get("field"),
                )
            return payload
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        why = str(exc) or type(exc).__name__
        raise ApiError(0, f"cannot reach the gpusched API at {endpoint.url}: {why}") from exc
