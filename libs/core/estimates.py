"""Estimates a scheduler believes: a performance model off by a fixed factor per model."""

from __future__ import annotations

import hashlib
import math
import random

from gpusched.libs.core.convergence import Convergence
from gpusched.libs.core.perf import ConvergenceSource, DelegatingModel, PerformanceModel

#: |log| of the largest factor `NoisyEstimates` applies (e^100, about 2.7e43)
MAX_LOG_FACTOR = 100.0


class NoisyEstimates(DelegatingModel):
    """A :class:`PerformanceModel` that believes iteration times off by a fixed factor.

    Each model's iteration time is multiplied by ``exp(sigma * z)``, with ``z`` a
    standard normal drawn deterministically from ``seed`` and the model name: the same
    model is always mis-predicted the same way, as a profiler with a systematic bias
    would. The median factor is 1, and ``sigma * z`` is clamped to
    ``+-MAX_LOG_FACTOR`` so that no sigma overflows. Everything else passes through
    unchanged, and a positive factor per model keeps the contract.
    """

    def __init__(self, base: PerformanceModel, sigma: float, seed: int = 0) -> None:
        if not sigma >= 0 or not math.isfinite(sigma):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
        super().__init__(base)
        self.sigma = sigma
        self.seed = seed
        self._factors: dict[str, float] = {}

    def factor(self, model: str) -> float:
        """The multiplier applied to ``model``'s iteration times."""
        try:
            return self._factors[model]
        except KeyError:
            pass
        digest = hashlib.sha256(f"{self.seed}/{model}".encode()).digest()
        z = random.Random(int.from_bytes(digest[:8], "big")).gauss(0.0, 1.0)
        # clamped, so that any finite sigma gives finite times that still sum finitely
        log_factor = max(-MAX_LOG_FACTOR, min(MAX_LOG_FACTOR, self.sigma * z))
        value = self._factors[model] = math.exp(log_factor)
        return value

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        exact = self.inner.iteration_time(model, batch_size, gpus, nodes, accum_steps)
        return exact * self.factor(model)

    def convergence(self, model: str) -> Convergence | None:
        """The base's convergence curve (the noise is in iteration times only), so a
        policy that reads curves sees them with noisy estimates too."""
        inner = self.inner
        return inner.convergence(model) if isinstance(inner, ConvergenceSource) else None
