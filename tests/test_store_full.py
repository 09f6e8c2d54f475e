"""A JetStream store that fills up and empties again: refusals are a clear 503 and leave
nothing behind, GET /healthz and the dashboard say what is wrong while it lasts, and the
cluster recovers by itself once space is back (the scheduler leads again), with every
accepted job stored once and finished once.

The store's limit (nats-server's ``max_file_store``) stands in for a full disk: the server
refuses writes past it with "insufficient resources", as it does when its disk's space
runs out under its default limit, and takes them again once space is freed. A filler
stream fills it; purging the filler frees it. The tmpfs test at the end fills a real
disk, which needs root to mount."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.js.api import StreamConfig
from nats.js.errors import KeyNotFoundError, ServiceUnavailableError

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import JobRecord, JobState
from gpusched.services.admission import AdmissionConfig, AdmissionService, quota
from gpusched.services.admission.app import API
from gpusched.services.admission.ids import idempotent_job_id
from gpusched.services.admission.quota import read_ledger
from gpusched.services.cli.up import LocalCluster, UpConfig
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler

TOKEN, TENANT = "tok-full", "filled"
#: the store's limit: the streams and buckets start far below it, a filler reaches it
STORE_LIMIT = 4 << 20
FILLER, FILLER_CHUNK = "FILLER", 64 << 10
#: a job of 200 iterations at time scale 0.01 runs well under a second; the long one runs
#: for a while, so that the store fills while it runs
ITERATIONS, LONG_ITERATIONS = 200, 3000
#: every limit below bounds a hang: the work takes seconds (a lease TTL of 1.5 s to lapse,
#: a rescan, jobs of well under a second)
WITHIN_S = 90.0


def body(n: int | str, iterations: int = ITERATIONS) -> dict[str, Any]:
    return {"name": f"f{n}", "model": "resnet50", "batch_size": 32, "iterations": iterations}


@dataclass
class Cluster:
    url: str
    session: aiohttp.ClientSession
    stores: Stores
    scheduler: SchedulerService
    admission: AdmissionService | None = None

    async def submit(self, key: str, iterations: int = ITERATIONS) -> tuple[int, Any]:
        async with self.session.post(f"{self.url}/v1/jobs", json=body(key, iterations),
                                     headers={"Idempotency-Key": key}) as response:
            return response.status, await response.json()

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(f"{self.url}{path}") as response:
            return response.status, await response.json()

    async def health(self) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as anonymous, anonymous.get(
            f"{self.url}/healthz"
        ) as response:
            return response.status, await response.json()

    async def record(self, job_id: str) -> JobRecord | None:
        try:
            entry = await self.stores.jobs.get(job_id)
        except KeyNotFoundError:
            return None
        return codec.decode(entry.value, JobRecord) if entry.value else None

    async def submitted_events(self, job_id: str) -> int:
        info = await self.stores.js.stream_info(
            subjects.JOBS_STREAM, subjects_filter=subjects.job_submitted(job_id)
        )
        return (info.state.subjects or {}).get(subjects.job_submitted(job_id), 0)

    async def fill(self) -> None:
        """Publish into the filler stream until the store refuses."""
        chunk = b"x" * FILLER_CHUNK
        for _ in range(2 * STORE_LIMIT // FILLER_CHUNK):
            try:
                await self.stores.js.publish(f"{FILLER}.x", chunk)
            except ServiceUnavailableError:
                return
        raise AssertionError("the store never refused a write")

    async def succeeded(self, job_ids: list[str]) -> dict[str, JobRecord]:
        async def all_done() -> dict[str, JobRecord] | None:
            records = {job_id: await self.record(job_id) for job_id in job_ids}
            done = {k: r for k, r in records.items() if r and r.state is JobState.SUCCEEDED}
            return done if len(done) == len(job_ids) else None

        try:
            found: dict[str, JobRecord] = await wait_until(all_done, timeout_s=WITHIN_S,
                                                           every_s=0.2)
        except TimeoutError:
            states = {j: (r.state if (r := await self.record(j)) else None) for j in job_ids}
            raise AssertionError(f"not every accepted job succeeded: {states}") from None
        return found


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    # a reservation whose submission was refused is given back by reconciliation once
    # the store takes writes again: soon, here
    monkeypatch.setattr(quota, "RECONCILE_S", 0.5)
    monkeypatch.setattr(quota, "RESERVATION_GRACE_S", 1.0)
    server = NatsServer(store_dir=tmp_path / "nats", max_file_store=STORE_LIMIT).start()
    try:
        url = server.url
        admission = AdmissionConfig(nats_url=url, port=0, tokens={TOKEN: TENANT},
                                    quotas={TENANT: 1000})
        async with EmulatedCluster.of(
            url, 1, 4, work_dir=tmp_path / "work", heartbeat_s=0.2, progress_s=0.2,
            time_scale=0.01,
        ), SchedulerService(fast_scheduler(url, time_scale=0.01)) as scheduler, \
                AdmissionService(admission) as service, aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as session, connection(url, "test") as nc:
            stores = await Stores.open(nc)
            await stores.js.add_stream(StreamConfig(name=FILLER, subjects=[f"{FILLER}.>"]))
            yield Cluster(service.url, session, stores, scheduler, service)
    finally:
        server.close()


async def test_a_store_that_fills_and_empties_again_keeps_every_accepted_job_and_no_refused_one(
    cluster: Cluster,
) -> None:
    up = cluster
    await wait_until(lambda: up.scheduler.is_leader, timeout_s=WITHIN_S)
    assert await up.health() == (200, {"status": "ok"})
    before = [str((await up.submit(f"before-{n}"))[1]["id"]) for n in range(3)]
    await up.succeeded(before)
    status, answer = await up.submit("long", LONG_ITERATIONS)
    assert status == 201, answer
    long_job = str(answer["id"])

    async def long_job_runs() -> bool:
        record = await up.record(long_job)
        return record is not None and record.state is JobState.RUNNING

    await wait_until(long_job_runs, timeout_s=WITHIN_S, every_s=0.05)

    # the store fills between the submission's record and its event: the record, stored,
    # must go again (a full store takes no delete marker)
    api = up.admission.app[API] if up.admission.app is not None else None
    assert api is not None
    publish = api.writer.publish
    first = idempotent_job_id(TENANT, "refused-0")

    async def filled_first(subject: str, *args: Any, **kwargs: Any) -> Any:
        if subject == subjects.job_submitted(first):
            await up.fill()
        return await publish(subject, *args, **kwargs)

    api.writer.publish = filled_first  # type: ignore[method-assign]
    refused = [await up.submit(f"refused-{n}") for n in range(4)]
    api.writer.publish = publish  # type: ignore[method-assign]

    for status, problem in refused:
        assert status == 503, problem
        assert problem["type"].endswith("/store-full"), problem
        assert "nothing was" in problem["detail"]  # stored, or changed (no GPUs reserved)
    assert "nothing was stored" in refused[0][1]["detail"]
    refused_ids = [idempotent_job_id(TENANT, f"refused-{n}") for n in range(4)]
    live = set(await up.stores.live_job_ids())
    for job_id in refused_ids:
        assert await up.record(job_id) is None, job_id
        assert job_id not in live
        assert await up.submitted_events(job_id) == 0
    assert not [j for j in (await up.get("/v1/jobs?limit=1000"))[1]["jobs"]
                if j["id"] in refused_ids]

    # while it is full: /healthz says the store takes no writes, and once the lease has
    # lapsed (it cannot be renewed) that no scheduler leads; so does the dashboard
    async def degraded() -> list[str] | None:
        status, answer = await up.health()
        problems: list[str] = answer.get("problems", [])
        store = any("does not take writes" in p for p in problems)
        leader = any("no scheduler" in p for p in problems)
        return problems if status == 503 and store and leader else None

    problems = await wait_until(degraded, timeout_s=WITHIN_S, every_s=0.2)
    assert any("insufficient resources" in p for p in problems), problems
    assert (await up.get("/v1/dashboard/scheduler"))[1]["leader"] is None
    assert not up.scheduler.is_leader

    # space is back: no restart, the scheduler leads again and health is ok
    await up.stores.js.purge_stream(FILLER)

    async def healthy() -> bool:
        return (await up.health())[0] == 200

    await wait_until(healthy, timeout_s=WITHIN_S, every_s=0.2)
    assert up.scheduler.is_leader
    assert (await up.get("/v1/dashboard/scheduler"))[1]["leader"] == up.scheduler.config.instance

    # the refused ones, retried with their keys, and new ones are taken and run
    retried = []
    for n in range(4):
        status, answer = await up.submit(f"refused-{n}")
        assert status == 201, answer  # created now: nothing of the refused one was left
        retried.append(str(answer["id"]))
    assert retried == refused_ids
    after = [str((await up.submit(f"after-{n}"))[1]["id"]) for n in range(3)]

    accepted = [*before, long_job, *retried, *after]
    records = await up.succeeded(accepted)
    for job_id, record in records.items():
        states = [change.state for change in record.history]
        assert states.count(JobState.SUCCEEDED) == 1, (job_id, states)
        assert states.count(JobState.RUNNING) == 1, (job_id, states)
        assert await up.submitted_events(job_id) == 1, job_id
    listed = {j["id"] for j in (await up.get("/v1/jobs?limit=1000"))[1]["jobs"]}
    assert listed == set(accepted)

    async def nothing_reserved() -> bool:
        _, ledger = await read_ledger(api.quotas.kv, TENANT)
        return not ledger.reservations

    await wait_until(nothing_reserved, timeout_s=WITHIN_S, every_s=0.2)


# ---------------------------------------------------------------------- nats-server's log


def test_the_embedded_nats_server_logs_in_its_store_directory_and_says_why_it_did_not_start(
    tmp_path: Path,
) -> None:
    with NatsServer(store_dir=tmp_path / "first") as first:
        assert first.log_file == tmp_path / "first" / "nats-server.log"
        assert "Server is ready" in first.log_file.read_text()
        # its route port is the first server's client port, which is taken
        second = NatsServer(store_dir=tmp_path / "second", cluster_port=first.port,
                            server_name="second", routes=["nats-route://127.0.0.1:1"])
        with pytest.raises(RuntimeError, match="address already in use"):
            second.start()
        assert "address already in use" in second.log_file.read_text()


# ---------------------------------------------------------------------- a real full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MB tmpfs where ``gpusched up`` keeps its NATS store (state/nats); skipped
    where none can be mounted (it takes root)."""
    disk = tmp_path / "state" / "nats"
    disk.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until the disk has no room left."""
    chunk = b"\0" * (1 << 20)
    with path.open("wb") as filler:
        while True:
            try:
                filler.write(chunk)
                filler.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        with contextlib.suppress(OSError):
            os.fsync(filler.fileno())


async def test_gpusched_up_recovers_without_a_restart_once_its_full_disk_has_room_again(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(state))
    config = UpConfig(nodes=1, gpus_per_node=4, policy="fifo", port=0, state_dir=state,
                      time_scale=0.01, heartbeat_s=0.2)
    async with LocalCluster(config) as local, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {local.token}"},
        timeout=aiohttp.ClientTimeout(total=60),
    ) as session, connection(local.connect_url("scheduler"), "test") as nc:
        assert local.scheduler is not None
        up = Cluster(local.url, session, await Stores.open(nc), local.scheduler)
        tenant = "default"
        await wait_until(lambda: local.scheduler is not None and local.scheduler.is_leader,
                         timeout_s=WITHIN_S)
        before = str((await up.submit("disk-before"))[1]["id"])
        await up.succeeded([before])

        await asyncio.to_thread(fill_disk, small_disk / "filler")
        # a write that still fits a page the store began may pass; the next ones cannot
        accepted, refused = [before], []
        for n in range(10):
            status, answer = await up.submit(f"disk-{n}")
            if status in (200, 201):
                accepted.append(str(answer["id"]))
                continue
            assert status == 503, answer
            assert answer["type"].rsplit("/", 1)[-1].startswith("store-"), answer
            refused.append((f"disk-{n}", answer["detail"]))
            if len(refused) == 2:
                break
        assert refused, "the full disk refused no submission"
        log_file = small_disk / "nats-server.log"
        assert "no space left on device" in log_file.read_text()

        async def store_unwritable() -> bool:
            status, answer = await up.health()
            problems = answer.get("problems", [])
            return status == 503 and any("does not take writes" in p for p in problems)

        await wait_until(store_unwritable, timeout_s=WITHIN_S, every_s=0.5)
        for key, detail in refused:
            if "nothing was stored" in detail:
                assert await up.record(idempotent_job_id(tenant, key)) is None, key

        (small_disk / "filler").unlink()  # room again: the stream that failed is restarted

        async def healthy() -> bool:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                return (await up.health())[0] == 200
            return False

        await wait_until(healthy, timeout_s=WITHIN_S, every_s=0.5)
        for key, _ in refused:
            status, answer = await up.submit(key)
            assert status in (200, 201), answer
            accepted.append(str(answer["id"]))
        status, answer = await up.submit("disk-after")
        assert status == 201, answer
        accepted.append(str(answer["id"]))

        records = await up.succeeded(accepted)
        for job_id, record in records.items():
            states = [change.state for change in record.history]
            assert states.count(JobState.SUCCEEDED) == 1, (job_id, states)
            assert await up.submitted_events(job_id) == 1, job_id
