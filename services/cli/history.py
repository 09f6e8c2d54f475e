"""``gpusched history export``: a running cluster's finished jobs as a native trace and
a cluster file beside it, for ``gpusched simulate`` to replay under other policies."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from gpusched.services.cli.client import ApiError, Endpoint, call
from gpusched.services.cli.jobview import shown
from gpusched.services.cli.live import TokenOption, UrlOption, _run
from gpusched.services.cli.whatif import register as register_whatif

#: the options whose values the API checks, by the query parameter they become
WINDOW_OPTIONS = {"since": "--since", "until": "--until"}
_UNIX_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_TIME_HELP = (
    "unix seconds or an ISO 8601 date or time (2026-01-01, 2026-01-01T09:30); a time "
    "without a zone is this machine's local time."
)


def register(app: typer.Typer) -> None:
    history_app = typer.Typer(help="The finished jobs of a running cluster.",
                              no_args_is_help=True)
    app.add_typer(history_app, name="history")
    register_whatif(history_app)

    @history_app.command("export")
    def export(
        out: Annotated[
            Path,
            typer.Option(
                help="Trace to write, in the native format: .csv, or .jsonl for JSON "
                "lines. The cluster's shape goes beside it, to OUT.cluster.json."
            ),
        ],
        since: Annotated[
            str | None,
            typer.Option(help=f"Jobs submitted at or after this time: {_TIME_HELP}"),
        ] = None,
        until: Annotated[
            str | None,
            typer.Option(help=f"Jobs submitted before this time: {_TIME_HELP}"),
        ] = None,
        url: UrlOption = None,
        token: TokenOption = None,
    ) -> None:
        """Export your finished jobs (an operator's token: every tenant's) as a trace
        `gpusched simulate --format native` replays, and the cluster's shape."""
        from gpusched.libs.core.cluster_file import (
            CLUSTER_FILE_SUFFIX,
            ClusterFileError,
            cluster_from_document,
            write_cluster_file,
        )
        from gpusched.libs.core.traces import (
            NATIVE_CSV_SUFFIXES,
            NATIVE_JSONL_SUFFIXES,
            TraceError,
            native_job,
            write_native,
        )

        err = Console(stderr=True)
        suffixes = NATIVE_CSV_SUFFIXES + NATIVE_JSONL_SUFFIXES
        if out.suffix.lower() not in suffixes:
            _fail(err, f"--out {out}: a native trace ends in {' or '.join(suffixes)}")
        if not out.parent.is_dir():
            _fail(err, f"--out {out}: no folder {out.parent}")
        params = {name: _zoned(value) for name, value in (("since", since), ("until", until))
                  if value is not None}
        endpoint = Endpoint.resolve(url, token)
        answer = _run(_export(endpoint, params))
        cluster_path = Path(f"{out}{CLUSTER_FILE_SUFFIX}")
        try:
            jobs = [native_job(row, line) for line, row in enumerate(answer["jobs"], start=1)]
            nodes = answer["cluster"]
            cluster = cluster_from_document(nodes, "the API's cluster") if nodes["nodes"] else None
        except (TraceError, ClusterFileError, KeyError, TypeError) as exc:
            _fail(err, f"the API answered an export this CLI cannot read: {exc}", code=1)
        try:
            write_native(out, jobs)
            if cluster is not None:
                write_cluster_file(cluster_path, cluster)
        except OSError as exc:
            _fail(err, f"--out {out}: cannot write: {exc.strerror or exc}", code=1)
        print(_summary(answer, out, cluster_path if cluster is not None else None))


async def _export(endpoint: Endpoint, params: dict[str, str]) -> Any:
    try:
        return await call(endpoint, "GET", "/v1/history/export", params=params)
    except ApiError as exc:
        option = WINDOW_OPTIONS.get(exc.field or "")
        if option is None:
            raise
        # the API names its query parameter; the user typed the option
        message = str(exc.args[0]).removeprefix(f"{exc.field}: ")
        raise ApiError(exc.status, f"{option}: {message}", option) from None


def _zoned(value: str) -> str:
    """A time as the user gave it, where a date or time without a zone gets this
    machine's local zone (the API reads a time without a zone as UTC); anything the
    API may refuse is sent as it is, for the API to say what is wrong with it."""
    text = value.strip()
    if _UNIX_SECONDS.fullmatch(text):
        return text
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return value
    if at.tzinfo is not None:
        return text
    try:
        return at.astimezone().isoformat()  # a naive time is taken as local
    except (OverflowError, OSError, ValueError):
        return value


def _summary(answer: dict[str, Any], out: Path, cluster_path: Path | None) -> str:
    jobs = answer["jobs"]
    states = ", ".join(f"{count} {state}" for state, count in answer["states"].items())
    tenants = answer["tenants"]
    whose = (f"{len(tenants)} tenant{'s' if len(tenants) != 1 else ''} ({', '.join(tenants)})"
             if answer["all_tenants"] else f"tenant {', '.join(tenants)}")
    lines = [
        f"wrote {len(jobs)} finished job{'s' if len(jobs) != 1 else ''} ({states}) of "
        f"{whose} to {out}",
        f"  submitted {_local(answer['first_submitted_at'])} .. "
        f"{_local(answer['last_submitted_at'])} (local time; window: since "
        f"{_bound(answer['since'])}, until {_bound(answer['until'])})",
    ]
    left_out = answer.get("left_out") or {}
    if left_out:
        lines.append("  left out: " + "; ".join(f"{n} {why}" for why, n in left_out.items()))
    nodes = answer["cluster"]["nodes"]
    if cluster_path is not None:
        models = sorted({node["gpu_model"] for node in nodes})
        gpus = sum(node["gpus"] for node in nodes)
        lines.append(
            f"wrote the cluster, {len(nodes)} node{'s' if len(nodes) != 1 else ''} with "
            f"{gpus} GPUs ({', '.join(models)}), to {cluster_path}"
        )
        cluster = str(cluster_path)
    else:
        cluster = "NODESxGPUS"
    lines += [f"  note: {note}" for note in answer.get("notes", [])]
    lines.append(f"replay: gpusched simulate --trace {out} --format native --cluster {cluster} "
                 "--out DIR")
    return "\n".join(shown(line) for line in lines)


def _local(at: float) -> str:
    return datetime.fromtimestamp(at).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _bound(at: float | None) -> str:
    return "-" if at is None else _local(at)


def _fail(console: Console, message: str, code: int = 2) -> NoReturn:
    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    raise typer.Exit(code)
