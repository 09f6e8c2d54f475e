"""Live against replay: how closely the simulator reproduces what a live cluster did.

Starts `gpusched up` (emulated GPUs, simulated jobs at ``--time-scale``) under one
policy, submits a seeded workload over HTTP with enough contention that jobs queue,
share GPUs, are preempted and (ones) resized, waits until every job has finished,
exports the history with `gpusched history export` (the real CLI against the real API)
and replays the export under the same policy through the what-if code
(services/scheduler/simulation/whatif.py: the measured iteration times, then the
simulator). Prints the live and replayed mean JCT and their difference, the share of
jobs whose JCT differs by at most 10 %, the per-job differences' p50/p90, what
happened live (preemptions, GPU shares, resizes) beside the replay's, the wall time and
the machine-speed figure. Targets: mean JCT within 5 %, 90 % of jobs within 10 %.

    python bench/fidelity.py [--policy sjf-bsbf] [--jobs 200] [--seed 0] [--nodes 4]
        [--gpus 4] [--time-scale 0.01] [--load 1.5] [--restart-s 0] [--round-s S]
        [--decision-delay-s 0] [--jitter-s 5] [--floor-runs 3]
        [--keep DIR | --replay-only DIR]

The replay runs with the live cluster's own settings in the jobs' seconds, as
`gpusched history whatif` takes them: ``--restart-s`` (its --restart-overhead-s) per
preemption or resize, 0 by default since emulated runs checkpoint and resume at once
(the simulator's default is 30 s); ``--round-s`` (its --round-s), by default the live
scheduler's round, ``decide_every_s`` (1 s) over the time scale; ``--decision-delay-s``
(its --decision-delay-s), a delay from submission to the policy, 0 by default.
``--replay-only DIR`` replays the export a ``--keep DIR`` run left there again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.cluster_file import load_cluster_file
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.traces import TraceJob, load_trace
from gpusched.libs.core.workload import materialize
from gpusched.services.scheduler.config import SchedulerConfig
from gpusched.services.scheduler.simulation import whatif
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import (
    build_models,
    load_workload,
    run_policies,
)
from gpusched.services.scheduler.simulation.simulator import SimConfig

ROOT = Path(__file__).resolve().parents[1]
#: the models jobs are drawn from: image, language and speech models that fit a
#: V100-32GB at their default batch, two of them beside each other
MODELS = ("resnet18", "resnet50", "vgg16", "shufflenet_v2", "cifar10", "bert", "transformer",
          "lm", "yolov3", "deepspeech2")
#: GPUs per job and their weights
GPU_CHOICES = ((1, 0.6), (2, 0.25), (4, 0.15))
#: exclusive run time in the jobs' own seconds: lognormal median and sigma, and bounds
DURATION_MEDIAN_S = 400.0
DURATION_SIGMA = 0.8
DURATION_BOUNDS_S = (120.0, 3_000.0)
#: what the issue asks of a replay
TARGET_MEAN_PCT = 5.0
TARGET_JOBS_PCT = 90.0
WITHIN_PCT = 10.0
#: how long the live run may take, in wall seconds, before the bench gives up
LIVE_LIMIT_S = 1_800.0
POLL_S = 0.5
UP_START_S = 120.0


@dataclass(frozen=True)
class Planned:
    """One job of the workload: when to submit it (the jobs' own seconds after the
    first) and what."""

    submit_s: float
    body: dict[str, Any]


def workload(n: int, seed: int, total_gpus: int, load: float) -> list[Planned]:
    """``n`` jobs, Poisson arrivals at ``load`` times the GPU-seconds the cluster
    serves, models from ``MODELS`` at their default batch per GPU, lognormal exclusive
    run times turned into iterations by the ground truth (on one node)."""
    truth = ProfilePerformanceModel.builtin()
    rng = random.Random(seed)
    counts, weights = zip(*GPU_CHOICES, strict=True)
    mean_gpus = sum(c * w for c, w in GPU_CHOICES) / sum(weights)
    low, high = DURATION_BOUNDS_S
    mean_s = DURATION_MEDIAN_S * math.exp(DURATION_SIGMA**2 / 2)
    gap_s = mean_gpus * mean_s / (load * total_gpus)
    planned = []
    at = 0.0
    for i in range(n):
        model = rng.choice(MODELS)
        gpus = rng.choices(counts, weights)[0]
        batch = truth.default_batch_size(model) * gpus
        seconds = min(high, max(low, rng.lognormvariate(math.log(DURATION_MEDIAN_S),
                                                        DURATION_SIGMA)))
        iterations = max(1, round(seconds / truth.iteration_time(model, batch, gpus, 1)))
        body = {"name": f"fidelity-{i}", "model": model, "gpus": gpus, "batch_size": batch,
                "iterations": iterations, "allow_sharing": True}
        planned.append(Planned(at, body))
        at += rng.expovariate(1 / gap_s)
    return planned


# ------------------------------------------------------------------------- the live run


class LiveCluster:
    """`gpusched up` in a process (and session) of its own, its state in ``state``;
    stopped with SIGINT (its services drain), killed with its process group if that
    does not end it."""

    def __init__(self, state: Path, policy: str, nodes: int, gpus: int, scale: float) -> None:
        self.state = state
        # a PYTHONPATH given runs the cluster from that tree (one holding gpusched/)
        self.env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT),
                    "GPUSCHED_STATE_DIR": str(state)}
        self.command = [
            sys.executable, "-m", "gpusched.services.cli.main", "up", "--nodes", str(nodes),
            "--gpus-per-node", str(gpus), "--time-scale", f"{scale:g}", "--policy", policy,
            "--port", "0", "--no-metrics", "--job-user", "self", "--fresh",
            "--state-dir", str(state),
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LiveCluster:
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / "up.out", "wb") as out, open(self.state / "up.err", "wb") as err:
            self.process = subprocess.Popen(self.command, env=self.env, cwd=ROOT, stdout=out,
                                            stderr=err, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def endpoint(self) -> tuple[str, str]:
        """The API's URL and token, once `up` has printed its banner."""
        began = time.monotonic()
        banner = self.state / "up.out"
        while time.monotonic() - began < UP_START_S:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"gpusched up exited ({self.process.returncode}): "
                                   f"{(self.state / 'up.err').read_text()[-2000:]}")
            if "Ctrl-C stops everything" in banner.read_text(errors="replace"):
                saved = json.loads((self.state / "up.json").read_text())
                return saved["url"], saved["token"]
            time.sleep(0.2)
        raise RuntimeError(f"gpusched up printed no banner in {UP_START_S:.0f} s")

    def cli(self, *args: str) -> str:
        """A `gpusched` command against this cluster (it finds the API in ``state``)."""
        done = subprocess.run([sys.executable, "-m", "gpusched.services.cli.main", *args],
                              env=self.env, cwd=ROOT, capture_output=True, text=True,
                              timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"gpusched {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout


@dataclass
class LiveRun:
    """What the bench saw of the live run."""

    wall_s: float
    #: pairs of jobs seen sharing a GPU (while polling the running jobs)
    shared_pairs: int
    jobs: list[dict[str, Any]]

    @property
    def preemptions(self) -> int:
        return sum(int(job.get("preemptions", 0)) for job in self.jobs)

    @property
    def resizes(self) -> int:
        return sum(str(change.get("reason", "")).startswith("resized")
                   for job in self.jobs for change in job.get("history", []))

    def states(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for job in self.jobs:
            counted[job["state"]] = counted.get(job["state"], 0) + 1
        return dict(sorted(counted.items()))


async def run_live(url: str, token: str, planned: Sequence[Planned], scale: float) -> LiveRun:
    """Submit ``planned`` at their times (wall: ``submit_s * scale``), follow the running
    jobs' partners, and wait until every job has finished."""
    pairs: set[frozenset[str]] = set()
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(url, headers=headers) as session:

        async def listed(states: str) -> list[dict[str, Any]]:
            jobs: list[dict[str, Any]] = []
            after: str | None = None
            while True:
                params = {"limit": "1000", **({"state": states} if states else {}),
                          **({"after": after} if after else {})}
                async with session.get("/v1/jobs", params=params) as response:
                    response.raise_for_status()
                    page = await response.json()
                jobs += page["jobs"]
                after = page.get("next")
                if not after:
                    return jobs

        async def follow() -> None:
            while True:
                for job in await listed("RUNNING"):
                    for partner in job.get("shares_with") or []:
                        pairs.add(frozenset((job["id"], partner)))
                await asyncio.sleep(POLL_S)

        began = time.monotonic()
        watcher = asyncio.create_task(follow())
        try:
            for job in planned:
                await asyncio.sleep(max(0.0, began + job.submit_s * scale - time.monotonic()))
                async with session.post("/v1/jobs", json=job.body) as response:
                    if response.status != 201:
                        raise RuntimeError(f"submit {job.body['name']}: {response.status} "
                                           f"{await response.text()}")
            while time.monotonic() - began < LIVE_LIMIT_S:
                if not await listed("QUEUED,RUNNING,PREEMPTED"):
                    break
                await asyncio.sleep(POLL_S)
            else:
                raise RuntimeError(f"jobs still unfinished after {LIVE_LIMIT_S:.0f} s")
            wall = time.monotonic() - began
        finally:
            watcher.cancel()
        return LiveRun(wall, len(pairs), await listed(""))


# ------------------------------------------------------------------------- the replay


@dataclass(frozen=True)
class ReplaySettings:
    """The replay's settings, in the jobs' own seconds (`gpusched history whatif`'s
    --restart-overhead-s, --round-s and --decision-delay-s)."""

    restart_s: float
    #: None: the policy is called on events only
    round_s: float | None
    decision_delay_s: float

    def config(self) -> SimConfig:
        return SimConfig(restart_overhead_s=self.restart_s, round_s=self.round_s)


def live_round_s(time_scale: float) -> float:
    """The live scheduler's round interval in the jobs' own seconds: it decides every
    ``decide_every_s`` of wall time (and on events), ``decide_every_s / time_scale`` of
    the jobs' time."""
    # `gpusched up` leaves the scheduler's default
    default = next(f.default for f in fields(SchedulerConfig) if f.name == "decide_every_s")
    return float(cast(float, default)) / time_scale


def replay(trace: Path, policy: str, settings: ReplaySettings, jitter_s: float,
           floor_runs: int) -> dict[str, Any]:
    """The export replayed under ``policy`` as `gpusched history whatif` replays it (on
    the cluster file beside it, models timed by their measured iteration times, with
    ``settings``), set beside the live figures; and the same replay set beside
    ``floor_runs`` replays of itself with each submission delayed by up to ``jitter_s``
    more (the noise floor)."""
    exported = load_trace(trace, "native").jobs
    cluster = load_cluster_file(Path(f"{trace}.cluster.json"))
    truth, _ = build_models(None)
    timed, measured_note = whatif.measured_over(exported, truth, cluster)
    config = settings.config()
    jobs = load_workload(trace, "native", timed, cluster=cluster).jobs
    began = time.perf_counter()
    arriving = whatif.delayed(jobs, settings.decision_delay_s)
    result = whatif.from_submission(
        run_policies(arriving, cluster, [policy], timed, config=config)[0], jobs)
    replay_wall = time.perf_counter() - began
    compared = whatif.fidelity(exported, result, WITHIN_PCT)
    live, _ = whatif.live_figures(exported)
    floor = [noise_floor(exported, result, cluster, timed, settings, jitter_s, seed)
             for seed in range(floor_runs)]
    return {
        "replay_wall_s": replay_wall,
        "measured": measured_note,
        "restart_s": settings.restart_s,
        "round_s": settings.round_s,
        "decision_delay_s": settings.decision_delay_s,
        "fidelity": compared.as_dict(),
        "live": None if live is None else live.as_dict(),
        "replayed": whatif.simulated_figures(result).as_dict(),
        "live_wait_p50_s_of_jobs_replay_starts_at_once": prompt_wait(exported, result),
        "replay_preemptions": result.preemptions,
        "replay_shared_pairs": result.shared_pairs,
        "replay_resizes": result.resizes,
        "noise_floor": {
            "jitter_s": jitter_s,
            "mean_diff_pct": [round(f.mean_diff_pct, 2) for f in floor],
            "jobs_within_pct": [round(f.jobs_within_pct, 1) for f in floor],
            "diff_p90_pct": [round(f.diff_p90_pct, 1) for f in floor],
        },
    }


def prompt_wait(exported: Sequence[TraceJob], result: SimResult) -> float | None:
    """The median live wait of the jobs the replay starts as soon as they reach the
    policy: the live decision delay (submission, round, start command) where no other
    job holds them back, in the jobs' own seconds."""
    late = {o.job_id: o.queue_s for o in result.jobs if o.preemptions == 0}
    floor = min(late.values(), default=0.0)
    waits = sorted(float(job.live_queue_s) for job in exported
                   if job.live_queue_s is not None and late.get(job.job_id) == floor)
    return waits[len(waits) // 2] if waits else None


def noise_floor(
    exported: Sequence[TraceJob], result: SimResult, cluster: Cluster,
    timed: PerformanceModel, settings: ReplaySettings, jitter_s: float, seed: int,
) -> whatif.Fidelity:
    """``result`` (the replay) taken as the live run, against a replay whose
    submissions each come up to ``jitter_s`` later (seeded) than ``result``'s, as a live
    cluster's decisions do: how far apart two runs of the same policy land on their
    own."""
    rng = random.Random(seed)
    late = settings.decision_delay_s
    jittered = [replace(job, submit_time=job.submit_time + late + rng.uniform(0, jitter_s))
                for job in exported]
    again = run_policies(materialize(jittered, timed, seed=0, cluster=cluster), cluster,
                         [result.policy], timed, config=settings.config())[0]
    submitted = {job.job_id: job.submit_time for job in exported}
    # completion times from the jobs' own submissions, as the live ones count
    again = replace(again, jobs=tuple(replace(o, submit_time=submitted[o.job_id])
                                      for o in again.jobs))
    first = {o.job_id: o for o in result.jobs}
    as_live = [replace(job, live_jct_s=first[job.job_id].jct_s, live_queue_s=0.0)
               for job in exported]
    return whatif.fidelity(as_live, again, WITHIN_PCT)


def verdict(fid: dict[str, Any]) -> str:
    mean_ok = abs(fid["mean_diff_pct"]) <= TARGET_MEAN_PCT
    jobs_ok = fid["jobs_within_pct"] >= TARGET_JOBS_PCT
    return (f"mean JCT {fid['mean_diff_pct']:+.1f}% (target within {TARGET_MEAN_PCT:g}%: "
            f"{'met' if mean_ok else 'missed'}); {fid['jobs_within_pct']:.1f}% of jobs within "
            f"{WITHIN_PCT:g}% (target {TARGET_JOBS_PCT:g}%: {'met' if jobs_ok else 'missed'})")


def settings(args: argparse.Namespace) -> ReplaySettings:
    """The replay's settings: the options given, the live cluster's round by default."""
    round_s = live_round_s(args.time_scale) if args.round_s is None else args.round_s
    return ReplaySettings(args.restart_s, round_s or None, args.decision_delay_s)


def live_then_replay(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    planned = workload(args.jobs, args.seed, args.nodes * args.gpus, args.load)
    trace = work / "history.csv"
    with LiveCluster(work / "state", args.policy, args.nodes, args.gpus,
                     args.time_scale) as cluster:
        url, token = cluster.endpoint()
        live = asyncio.run(run_live(url, token, planned, args.time_scale))
        print(cluster.cli("history", "export", "--out", str(trace)).strip())
    return {
        "jobs": args.jobs, "seed": args.seed, "load": args.load,
        "cluster": f"{args.nodes}x{args.gpus}", "time_scale": args.time_scale,
        "live_wall_s": live.wall_s, "live_states": live.states(),
        "live_preemptions": live.preemptions, "live_shared_pairs": live.shared_pairs,
        "live_resizes": live.resizes,
        **replay(trace, args.policy, settings(args), args.jitter_s, args.floor_runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="sjf-bsbf")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=4, help="GPUs per node")
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--load", type=float, default=1.5,
                        help="offered GPU load while jobs arrive (1: the cluster's GPUs)")
    parser.add_argument("--restart-s", type=float, default=0.0,
                        help="the replay's restart overhead per preemption or resize")
    parser.add_argument("--round-s", type=float,
                        help="the replay's round interval, in the jobs' seconds (0: on "
                        "events only); default: the live scheduler's decide_every_s over "
                        "the time scale")
    parser.add_argument("--decision-delay-s", type=float, default=0.0,
                        help="the replay's delay from a submission to the policy seeing "
                        "the job, in the jobs' seconds")
    parser.add_argument("--jitter-s", type=float, default=5.0,
                        help="noise floor: submissions come up to this much later")
    parser.add_argument("--floor-runs", type=int, default=3,
                        help="noise floor: jittered replays (0: none)")
    parser.add_argument("--keep", type=Path, help="keep the state, logs and export here")
    parser.add_argument("--replay-only", type=Path,
                        help="replay the export a --keep run left in this folder again")
    args = parser.parse_args()
    speed = print_machine_speed()
    began = time.perf_counter()
    figures: dict[str, Any] = {"policy": args.policy, "machine_speed_s": speed}
    if args.replay_only is not None:
        figures.update(replay(args.replay_only / "history.csv", args.policy, settings(args),
                              args.jitter_s, args.floor_runs))
    else:
        if args.keep is not None and args.keep.exists():
            shutil.rmtree(args.keep)
        work = args.keep or Path(tempfile.mkdtemp(prefix="gpusched-fidelity-"))
        try:
            figures.update(live_then_replay(args, work))
        finally:
            if args.keep is None:
                shutil.rmtree(work, ignore_errors=True)
    figures["wall_s"] = time.perf_counter() - began
    print(json.dumps(figures, indent=2, default=lambda v: round(v, 4)))
    print(verdict(figures["fidelity"]))


if __name__ == "__main__":
    main()
