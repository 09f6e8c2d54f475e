"""`gpusched up` on a three-server JetStream cluster: streams and buckets kept on every
server, and a server killed (SIGKILL) while jobs are submitted and run loses nothing.

The server is killed at a chosen moment, not a lucky one: the leader of the job records'
stream, as the scheduler writes the record that starts a job, once some jobs were
accepted. A write that dies with its server times out; the job it was starting must
still run."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import JobRecord, JobState
from gpusched.services.cli.up import LocalCluster, UpConfig

JOBS = 24
#: the server is killed once this many jobs were accepted
KILL_AFTER = 8
ITERATIONS = 200
#: generous: each job alone takes well under a second at this time scale, and a lost
#: server costs the clients a reconnect and a few request timeouts (5 s each)
DEADLINE_S = 120.0 + 5.0 * JOBS


async def submit(session: aiohttp.ClientSession, url: str, n: int) -> str:
    """Submit job ``n`` until it is accepted: a request that failed while a server died is
    retried with the same Idempotency-Key, so it is stored once either way."""
    body = {"name": f"c{n}", "model": "resnet50", "batch_size": 32, "iterations": ITERATIONS}
    headers = {"Idempotency-Key": f"job-{n}"}

    async def accepted() -> str | None:
        try:
            async with session.post(f"{url}/v1/jobs", json=body, headers=headers) as response:
                if response.status in (200, 201):
                    return str((await response.json())["id"])
        except (aiohttp.ClientError, TimeoutError):
            pass
        return None

    job_id: str = await wait_until(accepted, timeout_s=DEADLINE_S, every_s=0.2)
    return job_id


async def test_a_three_server_nats_cluster_loses_no_job_when_one_server_is_killed(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(
        nodes=2, gpus_per_node=4, policy="fifo", port=0, state_dir=tmp_path / "state",
        time_scale=0.01, heartbeat_s=0.2, nats_cluster=3,
    )
    async with LocalCluster(config) as cluster, aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {cluster.token}"},
        timeout=aiohttp.ClientTimeout(total=30),
    ) as session:
        assert cluster.nats_cluster is not None
        assert len(cluster.nats_url.split(",")) == 3
        async with connection(cluster.connect_url("scheduler"), "test") as nc:
            js = nc.jetstream(timeout=10)
            streams = [subjects.JOBS_STREAM,
                       *(f"KV_{b}" for b in (subjects.JOBS_BUCKET, subjects.NODES_BUCKET,
                                             subjects.LEASE_BUCKET, subjects.LIVE_BUCKET))]
            infos = {s: await js.stream_info(s) for s in streams}
        assert {s: i.config.num_replicas for s, i in infos.items()} == dict.fromkeys(streams, 3)
        # the leader of the job records' stream: the start's write goes to it
        leader = infos[f"KV_{subjects.JOBS_BUCKET}"].cluster.leader
        victim: NatsServer = next(s for s in cluster.nats_cluster.servers
                                  if s.server_name == leader)

        accepted: list[str] = []
        killed: list[str] = []
        assert cluster.scheduler is not None and cluster.scheduler.stores is not None
        jobs = cluster.scheduler.stores.jobs
        write = jobs.update

        async def killing_under_a_start(key: str, value: bytes, **kwargs: Any) -> int:
            record = codec.decode(value, JobRecord)
            starts = record.state is JobState.QUEUED and bool(record.placement)
            if starts and not killed and len(accepted) >= KILL_AFTER:
                killed.append(key)
                victim.kill()  # mid-stream of submissions, under the start's write
            revision: int = await write(key, value, **kwargs)
            return revision

        jobs.update = killing_under_a_start  # type: ignore[method-assign]

        async def submit_all() -> None:
            for n in range(JOBS):
                accepted.append(await submit(session, cluster.url, n))

        await asyncio.wait_for(submit_all(), DEADLINE_S)
        assert len(set(accepted)) == JOBS

        async def states() -> dict[str, str]:
            found: dict[str, str] = {}
            for job_id in accepted:
                try:
                    async with session.get(f"{cluster.url}/v1/jobs/{job_id}") as response:
                        if response.status == 200:
                            found[job_id] = (await response.json())["state"]
                except (aiohttp.ClientError, TimeoutError):
                    pass
            return found

        async def all_succeeded() -> bool:
            return set((await states()).values()) == {"SUCCEEDED"} and len(await states()) == JOBS

        try:
            await wait_until(all_succeeded, timeout_s=DEADLINE_S, every_s=0.5)
        except TimeoutError:
            raise AssertionError(f"not all jobs succeeded: {await states()}") from None
        assert killed, "no start was written after the first jobs were accepted"

        async with session.get(f"{cluster.url}/v1/jobs", params={"limit": "1000"}) as response:
            listed = [j["id"] for j in (await response.json())["jobs"]]
        assert sorted(listed) == sorted(accepted), "a job stored twice, or one lost"
        async with connection(cluster.connect_url("scheduler"), "test") as nc:
            info = await nc.jetstream(timeout=10).stream_info(
                subjects.JOBS_STREAM, subjects_filter=f"{subjects.PREFIX}.job.*.submitted"
            )
        counts = info.state.subjects or {}
        # no submission stored twice (a retry's event is dropped as a duplicate); one whose
        # event died with the server ran all the same (from the index of unfinished jobs)
        assert set(counts) <= {subjects.job_submitted(j) for j in accepted}
        assert set(counts.values()) == {1}
