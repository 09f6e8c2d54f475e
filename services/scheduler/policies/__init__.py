"""Scheduling policies: each a pure ``decide(snapshot) -> Decision``."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.policies.base import Policy
from services.scheduler.policies.preemptive import Srtf, Tiresias
from services.scheduler.policies.simple import Fifo, Sjf
from services.scheduler.policies.sjf_bsbf import SjfBsbf

POLICIES: dict[str, Callable[[], Policy]] = {
    "fifo": Fifo,
    "sjf": Sjf,
    "srtf": Srtf,
    "tiresias": Tiresias,
    "sjf-ffs": lambda: SjfBsbf(benefit_test=False, name="sjf-ffs"),
    "sjf-bsbf": SjfBsbf,
}


class UnknownPolicyError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")


def make_policy(name: str, time_scale: float = 1.0) -> Policy:
    """The policy ``name``; ``time_scale`` (wall seconds per job second) turns the
    durations of a policy that has any (``scaled``) into wall seconds."""
    factory = POLICIES.get(name.strip().lower())
    if factory is None:
        raise UnknownPolicyError(name)
    policy = factory()
    scaled = getattr(policy, "scaled", None)
    if time_scale != 1.0 and scaled is not None:
        return scaled(time_scale)
    return policy


__all__ = ["POLICIES", "Policy", "UnknownPolicyError", "make_policy"]
