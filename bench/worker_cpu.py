"""How much the worker's input pipeline depends on CPU cores: training samples/s of a
CPU-hungry model (resnet18, Synergy class "high") and a CPU-light one (vgg16, class
"low"; the same zoo CNN, so only the pipeline's work per sample differs) pinned to 1 and
to 2 cores, with no cache of decoded samples (every sample decoded) and with a cache that
holds the whole data set (only augmentation left). Each point runs in a fresh process
pinned with sched_setaffinity, as the node agent pins a run; its pipeline workers and
torch threads follow the cores. Stage "training" is the whole training step, stage
"data" the input pipeline alone (the same batches, no model). Each point is the best of
``--repeats`` runs (other work on the machine only slows a run down); the CPU time per
sample of the 1-core run, where everything runs in one process, is the work itself,
whatever else the machine does.

    python bench/worker_cpu.py [--iterations 150] [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from speed import print_machine_speed  # bench/ is the script's own directory

ROOT = Path(__file__).resolve().parents[1]
MODELS = (("resnet18", "hungry"), ("vgg16", "light"))
DATASET_SIZE = 2048
#: a memory allocation that leaves nothing for the cache, and one that caches everything
NO_CACHE_GB = 0.0
WHOLE_CACHE_GB = 64.0


def measure(
    model: str, cores: int, mem_gb: float, iterations: int, batch: int, data_only: bool
) -> None:
    """One point, in this process (the child): prints a JSON line. ``data_only``: the
    input pipeline alone, no model."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    from gpusched.services.nodeagent.worker.catalog import ModelSpec, cpu_cost_for
    from gpusched.services.nodeagent.worker.training import Resources, Trainer, TrainingOptions

    options = TrainingOptions(dataset_size=DATASET_SIZE, cpu_cost=cpu_cost_for(model))
    trainer = Trainer(
        ModelSpec.for_model(model),
        batch_size=batch,
        accum_steps=1,
        device="cpu",
        options=options,
        resources=Resources(cores, mem_gb),
    )
    pipeline = trainer.pipeline

    def step(iteration: int) -> None:
        if not data_only:
            trainer.step(iteration)
            return
        start = iteration * batch
        pipeline.images(range(start, start + batch))
        pipeline.prefetch(range(start + batch, start + 2 * batch))

    try:
        # one epoch first: the cache (where there is room) then holds the data set
        warmup = -(-DATASET_SIZE // batch)
        for iteration in range(warmup):
            step(iteration)
        began, cpu_began = time.perf_counter(), time.process_time()
        for iteration in range(warmup, warmup + iterations):
            step(iteration)
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
        workers, cached = pipeline.workers, len(pipeline.cache)
    finally:
        trainer.close()
    print(
        json.dumps(
            {
                "samples_per_s": iterations * batch / elapsed,
                # this process's CPU time: all of the work when it runs no pipeline workers
                "cpu_us_per_sample": cpu / (iterations * batch) * 1e6,
                "workers": workers,
                "cached": cached,
            }
        )
    )


def point(
    model: str, cores: int, mem_gb: float, iterations: int, batch: int, data_only: bool
) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    output = subprocess.run(
        [sys.executable, __file__, "--point", model, str(cores), str(mem_gb),
         "--iterations", str(iterations), "--batch-size", str(batch),
         *(["--data-only"] if data_only else [])],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    result: dict = json.loads(output.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--point", nargs=3, metavar=("MODEL", "CORES", "MEM_GB"))
    parser.add_argument("--data-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        model, cores, mem_gb = args.point
        measure(model, int(cores), float(mem_gb), args.iterations, args.batch_size, args.data_only)
        return
    available = len(os.sched_getaffinity(0))
    if available < 2:
        sys.exit(f"needs 2 cores, this process may use {available}")
    print_machine_speed()
    print(
        f"batch {args.batch_size}, data set {DATASET_SIZE} samples, "
        f"{args.iterations} iterations per point; samples/s"
    )
    print(
        f"{'model':<10} {'kind':<7} {'stage':<9} {'cache':<6} {'1 core':>9} {'2 cores':>9}"
        f" {'speed-up':>9} {'CPU us/sample':>14}"
    )
    for model, kind in MODELS:
        for stage, data_only in (("training", False), ("data", True)):
            for cache, mem_gb in (("none", NO_CACHE_GB), ("whole", WHOLE_CACHE_GB)):
                runs: dict[int, list[dict]] = {1: [], 2: []}
                for _ in range(args.repeats):
                    for cores in (1, 2):  # alternated, so that a busy spell hits both
                        runs[cores].append(
                            point(model, cores, mem_gb, args.iterations, args.batch_size, data_only)
                        )
                one, two = (max(r["samples_per_s"] for r in runs[c]) for c in (1, 2))
                cpu = min(r["cpu_us_per_sample"] for r in runs[1])
                print(
                    f"{model:<10} {kind:<7} {stage:<9} {cache:<6} {one:>9.0f} {two:>9.0f}"
                    f" {two / one:>8.2f}x {cpu:>14.0f}"
                )
    print_machine_speed()


if __name__ == "__main__":
    main()
