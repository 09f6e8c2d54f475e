"""When nodes' heartbeats arrived, noted as they come in rather than when the actor
reads them: a backlogged actor would otherwise take healthy nodes for lost. Kept apart
from the actor because two parties share it: the heartbeat subscription writes it, the
actor only reads it."""

from __future__ import annotations

from collections.abc import Iterable

from gpusched.libs.common.schemas import Heartbeat


class Liveness:
    """When heartbeats arrived, written by the heartbeat subscription as each one comes
    in, ahead of the actor's queue. A backlogged actor handles a beat late; judging a
    node by that would declare healthy nodes lost. The actor only reads it. A run is
    kept per node that listed it: only the nodes a job was placed on keep it alive."""

    def __init__(self) -> None:
        self._nodes: dict[str, float] = {}
        self._runs: dict[tuple[str, str, int], float] = {}

    def saw(self, beat: Heartbeat, arrived: float) -> None:
        self._nodes[beat.node] = arrived
        for run in beat.running:
            self._runs[(beat.node, run.job_id, run.run_id)] = arrived
        for ended in beat.exiting:
            self._runs[(beat.node, ended.job_id, ended.run_id)] = arrived

    def node_seen(self, node: str) -> float:
        return self._nodes.get(node, 0.0)

    def run_seen(self, job_id: str, run_id: int | None, nodes: Iterable[str]) -> float:
        """When one of ``nodes`` last listed the run (0: never)."""
        if run_id is None:
            return 0.0
        return max((self._runs.get((node, job_id, run_id), 0.0) for node in nodes), default=0.0)

    def forget_runs_before(self, moment: float) -> None:
        """Drop runs last listed before ``moment``: once older than the missing-job
        grace they can no longer keep a job alive, and every run ever listed would
        otherwise stay."""
        self._runs = {run: at for run, at in self._runs.items() if at >= moment}
