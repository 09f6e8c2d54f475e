"""``gpusched simulate``: replay a trace under several policies, print a table, write outputs.

A thin shell over `gpusched.services.scheduler.simulation.runner` and
`gpusched.services.scheduler.simulation.report`: it parses options (checked in
``simulate_options``), turns user mistakes into one-line errors (exit code 2) and shows
progress.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from gpusched.libs.core.cluster import DEFAULT_CPUS_PER_GPU, DEFAULT_HOST_MEM_GB_PER_GPU
from gpusched.services.cli.simulate_options import (
    DEFAULT_CLUSTER,
    UsageError,
    _build_cluster,
    _check_opt_bound,
    _check_out,
    _cluster_spec,
    _honouring_priorities,
    _measure_ids,
    _measured,
    _parse_mix,
    _policy_names,
    _slack,
    _synergy_workload,
    _trace_source,
    _user_errors,
    _with_extras,
)

if TYPE_CHECKING:
    from gpusched.libs.core.jobs import JobSpec
    from gpusched.libs.core.perf import PerformanceModel
    from gpusched.services.scheduler.simulation.report_html import RunInfo
    from gpusched.services.scheduler.simulation.results import SimResult
    from gpusched.services.scheduler.simulation.runner import (
        ProgressCallback,
        ProgressFactory,
    )
    from gpusched.services.scheduler.simulation.sweep import Executor

# Only what the options themselves need is imported above: the simulator, its policies,
# numpy, scipy and matplotlib are imported by the commands that use them, so that
# `gpusched decode` (run once per message by `nats sub --translate`) starts quickly.


USAGE_EXIT = 2
#: Ctrl-C, as a shell reports a command stopped by SIGINT (128 + 2)
INTERRUPTED_EXIT = 130
#: below this width rich squeezes the results table into unreadable wrapped cells
MIN_TABLE_WIDTH = 160


class SpeedModel(StrEnum):
    """How a job's CPU/memory allocation sets its speed; mirrors
    `gpusched.libs.core.groundtruth.SPEED_MODELS`."""

    grid = "grid"
    binary = "binary"


class TraceFormat(StrEnum):
    """Trace file formats; mirrors `gpusched.libs.core.traces.FORMATS`."""

    philly = "philly"
    alibaba = "alibaba"
    pollux = "pollux"
    native = "native"


_DATA_DIR_HELP = (
    "Folder of research data laid out like traces/... and profiles/... "
    "(see docs/trace-format.md), e.g. ../shared/data. Relative trace paths are also "
    "looked up there. Default: the built-in performance profiles."
)


def register(app: typer.Typer) -> None:
    app.command()(simulate)


def simulate(
    context: typer.Context,
    out: Annotated[Path, typer.Option(help="Folder for summary.json, jobs.csv and plots.")],
    trace: Annotated[
        str | None, typer.Option(
            help="Trace file, or generated jobs: synthetic:N, recurring:N, synergy:N, "
            "mixed:N[,load=L,...] (README, docs/trace-format.md)."
        )
    ] = None,
    fmt: Annotated[
        TraceFormat | None,
        typer.Option("--format", help="Format of the trace file (required with a file)."),
    ] = None,
    synthetic_jobs: Annotated[
        int | None,
        typer.Option("--synthetic", min=1, help="Generate N jobs instead of reading --trace."),
    ] = None,
    rate: Annotated[
        float, typer.Option(min=0.001, help="Arrival rate of generated jobs, per hour.")
    ] = 10.0,
    cluster: Annotated[
        str | None,
        typer.Option(
            help=f"NODESxGPUS (default {DEFAULT_CLUSTER}), groups of one GPU type each "
            "(NODESxGPUS:TYPE,..., e.g. 8x4:V100,8x4:P100,16x4:K80), 'alibaba' for the "
            "Alibaba node list in --data-dir, or a cluster file (.json, as `gpusched "
            "history export` writes beside its trace)."
        ),
    ] = None,
    nodes_file: Annotated[
        Path | None, typer.Option(help="Alibaba-style node list CSV to use as the cluster.")
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            help="Policy to run; repeat for several. Default: all (`gpusched policies` "
            "lists them).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for models, generated jobs and noise.")] = 0,
    data_dir: Annotated[Path | None, typer.Option(help=_DATA_DIR_HELP)] = None,
    profiles: Annotated[
        Path | None,
        typer.Option(
            help="Measured profile file of one GPU type (docs/profiles.md): its models' "
            "iteration times and memory replace the research profiles'."
        ),
    ] = None,
    skip_bad_rows: Annotated[
        bool,
        typer.Option(
            "--skip-bad-rows", help="Skip and count malformed trace rows instead of stopping."
        ),
    ] = False,
    limit: Annotated[
        int | None, typer.Option(min=1, help="Keep only the first N jobs by submit time.")
    ] = None,
    prediction_error: Annotated[
        float,
        typer.Option(
            min=0.0, help="Log-normal sigma of the scheduler's runtime estimates (0: exact)."
        ),
    ] = 0.0,
    restart_overhead: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds a preempted job spends restoring when it restarts."),
    ] = 30.0,
    mix: Annotated[
        str | None,
        typer.Option(
            help="Models for jobs without one, as name=weight,... (categories image, language, "
            "speech, recommendation, rl or model names). Default: image=20,language=70,speech=10."
        ),
    ] = None,
    max_resident_slowdown: Annotated[
        float | None,
        typer.Option(
            help="sjf-bsbf and sjf-ffs also refuse a partner they would slow down by more "
            "than this factor (>= 1; default: no cap, the rule as specified)."
        ),
    ] = None,
    multigpu: Annotated[
        bool,
        typer.Option(
            "--multigpu", help="--trace synergy:N jobs take Philly-like GPU counts, not 1 each."
        ),
    ] = False,
    measure_ids: Annotated[
        str | None,
        typer.Option(
            help="Report only the jobs whose ids end in a number in FIRST-LAST "
            "(e.g. 4000-4999, as Synergy measures); all jobs still run."
        ),
    ] = None,
    cpus_per_node: Annotated[
        int | None,
        typer.Option(
            help="CPU cores of every node (default: the cluster's own, "
            f"{DEFAULT_CPUS_PER_GPU} a GPU for NODESxGPUS)."
        ),
    ] = None,
    mem_gb_per_node: Annotated[
        float | None,
        typer.Option(
            help="Host memory GB of every node (default: the cluster's own, "
            f"{DEFAULT_HOST_MEM_GB_PER_GPU:g} a GPU for NODESxGPUS)."
        ),
    ] = None,
    speed_model: Annotated[
        SpeedModel,
        typer.Option(
            help="How CPU/memory allocations set speed: grid (read from Synergy's "
            "throughput grids, or the built-in sensitivity) or binary (Synergy's artifact: "
            "the best-case speed-up only with the whole best-case vector)."
        ),
    ] = SpeedModel.grid,
    round_s: Annotated[
        float | None,
        typer.Option(
            help="Call the policy every S seconds even when no job arrives or finishes "
            "(rounds in which a policy may re-plan CPU/memory). Default: only on events."
        ),
    ] = None,
    deadlines: Annotated[
        str | None,
        typer.Option(
            help="Give every job a deadline: submit time + s x its run time alone, s drawn "
            "uniformly (seeded) from LO-HI, e.g. 1.2-3; summary.json then reports qos_pct, "
            "the share of jobs that met theirs.",
        ),
    ] = None,
    opt_bound: Annotated[
        bool,
        typer.Option(
            "--opt-bound",
            help="After every decision, bound the total throughput of the jobs holding GPUs "
            "by Synergy-OPT (an integer program over the cluster's CPUs and memory) and "
            "report it beside the policy's own in summary.json (opt_bound). Slow: one "
            "program per decision with a new set of jobs.",
        ),
    ] = False,
    predictor: Annotated[
        str,
        typer.Option(
            help="Job sizes the policies see: truth (default), declared (what users say) "
            "or rf (a random forest trained on the jobs completed so far); summary.json "
            "then reports the prediction error.",
        ),
    ] = "truth",
    jobs_at_once: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            help="Policies run at a time, each in a process of its own (default: the "
            "cores); the results are those of one run after another.",
        ),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            help="Where the runs go: local (processes on this machine), dask (a Dask "
            "LocalCluster of --jobs workers) or dask:ADDRESS (a running Dask scheduler, "
            "e.g. dask:tcp://10.0.0.5:8786); dask needs the 'dask' extra.",
        ),
    ] = "local",
) -> None:
    """Replay a trace under one or more policies; print a table and write outputs."""
    from gpusched.libs.core.workload import with_deadlines
    from gpusched.services.scheduler.simulation.runner import (
        Interrupted,
        build_models,
        check_policies,
        check_round_s,
        load_workload,
        run_policies,
    )
    from gpusched.services.scheduler.simulation.simulator import PolicyViolation, SimConfig
    from gpusched.services.scheduler.simulation.sweep import default_workers

    out_console, err_console = _consoles()
    stopped: Interrupted | None = None
    try:
        source = _trace_source(trace, synthetic_jobs)
        cluster_spec = _cluster_spec(cluster, nodes_file)
        job_mix = _parse_mix(mix)
        # fail before a long trace load
        names = check_policies(_policy_names(policy), max_resident_slowdown)
        names = _with_extras(names, explicit=bool(policy), notes=err_console)
        check_round_s(round_s)
        from gpusched.services.scheduler.simulation.runner import check_predictor

        check_predictor(predictor)
        where = _executor(executor)
        workers = jobs_at_once or default_workers()
        _check_out(out)
        built = _build_cluster(cluster_spec, data_dir, cpus_per_node, mem_gb_per_node)
        if opt_bound:
            _check_opt_bound(built)
        truth, estimates = build_models(
            data_dir, prediction_error, seed, speed_model.value, profiles=profiles
        )
        measured = _measure_ids(measure_ids)
        slack = _slack(deadlines)
        workload = _synergy_workload(source, truth, seed, rate, multigpu, built) or load_workload(
            source,
            fmt.value if fmt else None,
            truth,
            seed=seed,
            data_dir=data_dir,
            skip_bad_rows=skip_bad_rows,
            limit=limit,
            rate_per_h=rate,
            mix=job_mix,
            cluster=built,
        )
        for note in workload.notes:
            err_console.print(Text(note, style="dim"), soft_wrap=True)
        jobs = workload.jobs
        if slack is not None:
            jobs = with_deadlines(jobs, truth, built, slack, seed)
        names = _honouring_priorities(names, jobs, explicit=bool(policy), notes=err_console)
        config = SimConfig(
            restart_overhead_s=restart_overhead, round_s=round_s, predictor=predictor
        )
        _announce(err_console, names, len(jobs), workers, where)
        with _progress_bars(err_console) as progress:
            try:
                results = run_policies(
                    jobs,
                    built,
                    names,
                    truth,
                    estimates,
                    config,
                    progress,
                    max_resident_slowdown=max_resident_slowdown,
                    on_finished=_finished_lines(err_console, len(names)),
                    opt_bound=opt_bound,
                    workers=workers,
                    executor=where,
                )
            except Interrupted as exc:  # Ctrl-C: report the policies that finished
                results, stopped = exc.finished, exc
    except _user_errors() as exc:
        _fail(err_console, str(exc))
    except PolicyViolation as exc:  # a policy bug, not a user mistake: exit 1
        _fail(err_console, f"policy broke a cluster invariant: {exc}", code=1)
    if stopped is not None and not results:
        _stop(err_console, stopped, "no policy had finished, so nothing was written")
    if measured is not None:
        results = [_measured(r, measured) for r in results]
    from gpusched.services.scheduler.simulation.report import summary_table

    out_console.print(summary_table(results))
    notes = _print_notes(out_console, results, jobs, truth)
    settings: dict[str, object] = {
        "cpus_per_node": cpus_per_node,
        "mem_gb_per_node": mem_gb_per_node,
        "speed_model": speed_model.value,
        "round_s": round_s,
    }
    if opt_bound:
        settings["opt_bound"] = True
    from gpusched.services.scheduler.simulation.report_html import RunInfo

    ran = [r.policy for r in results]
    run = RunInfo.from_context(context, cluster=built, policies=ran, notes=workload.notes)
    _write(out_console, err_console, results, out, settings, run, notes)
    if stopped is not None:
        _stop(err_console, stopped, f"the table and outputs cover the {len(ran)} that finished")


def _write(
    out_console: Console,
    err_console: Console,
    results: list[SimResult],
    out: Path,
    settings: dict[str, object],
    run: RunInfo | None = None,
    notes: Sequence[str] = (),
) -> None:
    from gpusched.services.scheduler.simulation.report import write_outputs

    try:
        paths = write_outputs(results, out, settings, run, notes)
    except OSError as exc:
        _fail(err_console, f"cannot write outputs to {out}: {exc.strerror or exc}")
    names = ", ".join(p.name for p in paths)
    out_console.print(Text(f"wrote {names} to {out}"), soft_wrap=True)


# ------------------------------------------------------------------------ output helpers


def _consoles() -> tuple[Console, Console]:
    out, err = Console(), Console(stderr=True)
    if not out.is_terminal:  # piped or captured: no width to fit, so do not squeeze
        out.width = max(out.width, MIN_TABLE_WIDTH)
    return out, err


@contextmanager
def _progress_bars(console: Console) -> Iterator[ProgressFactory | None]:
    """One bar per policy on a terminal; nothing when output is captured or piped."""
    if not console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("jobs"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:

        def factory(name: str, total: int) -> ProgressCallback:
            task = progress.add_task(name, total=total)
            last = [-1]

            def update(done: int, _total: int) -> None:
                # the simulator reports often with the same count; redraws are not free
                if done != last[0]:
                    last[0] = done
                    progress.update(task, completed=done)

            return update

        yield factory


def _executor(spec: str) -> Executor:
    """``--executor``; without the dask extra, `MissingExtraError` names it."""
    from gpusched.services.scheduler.simulation.sweep import Executor

    try:
        return Executor.parse(spec)
    except ValueError as exc:
        raise UsageError(f"--executor {spec!r}: {exc}") from None


def _announce(
    console: Console, names: Sequence[str], n_jobs: int, workers: int, where: Executor
) -> None:
    """What is about to run, and about how long it takes (``runner.estimate_s``)."""
    from gpusched.services.scheduler.simulation.report import human_duration
    from gpusched.services.scheduler.simulation.runner import estimate_s

    count = f"{len(names)} polic{'y' if len(names) == 1 else 'ies'}"
    each = [estimate_s([name], n_jobs) for name in names]
    at_once = min(workers, len(names))
    how = "one after another" if at_once == 1 else f"{at_once} at a time"
    if where.address is not None:
        # a running Dask cluster: how many workers it has is its own affair
        at_once, how = 1, f"on the workers of {where}"
    elif where.kind != "local":
        how += f" on {where}"
    # no faster than the slowest run, however many run beside it
    took = human_duration(max(max(each, default=0.0), sum(each) / at_once))
    console.print(
        Text(
            f"running {count} on {n_jobs:,} jobs, {how} ({', '.join(names)}): "
            f"about {took} on a 2-core machine (per-policy rates: docs/results.md)"
        ),
        soft_wrap=True,
    )


def _finished_lines(console: Console, total: int) -> Callable[[SimResult], None]:
    """A line per policy as its run ends, on a terminal or not."""
    done = [0]

    def finished(result: SimResult) -> None:
        done[0] += 1
        console.print(
            Text(f"finished {result.policy} in {result.wall_s:.1f} s ({done[0]} of {total})"),
            soft_wrap=True,
        )

    return finished


def _print_notes(
    console: Console, results: Sequence[SimResult], jobs: Sequence[JobSpec], truth: PerformanceModel
) -> list[str]:
    """Under the table, the facts that explain a figure (``result_notes``)."""
    from gpusched.services.scheduler.simulation.result_notes import WorkloadFacts, result_notes

    notes = result_notes(results, WorkloadFacts.of(jobs, truth))
    for note in notes:
        console.print(Text(f"note: {note}"), soft_wrap=True)
    return notes


def _stop(console: Console, stopped: KeyboardInterrupt, what: str) -> NoReturn:
    """Ctrl-C during the runs: say what was kept, exit 130 as a shell does on SIGINT."""
    console.print(Text(f"{stopped}: {what}", style="bold yellow"), soft_wrap=True)
    raise typer.Exit(INTERRUPTED_EXIT)


def _fail(console: Console, message: str, code: int = USAGE_EXIT) -> NoReturn:
    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    raise typer.Exit(code)
