"""The options of a benchmark that sweeps several runs (``--workers``, ``--executor``)
and the sweep itself (``gpusched.services.scheduler.simulation.sweep``).

``--workers``, not ``--jobs`` as ``gpusched simulate`` has it: here ``--jobs`` already
counts a trace's jobs. The results, and so every printed figure but wall times, are
those of one run after another.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from gpusched.services.scheduler.simulation.sweep import Executor, Run, sweep

R = TypeVar("R")


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=int, default=None,
        help="runs at a time, each in a process (default: the cores)",
    )  # fmt: skip
    parser.add_argument(
        "--executor", default="local", type=Executor.parse,
        help="local, dask (a LocalCluster of --workers) or dask:ADDRESS",
    )  # fmt: skip


def run_all(runs: Sequence[Run[R]], args: argparse.Namespace) -> list[R]:
    """Every run's result in the order of ``runs``; a line on stderr as each ends."""
    done = [0]

    def finished(_result: Any) -> None:
        done[0] += 1
        print(f"  {done[0]} of {len(runs)} runs done", file=sys.stderr, flush=True)

    return sweep(runs, args.workers, args.executor, on_finished=finished)
