"""What a node's report proves about its sender. A report's subject names the node
(and job) that sent it, and only that node's NATS user may publish there; its payload
only claims it. A heartbeat, progress event or exit whose payload claims another node or
job is dropped here, with a warning and a count, and so are a heartbeat's runs whose job
id no job can have. Shared by the service (the subscriptions) and the actor (exits from
the exits stream).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import structlog
from msgspec.structs import replace
from nats.aio.msg import Msg

from gpusched.libs.common import subjects
from gpusched.libs.common.schemas import Heartbeat, IdStr, JobExit, JobProgressEvent
from gpusched.services.scheduler.live.metrics import SchedulerMetrics

log = structlog.get_logger("gpusched.scheduler")

_Report = TypeVar("_Report", Heartbeat, JobProgressEvent, JobExit)


def from_sender(
    msg: Msg, report: _Report, metrics: SchedulerMetrics, kind: str
) -> _Report | None:
    """``report`` when it speaks of the node and job its subject names: the subject says
    who sent it (only that node's user may publish there), the payload only claims it.
    A report claiming another node or job is dropped, with a warning and a count."""
    job_id = None if isinstance(report, Heartbeat) else report.job_id
    if subjects.matches_sender(msg.subject, report.node, job_id):
        return report
    metrics.report_refused(kind)
    log.warning("report claiming another sender dropped", kind=kind, subject=msg.subject,
                claimed_node=report.node[:64])
    return None


def valid_runs(beat: Heartbeat) -> Heartbeat:
    """The beat without the runs whose job id no job can have (not an ``IdStr``): no
    command can name them, and one such entry must not cost the node its other runs."""
    running = [r for r in beat.running if is_id(r.job_id)]
    exiting = [r for r in beat.exiting if is_id(r.job_id)]
    skipped = len(beat.running) - len(running) + len(beat.exiting) - len(exiting)
    if not skipped:
        return beat
    log.warning("heartbeat runs with invalid job ids skipped", node=beat.node[:64],
                skipped=skipped)
    return replace(beat, running=running, exiting=exiting)


def is_id(text: str) -> bool:
    try:
        msgspec.convert(text, IdStr)
    except msgspec.ValidationError:
        return False
    return True
