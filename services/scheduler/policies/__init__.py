"""Scheduling policies: each a pure ``decide(snapshot) -> Decision``."""

from __future__ import annotations

from collections.abc import Callable

from gpusched.services.scheduler.policies.asrpt import Asrpt
from gpusched.services.scheduler.policies.auto import Auto
from gpusched.services.scheduler.policies.base import (
    Capabilities,
    Policy,
    ReportsRho,
    ResidentCapped,
    Scalable,
)
from gpusched.services.scheduler.policies.genie import Genie
from gpusched.services.scheduler.policies.ones import Ones
from gpusched.services.scheduler.policies.preemptive import Srtf, Tiresias
from gpusched.services.scheduler.policies.simple import Edf, Fifo, FifoBackfill, Sjf
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf
from gpusched.services.scheduler.policies.synergy import SYNERGY_POLICIES

POLICIES: dict[str, Callable[[], Policy]] = {
    "fifo": Fifo,
    "fifo-backfill": FifoBackfill,
    "sjf": Sjf,
    "edf": Edf,
    "genie": Genie,
    "srtf": Srtf,
    "tiresias": Tiresias,
    "asrpt": Asrpt,
    "sjf-ffs": lambda: SjfBsbf(benefit_test=False, name="sjf-ffs"),
    "sjf-bsbf": SjfBsbf,
    **SYNERGY_POLICIES,
    "ones": Ones,
    "auto": Auto,
}


def honours_priority(policy: Policy) -> bool:
    """Whether the policy orders jobs by their ``priority`` (every policy but those whose
    ``capabilities`` say otherwise)."""
    return policy.capabilities.honours_priority


class UnknownPolicyError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")


#: the policies that take ``max_resident_slowdown`` (those that share GPUs)
RESIDENT_CAP_POLICIES = tuple(
    n for n, make in POLICIES.items() if isinstance(make(), ResidentCapped)
)


def make_policy(
    name: str, time_scale: float = 1.0, max_resident_slowdown: float | None = None
) -> Policy:
    """The policy ``name``; ``time_scale`` (wall seconds per job second) turns the
    durations of a policy that has any (``Scalable``) into wall seconds;
    ``max_resident_slowdown`` caps how much a policy that shares GPUs may slow a running
    job (``ResidentCapped``), and is ignored by the others (``RESIDENT_CAP_POLICIES``)."""
    factory = POLICIES.get(name.strip().lower())
    if factory is None:
        raise UnknownPolicyError(name)
    policy = factory()
    if max_resident_slowdown is not None and isinstance(policy, ResidentCapped):
        policy = policy.with_max_resident_slowdown(max_resident_slowdown)
    if time_scale != 1.0 and isinstance(policy, Scalable):
        return policy.scaled(time_scale)
    return policy


__all__ = [
    "POLICIES",
    "RESIDENT_CAP_POLICIES",
    "Capabilities",
    "Policy",
    "ReportsRho",
    "ResidentCapped",
    "Scalable",
    "UnknownPolicyError",
    "honours_priority",
    "make_policy",
]
