"""Chaos: thousands of jobs submitted with idempotent retries while, in turn, the leading
scheduler, the nats-server, a node agent and the admission service are killed with
SIGKILL and restarted. Every service runs as its own process, as in a deployment.

What must hold: every accepted job is stored exactly once, every job finishes, no job
that had finished ran again, and a tenant's GPU quota is never exceeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, free_port, wait_until
from gpusched.libs.common.schemas import JobExit, JobRecord, JobState

REPOSITORY = Path(__file__).resolve().parents[1]
JOBS = 2_000
#: of which the capped tenant submits this many, against a quota of CAP GPUs
CAPPED_JOBS = 200
CAP = 4
CONCURRENCY = 32
#: about a second of wall time at the emulated speed (time scale 0.001)
LONG_ITERATIONS = 25_000
TOKENS = {"tok-open": "open", "tok-capped": "capped"}
NODES = ("chaos-a", "chaos-b")
#: seconds each killed service stays down before it is started again
DOWN_S = 1.0
#: seconds between two kills
BETWEEN_KILLS_S = 3.0


@dataclass
class Process:
    """A service in its own process group, killed with SIGKILL and started again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=REPOSITORY, stdout=out, stderr=out,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Tally:
    accepted: dict[str, str] = field(default_factory=dict)  # idempotency key -> job id
    retries: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    changed_id: list[str] = field(default_factory=list)


def service(name: str, nats_url: str, tmp: Path, **env: str) -> Process:
    environment = {
        **os.environ, "NATS_URL": nats_url, "GPUSCHED_LOG_LEVEL": "info",
        "PYTHONPATH": str(REPOSITORY), **env,
    }
    argv = [sys.executable, "-m", "gpusched.services.cli.main", "service", name.split(":")[0]]
    return Process(name, argv, environment, tmp / f"{name.replace(':', '-')}.log")


async def submit_all(url: str, tally: Tally, done: asyncio.Event) -> None:
    keys: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for i in range(JOBS):
        token = "tok-capped" if i % (JOBS // CAPPED_JOBS) == 0 else "tok-open"
        keys.put_nowait((f"chaos-{i:05d}", token))

    async def worker(session: aiohttp.ClientSession) -> None:
        while not keys.empty():
            key, token = keys.get_nowait()
            # one job in ten runs for about a second, so kills meet runs in flight
            iterations = LONG_ITERATIONS if key.endswith("5") else 20
            body = {"name": key, "model": "resnet18", "batch_size": 32,
                    "iterations": iterations}
            headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
            while True:
                try:
                    async with session.post(f"{url}/v1/jobs", json=body, headers=headers) as r:
                        answer = await r.json(content_type=None)
                        if r.status in (200, 201):
                            known = tally.accepted.setdefault(key, answer["id"])
                            if known != answer["id"]:
                                tally.changed_id.append(key)
                            break
                        # 403: the capped tenant is at its quota until a job ends;
                        # 503 and 5xx: a service or NATS is down for a moment
                        assert r.status == 403 or r.status >= 500, (r.status, answer)
                        tally.retries["quota" if r.status == 403 else "unavailable"] += 1
                except (TimeoutError, aiohttp.ClientError):
                    tally.retries["no answer"] += 1
                await asyncio.sleep(0.2)

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    done.set()


async def leading_scheduler(nc: Any, schedulers: list[Process]) -> Process | None:
    """The scheduler process that holds the lease, by its micro status endpoint (an
    instance is named host-pid)."""
    for candidate in schedulers:
        if candidate.process is None or candidate.process.poll() is not None:
            continue
        instances = [line for line in await _instances(nc) if line.endswith(f"-{candidate.pid}")]
        for instance in instances:
            with contextlib.suppress(Exception):
                reply = await nc.request(subjects.scheduler_status(instance), b"", timeout=1)
                if json.loads(reply.data)["leader"]:
                    return candidate
    return None


async def _instances(nc: Any) -> list[str]:
    inbox = nc.new_inbox()
    found: list[str] = []

    async def info(msg: Any) -> None:
        found.append(json.loads(msg.data)["metadata"]["instance"])

    subscription = await nc.subscribe(inbox, cb=info)
    await nc.publish("$SRV.INFO.gpusched-scheduler", b"", reply=inbox)
    await asyncio.sleep(0.3)
    await subscription.unsubscribe()
    return found


async def chaos(
    nc: Any, nats: NatsServer, schedulers: list[Process], agent: Process,
    admission: Process, tally: Tally, done: asyncio.Event,
) -> None:
    """Kill one kind after another, round after round, until every job is accepted
    (at least one full round)."""
    for turn in itertools.count():
        kind = ("scheduler", "nats", "nodeagent", "admission")[turn % 4]
        if done.is_set() and turn >= 4:
            return
        await asyncio.sleep(BETWEEN_KILLS_S)
        if kind == "scheduler":
            leader = await leading_scheduler(nc, schedulers)
            if leader is None:
                continue
            leader.kill()
            await asyncio.sleep(DOWN_S)
            leader.start()
        elif kind == "nats":
            assert nats._process is not None  # SIGKILL, not the clean stop of stop()
            nats._process.kill()
            nats._process.wait()
            await asyncio.sleep(DOWN_S)
            nats.start()
        else:
            victim = agent if kind == "nodeagent" else admission
            victim.kill()
            await asyncio.sleep(DOWN_S)
            victim.start()
        tally.kills[kind] += 1


async def stored_records(stores: Stores) -> list[JobRecord]:
    keys = await stores.job_ids()
    entries = await asyncio.gather(*(stores.jobs.get(k) for k in keys))
    return [codec.decode(e.value, JobRecord) for e in entries if e.value]


async def succeeded_exits(stores: Stores) -> dict[str, list[JobExit]]:
    """Per job, the runs its agents reported succeeded (one message per run: the stream
    drops an exit's retries by id)."""
    pull = await stores.js.pull_subscribe(
        subjects.ALL_JOB_EXITS, stream=subjects.EXITS_STREAM,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
    )
    counts: dict[str, list[JobExit]] = {}
    info = await pull.consumer_info()
    pending = info.num_pending or 0
    while pending > 0:
        messages = await pull.fetch(min(pending, 1000), timeout=10)
        for message in messages:
            exit = codec.decode(message.data, JobExit)
            if exit.outcome == "succeeded":
                counts.setdefault(exit.job_id, []).append(exit)
        pending = messages[-1].metadata.num_pending
    await pull.unsubscribe()
    return counts


def most_gpus_at_once(records: list[JobRecord]) -> int:
    """The most GPUs a tenant's unfinished jobs held at one instant, from submission to
    the end its record shows: never more than admission counted against the quota."""
    events: list[tuple[float, int]] = []
    for record in records:
        end = next((c.at for c in record.history if c.state.terminal), None)
        assert end is not None, record.id
        events += [(record.submitted_at, record.spec.gpus), (end, -record.spec.gpus)]
    held = most = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        held += change
        most = max(most, held)
    return most


async def test_no_job_is_lost_duplicated_rerun_or_over_quota_while_services_are_killed(
    tmp_path: Path,
):
    nats = NatsServer(store_dir=tmp_path / "nats").start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = {"GPUSCHED_TIME_SCALE": "0.001", "GPUSCHED_POLICY": "sjf"}
    schedulers = [service(f"scheduler:{i}", nats.url, tmp_path, **common) for i in range(2)]
    agents = [
        service(f"nodeagent:{n}", nats.url, tmp_path, GPUSCHED_NODE_NAME=n,
                GPUSCHED_NODE_GPUS="8", GPUSCHED_WORK_DIR=str(tmp_path / n), **common)
        for n in NODES
    ]
    admission = service(
        "admission", nats.url, tmp_path, GPUSCHED_HTTP_PORT=str(port),
        GPUSCHED_TOKENS=",".join(f"{t}={n}" for t, n in TOKENS.items()),
        GPUSCHED_QUOTAS=f"capped={CAP}",
    )
    everything = [*schedulers, service("predictor", nats.url, tmp_path), *agents, admission]
    tally = Tally()
    try:
        for process in everything:
            process.start()
        async with connection(nats.url, "chaos-observer") as nc:
            stores = await Stores.open(nc)
            await wait_until(_answers(url), timeout_s=120, every_s=0.2)
            done = asyncio.Event()
            began = time.monotonic()
            submitting = asyncio.create_task(submit_all(url, tally, done))
            killing = asyncio.create_task(
                chaos(nc, nats, schedulers, agents[0], admission, tally, done)
            )
            await asyncio.gather(submitting, killing)
            submitted_s = time.monotonic() - began
            # a limit from the work measured: finishing takes at most a few times as long
            # as accepting did, kills included; it only bounds a hang
            records: list[JobRecord] = []

            async def all_finished() -> bool:
                nonlocal records
                records = await stored_records(stores)
                mine = [r for r in records if r.spec.name.startswith("chaos-")]
                return len(mine) >= len(tally.accepted) and all(r.state.terminal for r in mine)

            await wait_until(all_finished, timeout_s=max(120.0, 5 * submitted_s), every_s=1.0)
            exits = await succeeded_exits(stores)
    finally:
        for process in everything:
            process.stop()
        nats.close()

    by_name = Counter(r.spec.name for r in records)
    reran = sorted(job for job, runs in exits.items() if len(runs) > 1)
    history = {r.id: [(c.state.name, round(c.at, 2), c.reason) for c in r.history] for r in records}
    capped = [r for r in records if r.tenant == "capped"]
    requeues = sum(
        1 for r in records for before, after in itertools.pairwise(r.history)
        if before.state is JobState.RUNNING and after.state.waiting
    )
    # a job whose start a killed leader sent but never recorded has no RUNNING entry: a
    # new leader finds its exit and records the success straight from the queue
    run_starts = {
        r.id: next((c.at for c in r.history if c.state is JobState.RUNNING), None)
        for r in records if r.spec.name.endswith("5") and r.state is JobState.SUCCEEDED
    }
    long_runs = sorted(
        r.history[-1].at - start
        for r in records if (start := run_starts.get(r.id)) is not None
    ) or [0.0]
    succeeded = sum(r.state is JobState.SUCCEEDED for r in records)
    print(
        f"\nchaos: accepted {len(tally.accepted)} jobs in {submitted_s:.0f} s; "
        f"stored {len(records)}; succeeded {succeeded}; kills {dict(tally.kills)}; "
        f"retries {dict(tally.retries)}; requeues {requeues}; "
        f"finished jobs run again {len(reran)}; most GPUs of the capped tenant at once "
        f"{most_gpus_at_once(capped)} (quota {CAP}); "
        f"long runs median {long_runs[len(long_runs) // 2]:.2f} s"
    )
    assert len(tally.accepted) == JOBS
    assert not tally.changed_id, "a retried submission got another job id"
    assert set(tally.kills) == {"scheduler", "nats", "nodeagent", "admission"}
    assert all(count == 1 for count in by_name.values()), by_name.most_common(3)
    assert {r.id for r in records} == set(tally.accepted.values())
    assert all(r.state is JobState.SUCCEEDED for r in records), Counter(r.state for r in records)
    assert not reran, "; ".join(
        f"{job}: exits {[(e.run_id, e.node, round(e.at, 2)) for e in exits[job]]} "
        f"history {history.get(job)}" for job in reran[:3]
    )
    for record in records:
        states = [c.state for c in record.history]
        assert states.count(JobState.SUCCEEDED) == 1 and states[-1] is JobState.SUCCEEDED
    assert len(capped) == CAPPED_JOBS
    assert most_gpus_at_once(capped) <= CAP


def _answers(url: str) -> Any:
    async def check() -> bool:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz") as r:
                return r.status == 200
        return False

    return check
