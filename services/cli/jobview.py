"""How the CLI shows jobs to a person: one job's record as labelled lines with local
times and durations (``gpusched job``), and the job list as plain columns when the
output is not a terminal (``gpusched jobs | ...``)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

_FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")
_RUNNING = ("RUNNING",)
_WAITING = ("QUEUED", "PREEMPTED")
#: the longest tail of a failed run's stderr the view shows
ERROR_LINES = 5


#: what a terminal would act on instead of showing: C0 and C1 control characters (ESC
#: starts the escape sequences that recolour, move the cursor or retitle the window), DEL,
#: and the bidirectional overrides that reorder what follows them
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text: object) -> str:
    r"""Text from a record as it may be printed: every character a terminal would act on
    written as its escape (``\x1b``, ``\n``, ``\u202e``), so a name or an error
    stored by anyone cannot move the cursor, recolour the screen or fake a line."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def duration_text(seconds: float) -> str:
    """``0.4 s``, ``35 s``, ``4 min 7 s``, ``2 h 5 min``, ``3 d 4 h``: two units at
    most, whole ones past a minute."""
    if not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s".replace(".0 s", " s")
    whole = round(seconds)
    for unit, size, smaller, small_size in (
        ("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1),
    ):
        if whole >= size:
            big, rest = divmod(whole, size)
            part = rest // small_size
            return f"{big} {unit} {part} {smaller}" if part else f"{big} {unit}"
    return f"{whole} s"


def local_time(at: float) -> str:
    """Seconds since the epoch as the local date and time, to the second."""
    return datetime.fromtimestamp(at).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _zone(at: float) -> str:
    """The local zone at ``at``: ``CET, UTC+01:00``, or the offset alone."""
    moment = datetime.fromtimestamp(at).astimezone()
    offset = moment.strftime("%z") or "+0000"
    utc = f"UTC{offset[:3]}:{offset[3:]}"
    name = moment.tzname() or ""
    return f"{name}, {utc}" if name.isalpha() and name != "UTC" else utc


def _number(value: float) -> str:
    return f"{value:.4g}"


def _placement(placement: Sequence[dict[str, Any]]) -> str:
    parts = []
    for part in placement:
        gpus = ",".join(str(g) for g in part.get("gpus", []))
        noun = "GPU" if len(part.get("gpus", [])) == 1 else "GPUs"
        parts.append(f"{part.get('node', '?')} {noun} {gpus}")
    return "; ".join(parts)


def _shape(job: dict[str, Any]) -> str:
    spec = job.get("spec", {})
    batch = job.get("batch_size") or spec.get("batch_size")
    gpus = job.get("gpus") or spec.get("gpus", 1)
    text = f"{spec.get('model', '?')}, batch {batch} on {gpus} GPU{'s' if gpus != 1 else ''}"
    resized = (job.get("batch_size") or job.get("gpus")) and (
        batch != spec.get("batch_size") or gpus != spec.get("gpus", 1)
    )
    if resized:
        text += f" (submitted: batch {spec.get('batch_size')} on {spec.get('gpus', 1)})"
    accum = job.get("accum_steps") or 1
    if accum > 1:
        text += f", accumulating {accum} steps"
    parallel = [
        f"{name} {spec[key]}" for name, key in (
            ("tensor parallel", "tensor_parallel"), ("pipeline parallel", "pipeline_parallel"),
        ) if (spec.get(key) or 1) > 1
    ]
    if parallel:
        text += ", " + ", ".join(parallel)
    return text


def _progress(job: dict[str, Any]) -> str:
    progress = job.get("progress") or {}
    total = job.get("total_iterations") or 0
    done = progress.get("iteration", 0)
    text = f"{done} / {total} iterations" if total else f"{done} iterations"
    if total:
        text += f" ({100 * done / total:.0f} %)"
    extras = []
    if progress.get("loss") is not None:
        extras.append(f"loss {_number(progress['loss'])}")
    if progress.get("accuracy") is not None:
        extras.append(f"accuracy {_number(progress['accuracy'])}")
    if progress.get("epoch") is not None:
        extras.append(f"epoch {progress['epoch']:.2f}")
    if progress.get("samples_per_s"):
        extras.append(f"{progress['samples_per_s']:.0f} samples/s")
    if progress.get("lr") is not None:
        extras.append(f"lr {_number(progress['lr'])}")
    if progress.get("at"):
        extras.append(f"reported {local_time(progress['at'])}")
    return ", ".join([text, *extras])


def _history(job: dict[str, Any], now: float) -> list[str]:
    """One line per state change: when, the state, how long the job stayed in it, why."""
    history = job.get("history") or []
    if not history:
        return []
    rows = []
    for index, change in enumerate(history):
        at = float(change.get("at", 0.0))
        state = str(change.get("state", ""))
        if index + 1 < len(history):
            lasted = duration_text(float(history[index + 1].get("at", at)) - at)
        elif state in _FINISHED:
            lasted = ""
        else:
            lasted = duration_text(now - at) + " so far"
        rows.append((local_time(at), shown(state), lasted, shown(change.get("reason", ""))))
    width_state = max(len(r[1]) for r in rows)
    width_lasted = max(len(r[2]) for r in rows)
    lines = [f"history (local time, {_zone(float(history[0].get('at', now)))}):"]
    for when, state, lasted, reason in rows:
        line = f"  {when}  {state:<{width_state}}  {lasted:<{width_lasted}}  {reason}"
        lines.append(line.rstrip())
    return lines


def _times(job: dict[str, Any], now: float) -> str:
    """How long the job waited and ran in all, and since when it is in its state."""
    history = job.get("history") or []
    waited = ran = 0.0
    for index, change in enumerate(history):
        state = change.get("state")
        start = float(change.get("at", 0.0))
        if index + 1 < len(history):
            end = float(history[index + 1].get("at", start))
        elif state in _FINISHED:
            end = start
        else:
            end = now
        if state in _WAITING:
            waited += end - start
        elif state in _RUNNING:
            ran += end - start
    state = str(job.get("state", ""))
    submitted = float(job.get("submitted_at") or (history[0]["at"] if history else now))
    if state in _FINISHED and history:
        ended = float(history[-1].get("at", now))
        head = (f"{state} at {local_time(ended)}, {duration_text(ended - submitted)} after "
                "submission")
    else:
        since = float(history[-1].get("at", now)) if history else submitted
        head = f"{state} for {duration_text(now - since)}"
    return f"{head} (waited {duration_text(waited)}, ran {duration_text(ran)})"


def job_text(job: dict[str, Any], now: float | None = None) -> str:
    """A job record of the API as labelled lines a person reads at once."""
    now = time.time() if now is None else now
    spec = job.get("spec", {})
    rows: list[tuple[str, str]] = [
        ("job", f"{job.get('id', '?')}  {spec.get('name', '')}".rstrip()),
        ("state", _times(job, now)),
        ("submitted", local_time(float(job.get("submitted_at", now)))),
        ("shape", _shape(job)),
        ("progress", _progress(job)),
    ]
    placement = job.get("placement") or []
    if placement:
        rows.append(("placement", _placement(placement)))
    if job.get("shares_with"):
        rows.append(("sharing", "GPUs with " + ", ".join(job["shares_with"])))
    if job.get("cpus") is not None or job.get("mem_gb") is not None:
        held = []
        if job.get("cpus") is not None:
            held.append(f"{job['cpus']:g} CPU cores")
        if job.get("mem_gb") is not None:
            held.append(f"{job['mem_gb']:g} GB host memory")
        rows.append(("allocation", ", ".join(held)))
    state = str(job.get("state", ""))
    if job.get("pending_reason") and state not in _FINISHED and state not in _RUNNING:
        rows.append(("waiting", str(job["pending_reason"])))
    if job.get("deadline") is not None:
        met = job.get("deadline_likely_met")
        verdict = {True: "likely met", False: "at risk", None: "no estimate yet"}[met]
        if state in _FINISHED and met is not None:
            verdict = "met" if met else "missed"
        rows.append(("deadline", f"{local_time(float(job['deadline']))}, {verdict}"))
    if job.get("attempts") or job.get("preemptions"):
        parts = []
        if job.get("attempts"):
            parts.append(f"{job['attempts']} failed attempt{'s' if job['attempts'] != 1 else ''}")
        if job.get("preemptions"):
            parts.append(f"preempted {job['preemptions']} time"
                         f"{'s' if job['preemptions'] != 1 else ''}")
        rows.append(("restarts", ", ".join(parts)))
    if job.get("exit_code"):
        rows.append(("exit code", str(job["exit_code"])))
    if job.get("cancel_requested") and state not in _FINISHED:
        rows.append(("cancel", "requested; the job ends once stopped"))
    labels = spec.get("labels") or {}
    if labels:
        rows.append(("labels", ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))))
    if spec.get("command"):
        rows.append(("command", " ".join(spec["command"])))
    rows = [(label, shown(value)) for label, value in rows]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    error = str(job.get("error") or "").strip()
    if error:
        tail = [shown(line) for line in error.splitlines()[-ERROR_LINES:]]
        lines.append(f"{'error':<{width}}  {tail[0]}")
        lines.extend(f"{'':<{width}}  {line}" for line in tail[1:])
    return "\n".join([*lines, *_history(job, now)])


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded with spaces, one row a line, nothing cut or folded: for a pipe,
    where a terminal's width means nothing. The last column is not padded."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)
