"""The settings of one simulated run (``SimConfig``), apart from the cluster, the jobs,
the policy and the performance models it is given."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpusched.libs.core.size_predictor import PREDICTORS


@dataclass(frozen=True)
class SimConfig:
    #: seconds a preempted job spends restoring its checkpoint when it restarts
    restart_overhead_s: float = 30.0
    max_jobs_per_gpu: int = 2
    #: most points kept in the result's timeline
    timeline_points: int = 2_000
    #: call the policy every this many seconds even when nothing happens (a round-based
    #: policy re-plans CPU/memory then); None: only when jobs arrive or finish
    round_s: float | None = None
    #: the sizes policies believe: "truth", "declared" (the users' figures) or "rf" (a
    #: random forest learning from the jobs completed so far; see SubmissionSizes)
    predictor: str = "truth"

    def __post_init__(self) -> None:
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}")
        if self.restart_overhead_s < 0:
            raise ValueError("restart_overhead_s must be >= 0")
        if self.max_jobs_per_gpu < 1:
            raise ValueError("max_jobs_per_gpu must be >= 1")
        if self.round_s is not None and not (self.round_s > 0 and math.isfinite(self.round_s)):
            raise ValueError(f"round_s must be a finite number > 0, got {self.round_s!r}")
