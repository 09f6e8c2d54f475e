"""What a scheduler believes of a job, the same in both drivers (the simulator's
``services/scheduler/simulator.py`` and the live scheduler's
``services/scheduler/state.py``): the iterations it has left.
"""

from __future__ import annotations

from gpusched.libs.core.size_predictor import OVERRUN_SHARE


def remaining_iterations(believed: float, done: float, stops_at: float | None = None) -> float:
    """The iterations a job is believed to have left after ``done``, when it is believed
    to run ``believed`` in all (a size predictor's figure, or the declared total).

    Our rule: what is left of the believed total, but at least `OVERRUN_SHARE` of it: a
    job that ran past its prediction is not believed finished (believed done, it would
    hold its GPUs at no cost).

    ``stops_at``: the iterations after which the run stops, where the driver knows them
    (the live scheduler: the job's declared total, which its worker never runs past; a
    simulated job's true length is the ground truth, which no scheduler reads). Then the
    belief never exceeds what is left of the run, and is exactly that where the believed
    total is the run's own (``believed >= stops_at``) or nothing is left.
    """
    if stops_at is not None:
        left = max(0.0, float(stops_at - done))
        if believed >= stops_at or left == 0:
            return left
        return min(left, max(believed - done, OVERRUN_SHARE * believed))
    return max(believed - done, OVERRUN_SHARE * believed)
