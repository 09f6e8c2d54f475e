"""GENIE's platform model: what an all-reduce of a model's gradients costs at a
placement, from measured (or configured) link bandwidth and latency.

Our design, not the paper's (its text is not available; DESIGN.md section 5 says
"measured intra- and inter-node bandwidth and latency", all-reduce is our assumption):

- **Ring all-reduce.** The time of ``bytes`` over ``gpus`` GPUs on ``nodes`` servers is
  the built-in profiles' formula, :meth:`gpusched.libs.core.profiles.builtin.Network.allreduce_s`
  (each GPU sends ``2 (g - 1) / g`` of the bytes; a ring inside one server runs at the
  intra-node bandwidth, one that leaves it at the inter-node bandwidth, and every extra
  server adds an inter-node latency in each of the ring's two phases), plus what that
  formula leaves out, the latency of the hops inside the servers: every GPU beyond the
  first of its server adds an intra-node latency in each phase, ``2 (g - k)`` of them
  for ``g`` GPUs on ``k`` servers.
- **A link between servers is never faster than one inside a server**: where the
  configured inter-node figures beat the intra-node ones (the built-in 12.5 GB/s network
  against a measured loopback of a few GB/s), the intra-node figure counts, so spanning
  more servers never makes an iteration faster (the performance-model contract).
- **Fit.** A measured link is a set of all-reduces of a few sizes between two ranks;
  ``t = a + b x`` by least squares, read through the model of two ranks on one server
  (``t = 2 latency + x / bandwidth``): ``latency = a / 2``, ``bandwidth = 1 / b``.
- **Prediction.** An iteration of a data-parallel job is its compute time on one GPU
  (at its per-GPU batch, from a profiling run) plus the all-reduce of its parameter
  bytes, not overlapped (as the built-in profiles add them): :meth:`PlatformModel.predict`
  gives the iteration time and the communication latency in it, and
  :meth:`PlatformModel.placements` both at every placement of n GPUs over k servers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from gpusched.libs.core.profiles.builtin import Network, ring_factor

#: bytes in the built-in network's megabyte (``Network.allreduce_s`` takes MB)
BYTES_PER_MB = 1e6
#: the two ranks of a link measurement
LINK_RANKS = 2


def _check(name: str, value: float, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkFit:
    """A link's fitted figures: latency per hop and phase, bandwidth, and how far the
    measurements lie from the line (root mean square, seconds)."""

    latency_s: float
    gb_per_s: float
    rms_error_s: float = 0.0

    def __post_init__(self) -> None:
        _check("latency_s", self.latency_s, positive=False)
        _check("gb_per_s", self.gb_per_s, positive=True)
        _check("rms_error_s", self.rms_error_s, positive=False)


def fit_link(points: Sequence[tuple[float, float]]) -> LinkFit:
    """Fit ``(bytes, seconds)`` all-reduces between two ranks of one server (see the
    module). A negative intercept (noise on a busy machine) is refitted through the
    origin: latency 0. Raises ``ValueError`` (naming ``points``) for fewer than two
    sizes, or times that do not grow with the bytes."""
    if len({x for x, _ in points}) < 2:
        raise ValueError(f"points: need all-reduces of at least two sizes, got {len(points)}")
    for x, t in points:
        _check("points: bytes", x, positive=True)
        _check("points: seconds", t, positive=True)
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / sxx
    intercept = mean_t - slope * mean_x
    if intercept < 0:
        slope = sum(x * t for x, t in points) / sum(x * x for x, _ in points)
        intercept = 0.0
    if not slope > 0:
        raise ValueError("points: the all-reduce time does not grow with the bytes")
    rms = math.sqrt(sum((intercept + slope * x - t) ** 2 for x, t in points) / n)
    return LinkFit(
        latency_s=intercept / (2 * (LINK_RANKS - 1)),
        gb_per_s=ring_factor(LINK_RANKS) / slope / 1e9,
        rms_error_s=rms,
    )


class Predicted(NamedTuple):
    """One placement's prediction: seconds per iteration, and the communication latency
    (the all-reduce) in it."""

    iteration_s: float
    latency_s: float

    @property
    def rate(self) -> float:
        """Iterations per second."""
        return 1.0 / self.iteration_s


@dataclass(frozen=True, slots=True)
class PlatformModel:
    """Link figures inside a server and between servers (GB/s, seconds per hop)."""

    intra_gb_s: float
    intra_latency_s: float
    inter_gb_s: float
    inter_latency_s: float
    #: the built-in formula with the effective figures (see the module)
    _network: Network = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check("intra_gb_s", self.intra_gb_s, positive=True)
        _check("intra_latency_s", self.intra_latency_s, positive=False)
        _check("inter_gb_s", self.inter_gb_s, positive=True)
        _check("inter_latency_s", self.inter_latency_s, positive=False)
        network = Network(
            intra_node_gb_per_s=self.intra_gb_s,
            inter_node_gb_per_s=min(self.inter_gb_s, self.intra_gb_s),
            inter_node_latency_s=max(self.inter_latency_s, self.intra_latency_s),
        )
        object.__setattr__(self, "_network", network)

    @classmethod
    def configured(cls, network: Network, intra_latency_s: float = 0.0) -> PlatformModel:
        """The figures of a configured network (the built-in profiles' ``network``),
        which gives no intra-node latency."""
        return cls(
            network.intra_node_gb_per_s, intra_latency_s,
            network.inter_node_gb_per_s, network.inter_node_latency_s,
        )  # fmt: skip

    @classmethod
    def measured(cls, intra: LinkFit, inter: LinkFit | None, network: Network) -> PlatformModel:
        """Measured intra-node figures; inter-node ones measured where there are, else
        ``network``'s configured ones."""
        if inter is None:
            return cls(
                intra.gb_per_s, intra.latency_s,
                network.inter_node_gb_per_s, network.inter_node_latency_s,
            )  # fmt: skip
        return cls(intra.gb_per_s, intra.latency_s, inter.gb_per_s, inter.latency_s)

    def allreduce_s(self, nbytes: float, gpus: int, nodes: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``gpus`` GPUs on ``nodes``
        servers (0 for one GPU)."""
        if gpus < 1 or nodes < 1 or nodes > gpus:
            raise ValueError(f"{gpus} GPUs cannot span {nodes} nodes")
        _check("nbytes", nbytes, positive=False)
        if gpus == 1:
            return 0.0
        hops = self._network.allreduce_s(nbytes / BYTES_PER_MB, gpus, nodes)
        return hops + 2 * (gpus - nodes) * self.intra_latency_s

    def predict(self, compute_s: float, model_bytes: float, gpus: int, nodes: int) -> Predicted:
        """An iteration of ``compute_s`` per GPU whose gradients (``model_bytes``) are
        all-reduced over ``gpus`` GPUs on ``nodes`` servers."""
        _check("compute_s", compute_s, positive=True)
        latency = self.allreduce_s(model_bytes, gpus, nodes)
        return Predicted(compute_s + latency, latency)

    def placements(
        self, compute_s: Callable[[int], float], model_bytes: float, gpus_per_node: int,
        nodes: int,
    ) -> dict[tuple[int, int], Predicted]:  # fmt: skip
        """The prediction at every placement ``(n, k)`` of n GPUs over k of ``nodes``
        servers of ``gpus_per_node`` GPUs; ``compute_s(n)`` is the compute time per GPU
        at n GPUs (the per-GPU batch shrinks as n grows)."""
        if gpus_per_node < 1 or nodes < 1:
            raise ValueError(f"need servers with GPUs, got {nodes} x {gpus_per_node}")
        table = {}
        for n in range(1, gpus_per_node * nodes + 1):
            for k in range(-(-n // gpus_per_node), min(n, nodes) + 1):
                table[n, k] = self.predict(compute_s(n), model_bytes, n, k)
        return table


__all__ = ["LinkFit", "PlatformModel", "Predicted", "fit_link"]
