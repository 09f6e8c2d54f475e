"""CLI commands that talk to a running cluster: submit, jobs, job, cancel, tap, decode."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.common.settings import Setting, text
from gpusched.services.cli.client import ApiError, Endpoint, call
from gpusched.services.cli.decode import decode_stdin
from gpusched.services.cli.jobview import job_text, plain_table, shown

LOG_LEVEL = Setting("GPUSCHED_LOG_LEVEL", text())

UrlOption = Annotated[
    str | None, typer.Option("--url", help="API address (default: GPUSCHED_URL or `up`'s).")
]
TokenOption = Annotated[
    str | None, typer.Option("--token", help="Bearer token (default: GPUSCHED_TOKEN or `up`'s).")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")]


def _run(coro: Any) -> Any:
    err = Console(stderr=True)
    try:
        return asyncio.run(coro)
    except ApiError as exc:
        # the API's detail may quote what a user submitted: printed as text, not markup
        err.print(Text.assemble(("error: ", "bold red"), shown(exc)), soft_wrap=True)
        raise typer.Exit(2 if 400 <= exc.status < 500 else 1) from None


def _spec_from_flags(
    name: str | None, model: str | None, gpus: int, batch_size: int | None,
    iterations: int | None, epochs: float | None, dataset_size: int | None,
    command: str | None, priority: int, no_sharing: bool, label: list[str] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    missing = [flag for flag, value in (("--model", model), ("--batch-size", batch_size))
               if value is None]
    if missing:
        raise typer.BadParameter(f"{' and '.join(missing)} needed when no FILE is given")
    spec: dict[str, Any] = {
        "name": name or model, "model": model, "gpus": gpus, "batch_size": batch_size,
        "priority": priority, "allow_sharing": not no_sharing,
    }
    optional = {"iterations": iterations, "epochs": epochs, "dataset_size": dataset_size,
                **extra}
    spec.update({k: v for k, v in optional.items() if v is not None})
    if command:
        spec["command"] = shlex.split(command)
    labels = {}
    for item in label or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    if labels:
        spec["labels"] = labels
    return spec


def register(app: typer.Typer) -> None:
    @app.command()
    def submit(
        file: Annotated[
            Path | None, typer.Argument(help="Job spec, JSON or YAML ('-' reads stdin).")
        ] = None,
        name: Annotated[str | None, typer.Option(help="Job name (default: the model).")] = None,
        model: Annotated[str | None, typer.Option(help="Model profile, e.g. resnet50.")] = None,
        gpus: Annotated[int, typer.Option(help="GPUs the job needs.")] = 1,
        batch_size: Annotated[int | None, typer.Option(help="Global batch size.")] = None,
        iterations: Annotated[int | None, typer.Option(help="Iterations to run.")] = None,
        epochs: Annotated[float | None, typer.Option(help="Epochs (with --dataset-size).")] = None,
        dataset_size: Annotated[int | None, typer.Option(help="Samples per epoch.")] = None,
        command: Annotated[
            str | None, typer.Option(help="Your own training command instead of the worker.")
        ] = None,
        priority: Annotated[int, typer.Option(help="Higher runs first where policies care.")] = 0,
        no_sharing: Annotated[bool, typer.Option(help="Never share this job's GPUs.")] = False,
        label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")] = None,
        deadline_in: Annotated[
            float | None,
            typer.Option(help="Seconds from now by which the job should finish (a deadline)."),
        ] = None,
        min_batch_size: Annotated[
            int | None, typer.Option(help="Smallest global batch an elastic policy may give it.")
        ] = None,
        max_batch_size: Annotated[
            int | None, typer.Option(help="Largest global batch an elastic policy may give it.")
        ] = None,
        idempotency_key: Annotated[
            str | None, typer.Option(help="Retrying with the same key creates one job.")
        ] = None,
        url: UrlOption = None,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Submit a training job from a spec file or from flags; prints its id."""
        endpoint = Endpoint.resolve(url, token)
        if file is not None:
            text = sys.stdin.read() if str(file) == "-" else _read(file)
            yaml_like = file.suffix.lower() in (".yaml", ".yml") or not text.lstrip().startswith(
                "{"
            )
            body, content_type = text.encode(), (
                "application/yaml" if yaml_like else "application/json"
            )
        else:
            extra = {
                "deadline": None if deadline_in is None else time.time() + deadline_in,
                "min_batch_size": min_batch_size,
                "max_batch_size": max_batch_size,
            }
            spec = _spec_from_flags(name, model, gpus, batch_size, iterations, epochs,
                                    dataset_size, command, priority, no_sharing, label, extra)
            body, content_type = json.dumps(spec).encode(), "application/json"

        async def go() -> Any:
            return await _submit(endpoint, body, content_type, idempotency_key)

        record = _run(go())
        if as_json:
            print(json.dumps(record, indent=2), flush=True)
        else:
            print(shown(_job_id(record)), flush=True)  # the id first, then any warning
        _warn(record)

    @app.command()
    def jobs(
        state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
        limit: Annotated[int, typer.Option(help="At most this many jobs.")] = 100,
        url: UrlOption = None,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """List your jobs with their state and why they wait."""
        endpoint = Endpoint.resolve(url, token)
        params = {"limit": str(limit)}
        if state:
            params["state"] = state.upper()
        answer = _run(call(endpoint, "GET", "/v1/jobs", params=params))
        listed = answer.get("jobs", []) if isinstance(answer, dict) else []
        if as_json:
            print(json.dumps(answer, indent=2))
            return
        if not listed:
            Console(stderr=True).print(_no_jobs(state), soft_wrap=True, highlight=False)
            return
        rows = [_job_row(job) for job in listed]
        if sys.stdout.isatty():
            Console().print(_jobs_table(rows))
        else:  # a pipe or a file: whole rows, whatever width a terminal would have
            print(plain_table([h.upper() for h in _JOB_COLUMNS], rows))

    @app.command()
    def job(
        job_id: Annotated[str, typer.Argument(help="The job id.")],
        url: UrlOption = None,
        token: TokenOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Show one job: state history with local times and durations, placement,
        progress and why it waits."""
        endpoint = Endpoint.resolve(url, token)
        record = _run(call(endpoint, "GET", f"/v1/jobs/{job_id}"))
        print(json.dumps(record, indent=2) if as_json else job_text(record))

    @app.command()
    def cancel(
        job_id: Annotated[str, typer.Argument(help="The job id.")],
        url: UrlOption = None,
        token: TokenOption = None,
    ) -> None:
        """Cancel a job: a queued job ends at once, a running one once stopped."""
        endpoint = Endpoint.resolve(url, token)
        record = _run(call(endpoint, "DELETE", f"/v1/jobs/{job_id}"))
        print(f"{shown(_job_id(record) or job_id)}: cancel requested")

    @app.command()
    def tap(
        subject: Annotated[
            str, typer.Argument(help="Subject to watch, e.g. 'gpusched.job.*.state'.")
        ] = subjects.EVERYTHING,
        nats_url: Annotated[str | None, typer.Option(help="Default: NATS_URL or `up`'s.")] = None,
        count: Annotated[int, typer.Option(help="Stop after this many messages (0: never).")] = 0,
    ) -> None:
        """Print live messages on a subject as JSON lines, decoded from MessagePack."""
        # the connection's retries are debug lines: not for a user waiting on a tap
        configure_logging(LOG_LEVEL.read() or "warning")
        endpoint = Endpoint.resolve(None, None, nats_url)
        try:
            asyncio.run(_tap(endpoint.nats_url, subject, count))
        except KeyboardInterrupt:
            pass
        except (ConnectionError, OSError) as exc:
            Console(stderr=True).print(
                f"[bold red]error:[/] {exc}; is a cluster running? Start one with "
                "`gpusched up`, or name its NATS with --nats-url or NATS_URL",
                soft_wrap=True, highlight=False,
            )
            raise typer.Exit(1) from None

    @app.command()
    def decode() -> None:
        """Read MessagePack from stdin, print JSON (for `nats sub --translate`)."""
        decode_stdin()


def _read(file: Path) -> str:
    try:
        return file.read_text()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {file}: {exc.strerror}") from None


async def _submit(
    endpoint: Endpoint, body: bytes, content_type: str, idempotency_key: str | None
) -> Any:
    extra = {"Idempotency-Key": idempotency_key} if idempotency_key else None
    return await call(
        endpoint, "POST", "/v1/jobs", body=body, content_type=content_type, extra_headers=extra
    )


def _warn(answer: Any) -> None:
    """The submission's warnings, after its id, on stderr."""
    warnings = answer.get("warnings") if isinstance(answer, dict) else None
    err = Console(stderr=True)
    for warning in warnings or []:
        err.print(Text.assemble(("warning: ", "bold yellow"), shown(warning)),
                  soft_wrap=True, highlight=False)


def _no_jobs(state: str | None) -> str:
    if state:
        return (f"no {state.upper()} jobs; `gpusched jobs` lists all of them")
    return ("no jobs yet; submit one with `gpusched submit --model resnet50 --batch-size 64 "
            "--iterations 500` (or a spec file, see `gpusched submit --help`)")


def _job_id(record: Any) -> str:
    if isinstance(record, dict):
        return str(record.get("id") or record.get("job", {}).get("id", ""))
    return ""


_FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")
_DEADLINE_WORDS = {
    (True, True): "deadline met", (True, False): "deadline missed",
    (False, True): "deadline likely met", (False, False): "deadline at risk",
}


def _job_row(job: dict[str, Any]) -> tuple[str, ...]:
    spec = job.get("spec", {})
    progress = job.get("progress", {}) or {}
    total = job.get("total_iterations") or 0
    done = progress.get("iteration", 0)
    placement = ", ".join(
        f"{p['node']}:{','.join(map(str, p['gpus']))}" for p in job.get("placement", [])
    )
    state = str(job.get("state", ""))
    met = job.get("deadline_likely_met")
    if met is not None:  # a job with a deadline: (finished, met) -> words
        state += ", " + _DEADLINE_WORDS[(state in _FINISHED, bool(met))]
    cells = (
        job.get("id", ""), spec.get("name", ""), spec.get("model", ""), spec.get("gpus", ""),
        state, f"{done}/{total}" if total else "", placement or job.get("pending_reason", ""),
    )
    # whatever a record holds, nothing in it reaches the terminal as an escape
    return tuple(shown(cell) for cell in cells)


_JOB_COLUMNS = ("id", "name", "model", "gpus", "state", "progress", "placement / reason")


def _jobs_table(rows: list[tuple[str, ...]]) -> Table:
    """The jobs as a table whose ids are never cut or folded, so they can be copied
    whole; the other columns wrap instead."""
    table = Table()
    widest = max((len(row[0]) for row in rows), default=2)
    table.add_column(_JOB_COLUMNS[0], no_wrap=True, min_width=widest)
    for header in _JOB_COLUMNS[1:]:
        table.add_column(header)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # text, never rich markup
    return table


#: DEL and the C1 control characters as JSON escapes (valid inside a JSON string, the
#: only place they can occur in a JSON text)
_JSON_C1 = {code: f"\\u{code:04x}" for code in range(0x7F, 0xA0)}


async def _tap(nats_url: str, subject: str, count: int) -> None:
    from gpusched.libs.common.bus import connection

    seen = 0
    done = asyncio.Event()
    async with connection(nats_url, "gpusched-tap", first_connect_s=5) as nc:

        async def show(msg: Any) -> None:
            nonlocal seen
            line = f"{shown(msg.subject)} {codec.to_json_text(msg.data)}"
            # JSON escapes C0 controls itself; DEL and C1 pass raw, so as \u escapes here
            print(line.translate(_JSON_C1), flush=True)
            seen += 1
            if count and seen >= count:
                done.set()

        await nc.subscribe(subject, cb=show)
        await done.wait()
