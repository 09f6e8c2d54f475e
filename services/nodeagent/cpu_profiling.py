"""Synergy's optimistic profiling on a node: how a model's training speed depends on CPU
cores and host memory, measured with the real worker.

One fresh process (``python -m gpusched.services.nodeagent.cpu_profiling``) builds the worker's
:class:`~gpusched.services.nodeagent.worker.training.Trainer` for the model on the CPU, with the
input pipeline the model really has (its decode and augmentation passes per sample, see
``cpu_cost_for``), and trains it at CPU counts halving from all the node's cores (all,
all/2, ..., 1). For each count it pins all its threads to the machine's cores behind
that many node cores (``os.sched_setaffinity``, as the agent pins a run; emulated cores
wrap around the machine's) and gives the trainer that many cores (pipeline worker
processes, forked after the pinning, and torch threads follow them), then times
training iterations twice:

- with the data set's decoded samples all cached (the first pass over the small data
  set of the profile fills the cache), and
- with an empty cache (every sample decoded again).

Each point is the best of ``rounds`` passes over the counts (a busy machine only slows
a run down, so the fastest pass is the closest to the work itself). The result is a
:class:`~gpusched.libs.common.schemas.CpuProfile`: seconds per sample at each count, cached and
not, plus what the worker holds besides its cache and what caching the whole data set
of the default size takes; libs/common/cpu_sensitivity.py turns it into Synergy's
best-case vector and speed-ups (the memory axis follows from the cache model there).

Profiling shares the node's cores with the runs there, like any job; it is cheap (a
few seconds: one torch start, a few dozen small iterations per point).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.libs.common.schemas import CpuProfile, CpuProfilePoint, NodeInfo
from gpusched.services.nodeagent.cores import real_cores

GIB = 2**30


class CpuProfilingError(RuntimeError):
    """The profile could not be measured (unknown model, the process failed)."""


async def run_measuring_process(
    module: str,
    arguments: Sequence[str],
    env: dict[str, str],
    timeout_s: float,
    *,
    failed: Callable[[str], Exception],
    own_group: bool = False,
) -> Any:
    """Run ``python -m module arguments`` and return the JSON of its last output line.

    Killed after ``timeout_s`` or when the caller is cancelled, with the processes it
    started too where it runs as its own process group (``own_group``); a non-zero exit
    raises ``failed("exited N: <last lines of its stderr>")``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *arguments,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=own_group,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            if own_group:
                os.killpg(process.pid, 9)
            else:
                process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise failed(f"exited {process.returncode}: {' | '.join(tail)}")
    return json.loads(out.decode().strip().splitlines()[-1])


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """How much a profile measures: ``iterations`` timed per point and cache state, of
    ``batch_size`` samples, over a data set of ``dataset_size`` samples, best of
    ``rounds``; the process is killed after ``timeout_s``."""

    batch_size: int = 32
    dataset_size: int = 256
    iterations: int = 8
    rounds: int = 2
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "dataset_size", "iterations", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def cpu_counts(cores: int) -> list[int]:
    """All the cores, then halved (rounding down) to one: 12 -> [12, 6, 3, 1]."""
    counts = [max(1, cores)]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


async def measure_cpu_profile(
    model: str,
    node: NodeInfo,
    machine: Sequence[int],
    settings: ProfileSettings | None = None,
) -> CpuProfile:
    """Measure ``model`` on ``node`` (whose cores map onto the machine's ``machine``)."""
    from gpusched.libs.core.extras import TRAIN, MissingExtraError, require
    from gpusched.services.nodeagent.worker.catalog import UnknownModelNameError, zoo_model_for

    settings = settings or ProfileSettings()
    try:
        require("torch", TRAIN, "CPU profiling")
        zoo_model_for(model)
    except (UnknownModelNameError, MissingExtraError) as exc:
        raise CpuProfilingError(str(exc)) from None
    points = [
        f"{count}:{','.join(map(str, real_cores(range(count), machine)))}"
        for count in cpu_counts(node.cpus)
    ]
    arguments = [
        "--model", model, "--batch-size", str(settings.batch_size),
        "--dataset-size", str(settings.dataset_size), "--iterations", str(settings.iterations),
        "--rounds", str(settings.rounds), *(f"--point={p}" for p in points),
    ]  # fmt: skip
    # torch's threads share their cores with the pipeline's workers: none may spin
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    measured = await run_measuring_process(
        "gpusched.services.nodeagent.cpu_profiling", arguments, env, settings.timeout_s,
        failed=lambda why: CpuProfilingError(f"profiling {model} {why}"),
    )  # fmt: skip
    return CpuProfile(
        model=model,
        node=node.name,
        measured_at=time.time(),
        node_cpus=node.cpus,
        node_gpus=max(1, len(node.gpus)),
        node_mem_gb=node.host_mem_gb,
        resident_gb=measured["resident_gb"],
        dataset_gb=measured["dataset_gb"],
        points=[CpuProfilePoint(*p) for p in measured["points"]],
    )


# ---- the measuring process ----------------------------------------------------------


def _measure(
    model: str, points: list[tuple[int, tuple[int, ...]]], batch_size: int, dataset_size: int,
    iterations: int, rounds: int,
) -> dict[str, object]:  # fmt: skip
    from gpusched.libs.sdk import resident_set_mb
    from gpusched.services.nodeagent.cores import pin
    from gpusched.services.nodeagent.worker.catalog import ModelSpec, cpu_cost_for
    from gpusched.services.nodeagent.worker.pipeline import (
        DEFAULT_DATASET_SIZE,
        ENTRY_OVERHEAD_BYTES,
        RECORD_BYTES,
        DecodedCache,
    )
    from gpusched.services.nodeagent.worker.training import Resources, Trainer, TrainingOptions

    options = TrainingOptions(dataset_size=dataset_size, cpu_cost=cpu_cost_for(model))
    trainer = Trainer(
        ModelSpec.for_model(model), batch_size=batch_size, accum_steps=1, device="cpu",
        options=options,
    )  # fmt: skip
    step = 0

    def timed(count: int) -> float:
        """Seconds per sample over ``count`` iterations."""
        nonlocal step
        began = time.perf_counter()
        for _ in range(count):
            trainer.step(step)
            step += 1
        return (time.perf_counter() - began) / (count * batch_size)

    best: dict[int, list[float]] = {}
    resident_gb = 0.0
    try:
        for round_ in range(rounds):
            for cpus, cores in points:
                pin(os.getpid(), cores)
                # the pipeline's workers are forked now, on these cores
                trainer.allocate(Resources(cpus, None))
                cached = trainer.pipeline.cache
                # the first pass over the data set fills the cache; later ones warm up
                warmup = -(-dataset_size // batch_size) + 1 if round_ == 0 and not best else 2
                timed(warmup)
                hit = timed(iterations)
                trainer.pipeline.cache = DecodedCache(0)
                timed(1)
                miss = timed(iterations)
                trainer.pipeline.cache = cached
                if not resident_gb:
                    resident_gb = (resident_set_mb() * 2**20 - cached.nbytes) / GIB
                old = best.get(cpus)
                best[cpus] = [hit, miss] if old is None else [min(old[0], hit), min(old[1], miss)]
    finally:
        trainer.close()
    return {
        "resident_gb": max(0.0, resident_gb),
        "dataset_gb": DEFAULT_DATASET_SIZE * (RECORD_BYTES + ENTRY_OVERHEAD_BYTES) / GIB,
        "points": [[cpus, *best[cpus]] for cpus, _ in points],
    }


def _point(text: str) -> tuple[int, tuple[int, ...]]:
    count, _, cores = text.partition(":")
    return int(count), tuple(int(c) for c in cores.split(","))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpusched.services.nodeagent.cpu_profiling",
        description="Measure a model's seconds per sample with the real worker at CPU "
        "counts pinned to given cores, cached and not; prints one JSON line.",
    )
    defaults = ProfileSettings()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--dataset-size", type=int, default=defaults.dataset_size)
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument(
        "--point", type=_point, action="append", required=True,
        help="COUNT:CORE,CORE,...: train on COUNT cores pinned to these machine cores",
    )  # fmt: skip
    args = parser.parse_args(argv)
    result = _measure(
        args.model, args.point, args.batch_size, args.dataset_size, args.iterations, args.rounds
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
