"""The live scheduler under load: hundreds of emulated node agents and thousands of
simulated jobs, each part in its own process, one nats-server.

Prints the NATS message rate, heartbeat gaps (a gap over 2 s is a missed heartbeat),
the scheduler's input lag (how old a heartbeat is when the scheduler handles it), its
decision times, and submit-to-RUNNING latency.

    python bench/live_scale.py [--nodes 200] [--gpus 8] [--jobs 2000] [--seconds 40]
        [--policy sjf-bsbf] [--time-scale 0.01] [--agent-processes N]
        [--profile-scheduler flame.svg]

The agents are split over ``--agent-processes`` processes (by default one per 250
agents), so one agents' event loop is not what holds heartbeats back at 1,000 agents.
``--profile-scheduler`` records the scheduler process with py-spy for the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nats.aio.msg import Msg
from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.common.schemas import (
    Heartbeat,
    JobRecord,
    JobSpec,
    JobState,
    JobStateEvent,
    JobSubmitted,
    StateChange,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.live import SchedulerService

MISSED_GAP_S = 2.0


def run_agents(url: str, nodes: int, gpus: int, scale: float, work: str, stop: Any,
               prefix: str = "node") -> None:
    configure_logging(level="error")

    async def main() -> None:
        async with EmulatedCluster.of(url, nodes, gpus, time_scale=scale, work_dir=Path(work),
                                      prefix=prefix):
            while not stop.is_set():
                await asyncio.sleep(0.2)

    asyncio.run(main())


def run_scheduler(url: str, policy: str, scale: float, stop: Any, out: Any,
                  nodes: int = 0, ready: Any = None) -> None:
    configure_logging(level="error")

    async def main() -> None:
        config = SchedulerConfig(nats_url=url, policy=policy, time_scale=scale,
                                 instance="bench", node_timeout_s=10, decide_every_s=1.0)
        async with SchedulerService(config) as service:
            # the worst input lag of each 5 s, to tell a start-up backlog from a steady
            # one; the deque is drained here, as it keeps only the last 10,000
            timeline: list[float] = []
            lags: list[float] = []
            leader, leaderships = None, 0  # a lease lost under load starts a new one
            cpu_at, wall_at = time.process_time(), time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(5.0 if timeline else 0.2)
                live = service.scheduler
                if live is None:
                    continue
                if live is not leader:
                    leader, leaderships = live, leaderships + 1
                if ready is not None and not ready.is_set():
                    if len(live.nodes) < nodes:
                        continue
                    ready.set()  # leading, every agent in its picture: submissions start
                    live.beat_lag_s.clear()  # the figures are of the run, not its set-up
                if not timeline:
                    cpu_at, wall_at = time.process_time(), time.monotonic()
                fresh = list(live.beat_lag_s)
                live.beat_lag_s.clear()
                lags += fresh
                timeline.append(round(max(fresh, default=0.0), 2))
            live = service.scheduler
            if live is not None:
                lags += live.beat_lag_s
            out.put({
                "beat_lag_s": sorted(lags),
                "decide_ms": sorted(live.decide_ms) if live else [],
                "rounds": live.rounds if live else 0,
                "leaderships": leaderships,
                "lag_max_per_5s": timeline[1:],
                "cpu_share": (time.process_time() - cpu_at) / (time.monotonic() - wall_at),
            })

    asyncio.run(main())


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(args: argparse.Namespace, url: str, ready: Any = None) -> dict[str, Any]:
    truth = ProfilePerformanceModel.builtin()
    rng = random.Random(0)
    models = list(truth.models())
    counts: dict[str, int] = defaultdict(int)
    last_beat: dict[str, float] = {}
    gaps: list[float] = []
    submitted: dict[str, float] = {}
    running_at: dict[str, float] = {}
    finished: dict[str, str] = {}

    async with connection(url, "bench-driver") as nc:
        stores = await Stores.open(nc)

        async def everything(msg: Msg) -> None:
            counts[msg.subject.split(".")[1] + "." + msg.subject.rsplit(".", 1)[-1]] += 1

        async def beat(msg: Msg) -> None:
            hb = codec.decode(msg.data, Heartbeat)
            now = time.monotonic()
            if hb.node in last_beat:
                gaps.append(now - last_beat[hb.node])
            last_beat[hb.node] = now

        async def state(msg: Msg) -> None:
            event = codec.decode(msg.data, JobStateEvent)
            if event.state is JobState.RUNNING and event.job_id not in running_at:
                running_at[event.job_id] = time.time()
            elif event.state.terminal:
                finished[event.job_id] = event.state.value

        await nc.subscribe(subjects.EVERYTHING, cb=everything)
        await nc.subscribe(subjects.ALL_HEARTBEATS, cb=beat)
        await nc.subscribe(subjects.ALL_JOB_STATES, cb=state)
        await asyncio.sleep(3)  # agents register, scheduler leads
        waited = time.monotonic()
        while ready is not None and not ready.is_set() and time.monotonic() - waited < 300:
            await asyncio.sleep(0.2)
        setup_s = time.monotonic() - waited + 3
        counts.clear()
        started = time.monotonic()
        interval = args.seconds * 0.5 / args.jobs  # submit over the first half
        for i in range(args.jobs):
            model = rng.choice(models)
            gpus = rng.choices([1, 2, 4, 8], weights=[70, 15, 10, 5])[0]
            batch = truth.default_batch_size(model) * gpus
            per_iter = truth.iteration_time(model, batch, gpus, 1) * args.time_scale
            wall_s = rng.uniform(2, args.seconds / 3)
            spec = JobSpec(name=f"bench-{i}", model=model, gpus=gpus, batch_size=batch,
                           iterations=max(1, int(wall_s / per_iter)))
            job_id = f"bench{i:05d}"
            now = time.time()
            record = JobRecord(id=job_id, tenant="bench", spec=spec,
                               total_iterations=spec.iterations or 1, submitted_at=now,
                               history=[StateChange(JobState.QUEUED, now, "submitted")])
            await stores.jobs.create(job_id, codec.encode(record))
            await stores.js.publish(subjects.job_submitted(job_id),
                                    codec.encode(JobSubmitted(job_id, now)),
                                    headers=codec.headers({"Nats-Msg-Id": job_id}))
            submitted[job_id] = now
            await asyncio.sleep(max(0.0, started + (i + 1) * interval - time.monotonic()))
        await asyncio.sleep(max(0.0, started + args.seconds - time.monotonic()))
        elapsed = time.monotonic() - started

    latency = [running_at[j] - submitted[j] for j in running_at if j in submitted]
    return {
        "elapsed_s": elapsed,
        "until_leading_with_every_node_s": setup_s,
        "messages_per_s": sum(counts.values()) / elapsed,
        "messages_by_kind_per_s": {k: round(v / elapsed, 1) for k, v in sorted(counts.items())},
        "heartbeat_gap_max_s": max(gaps, default=float("nan")),
        "missed_heartbeats": sum(g > MISSED_GAP_S for g in gaps),
        "jobs_submitted": len(submitted),
        "jobs_started": len(running_at),
        "jobs_finished": len(finished),
        "submit_to_running_p50_s": pct(latency, 0.5),
        "submit_to_running_p99_s": pct(latency, 0.99),
    }


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--policy", default="sjf-bsbf")
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--agent-processes", type=int, default=0,
                        help="processes the agents are split over (0: one per 250)")
    parser.add_argument("--profile-scheduler", metavar="SVG", default="",
                        help="record the scheduler process with py-spy into this file")
    args = parser.parse_args()
    processes = args.agent_processes or max(1, -(-args.nodes // 250))
    if not 1 <= processes <= args.nodes:
        parser.error(f"--agent-processes: must be 1..{args.nodes}, got {processes}")
    configure_logging(level="error")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    out = ctx.Queue()
    with NatsServer() as server, tempfile.TemporaryDirectory() as work:
        shares = [args.nodes // processes + (k < args.nodes % processes)
                  for k in range(processes)]
        agents = [
            ctx.Process(target=run_agents, args=(
                server.url, share, args.gpus, args.time_scale, work, stop, f"node{k}"))
            for k, share in enumerate(shares)
        ]
        ready = ctx.Event()
        scheduler = ctx.Process(target=run_scheduler, args=(
            server.url, args.policy, args.time_scale, stop, out, args.nodes, ready))
        for process in agents:
            process.start()
        scheduler.start()
        profiler = None
        if args.profile_scheduler:
            profiler = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                 str(scheduler.pid), "--rate", "50", "--output", args.profile_scheduler,
                 *(["--format", "speedscope"] if args.profile_scheduler.endswith(".json")
                   else [])],
                stdout=subprocess.DEVNULL)
        try:
            figures = asyncio.run(drive(args, server.url, ready))
        finally:
            stop.set()
        stats = out.get(timeout=60)
        scheduler.join(30)
        for process in agents:
            process.join(60)
        if profiler is not None:
            profiler.wait(60)
    lag = stats["beat_lag_s"]
    figures.update({
        "scheduler_input_lag_p50_s": pct(lag, 0.5),
        "scheduler_input_lag_p99_s": pct(lag, 0.99),
        "scheduler_input_lag_max_s": max(lag, default=float("nan")),
        "decide_ms_p50": pct(stats["decide_ms"], 0.5),
        "decide_ms_max": max(stats["decide_ms"], default=float("nan")),
        "rounds": stats["rounds"],
        "leaderships": stats["leaderships"],
        "scheduler_lag_max_per_5s": stats["lag_max_per_5s"],
        "scheduler_cpu_share": stats["cpu_share"],
        "nodes": args.nodes, "gpus_per_node": args.gpus, "policy": args.policy,
        "agent_processes": processes,
    })
    print(json.dumps(figures, indent=2, default=lambda v: round(v, 4)))
    if statistics.fmean([figures["missed_heartbeats"]]) > 0:
        print(f"missed heartbeats: {figures['missed_heartbeats']}", file=sys.stderr)


if __name__ == "__main__":
    main()
