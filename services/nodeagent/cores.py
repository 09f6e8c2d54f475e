"""Which CPU cores a run is pinned to.

A start or a reallocation gives a run a number of CPU cores (fractions round up: a share
of a core still needs one to run on). The agent picks that many of the node's cores not
held by other runs, lowest ids first, so the choice is deterministic. An emulated node may
register more cores than the machine has: its core ``c`` is the machine's
``available[c % len(available)]``, ``available`` being the cores the agent itself may run
on, so several emulated cores can land on one real core.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

_PROC = Path("/proc")


def core_count(cpus: float) -> int:
    """Cores to pin a run with ``cpus`` to: at least one, fractions rounded up."""
    return max(1, math.ceil(cpus - 1e-9))


def pick_cores(cpus: float, taken: Iterable[int], node_cores: int) -> tuple[int, ...]:
    """The node's lowest-numbered cores not in ``taken``; when too few are free (fractional
    allocations rounded up) the rest are shared, again lowest ids first."""
    count = min(core_count(cpus), node_cores)
    held = set(taken)
    free = [core for core in range(node_cores) if core not in held]
    shared = [core for core in range(node_cores) if core in held]
    return tuple(sorted((free + shared)[:count]))


def machine_cores() -> tuple[int, ...]:
    """The real cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def real_cores(node_cores: Sequence[int], available: Sequence[int]) -> tuple[int, ...]:
    """The machine's cores behind a node's cores (emulated ones wrap around)."""
    return tuple(sorted({available[core % len(available)] for core in node_cores}))


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (a run's process and its children)."""
    pids = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the fields after the command name, which may itself hold spaces and ')'
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def pin(pid: int, cores: Sequence[int]) -> None:
    """Pin every thread of ``pid`` to ``cores``; a thread or process gone meanwhile is
    skipped. Threads and children started later inherit it."""
    tids: list[int] = []
    with contextlib.suppress(OSError):
        tids = [int(task.name) for task in (_PROC / str(pid) / "task").iterdir()]
    for tid in tids or [pid]:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cores)


def pin_group(pgid: int, cores: Sequence[int]) -> None:
    """Pin every process of a process group, threads included."""
    for pid in group_pids(pgid) or [pgid]:
        pin(pid, cores)
