"""``gpusched profile``: measure models on this machine's GPU (or CPU) with the training
worker's ``--profile`` and write them to a measured profile file (docs/profiles.md),
the file ``gpusched simulate --profiles`` reads."""

from __future__ import annotations

import asyncio
import platform
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpusched.libs.core.profiles.measured import (
    GpuProfile,
    read_profile,
    with_figures,
    write_profile,
)

DEVICES = ("auto", "cuda", "cpu")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def register(app: typer.Typer) -> None:
    @app.command()
    def profile(
        models: Annotated[list[str], typer.Argument(help="Models to measure, e.g. resnet50.")],
        batch: Annotated[
            list[int] | None,
            typer.Option(
                "--batch",
                "-b",
                min=1,
                help="Per-GPU batch to measure; repeat for several (default: each model's "
                "default batch and its half).",
            ),
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option(help="Measured profile file to write; an existing one of the same "
                         "device gets these figures added."),
        ] = None,
        device: Annotated[
            str, typer.Option(help="cuda, cpu, or auto (cuda where torch sees a GPU).")
        ] = "auto",
        repeats: Annotated[int, typer.Option(min=1, help="Timed iterations per batch.")] = 10,
        warmup: Annotated[int, typer.Option(min=0, help="Iterations before timing.")] = 3,
        threads: Annotated[
            int | None, typer.Option(min=1, help="torch CPU threads (default: 1).")
        ] = None,
    ) -> None:
        """Measure iteration time and peak memory of models on this machine's GPU type."""
        err = Console(stderr=True)
        try:
            profile_ = _measure(models, batch or [], device, repeats, warmup, threads, out)
        except (ValueError, RuntimeError) as exc:
            err.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
            raise typer.Exit(2) from None
        _show(Console(), profile_, models)
        if out is not None:
            write_profile(out, profile_)
            err.print(f"wrote {out}", highlight=False)


def _measure(
    models: list[str], batches: list[int], device: str, repeats: int, warmup: int,
    threads: int | None, out: Path | None,
) -> GpuProfile:  # fmt: skip
    from gpusched.libs.core.groundtruth import ProfilePerformanceModel
    from gpusched.services.nodeagent.gpu_profiling import (
        MeasureSettings,
        figures_from_report,
        measured_at,
        profiled_batches,
        run_worker_profile,
    )

    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    truth = ProfilePerformanceModel.builtin()
    for model in models:
        truth.profile(model)  # an unknown model: one line naming the known ones
    existing = read_profile(out) if out is not None and out.exists() else None
    settings = MeasureSettings(warmup=warmup, repeats=repeats)
    profile: GpuProfile | None = existing
    for model in models:
        wanted = sorted(set(batches)) or profiled_batches(truth.default_batch_size(model))
        report = asyncio.run(
            run_worker_profile(
                model, wanted, device=_device(device), settings=settings, threads=threads
            )
        )
        figures = figures_from_report(report, measured_at())
        name = str(report["device_name"]) if figures.device == "cuda" else f"CPU {cpu_name()}"
        if profile is not None and profile.gpu_name != name:
            raise ValueError(
                f"--out {out}: it profiles {profile.gpu_name!r}, this machine measured on "
                f"{name!r}; write to another file"
            )
        profile = with_figures(profile, name, figures)
    assert profile is not None
    return profile


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _show(console: Console, profile: GpuProfile, models: list[str]) -> None:
    table = Table(title=f"{profile.gpu_name} ({profile.gpu_type})")
    for column in ("model", "architecture", "device", "batch", "iteration ms", "memory MiB"):
        table.add_column(column, justify="right" if column[0] in "bim" else "left")
    for model in models:
        figures = profile.models[model]
        for point in figures.points:
            table.add_row(
                model, figures.architecture, figures.device, str(point.batch_size),
                f"{point.iteration_s * 1000:.3f}", f"{point.memory_mb:.0f}",
            )  # fmt: skip
    console.print(table)
