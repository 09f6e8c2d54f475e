"""report.html: a simulation's results in one self-contained file to share.

The page holds the table the command line prints (the same cells, each with its exact
value from summary.json), the plots embedded as base64 data URIs, the run's settings
(every option of the command, the cluster, the policies) and what the trace loader said
(files, skipped rows, rows left out). Nothing on it is fetched from elsewhere. Every
text that reaches the page is escaped with ``html.escape``, trace and job names
included.
"""

from __future__ import annotations

import base64
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from html import escape
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    from gpusched.libs.core.cluster import Cluster

REPORT_FILE = "report.html"

#: the summary table as ``report.summary_cells`` gives it: columns (header, summary
#: key), one row of cells per policy, and which rows have the best average JCT
Cells = tuple[Sequence[tuple[str, str]], Sequence[Sequence[str]], Sequence[bool]]


@dataclass(frozen=True)
class Option:
    """One option of the command as the run had it."""

    #: the option as typed, e.g. ``--trace``
    flag: str
    #: its value as text, one item per repetition; empty when it has none
    values: tuple[str, ...]
    #: False when the option was left at its default
    given: bool
    #: ``--flag`` alone switches it on
    is_flag: bool = False

    def words(self) -> list[str]:
        """How the option is typed on a command line."""
        if self.is_flag:
            return [self.flag] if self.values == ("true",) else []
        return [word for value in self.values for word in (self.flag, value)]


@dataclass(frozen=True)
class RunInfo:
    """What report.html says about how a run was made."""

    #: e.g. ``gpusched simulate``
    command: str = "gpusched simulate"
    options: tuple[Option, ...] = ()
    #: the cluster as simulated, one line
    cluster: str = ""
    #: the policies in the order they ran
    policies: tuple[str, ...] = ()
    #: what the trace loader or the generator reported, one line each
    notes: tuple[str, ...] = ()

    def command_line(self) -> str:
        """The command with the options that were given, quoted for a POSIX shell."""
        words = [w for option in self.options if option.given for w in option.words()]
        return " ".join([self.command, *map(shlex.quote, words)])

    @classmethod
    def from_context(
        cls,
        context: typer.Context | None,
        *,
        cluster: Cluster | None = None,
        policies: Sequence[str] = (),
        notes: Sequence[str] = (),
    ) -> RunInfo:
        """The options of a running typer command, each with its value and whether it was
        given (on the command line or by an environment variable)."""
        options: list[Option] = []
        command = cls.command
        if context is not None:
            for param in context.command.params:
                name = param.name
                if param.param_type_name != "option" or name is None or name not in context.params:
                    continue
                source = context.get_parameter_source(name)
                options.append(
                    Option(
                        flag=max(param.opts, key=len),
                        values=_texts(context.params[name]),
                        given=source is not None and source.name != "DEFAULT",
                        is_flag=bool(getattr(param, "is_flag", False)),
                    )
                )
            command = f"gpusched {context.info_name}"
        described = describe_cluster(cluster) if cluster is not None else ""
        return cls(command, tuple(options), described, tuple(policies), tuple(notes))


def describe_cluster(cluster: Cluster) -> str:
    """``2 nodes x 4 GPUs (49,140 MiB), 32 CPUs, 500 GB host memory`` in one line."""
    nodes = cluster.nodes
    per_node = {n.gpus for n in nodes}
    memories = sorted({n.gpu_mem_mb for n in nodes})
    count = f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}"
    shape = (
        f"{count} x {per_node.pop()} GPUs"
        if len(per_node) == 1
        else f"{count}, {cluster.total_gpus} GPUs"
    )
    gpu_mem = "/".join(f"{m:,}" for m in memories[:4]) + (", ..." if len(memories) > 4 else "")
    cpus = sum(n.cpus for n in nodes)
    host_mem = sum(n.host_mem_gb for n in nodes)
    return f"{shape} ({gpu_mem} MiB each), {cpus:,} CPUs, {host_mem:,.6g} GB host memory"


def _texts(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(t for item in value for t in _texts(item))
    if isinstance(value, bool):
        return ("true" if value else "false",)
    if isinstance(value, Enum):
        return (str(value.value),)
    return (str(value),)


def write_report_html(
    path: Path,
    cells: Cells,
    summary: Mapping[str, Any],
    plots: Sequence[tuple[str, Path]],
    run: RunInfo | None = None,
    notes: Sequence[str] = (),
) -> None:
    """Write the page to ``path``; ``plots`` are (title, PNG file) already written,
    ``notes`` the lines under the results table (``result_notes``)."""
    path.write_text(render(cells, summary, plots, run, notes), encoding="utf-8")


def render(
    cells: Cells,
    summary: Mapping[str, Any],
    plots: Sequence[tuple[str, Path]],
    run: RunInfo | None = None,
    notes: Sequence[str] = (),
) -> str:
    run = run or RunInfo()
    policies = run.policies or tuple(summary.get("policies", {}))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>gpusched simulation: {escape(', '.join(policies))}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        "<h1>gpusched simulation</h1>",
        f'<p class="command"><code>{escape(run.command_line())}</code></p>',
        _results(cells, summary),
        *([_result_notes(notes)] if notes else []),
        _plots(plots),
        _settings(run, policies, summary.get("settings")),
        _trace(run.notes),
        _summary_json(summary),
        f"<footer>gpusched {escape(_version())}</footer>",
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def _results(cells: Cells, summary: Mapping[str, Any]) -> str:
    columns, rows, best = cells
    figures = summary.get("policies", {})
    head = "".join(f"<th>{escape(header.replace(chr(10), ' '))}</th>" for header, _ in columns)
    body = []
    for row, is_best in zip(rows, best, strict=True):
        policy = row[0]
        exact = figures.get(policy, {})
        tds = [f'<th scope="row">{escape(policy)}</th>']
        for (_, key), text in zip(columns[1:], row[1:], strict=True):
            value = exact.get(key)
            shown = escape(text)
            if key == "avg_jct_s" and is_best:
                shown = f"<strong>{shown}</strong>"
            tds.append(f"<td{_data_value(value)}>{shown}</td>")
        body.append(f'<tr data-policy="{escape(policy)}">{"".join(tds)}</tr>')
    return (
        "<h2>Results</h2>\n"
        '<table class="results">\n'
        "<caption>JCT and queueing figures cover finished jobs; hover a cell for the exact "
        "value in summary.json. The best average JCT is bold.</caption>\n"
        f"<thead><tr>{head}</tr></thead>\n"
        f"<tbody>\n{chr(10).join(body)}\n</tbody>\n"
        "</table>"
    )


def _result_notes(notes: Sequence[str]) -> str:
    items = "".join(f"<li>{escape(note)}</li>" for note in notes)
    return f'<p>Notes on these results:</p>\n<ul class="result-notes">{items}</ul>'


def _data_value(value: object) -> str:
    """The exact summary value as attributes (``data-value``, and a tooltip)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    text = escape(repr(value))
    return f' data-value="{text}" title="{text}"'


def _plots(plots: Sequence[tuple[str, Path]]) -> str:
    figures = []
    for title, png in plots:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        figures.append(
            "<figure>"
            f'<img alt="{escape(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{escape(title)} ({escape(png.name)})</figcaption>"
            "</figure>"
        )
    return "<h2>Plots</h2>\n" + "\n".join(figures)


def _settings(run: RunInfo, policies: Sequence[str], recorded: object) -> str:
    rows = [
        _row("cluster", run.cluster or "-"),
        _row("policies", ", ".join(policies) or "-"),
    ]
    for option in run.options:
        value = " ".join(option.values) if option.values else "(none)"
        rows.append(_row(option.flag, value, "given" if option.given else "default"))
    if isinstance(recorded, Mapping):
        for key, value in recorded.items():
            rows.append(_row(f"summary.json settings.{key}", json.dumps(value)))
    return (
        "<h2>Settings</h2>\n"
        '<table class="settings">\n'
        "<thead><tr><th>setting</th><th>value</th><th>source</th></tr></thead>\n"
        f"<tbody>\n{chr(10).join(rows)}\n</tbody>\n"
        "</table>"
    )


def _row(name: str, value: str, source: str = "") -> str:
    return (
        f'<tr><th scope="row">{escape(name)}</th><td>{escape(value)}</td>'
        f"<td>{escape(source)}</td></tr>"
    )


def _trace(notes: Sequence[str]) -> str:
    items = "".join(f"<li>{escape(note)}</li>" for note in notes) or "<li>(none)</li>"
    return f'<h2>Trace</h2>\n<ul class="notes">{items}</ul>'


def _summary_json(summary: Mapping[str, Any]) -> str:
    text = json.dumps(summary, indent=2, allow_nan=False)
    return f"<details><summary>summary.json</summary><pre>{escape(text)}</pre></details>"


def _version() -> str:
    try:
        return metadata.version("gpusched")
    except metadata.PackageNotFoundError:
        return "(not installed)"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem;
       padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { padding: 0.25rem 0.6rem; border-bottom: 1px solid #ddd; text-align: left; }
table.results td { text-align: right; font-variant-numeric: tabular-nums; }
caption { caption-side: bottom; font-size: 0.85rem; color: #666; text-align: left; }
figure { margin: 1rem 0; }
img { max-width: 100%; height: auto; }
code, pre { font-family: ui-monospace, monospace; font-size: 0.9rem; }
p.command code { white-space: pre-wrap; word-break: break-all; }
footer { margin-top: 2rem; font-size: 0.8rem; color: #666; }
""".strip()
