"""The ``gpusched`` command line: the typer app, ``gpusched policies``, and every other
command registered from its own module (``simulate``, ``live``, ``history``, ``models``,
``serve``, ``profile``).

Only what the options themselves need is imported at the top of those modules: the
simulator, its policies, numpy, scipy and matplotlib are imported by the commands that use
them, so that `gpusched decode` (run once per message by `nats sub --translate`) starts
quickly.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from gpusched.services.cli.history import register as register_history_commands
from gpusched.services.cli.live import register as register_live_commands
from gpusched.services.cli.models import register as register_models_command
from gpusched.services.cli.profile import register as register_profile_command
from gpusched.services.cli.serve import register as register_service_commands
from gpusched.services.cli.simulate import TraceFormat as TraceFormat  # importable here too
from gpusched.services.cli.simulate import register as register_simulate_command

app = typer.Typer(
    name="gpusched",
    help="Schedule deep-learning training jobs on GPU clusters, and replay traces offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# first in `gpusched --help`, before `policies`, as the command line's main use
register_simulate_command(app)


@app.command("policies")
def list_policies() -> None:
    """List the scheduling policies with a one-line description each."""
    from gpusched.services.scheduler.policies import POLICIES, make_policy

    table = Table(show_header=True, box=None)
    table.add_column("policy", style="cyan", no_wrap=True)
    table.add_column("description")
    for name in POLICIES:
        table.add_row(name, POLICY_LINES.get(name) or _first_doc_line(make_policy(name)))
    Console().print(table)


#: one line per policy for `gpusched policies`; several policies are one class with other
#: settings (sjf-ffs and sjf-bsbf, the synergy-* orders), so a docstring cannot tell them
#: apart. A policy missing here shows its class docstring's first line.
POLICY_LINES = {
    "fifo": "First come, first served; the head of the queue blocks the rest.",
    "fifo-backfill": "First come, first served with backfilling: a later job that fits "
    "the idle GPUs starts.",
    "sjf": "Shortest predicted job first, non-preemptive, skipping jobs that do not fit.",
    "edf": "Earliest deadline first, non-preemptive, skipping jobs that do not fit; jobs "
    "without a deadline last.",
    "genie": "GENIE: shortest waiting allowance before the deadline first, fastest free "
    "placement (our design from the paper's abstract).",
    "srtf": "Shortest remaining time first, preemptive, with oracle sizes (a simulator-only "
    "baseline).",
    "tiresias": "Tiresias 2D-LAS: preemptive, least attained GPU service first, in "
    "discretised queues.",
    "sjf-ffs": "SJF with first-fit sharing: a job that finds no idle GPUs shares GPUs "
    "holding one job whenever memory fits, without the benefit test.",
    "sjf-bsbf": "SJF, best sharing benefit first: a job shares GPUs holding one job only "
    "when that lowers the pair's mean completion time.",
    "synergy-fifo": "Synergy-TUNE in FIFO order: CPUs and memory by sensitivity, never "
    "below anyone's fair share.",
    "synergy-srtf": "Synergy-TUNE in oracle shortest-remaining-time order: CPUs and memory "
    "by sensitivity, never below anyone's fair share.",
    "synergy-las": "Synergy-TUNE in least-attained-service order: CPUs and memory by "
    "sensitivity, never below anyone's fair share.",
    "asrpt": "A-SRPT: preemptive SRPT on predicted virtual work (GPUs x remaining time) "
    "with backfilling; preempts only jobs whose restart is cheap (our design).",
    "ones": "ONES: each job's GPU count and batch chosen by an online genetic search (its "
    "progress predictor needs torch: the train extra).",
}


def _first_doc_line(obj: object) -> str:
    """The first sentence of the class docstring's first paragraph, on one line."""
    paragraph = (type(obj).__doc__ or "").strip().split("\n\n")[0]
    line = " ".join(paragraph.split())
    end = line.find(". ")
    first = line if end < 0 else line[: end + 1]
    return first.replace("``", "")  # reST literals read as noise in a terminal


register_live_commands(app)
register_history_commands(app)
register_models_command(app)
register_service_commands(app)
register_profile_command(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
