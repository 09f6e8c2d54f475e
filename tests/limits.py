"""Time limits for tests that run real processes, derived from work measured on this
machine in this run rather than guessed: a busy or slow machine measures slower and gets
proportionally longer limits. A limit only bounds a hung process; nothing is timed."""

from __future__ import annotations

import functools
import subprocess
import sys
import time

#: how many times the measured start of a torch process a test may take, per process;
#: the work after the start (a few tiny iterations, a checkpoint) is small beside it
STARTS_PER_PROCESS = 15
#: no limit below this, whatever the measurement says
FLOOR_S = 60.0


@functools.cache
def torch_process_start_s() -> float:
    """Wall seconds for a fresh Python to import torch and run one operation, measured
    once per test session."""
    began = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import torch; torch.ones(2).sum().item()"],
        check=True, capture_output=True,
    )
    return time.monotonic() - began


def process_limit_s(processes: int = 1) -> float:
    """A limit for a test whose work is ``processes`` torch processes, each started, run
    for a few iterations and stopped (sequentially or competing for the cores)."""
    return max(FLOOR_S, STARTS_PER_PROCESS * torch_process_start_s() * max(1, processes))
