"""GENIE's profiling run on a node: a model's compute time per iteration and size, and
the node's links, measured with the real worker.

One fresh process (``python -m gpusched.services.nodeagent.compute_profiling``) trains the
worker's :class:`~gpusched.services.nodeagent.worker.training.Trainer` for the model on one GPU
(on a node with emulated GPUs, the CPU) with the worker's own ``--profile`` measurement
(:func:`gpusched.services.nodeagent.worker.profiling.profile_batch`: a fresh model, a few warm-up
iterations, then ``iterations`` timed, 20 by default, their median counting: a busy
machine's pauses would land in a mean) at the requested batch and at its half, so the
compute time of any per-GPU batch follows from a line through the two
(services/predictor/compute_profiles.py). As the worker's ``--profile`` does, it times
the model's own work: the input pipeline's decode and augmentation work per sample is
the CPU profile's concern, not this one's. The model's size is its trainable
parameters' bytes, which is what one all-reduce of its gradients carries.

With ``links``, the same process then measures the node's links: it starts a second
process and the two join a gloo process group over the node's advertised address, then
all-reduce float32 tensors of a few sizes (4 KiB to 16 MiB), each timed
``link_repeats`` times after a warm-up; each size's best time is a point
(libs/core/platform.py fits latency and bandwidth to them). Both ranks are on this
node, so this measures a link between two ranks of one node. On an emulated cluster
all nodes are on this machine and traffic between them crosses the same loopback: the
agent says so (``shared_machine``, taken when its GPUs are emulated), and the platform
model then uses the measurement for the inter-node link too. It is loopback either way,
not a network: on real GPUs the intra-node link is NVLink or PCIe under NCCL, which this
gloo measurement does not see.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.libs.common.schemas import (
    ComputePoint,
    ComputeProfile,
    ComputeProfileRequest,
    LinkPoint,
    LinkProfile,
    NodeInfo,
)
from gpusched.services.nodeagent.cpu_profiling import run_measuring_process

#: float32 all-reduce sizes of a link measurement, bytes
LINK_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
LINK_BACKEND = "gloo"


class ComputeProfilingError(RuntimeError):
    """The profile could not be measured (unknown model, the process failed)."""


@dataclass(frozen=True, slots=True)
class ComputeSettings:
    """``warmup`` iterations before the timed ones; ``link_repeats`` timed all-reduces
    per size (best counts); the process is killed after ``timeout_s``."""

    warmup: int = 3
    link_repeats: int = 5
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.link_repeats < 1:
            raise ValueError(f"link_repeats must be >= 1, got {self.link_repeats}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def profiled_batches(batch_size: int) -> list[int]:
    """The batch and its half (rounded down), one point when the half is 0: 64 -> [64, 32]."""
    return [batch_size] if batch_size < 2 else [batch_size, batch_size // 2]


async def measure_compute_profile(
    request: ComputeProfileRequest,
    batch_size: int,
    node: NodeInfo,
    address: str,
    settings: ComputeSettings | None = None,
) -> ComputeProfile:
    """Measure ``request.model`` at ``batch_size`` on ``node`` (on its first GPU, or the
    CPU when its GPUs are emulated), and its links over ``address`` when asked."""
    from gpusched.services.nodeagent.worker.catalog import UnknownModelNameError, zoo_model_for

    settings = settings or ComputeSettings()
    try:
        zoo_model_for(request.model)
    except UnknownModelNameError as exc:
        raise ComputeProfilingError(str(exc)) from None
    device = "cpu" if node.emulated or not node.gpus else "cuda"
    env = dict(os.environ)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = node.gpus[0].uuid
    arguments = [
        "--model", request.model, "--device", device,
        "--batch-sizes", ",".join(map(str, profiled_batches(batch_size))),
        "--iterations", str(request.iterations), "--warmup", str(settings.warmup),
    ]  # fmt: skip
    if request.links:
        arguments += ["--links", "--address", address, "--repeats", str(settings.link_repeats)]
    measured = await run_measuring_process(
        "gpusched.services.nodeagent.compute_profiling", arguments, env, settings.timeout_s,
        failed=lambda why: ComputeProfilingError(f"profiling {request.model} {why}"),
        own_group=True,  # the measuring process and its peer of the link measurement
    )  # fmt: skip
    now = time.time()
    links = None
    if measured["links"] is not None:
        links = LinkProfile(
            node=node.name, measured_at=now, backend=LINK_BACKEND, address=address,
            shared_machine=node.emulated,
            points=[LinkPoint(*p) for p in measured["links"]],
        )  # fmt: skip
    return ComputeProfile(
        model=request.model, node=node.name, measured_at=now, device=device,
        iterations=request.iterations, points=[ComputePoint(*p) for p in measured["points"]],
        model_bytes=measured["model_bytes"], links=links,
    )  # fmt: skip


# ---- the measuring process ----------------------------------------------------------


def _compute(
    model: str, batches: list[int], iterations: int, warmup: int, device: str
) -> tuple[list[list[float]], int]:
    from gpusched.services.nodeagent.worker.catalog import ModelSpec
    from gpusched.services.nodeagent.worker.profiling import profile_batch
    from gpusched.services.nodeagent.worker.training import TrainingOptions

    spec = ModelSpec.for_model(model)
    points: list[list[float]] = []
    model_bytes = 0
    for batch in batches:
        result = profile_batch(
            spec, batch, device=device, accum_steps=1, warmup=warmup, repeats=iterations,
            options=TrainingOptions(),
        )  # fmt: skip
        if "error" in result:
            continue  # out of memory at this batch
        points.append([batch, result["median_iteration_s"]])
        model_bytes = result["parameter_bytes"]
    if not points:
        raise ComputeProfilingError(f"{model}: every batch of {batches} ran out of memory")
    return points, model_bytes


def _allreduces(rank: int, store: Any, sizes: Sequence[int], repeats: int) -> list[float]:
    """Join the two-rank gloo group through ``store`` and time all-reduces of each size
    (seconds, best of ``repeats`` after one warm-up; both ranks start each together)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        LINK_BACKEND, store=store, rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        best = []
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32)
            dist.all_reduce(tensor)
            times = []
            for _ in range(repeats):
                dist.barrier()
                began = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - began)
            best.append(min(times))
        return best
    finally:
        dist.destroy_process_group()


def _links(address: str, sizes: Sequence[int], repeats: int) -> list[list[float]]:
    """Rank 0: start the peer, measure, wait for it."""
    from torch.distributed import TCPStore

    store = TCPStore(
        address, 0, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False
    )
    peer = subprocess.Popen(
        [sys.executable, "-m", "gpusched.services.nodeagent.compute_profiling", "--peer",
         "--address", address, "--port", str(store.port), "--repeats", str(repeats),
         "--sizes", ",".join(map(str, sizes))],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        seconds = _allreduces(0, store, sizes, repeats)
        if peer.wait(timeout=120) != 0:
            raise ComputeProfilingError(f"the link peer exited {peer.returncode}")
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    return [[size, s] for size, s in zip(sizes, seconds, strict=True)]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpusched.services.nodeagent.compute_profiling",
        description="Measure a model's compute seconds per iteration on one device at "
        "given batches and its parameter bytes, and optionally all-reduces between two "
        "local ranks; prints one JSON line.",
    )
    defaults = ComputeSettings()
    parser.add_argument("--model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=_ints, default=[])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--links", action="store_true", help="also measure the links")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--repeats", type=int, default=defaults.link_repeats)
    parser.add_argument("--sizes", type=_ints, default=list(LINK_SIZES))
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        from torch.distributed import TCPStore

        store = TCPStore(args.address, args.port, 2, False,
                         timeout=datetime.timedelta(seconds=120))  # fmt: skip
        _allreduces(1, store, args.sizes, args.repeats)
        return 0
    if not args.model or not args.batch_sizes:
        parser.error("--model and --batch-sizes are required")
    points, model_bytes = _compute(
        args.model, args.batch_sizes, args.iterations, args.warmup, args.device
    )
    links = _links(args.address, args.sizes, args.repeats) if args.links else None
    print(json.dumps({"points": points, "model_bytes": model_bytes, "links": links}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
