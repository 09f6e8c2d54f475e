"""Hundreds of emulated node agents in one process against one nats-server.

Starts an embedded nats-server (or uses --nats-url), runs --nodes agents with --gpus
emulated GPUs each in one child process (1 Hz heartbeats and telemetry; optionally some
simulated jobs per node, each sending a progress event per second), and measures from a
separate process for --seconds: the NATS message rate on ``gpusched.>`` by kind, and the
gaps between consecutive heartbeats of each node (any gap over 2 s is a missed
heartbeat). Also prints the agents' CPU use and their event loop's worst lag.

    python bench/nodeagents_scale.py [--nodes 200] [--gpus 8] [--seconds 10]
        [--jobs-per-node 0] [--connection-per-agent] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.common.schemas import CommandReply, Heartbeat, JobSpec, StartJob
from gpusched.services.nodeagent.cluster import EmulatedCluster

#: a heartbeat later than this after the previous one counts as missed
MISSED_GAP_S = 2.0
FOREVER = 10**9


# ---- the agents' process -------------------------------------------------------------


def serve_agents(
    url: str, nodes: int, gpus: int, share: bool, work_dir: str,
    ready: Any, stop: Any, lag_out: Any,
) -> None:
    configure_logging(level="error")
    asyncio.run(_serve_agents(url, nodes, gpus, share, work_dir, ready, stop, lag_out))


async def _serve_agents(
    url: str, nodes: int, gpus: int, share: bool, work_dir: str,
    ready: Any, stop: Any, lag_out: Any,
) -> None:
    cluster = EmulatedCluster.of(
        url, nodes, gpus_per_node=gpus, share_connection=share, work_dir=Path(work_dir),
        heartbeat_s=1.0, telemetry_s=1.0, progress_s=1.0,
    )
    loop = asyncio.get_running_loop()
    worst_lag = 0.0

    async def watch_lag() -> None:
        nonlocal worst_lag
        while True:
            before = loop.time()
            await asyncio.sleep(0.05)
            worst_lag = max(worst_lag, loop.time() - before - 0.05)

    async with cluster:
        ready.set()
        watcher = asyncio.create_task(watch_lag())
        await loop.run_in_executor(None, stop.wait)
        watcher.cancel()
    lag_out.value = worst_lag


# ---- the observer --------------------------------------------------------------------


@dataclass
class Tally:
    counting: bool = False
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: int = 0
    #: node -> (receipt time, sender's time) of each heartbeat while counting
    beats: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    seen_nodes: set[str] = field(default_factory=set)

    async def receive(self, msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind == "heartbeat":
            beat = codec.decode(msg.data, Heartbeat)
            self.seen_nodes.add(beat.node)
            if self.counting:
                self.beats[beat.node].append((time.monotonic(), beat.at))
        if self.counting:
            self.messages[kind] += 1
            self.bytes += len(msg.data) + len(msg.subject)


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """Intervals between beats, counting the silence at both edges of the window."""
    points = [start, *sorted(times), end]
    return [b - a for a, b in itertools.pairwise(points)]


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_jobs(url: str, nodes: int, per_node: int) -> int:
    started = 0
    spec = JobSpec(name="bench", model="resnet50", batch_size=64, iterations=FOREVER)
    async with connection(url, "bench-jobs") as nc:
        for node in range(nodes):
            for gpu in range(per_node):
                command = StartJob(
                    job_id=f"bench-{node}-{gpu}", run_id=1, spec=spec,
                    total_iterations=FOREVER, gpus=[gpu],
                )
                reply = await nc.request(
                    subjects.node_command(f"node-{node}"), codec.encode(command),
                    timeout=5, headers=codec.headers(),
                )
                started += codec.decode(reply.data, CommandReply).ok
    return started


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    lag = context.Value("d", 0.0)
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as work_dir:
        agents = context.Process(
            target=serve_agents,
            args=(url, args.nodes, args.gpus, not args.connection_per_agent, work_dir,
                  ready, stop, lag),
        )
        async with connection(url, "bench-observer") as nc:
            # the streams the agents store registrations and exits in (the services
            # create them; node agents may not)
            await Stores.open(nc)
            began = time.monotonic()
            agents.start()
            await nc.subscribe(subjects.EVERYTHING, cb=tally.receive)
            loop = asyncio.get_running_loop()
            if not await loop.run_in_executor(None, ready.wait, 300):
                raise SystemExit("agents did not start within 300 s")
            started_s = time.monotonic() - began
            jobs = await start_jobs(url, args.nodes, args.jobs_per_node)
            while len(tally.seen_nodes) < args.nodes:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # let the jobs' first progress events settle
            assert agents.pid is not None
            cpu_before = cpu_seconds(agents.pid)
            tally.counting = True
            window_start = time.monotonic()
            await asyncio.sleep(args.seconds)
            window_end = time.monotonic()
            tally.counting = False
            cpu_after = cpu_seconds(agents.pid)
        stop.set()
        agents.join(timeout=120)
    duration = window_end - window_start
    node_gaps = {
        node: gaps([t for t, _ in tally.beats.get(node, [])], window_start, window_end)
        for node in (f"node-{i}" for i in range(args.nodes))
    }
    all_gaps = sorted(g for values in node_gaps.values() for g in values)
    sender_gaps = sorted(
        b - a
        for beats in tally.beats.values()
        for a, b in itertools.pairwise(at for _, at in beats)
    )
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "jobs_running": jobs,
        "shared_connection": not args.connection_per_agent,
        "startup_s": round(started_s, 2),
        "window_s": round(duration, 2),
        "messages_per_s": round(sum(tally.messages.values()) / duration, 1),
        "messages_per_s_by_kind": {
            k: round(v / duration, 1) for k, v in sorted(tally.messages.items())
        },
        "megabytes_per_s": round(tally.bytes / duration / 2**20, 3),
        "heartbeat_gap_max_s": round(all_gaps[-1], 3) if all_gaps else None,
        "heartbeat_gap_p99_s": round(_quantile(all_gaps, 0.99), 3) if all_gaps else None,
        "heartbeat_gap_median_s": round(statistics.median(all_gaps), 3) if all_gaps else None,
        "sender_gap_max_s": round(sender_gaps[-1], 3) if sender_gaps else None,
        "missed_heartbeats": sum(1 for g in all_gaps if g > MISSED_GAP_S),
        "nodes_with_a_gap_over_2s": sum(
            1 for values in node_gaps.values() if any(g > MISSED_GAP_S for g in values)
        ),
        "agents_cpu_percent": None if cpu is None else round(100 * cpu / duration, 1),
        "agents_worst_loop_lag_ms": round(lag.value * 1000, 1),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--jobs-per-node", type=int, default=0,
                        help="simulated jobs started on each node (one GPU each)")
    parser.add_argument("--connection-per-agent", action="store_true",
                        help="one NATS connection per agent instead of one shared")
    parser.add_argument("--nats-url", help="use this server instead of an embedded one")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    configure_logging(level="error")
    if args.jobs_per_node > args.gpus:
        parser.error("--jobs-per-node: at most --gpus")
    if args.nats_url:
        figures = asyncio.run(measure(args, args.nats_url))
    else:
        with NatsServer() as server:
            figures = asyncio.run(measure(args, server.url))
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
