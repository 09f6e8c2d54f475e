"""The live scheduler against a real nats-server, without node agents."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time

from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.schemas import CancelRequest, JobState
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler, spec, store_job, wait_state


async def test_exactly_one_of_two_schedulers_leads_and_the_standby_takes_over(nats_server):
    async with contextlib.AsyncExitStack() as stack:
        leader = await stack.enter_async_context(SchedulerService(fast_scheduler(nats_server.url)))
        await wait_until(lambda: leader.is_leader, timeout_s=5)
        async with SchedulerService(fast_scheduler(nats_server.url)) as standby:
            await asyncio.sleep(0.5)  # the standby keeps trying meanwhile
            assert leader.is_leader and not standby.is_leader
            await stack.aclose()
            # a clean exit releases the lease, so the standby need not wait for it to lapse
            handed = time.monotonic()
            await wait_until(lambda: standby.is_leader, timeout_s=5)
            assert time.monotonic() - handed < 1.0


async def test_a_standby_takes_over_after_a_leader_vanishes_without_releasing(nats_server, stores):
    crashed = SchedulerService(fast_scheduler(nats_server.url))
    await crashed.__aenter__()
    await wait_until(lambda: crashed.is_leader, timeout_s=5)
    job_id = await store_job(stores, spec())
    # a crash: the connection dies and the lease is never released
    assert crashed.nc is not None
    await crashed.nc.close()
    async with SchedulerService(fast_scheduler(nats_server.url)) as standby:
        taken = time.monotonic()
        await wait_until(lambda: standby.is_leader, timeout_s=5)
        assert time.monotonic() - taken >= 0.5  # it waited for the lease to lapse
        assert standby.scheduler is not None
        await wait_until(lambda: job_id in standby.scheduler.jobs, timeout_s=5)
    with contextlib.suppress(Exception):
        await crashed.__aexit__(None, None, None)


async def test_a_job_waits_with_a_readable_reason_while_no_node_has_registered(
    nats_server, stores: Stores
):
    async with SchedulerService(fast_scheduler(nats_server.url)):
        job_id = await store_job(stores, spec())

        async def explained() -> bool:
            entry = await stores.jobs.get(job_id)
            return b"no nodes with GPUs" in (entry.value or b"")

        await wait_until(explained, timeout_s=5)


async def test_cancelling_a_queued_job_ends_it_cancelled_and_publishes_the_state(
    nats_server, nc, stores: Stores
):
    seen: list[bytes] = []
    async with SchedulerService(fast_scheduler(nats_server.url)):
        job_id = await store_job(stores, spec())
        await nc.subscribe(subjects.job_state(job_id), cb=functools.partial(_append, seen))
        await stores.js.publish(
            subjects.job_cancel(job_id),
            codec.encode(CancelRequest(job_id, "default", time.time())),
            headers=codec.headers(),
        )
        done = await wait_state(stores, job_id, JobState.CANCELLED)
        assert [c.state for c in done.history] == [JobState.QUEUED, JobState.CANCELLED]
        await wait_until(lambda: seen, timeout_s=2)
        assert b"CANCELLED" in seen[0]


async def _append(seen: list[bytes], msg: Msg) -> None:
    seen.append(msg.data)


async def test_both_instances_answer_the_micro_protocol_and_report_who_leads(nats_server, nc):
    async with SchedulerService(fast_scheduler(nats_server.url)) as first, SchedulerService(
        fast_scheduler(nats_server.url)
    ) as second:
        await wait_until(lambda: first.is_leader or second.is_leader, timeout_s=5)
        statuses = []
        for instance in (first, second):
            reply = await nc.request(
                subjects.scheduler_status(instance.config.instance), b"", timeout=2
            )
            statuses.append(json.loads(reply.data))
        assert sorted(s["leader"] for s in statuses) == [False, True]
        ping = await nc.request("$SRV.INFO.gpusched-scheduler", b"", timeout=2)
        assert json.loads(ping.data)["name"] == "gpusched-scheduler"
