"""Measured profiles between the wire and the core: a
:class:`~gpusched.libs.common.schemas.MeasuredProfile` message holds the same fields as
the JSON file libs/core/profiles/measured.py reads, so each converts through that
document."""

from __future__ import annotations

import msgspec

from gpusched.libs.common.schemas import MeasuredProfile
from gpusched.libs.core.profiles.measured import GpuProfile, parse_profile, profile_document


def to_wire(profile: GpuProfile) -> MeasuredProfile:
    return msgspec.convert(profile_document(profile), MeasuredProfile)


def from_wire(message: MeasuredProfile, where: str = "measured profile") -> GpuProfile:
    """Raises ``MeasuredProfileError`` (a ``ValueError``) for figures the core refuses
    (a batch measured twice)."""
    return parse_profile(msgspec.to_builtins(message), where)


__all__ = ["from_wire", "to_wire"]
