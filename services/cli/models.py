"""``gpusched models``: every built-in model, the real architecture it trains and the small
stand-in it trains on a CPU (no torch needed: the figures come from the worker's registry,
which a test holds against the built networks)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

USAGE_EXIT = 2


def parameters_text(count: int) -> str:
    """A parameter count in millions: 25,557,032 -> "25.6 M", 2,278,604 -> "2.28 M"."""
    millions = count / 1e6
    return f"{millions:.1f} M" if millions >= 10 else f"{millions:.2f} M"


def register(app: typer.Typer) -> None:
    @app.command("models")
    def list_models(
        name: Annotated[
            str | None, typer.Argument(help="One model (default: every built-in model).")
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print JSON (exact parameter counts).")
        ] = False,
    ) -> None:
        """List the built-in models: the real architecture each trains (its parameters and
        input shape), the default on a CUDA device, and the stand-in each trains on the CPU.
        The worker's --architecture real|stand-in|auto (or GPUSCHED_WORKER_ARCHITECTURE)
        chooses."""
        from gpusched.services.nodeagent.worker.catalog import UnknownModelNameError
        from gpusched.services.nodeagent.worker.registry import builtin_model, builtin_models

        try:
            models = [builtin_model(name)] if name is not None else builtin_models()
        except UnknownModelNameError as error:
            message = Text.assemble(("error: ", "bold red"), f"model: {error}")
            Console(stderr=True).print(message, soft_wrap=True)
            raise typer.Exit(USAGE_EXIT) from None
        if as_json:
            typer.echo(json.dumps([model.as_json() for model in models], indent=2))
            return
        table = Table(
            show_header=True,
            box=None,
            caption="real: the default on a CUDA device; stand-in: on the CPU. "
            "* not a profile name: the worker trains it when named, a submitted job "
            "names a profile.",
        )
        table.add_column("model", style="cyan", no_wrap=True)
        table.add_column("architecture (real)")
        table.add_column("parameters", justify="right", no_wrap=True)
        table.add_column("input")
        table.add_column("stand-in (CPU)", no_wrap=True)
        for model in models:
            arch = model.architecture
            table.add_row(
                model.name if model.profile else f"{model.name} *",
                arch.text,
                parameters_text(arch.parameters),
                arch.input_text(),
                model.stand_in_text,
            )
        Console().print(table)
