"""``gpusched up`` and ``gpusched service NAME``: run the system."""

from __future__ import annotations

import asyncio
import os
import signal
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from gpusched.services.cli.up import LocalCluster


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
        emulate_gpus: Annotated[
            int | None,
            typer.Option(
                "--emulate-gpus", "--gpus-per-node",
                help="Emulate this many GPUs per node, even where real ones exist "
                "(default: the GPUs NVML finds, else 4 emulated per node).",
            ),
        ] = None,
        nodes: Annotated[
            int | None,
            typer.Option(help="Emulated node agents (default 2 when emulating; 0: none, "
                         "only nodes that join)."),
        ] = None,
        gpu_model: Annotated[str, typer.Option(help="Emulated GPU, e.g. V100-32GB.")] = (
            "V100-32GB"
        ),
        join: Annotated[
            list[str] | None,
            typer.Option(help="Admit a node agent of this name from another machine "
                         "(repeatable); prints the command it runs. See "
                         "`gpusched node add`."),
        ] = None,
        nats_host: Annotated[
            str, typer.Option(help="Address the embedded NATS listens on (0.0.0.0: other "
                              "machines' node agents may join).")
        ] = "127.0.0.1",
        nats_port: Annotated[
            int, typer.Option(help="Port of the embedded NATS (0: any free port).")
        ] = 0,
        fresh: Annotated[
            bool, typer.Option(help="Forget the jobs, store and checkpoints an earlier "
                               "`up` left in the state directory, and start clean.")
        ] = False,
        job_user: Annotated[
            str, typer.Option(help="Who job processes run as: auto (the system user "
                              "gpusched-job, created where missing; needs root), a user "
                              "name or uid, or self (this user: jobs can read its "
                              "secrets). docs/security.md.")
        ] = "auto",
        policy: Annotated[str, typer.Option(help="One of `gpusched policies`.")] = "auto",
        host: Annotated[str, typer.Option(help="Address the HTTP API listens on.")] = (
            "127.0.0.1"
        ),
        port: Annotated[int, typer.Option(help="HTTP API port (0: any free port).")] = 8080,
        jobs: Annotated[
            JobsMode | None,
            typer.Option(help="simulated: jobs advance at profiled speed; process: real "
                         "torch (default: process on real GPUs, simulated on emulated)."),
        ] = None,
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
        """Start a whole local cluster: nats-server, the services, and a node agent over
        this machine's GPUs (emulated nodes where NVML finds none, or when asked)."""
        from gpusched.libs.common.logging import configure_logging
        from gpusched.services.cli.client import up_file
        from gpusched.services.cli.up import LocalCluster, UpConfig
        from gpusched.services.scheduler.policies import POLICIES, UnknownPolicyError

        err = Console(stderr=True, soft_wrap=True)
        try:
            if policy.strip().lower() not in POLICIES:
                raise UnknownPolicyError(policy)
            config = UpConfig(
                nodes=nodes, gpus_per_node=emulate_gpus, gpu_model=gpu_model, policy=policy,
                host=host, port=port, jobs_mode=jobs.value if jobs else None,
                time_scale=time_scale, state_dir=state_dir or up_file().parent,
                data_dir=data_dir, token=token, max_resident_slowdown=max_resident_slowdown,
                nats_cluster=nats_cluster, metrics_port=metrics_port if metrics else None,
                join=tuple(join or ()), nats_host=nats_host, nats_port=nats_port, fresh=fresh,
                job_user=job_user,
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
                print_banner(out, cluster, policy)
                await stop.wait()
                out.print("stopping...", style="dim")

        try:
            asyncio.run(run())
        except ValueError as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(2) from None
        except OSError as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(1) from None

    nodes_app = typer.Typer(help="Node agents that join from other machines.")
    app.add_typer(nodes_app, name="node")

    @nodes_app.command("add")
    def node_add(
        name: Annotated[str, typer.Argument(help="The joining node's name.")],
        state_dir: Annotated[
            Path | None,
            typer.Option(help="The running `gpusched up`'s state directory (default: the "
                         "one it recorded)."),
        ] = None,
    ) -> None:
        """Admit a node agent on another machine to the running `gpusched up`: mints its
        NATS user (its own node's subjects only) and prints the command it runs."""
        _add_node(name, state_dir)

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


def _add_node(name: str, state_dir: Path | None) -> None:
    import json

    from gpusched.services.cli.client import up_file
    from gpusched.services.cli.join import JoinError, Joins

    err = Console(stderr=True, soft_wrap=True)
    if state_dir is None:
        try:
            state_dir = Path(json.loads(up_file().read_text())["state_dir"])
        except (OSError, ValueError, KeyError):
            state_dir = up_file().parent
    joins = Joins(state_dir)
    try:
        command = joins.add(name)
    except JoinError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    out = Console(soft_wrap=True)
    out.print(f"node {name} may join. On its machine (gpusched installed), run:")
    out.print(f"  {command}", highlight=False)


def cli_command() -> str:
    """How this shell reaches the CLI: ``gpusched`` where that is the one on PATH, else
    the path it was started by (``.venv/bin/gpusched``), else ``python -m``."""
    import shutil
    import sys

    found = shutil.which("gpusched")
    here = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if here is not None and here.name == "gpusched" and here.exists():
        if found and Path(found).resolve() == here.resolve():
            return "gpusched"
        return str(here)
    if found:
        return "gpusched"
    return f"{sys.executable} -m gpusched.services.cli.main"


def print_banner(out: Console, cluster: LocalCluster, policy: str) -> None:
    """What ``up`` started and how to use it."""
    plan = cluster.plan
    assert plan is not None
    cli = cli_command()
    out.print(plan.banner(policy))
    out.print(f"  {'GPUs':<9} {plan.why}", highlight=False)
    lines = [
        ("API", cluster.url),
        ("dashboard", f"{cluster.url}/ (asks for the token)"),
        ("token", cluster.token),
        ("NATS", cluster.nats_url),
        ("metrics", cluster.metrics_url),
        ("try", f"{cli} submit --model resnet50 --batch-size 64 --iterations 500; "
                f"{cli} jobs"),
    ]
    for label, value in lines:
        if value:
            out.print(f"  {label:<9} {value}", highlight=False)
    from gpusched.services.nodeagent.jobuser import DEFAULT_JOB_USER, start_warning

    warning = start_warning(cluster.config.job_user)
    if warning:
        out.print(f"  {'jobs':<9} [bold red]WARNING:[/] {warning}", highlight=False)
    else:
        who = DEFAULT_JOB_USER if cluster.config.job_user == "auto" else cluster.config.job_user
        out.print(f"  {'jobs':<9} run as user {who}, each in its own directory under "
                  f"{cluster.work_dir}", highlight=False)
    if cluster.resumed_jobs:
        out.print(
            f"  {'resumed':<9} {cluster.resumed_jobs} unfinished job"
            f"{'s' if cluster.resumed_jobs != 1 else ''} of an earlier run in "
            f"{cluster.config.state_dir} (`{cli} up --fresh` starts clean)",
            highlight=False,
        )
    for node, command in cluster.join_commands.items():
        out.print(f"  {'join':<9} on the machine of node {node}: {command}", highlight=False)
    if cluster.credentials is not None:
        if cluster.config.nats_host.startswith("127."):
            where = "(NATS listens on this machine only: --nats-host 0.0.0.0 lets others in)"
        else:
            where = ""
        out.print(f"  {'add node':<9} {cli} node add NAME {where}".rstrip(), highlight=False)
    out.print("Ctrl-C stops everything.", style="dim")


def _nodeagent(
    nodes: int, name: str | None, gpus: int | None, gpu_model: str | None,
    jobs: JobsMode | None,
) -> None:
    from gpusched.libs.common.logging import configure_logging
    from gpusched.services.nodeagent.__main__ import serve
    from gpusched.services.nodeagent.config import NodeAgentConfig

    err = Console(stderr=True, soft_wrap=True)
    if nodes < 1:
        err.print("[bold red]error:[/] --nodes: must be >= 1")
        raise typer.Exit(2)
    try:
        config = NodeAgentConfig.from_env(
            name=name, gpus=gpus, gpu_model=gpu_model, jobs_mode=jobs.value if jobs else None,
            # a node agent of its own runs jobs as a user of their own unless told otherwise
            job_user=None if os.environ.get("GPUSCHED_JOB_USER") else "auto",
        )
        check_credential_names_node(config.nats_url, config.name, nodes)
    except ValueError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    configure_logging()
    try:
        asyncio.run(serve(config, nodes))
    except ConnectionError as exc:
        err.print(
            f"[bold red]error:[/] {exc}. A node joins a `gpusched up` cluster with the "
            "command `gpusched node add NAME` prints on the cluster's machine.",
            highlight=False,
        )
        raise typer.Exit(1) from None


def check_credential_names_node(nats_url: str, node: str, nodes: int) -> None:
    """A node agent's NATS user speaks for one node: the agent must carry its name."""
    from gpusched.libs.common.bus import credentials
    from gpusched.libs.common.natsauth import node_of_user

    user = credentials(nats_url).get("user")
    named = node_of_user(user) if user else None
    if named is None:
        return
    if nodes != 1:
        raise ValueError(f"--nodes: the NATS user {user} speaks for node {named} alone")
    if named != node:
        raise ValueError(
            f"--name: {node!r} is not the node of the NATS user {user} (it is {named!r})"
        )
