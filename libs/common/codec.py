"""MessagePack on NATS with content-type and schema-version headers."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from gpusched.libs.common.schemas import SCHEMA_VERSION

T = TypeVar("T")

CONTENT_TYPE = "application/msgpack"
SCHEMA_HEADER = "Gpusched-Schema"
HEADERS = {"Content-Type": CONTENT_TYPE, SCHEMA_HEADER: str(SCHEMA_VERSION)}

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def decode(data: bytes, kind: type[T]) -> T:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(data)


def headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**HEADERS, **(extra or {})}


def to_json_text(data: bytes) -> str:
    """Any MessagePack payload as one JSON line (for ``gpusched decode`` and ``tap``)."""
    try:
        value = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return msgspec.json.encode(data.decode("utf-8", "replace")).decode()
    return msgspec.json.encode(value).decode()
