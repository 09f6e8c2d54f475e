"""What-if: the figures of what a live cluster really did with its jobs (the live
outcome columns of an exported history, docs/trace-format.md "Exported history") beside
those of each policy's replay of the same jobs, and which served them best.

Every row counts the same way: mean and p99 (nearest rank) of the job completion time
(submission to end) and mean queueing (time waiting, before the first start and after
preemptions) over the jobs that ended, and GPU-hours as each job's GPUs times the time
it held them (its completion time less its waits)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from gpusched.libs.core.traces import TraceJob
from gpusched.services.scheduler.simulation.results import SimResult, percentile

#: the row of the live cluster's own figures
LIVE = "live"


@dataclass(frozen=True)
class Figures:
    """One row of the what-if table."""

    #: ``live``, ``live (POLICY)`` or the policy replayed
    name: str
    jobs: int
    #: jobs that ended (live: whose end the export knows; replayed: that finished)
    ended: int
    mean_jct_s: float
    p99_jct_s: float
    mean_queue_s: float
    gpu_hours: float

    def as_dict(self) -> dict[str, object]:
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Best:
    """The policy of the lowest mean JCT, and how much it beats the live one by."""

    policy: str
    mean_jct_s: float
    #: live mean JCT less the policy's (negative: the live cluster did better); None
    #: without live figures
    saved_s: float | None = None
    #: ``saved_s`` as a share of the live mean JCT, in percent
    saved_pct: float | None = None


def live_policy(jobs: Sequence[TraceJob]) -> str | None:
    """The live policy the export names, where its rows agree on one."""
    named = {job.live_policy for job in jobs if job.live_policy}
    return named.pop() if len(named) == 1 else None


def live_figures(jobs: Sequence[TraceJob]) -> tuple[Figures | None, str]:
    """The live row, or None and why it cannot be had (an export without live columns,
    from before they were written)."""
    timed = [job for job in jobs if job.live_jct_s is not None and job.live_queue_s is not None]
    if not timed:
        return None, (
            "live figures missing: the trace has no live_jct_s/live_queue_s columns (an "
            "export older than them, or not an export); the policies are still compared"
        )
    policy = live_policy(jobs)
    name = f"{LIVE} ({policy})" if policy else LIVE
    jcts = sorted(float(job.live_jct_s or 0.0) for job in timed)
    queues = [float(job.live_queue_s or 0.0) for job in timed]
    held = sum(job.gpus * (float(job.live_jct_s or 0.0) - float(job.live_queue_s or 0.0))
               for job in timed)
    figures = Figures(
        name=name,
        jobs=len(jobs),
        ended=len(timed),
        mean_jct_s=sum(jcts) / len(jcts),
        p99_jct_s=percentile(jcts, 99),
        mean_queue_s=sum(queues) / len(queues),
        gpu_hours=held / 3600,
    )
    why = ""
    if len(timed) < len(jobs):
        why = (f"live figures cover {len(timed)} of {len(jobs)} jobs: the others' histories "
               "do not reach their end")
    return figures, why


def live_states(jobs: Sequence[TraceJob]) -> dict[str, int]:
    """How the jobs ended on the live cluster, by state (where the export says)."""
    return dict(sorted(Counter(job.live_state for job in jobs if job.live_state).items()))


def simulated_figures(result: SimResult) -> Figures:
    done = result.finished()
    jcts = sorted(j.jct_s for j in done if j.jct_s is not None)
    queues = [j.queue_s for j in done]
    held = sum(j.gpus * ((j.jct_s or 0.0) - j.queue_s) for j in done)
    return Figures(
        name=result.policy,
        jobs=len(result.jobs),
        ended=len(done),
        mean_jct_s=sum(jcts) / len(jcts) if jcts else math.nan,
        p99_jct_s=percentile(jcts, 99),
        mean_queue_s=sum(queues) / len(queues) if queues else math.nan,
        gpu_hours=held / 3600,
    )


def best(policies: Sequence[Figures], live: Figures | None) -> Best | None:
    """The replayed policy of the lowest mean JCT (the first of equals, in run order),
    among those that finished every job; None when none did."""
    complete = [f for f in policies if f.ended == f.jobs and math.isfinite(f.mean_jct_s)]
    if not complete:
        return None
    winner = min(complete, key=lambda f: f.mean_jct_s)
    if live is None or not live.mean_jct_s > 0:
        return Best(winner.name, winner.mean_jct_s)
    saved = live.mean_jct_s - winner.mean_jct_s
    return Best(winner.name, winner.mean_jct_s, saved, 100 * saved / live.mean_jct_s)


def best_line(winner: Best | None, live: Figures | None) -> str:
    if winner is None:
        return "best: none (no policy finished every job)"
    line = f"best: {winner.policy}, mean JCT {_duration(winner.mean_jct_s)}"
    if live is None or winner.saved_s is None or winner.saved_pct is None:
        return line + " (no live figures to compare with)"
    if winner.saved_s >= 0:
        return line + (f", {_duration(winner.saved_s)} ({winner.saved_pct:.1f}%) shorter "
                       f"than {live.name}'s {_duration(live.mean_jct_s)}")
    return line + (f", {_duration(-winner.saved_s)} ({-winner.saved_pct:.1f}%) longer than "
                   f"{live.name}'s {_duration(live.mean_jct_s)}: no policy beat the live one")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


__all__ = [
    "LIVE",
    "Best",
    "Figures",
    "best",
    "best_line",
    "live_figures",
    "live_policy",
    "live_states",
    "simulated_figures",
]
