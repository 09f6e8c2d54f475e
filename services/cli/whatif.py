"""``gpusched history whatif``: which policy would have served the jobs of an exported
history best? Replays the export (``gpusched history export``) under each policy on the
cluster file beside it and prints one table, the live cluster's own figures first
(services/scheduler/simulation/whatif.py says how each figure is counted)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from gpusched.libs.core.cluster import Cluster
    from gpusched.libs.core.jobs import JobSpec
    from gpusched.services.scheduler.simulation.results import SimResult
    from gpusched.services.scheduler.simulation.whatif import Best, Figures

#: a mistake in what the user gave
USAGE_EXIT = 2
#: the simulator's restart overhead unless told otherwise (SimConfig's)
RESTART_OVERHEAD_S = 30.0


def register(history_app: typer.Typer) -> None:
    @history_app.command("whatif")
    def whatif(
        context: typer.Context,
        trace: Annotated[
            Path,
            typer.Argument(help="An export of `gpusched history export` (.csv or .jsonl)."),
        ],
        policy: Annotated[
            list[str] | None,
            typer.Option(help="A policy to replay (repeatable, or a,b). Default: every "
                         "policy the jobs allow (see `gpusched policies`)."),
        ] = None,
        cluster: Annotated[
            str | None,
            typer.Option(help="The cluster to replay on: a cluster file (.json) or "
                         "NODESxGPUS. Default: TRACE.cluster.json, written by the export."),
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option(help="Folder for summary.json (with the live figures), jobs.csv, "
                         "plots and report.html, as `gpusched simulate` writes them."),
        ] = None,
        data_dir: Annotated[
            Path | None,
            typer.Option(help="Research data folder, as the admission service was given "
                         "(for models the built-in profiles lack)."),
        ] = None,
        restart_overhead_s: Annotated[
            float,
            typer.Option(min=0.0, help="Seconds a preempted or resized job spends restoring "
                         "when it restarts. Emulated nodes resume a run at once: 0 for "
                         "their exports."),
        ] = RESTART_OVERHEAD_S,
        round_s: Annotated[
            float | None,
            typer.Option(help="Call the policy every S seconds of the jobs' own time as "
                         "well as when jobs arrive or end, as the live scheduler decides "
                         "every decide_every_s of wall time (at time scale T: "
                         "decide_every_s / T). Default: only on events."),
        ] = None,
        decision_delay_s: Annotated[
            float,
            typer.Option(min=0.0, help="Each job reaches the policy this many seconds of "
                         "its own time after its submission (the live submission, round "
                         "and start command); its completion time still counts from the "
                         "submission. Ends are not delayed."),
        ] = 0.0,
    ) -> None:
        """Replay your exported jobs under every policy and compare each with what the
        live cluster really did: mean and p99 JCT, mean queueing, GPU-hours."""
        _whatif(context, trace, policy, cluster, out, data_dir,
                Replay(restart_overhead_s, round_s, decision_delay_s))


@dataclass(frozen=True)
class Replay:
    """How the replay runs: the simulator's restart overhead and rounds, and the delay
    before each job reaches the policy (seconds of the jobs' own time)."""

    restart_overhead_s: float = RESTART_OVERHEAD_S
    round_s: float | None = None
    decision_delay_s: float = 0.0

    def note(self) -> str:
        rounds = "on events only" if self.round_s is None else (
            f"on events and every {self.round_s:g} s")
        return (f"replay: restart overhead {self.restart_overhead_s:g} s, policy called "
                f"{rounds}, jobs reach it {self.decision_delay_s:g} s after submission")


def _whatif(
    context: typer.Context,
    trace: Path,
    policy: list[str] | None,
    cluster: str | None,
    out: Path | None,
    data_dir: Path | None,
    settings: Replay | None = None,
) -> None:
    from gpusched.libs.core.perf import UnknownModelError
    from gpusched.libs.core.traces import TraceError, load_trace
    from gpusched.services.scheduler.policies import UnknownPolicyError
    from gpusched.services.scheduler.simulation import whatif as figures
    from gpusched.services.scheduler.simulation.runner import (
        InputError,
        build_models,
        check_policies,
        check_round_s,
        load_workload,
        run_policies,
    )
    from gpusched.services.scheduler.simulation.simulator import PolicyViolation, SimConfig

    out_console, err = Console(), Console(stderr=True)
    if not out_console.is_terminal:
        out_console.width = max(out_console.width, 120)
    if not trace.is_file():
        _fail(err, f"TRACE {trace}: no such file (write one with `gpusched history export "
              "--out FILE.csv`)")
    settings = settings or Replay()
    try:
        check_round_s(settings.round_s)
    except InputError as exc:
        _fail(err, str(exc))
    if not math.isfinite(settings.decision_delay_s):
        _fail(err, f"--decision-delay-s {settings.decision_delay_s:g}: expected seconds >= 0")
    config = SimConfig(restart_overhead_s=settings.restart_overhead_s, round_s=settings.round_s)
    named = [p.strip() for item in policy or [] for p in item.split(",") if p.strip()]
    try:
        names = check_policies(named)
    except UnknownPolicyError as exc:
        _fail(err, f"--policy: {exc}")
    if out is not None:
        from gpusched.services.scheduler.simulation.report import output_problem

        problem = output_problem(out)
        if problem:
            _fail(err, f"--out {out}: {problem}")
    built = _cluster(err, trace, cluster, data_dir)
    try:
        exported = load_trace(trace, "native").jobs
        truth, _ = build_models(data_dir)
        # the shapes the live cluster measured are timed by what it measured
        truth, measured_note = figures.measured_over(exported, truth, built)
        workload = load_workload(trace, "native", truth, data_dir=data_dir, cluster=built)
    except (TraceError, InputError, UnknownModelError) as exc:
        _fail(err, str(exc))
    names = _runnable(err, names, workload.jobs, explicit=bool(named))
    if not names:
        _fail(err, "no policy left to replay the jobs with")
    live, live_note = figures.live_figures(exported)
    try:
        arriving = figures.delayed(workload.jobs, settings.decision_delay_s)
        results = [figures.from_submission(result, workload.jobs) for result in
                   run_policies(arriving, built, names, truth, config=config)]
    except PolicyViolation as exc:
        _fail(err, f"policy broke a cluster invariant: {exc}", code=1)
    replayed = [figures.simulated_figures(result) for result in results]
    winner = figures.best(replayed, live)
    out_console.print(_table(live, replayed, trace))
    if live_note:
        out_console.print(Text(f"note: {live_note}"), soft_wrap=True)
    states = figures.live_states(exported)
    if states:
        said = ", ".join(f"{n} {state}" for state, n in states.items())
        out_console.print(Text(f"live: {said}; each replay runs the iterations each job "
                               "really ran", style="dim"), soft_wrap=True)
    out_console.print(Text(figures.best_line(winner, live)), soft_wrap=True)
    out_console.print(Text(f"timing: {measured_note}", style="dim"), soft_wrap=True)
    out_console.print(Text(settings.note(), style="dim"), soft_wrap=True)
    if out is not None:
        _write(out_console, err, context, out, results, built,
               [*workload.notes, measured_note, settings.note()], live, replayed, winner,
               live_note)


def _cluster(err: Console, trace: Path, cluster: str | None, data_dir: Path | None) -> Cluster:
    from gpusched.libs.core.cluster_file import (
        CLUSTER_FILE_SUFFIX,
        ClusterFileError,
        load_cluster_file,
    )
    from gpusched.services.scheduler.simulation.runner import InputError, build_cluster

    spec = cluster if cluster is not None else f"{trace}{CLUSTER_FILE_SUFFIX}"
    if spec.strip().lower().endswith(".json"):
        path = Path(spec.strip())
        if not path.is_file():
            given = "--cluster" if cluster is not None else "the cluster file beside the trace,"
            _fail(err, f"{given} {path}: no such file; give --cluster FILE.json (the export "
                  "writes TRACE.cluster.json) or --cluster NODESxGPUS")
        try:
            return load_cluster_file(path)
        except ClusterFileError as exc:
            _fail(err, f"--cluster: {exc}")
    try:
        return build_cluster(spec, data_dir)
    except (InputError, ValueError) as exc:
        _fail(err, f"--cluster: {exc}")


def _runnable(
    err: Console, names: list[str], jobs: list[JobSpec], *, explicit: bool
) -> list[str]:
    """The policies that can replay these jobs: a policy whose progress predictor needs
    torch (ones) where it is installed, and only policies that honour priorities when
    the jobs carry some. One named with --policy that cannot stops the command; one of
    the default list is left out, saying why."""
    from gpusched.libs.core.extras import TRAIN, MissingExtraError, require
    from gpusched.services.scheduler.policies import honours_priority, make_policy

    prioritized = any(job.priority for job in jobs)
    kept = []
    for name in names:
        made = make_policy(name)
        problem = None
        try:
            if made.capabilities.predicts_progress:
                require("torch", TRAIN, f"policy {name} (its progress predictor)")
        except MissingExtraError as exc:
            problem = str(exc)
        if problem is None and prioritized and not honours_priority(made):
            problem = (f"policy {name} does not honour priorities (it re-plans every job's "
                       "size) and the export gives some jobs one")
        if problem is None:
            kept.append(name)
        elif explicit:
            _fail(err, f"--policy {name}: {problem}")
        else:
            err.print(Text(f"left out: {problem}", style="dim"), soft_wrap=True)
    return kept


def _table(live: Figures | None, replayed: list[Figures], trace: Path) -> Table:
    table = Table(title=f"What if: {trace.name}", title_justify="left", box=box.SIMPLE_HEAD)
    for header in ("", "jobs ended", "mean JCT (s)", "p99 JCT (s)", "mean queue (s)",
                   "GPU-hours"):
        table.add_column(header, justify="left" if not header else "right", no_wrap=True)
    if live is None:
        table.add_row("live", "-", "missing", "missing", "missing", "missing", style="dim")
    else:
        table.add_row(*_cells(live), style="bold")
    for row in replayed:
        table.add_row(*_cells(row))
    return table


def _cells(row: Figures) -> tuple[str, ...]:
    return (row.name, f"{row.ended}/{row.jobs}", _number(row.mean_jct_s),
            _number(row.p99_jct_s), _number(row.mean_queue_s), f"{row.gpu_hours:.3f}")


def _number(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.1f}"


def _write(
    out_console: Console,
    err: Console,
    context: typer.Context,
    out: Path,
    results: list[SimResult],
    built: Cluster,
    notes: list[str],
    live: Figures | None,
    replayed: list[Figures],
    winner: Best | None,
    live_note: str,
) -> None:
    from dataclasses import asdict, replace

    from gpusched.services.scheduler.simulation.report import SUMMARY_FILE, write_outputs
    from gpusched.services.scheduler.simulation.report_html import RunInfo

    run = RunInfo.from_context(context, cluster=built, policies=[r.policy for r in results],
                               notes=notes)
    run = replace(run, command="gpusched history whatif")
    try:
        paths = write_outputs(results, out, {"whatif": True}, run)
        summary_path = out / SUMMARY_FILE
        document = json.loads(summary_path.read_text(encoding="utf-8"))
        document["whatif"] = {
            "live": None if live is None else live.as_dict(),
            "live_note": live_note or None,
            "policies": [row.as_dict() for row in replayed],
            "best": None if winner is None else asdict(winner),
        }
        summary_path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n",
                                encoding="utf-8")
    except OSError as exc:
        _fail(err, f"--out {out}: cannot write: {exc.strerror or exc}", code=1)
    names = ", ".join(p.name for p in paths)
    out_console.print(Text(f"wrote {names} to {out}"), soft_wrap=True)


def _fail(console: Console, message: str, code: int = USAGE_EXIT) -> NoReturn:
    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    raise typer.Exit(code)
