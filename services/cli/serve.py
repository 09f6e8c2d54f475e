"""``gpusched up`` and ``gpusched service NAME``: run the system."""

from __future__ import annotations

import asyncio
import signal
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console


class ServiceName(StrEnum):
    admission = "admission"
    scheduler = "scheduler"
    predictor = "predictor"
    nodeagent = "nodeagent"


class JobsMode(StrEnum):
    simulated = "simulated"
    process = "process"


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        nodes: Annotated[int, typer.Option(help="Emulated node agents to start.")] = 2,
        gpus_per_node: Annotated[int, typer.Option(help="Emulated GPUs per node.")] = 4,
        gpu_model: Annotated[str, typer.Option(help="Emulated GPU, e.g. V100-32GB.")] = (
            "V100-32GB"
        ),
        policy: Annotated[str, typer.Option(help="One of `gpusched policies`.")] = (
            "sjf-bsbf"
        ),
        host: Annotated[str, typer.Option(help="Address the HTTP API listens on.")] = (
            "127.0.0.1"
        ),
        port: Annotated[int, typer.Option(help="HTTP API port (0: any free port).")] = 8080,
        jobs: Annotated[
            JobsMode,
            typer.Option(help="simulated: jobs advance at profiled speed; process: real torch."),
        ] = JobsMode.simulated,
        time_scale: Annotated[
            float, typer.Option(help="Wall seconds per profiled second for simulated jobs.")
        ] = 1.0,
        state_dir: Annotated[
            Path | None, typer.Option(help="JetStream data, checkpoints and job logs.")
        ] = None,
        data_dir: Annotated[
            Path | None, typer.Option(help="Research profiles (default: built-in).")
        ] = None,
        token: Annotated[str | None, typer.Option(help="API token (default: a new one).")] = None,
        nats_cluster: Annotated[
            int,
            typer.Option(help="Embedded NATS servers: 1, or a JetStream cluster of 3 or more "
                         "keeping every stream and bucket on 3 of them."),
        ] = 1,
        max_resident_slowdown: Annotated[
            float | None,
            typer.Option(
                help="sjf-bsbf and sjf-ffs also refuse a partner they would slow down by more "
                "than this factor (>= 1; default: no cap)."
            ),
        ] = None,
        metrics_port: Annotated[
            int,
            typer.Option(help="Port serving every service's Prometheus metrics at /metrics, "
                         "on the API's host (0: any free port; docs/metrics.md)."),
        ] = 9464,
        metrics: Annotated[
            bool, typer.Option(help="Serve the metrics (--no-metrics: do not).")
        ] = True,
    ) -> None:
        """Start a whole local cluster: nats-server, services and emulated nodes."""
        from gpusched.libs.common.logging import configure_logging
        from gpusched.services.cli.client import up_file
        from gpusched.services.cli.up import LocalCluster, UpConfig
        from gpusched.services.scheduler.policies import POLICIES, UnknownPolicyError

        err = Console(stderr=True)
        try:
            if policy.strip().lower() not in POLICIES:
                raise UnknownPolicyError(policy)
            config = UpConfig(
                nodes=nodes, gpus_per_node=gpus_per_node, gpu_model=gpu_model, policy=policy,
                host=host, port=port, jobs_mode=jobs.value, time_scale=time_scale,
                state_dir=state_dir or up_file().parent, data_dir=data_dir, token=token,
                max_resident_slowdown=max_resident_slowdown, nats_cluster=nats_cluster,
                metrics_port=metrics_port if metrics else None,
            )
        except ValueError as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(2) from None
        configure_logging()

        async def run() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            async with LocalCluster(config) as cluster:
                # soft wrap: a narrow terminal must not break a URL or command in two
                out = Console(soft_wrap=True)
                out.print(f"gpusched is up: {nodes} node{'s' if nodes != 1 else ''} x "
                          f"{gpus_per_node} GPUs, policy {policy}")
                lines = [
                    ("API", cluster.url),
                    ("dashboard", f"{cluster.url}/ (asks for the token)"),
                    ("token", cluster.token),
                    ("NATS", cluster.nats_url),
                    ("metrics", cluster.metrics_url),
                    ("try", "gpusched submit --model resnet50 --batch-size 64 "
                            "--iterations 500; gpusched jobs"),
                ]
                for label, value in lines:
                    if value:
                        out.print(f"  {label:<9} {value}", highlight=False)
                out.print("Ctrl-C stops everything.", style="dim")
                await stop.wait()
                out.print("stopping...", style="dim")

        try:
            asyncio.run(run())
        except OSError as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(1) from None

    @app.command()
    def service(
        name: Annotated[ServiceName, typer.Argument(help="Which service to run.")],
        nodes: Annotated[
            int, typer.Option(help="nodeagent: emulate this many nodes in one process.")
        ] = 1,
        node_name: Annotated[
            str | None, typer.Option("--name", help="nodeagent: node name (default: host).")
        ] = None,
        gpus: Annotated[
            int | None,
            typer.Option(help="nodeagent: emulate this many GPUs (default: NVML, else 8)."),
        ] = None,
        gpu_model: Annotated[
            str | None, typer.Option(help="nodeagent: emulated GPU, e.g. V100-32GB.")
        ] = None,
        jobs: Annotated[
            JobsMode | None, typer.Option(help="nodeagent: simulated or process runs.")
        ] = None,
    ) -> None:
        """Run one service against NATS_URL, configured from the environment (flags win)."""
        if name is ServiceName.admission:
            from gpusched.services.admission.__main__ import main as admission

            admission()
        elif name is ServiceName.scheduler:
            from gpusched.services.scheduler.__main__ import main as scheduler

            scheduler()
        elif name is ServiceName.predictor:
            from gpusched.services.predictor.__main__ import main as predictor

            predictor()
        else:
            _nodeagent(nodes, node_name, gpus, gpu_model, jobs)


def _nodeagent(
    nodes: int, name: str | None, gpus: int | None, gpu_model: str | None,
    jobs: JobsMode | None,
) -> None:
    from gpusched.libs.common.logging import configure_logging
    from gpusched.services.nodeagent.__main__ import serve
    from gpusched.services.nodeagent.config import NodeAgentConfig

    err = Console(stderr=True)
    if nodes < 1:
        err.print("[bold red]error:[/] --nodes: must be >= 1")
        raise typer.Exit(2)
    try:
        config = NodeAgentConfig.from_env(
            name=name, gpus=gpus, gpu_model=gpu_model, jobs_mode=jobs.value if jobs else None
        )
    except ValueError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    configure_logging()
    asyncio.run(serve(config, nodes))
