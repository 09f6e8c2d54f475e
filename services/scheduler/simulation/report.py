"""Turning simulation results into what an operator reads: JSON, CSV, plots and a table.

One `SimResult` per policy, all from the same trace and cluster. Everything here only
reads results; nothing re-runs a simulation.
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes

# A bare Figure renders with the Agg canvas on savefig: no pyplot, so no global backend
# switch, no figure registry to leak into, and it works on headless machines.
from matplotlib.figure import Figure
from rich import box
from rich.table import Table

from gpusched.services.scheduler.simulation.report_html import (
    REPORT_FILE,
    RunInfo,
    write_report_html,
)
from gpusched.services.scheduler.simulation.results import JobOutcome, SimResult, TimelinePoint

SUMMARY_FILE = "summary.json"
JOBS_FILE = "jobs.csv"
JCT_CDF_FILE = "jct_cdf.png"
GPU_UTIL_FILE = "gpu_util.png"
QUEUE_FILE = "queue_length.png"
#: each plot's title in report.html
PLOT_FILES = {"JCT CDF": JCT_CDF_FILE, "GPU utilisation": GPU_UTIL_FILE, "Queue length": QUEUE_FILE}
OUTPUT_FILES = (SUMMARY_FILE, JOBS_FILE, JCT_CDF_FILE, GPU_UTIL_FILE, QUEUE_FILE, REPORT_FILE)

JOB_COLUMNS = (
    "policy",
    "job_id",
    "model",
    "gpus",
    "submit_time",
    "start_time",
    "finish_time",
    "jct_s",
    "queue_s",
    "exclusive_s",
    "preemptions",
    "shared",
    "state",
    "reason",
)

_MINUTE, _HOUR, _DAY = 60.0, 3_600.0, 86_400.0


# ------------------------------------------------------------------------------ JSON


def summary_json(
    results: Sequence[SimResult], settings: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{"policies": {name: summary}}`` with NaN (no finished job) as None (JSON null),
    and the run's ``settings`` (``"settings"``) where given."""
    summary: dict[str, Any] = {"policies": {r.policy: _json_safe(r.summary()) for r in results}}
    if settings is not None:
        summary["settings"] = dict(settings)
    return summary


def _json_safe(summary: dict[str, Any]) -> dict[str, Any]:
    # json.dumps would write NaN, which is not JSON; strict parsers reject it
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()
    }


# ------------------------------------------------------------------------------ files


def output_problem(out_dir: str | Path) -> str | None:
    """Why `write_outputs` could not write into ``out_dir``, or None if it can, found
    without creating anything: the folder, or the nearest one above it that exists (the
    rest is created on writing), must be a folder a file can be written in."""
    out = Path(out_dir)
    where = out
    while not where.exists() and where.parent != where:
        where = where.parent
    if not where.is_dir():
        return f"{where} is not a folder" + (f", so {out} cannot be one" if where != out else "")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        return f"cannot write in {where}: {exc.strerror or exc}"
    return None


def write_outputs(
    results: Sequence[SimResult],
    out_dir: str | Path,
    settings: Mapping[str, Any] | None = None,
    run: RunInfo | None = None,
    notes: Sequence[str] = (),
) -> list[Path]:
    """Write the summary (with the run's ``settings`` and the table's ``notes``, see
    `gpusched.services.scheduler.simulation.result_notes`), per-job CSV, plots and the one-file
    report (with what ``run`` says of the run's options and trace) into ``out_dir``;
    return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / SUMMARY_FILE
    document = summary_json(results, settings)
    if notes:
        document["notes"] = list(notes)
    summary.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    write_jobs_csv(results, out / JOBS_FILE)
    plot_jct_cdf(results, out / JCT_CDF_FILE)
    plot_gpu_util(results, out / GPU_UTIL_FILE)
    plot_queue_length(results, out / QUEUE_FILE)
    plots = [(title, out / name) for title, name in PLOT_FILES.items()]
    write_report_html(out / REPORT_FILE, summary_cells(results), document, plots, run, notes)
    return [out / name for name in OUTPUT_FILES]


def write_jobs_csv(results: Sequence[SimResult], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(JOB_COLUMNS)
        for result in results:
            writer.writerows(_job_row(result.policy, job) for job in result.jobs)


def _job_row(policy: str, job: JobOutcome) -> tuple[object, ...]:
    return (
        policy,
        job.job_id,
        job.model,
        job.gpus,
        job.submit_time,
        _cell(job.start_time),
        _cell(job.finish_time),
        _cell(job.jct_s),
        job.queue_s,
        _cell(job.exclusive_s),
        job.preemptions,
        "true" if job.shared else "false",
        job.state,
        job.reason,
    )


def _cell(value: float | None) -> object:
    # NaN: no such time (a job larger than the cluster has no exclusive run time there)
    return "" if value is None or math.isnan(value) else value


# ------------------------------------------------------------------------------ plots


#: matplotlib's "tab10" colours, then line styles: policy ``i`` of `POLICIES` (and any
#: other name after them) draws in colour ``i % 10`` with style ``i // 10``, so up to 40
#: policies each get a (colour, style) pair of their own, the same in every plot and run
LINE_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
LINE_STYLES = ("-", "--", ":", "-.")
#: the queue-length plot's y axis is linear up to this many jobs and logarithmic above
#: (symlog: an empty queue still shows), so one policy's spike of thousands leaves the
#: others' tens readable
QUEUE_LINEAR_UP_TO = 1.0


def policy_styles(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Each name's (colour, line style), distinct for up to 40 names: a policy of
    `POLICIES` by its place there, any other name by its order after them."""
    from gpusched.services.scheduler.policies import POLICIES

    places = {name: i for i, name in enumerate(POLICIES)}
    for name in names:
        places.setdefault(name, len(places))
    colours = len(LINE_COLOURS)
    return {
        name: (LINE_COLOURS[places[name] % colours], LINE_STYLES[places[name] // colours % 4])
        for name in names
    }


def plot_jct_cdf(results: Sequence[SimResult], path: Path) -> None:
    _save(jct_cdf_figure(results), path)


def jct_cdf_figure(results: Sequence[SimResult]) -> Figure:
    fig, ax = _figure()
    styles = policy_styles([r.policy for r in results])
    for result in results:
        jcts = sorted(j.jct_s for j in result.finished() if j.jct_s is not None and j.jct_s > 0)
        if jcts:
            fractions = [(i + 1) / len(jcts) for i in range(len(jcts))]
            colour, style = styles[result.policy]
            ax.step(jcts, fractions, where="post", label=result.policy, color=colour, ls=style)
    if ax.lines:
        ax.set_xscale("log")  # JCTs span seconds to weeks; a linear axis hides the short ones
        _legend(ax)
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of finished jobs")
    ax.set_ylim(0, 1.0)
    ax.set_title("JCT CDF")
    return fig


def plot_gpu_util(results: Sequence[SimResult], path: Path) -> None:
    _save(gpu_util_figure(results), path)


def gpu_util_figure(results: Sequence[SimResult]) -> Figure:
    return _timeline_figure(
        results,
        value=lambda r, p: p.busy_gpus / r.total_gpus if r.total_gpus else 0.0,
        ylabel="busy GPUs (fraction)",
        title="GPU utilisation",
    )


def plot_queue_length(results: Sequence[SimResult], path: Path) -> None:
    _save(queue_length_figure(results), path)


def queue_length_figure(results: Sequence[SimResult]) -> Figure:
    """Queued jobs over time on a y axis linear up to ``QUEUE_LINEAR_UP_TO`` and
    logarithmic above (a queue of 10 and one of 10,000 both read)."""
    fig = _timeline_figure(
        results,
        value=lambda r, p: float(p.queued_jobs),
        ylabel=f"queued jobs (log scale, linear below {QUEUE_LINEAR_UP_TO:g})",
        title="Queue length",
    )
    ax = fig.axes[0]
    ax.set_yscale("symlog", linthresh=QUEUE_LINEAR_UP_TO)
    ax.set_ylim(bottom=0)
    return fig


def _timeline_figure(
    results: Sequence[SimResult],
    value: Callable[[SimResult, TimelinePoint], float],
    ylabel: str,
    title: str,
) -> Figure:
    span = max((r.timeline[0].time + r.makespan_s for r in results if r.timeline), default=0.0)
    scale, unit = _time_unit(span)
    fig, ax = _figure()
    styles = policy_styles([r.policy for r in results])
    for result in results:
        points = _within_run(result)
        if points:
            times = [p.time / scale for p in points]
            colour, style = styles[result.policy]
            values = [value(result, p) for p in points]
            ax.step(times, values, where="post", label=result.policy, color=colour, ls=style)
    if ax.lines:
        _legend(ax)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig


def _legend(ax: Axes) -> None:
    # beside the plot, not on it: fourteen entries would hide the lines they name
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def _within_run(result: SimResult) -> tuple[TimelinePoint, ...]:
    """Timeline points up to the last finish."""
    # stale events popped after the last job finished add idle points that would only
    # stretch the time axis of every policy
    if not result.timeline or result.makespan_s <= 0:
        return result.timeline
    end = result.timeline[0].time + result.makespan_s
    return tuple(p for p in result.timeline if p.time <= end)


def _time_unit(span_s: float) -> tuple[float, str]:
    """Divisor and label that keep the time axis in readable numbers."""
    if span_s >= 3 * _DAY:
        return _DAY, "days"
    if span_s >= 3 * _HOUR:
        return _HOUR, "hours"
    if span_s >= 3 * _MINUTE:
        return _MINUTE, "minutes"
    return 1.0, "seconds"


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(9, 5), layout="constrained")
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=100)


# ------------------------------------------------------------------------------ table


#: the summary table's columns: the header, and the summary.json key a cell shows
SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("jobs", "jobs"),
    ("avg\nJCT", "avg_jct_s"),
    ("median\nJCT", "p50_jct_s"),
    ("p99\nJCT", "p99_jct_s"),
    ("avg\nqueue", "avg_queue_s"),
    ("make-\nspan", "makespan_s"),
    ("GPU\nutil", "gpu_util"),
    ("pre-\nempt", "preemptions"),
    ("share\npairs", "shared_pairs"),
    ("wall\ntime", "wall_s"),
)
QOS_COLUMN = ("QoS\nmet", "qos_pct")


def summary_cells(
    results: Sequence[SimResult],
) -> tuple[list[tuple[str, str]], list[list[str]], list[bool]]:
    """The summary table as text: its columns (see ``SUMMARY_COLUMNS``; the QoS column
    only when a run had deadlines), one row of cells per policy, and whether each row
    has the best average JCT."""
    summaries = [r.summary() for r in results]
    with_qos = any("qos_pct" in s for s in summaries)
    columns = [*SUMMARY_COLUMNS, *([QOS_COLUMN] if with_qos else [])]
    best = min(
        (s["avg_jct_s"] for s in summaries if math.isfinite(s["avg_jct_s"])), default=math.nan
    )
    rows = [
        [
            result.policy,
            _jobs_cell(s),
            human_duration(s["avg_jct_s"]),
            human_duration(s["p50_jct_s"]),
            human_duration(s["p99_jct_s"]),
            human_duration(s["avg_queue_s"]),
            human_duration(s["makespan_s"]),
            f"{100 * s['gpu_util']:.1f}%",
            str(s["preemptions"]),
            str(s["shared_pairs"]),
            human_duration(s["wall_s"]),
            *([f"{s['qos_pct']:.1f}%" if "qos_pct" in s else "-"] if with_qos else []),
        ]
        for result, s in zip(results, summaries, strict=True)
    ]
    return columns, rows, [s["avg_jct_s"] == best for s in summaries]


def summary_table(results: Sequence[SimResult]) -> Table:
    """One row per policy; the best average JCT is bold."""
    # two-line headers, no vertical rules and collapsed padding: eleven columns of
    # unwrapped values still fit an 80-column terminal
    table = Table(
        title="Simulation results",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        show_edge=False,
        pad_edge=False,
    )
    columns, rows, best = summary_cells(results)
    table.add_column(columns[0][0], style="cyan", no_wrap=True)
    for header, _ in columns[1:]:
        table.add_column(header, justify="right", no_wrap=True)
    for row, is_best in zip(rows, best, strict=True):
        if is_best:
            row[2] = f"[bold]{row[2]}[/]"
        table.add_row(*row)
    return table


def _jobs_cell(summary: dict[str, Any]) -> str:
    # JCT figures cover finished jobs only, so say when that is not all of them
    total, done = summary["jobs"], summary["finished"]
    return str(total) if done == total else f"{done}/{total} done"


def human_duration(seconds: float) -> str:
    """``35 s``, ``12 min``, ``1.2 h``, ``2.3 d``; ``-`` when there is no value."""
    if not math.isfinite(seconds):
        return "-"
    if seconds == 0:
        return "0 s"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < _MINUTE:
        return f"{seconds:.0f} s"
    if seconds < _HOUR:
        return f"{seconds / _MINUTE:.0f} min"
    if seconds < _DAY:
        return f"{seconds / _HOUR:.1f} h"
    return f"{seconds / _DAY:.1f} d"
