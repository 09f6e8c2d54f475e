"""What the submission path remembers instead of asking again, and when it forgets it:
the leader's answer about priorities (kept for one leader term) and the Authorization
headers already accepted. Real nats-server and the real HTTP API; the leader is a
stand-in that answers the scheduler's status requests as the test says."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.schemas import Lease
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.admission.auth import MAX_ACCEPTED_HEADERS, Authenticator
from gpusched.services.admission.problems import ProblemError
from tests.test_admission_api import TOKENS, Api, spec

#: the lease bucket's TTL here: long, so that no entry expires while a test runs and the
#: terms below are made by the lease's renewal times alone
LEASE_TTL_S = 600.0


@dataclass
class StandInLeader:
    """Answers ``scheduler_status`` requests of every holder with ``status[holder]``
    and counts them."""

    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    asked: dict[str, int] = field(default_factory=dict)

    async def answer(self, msg: Msg) -> None:
        holder = msg.subject.split(".")[-2]
        assert msg.subject == subjects.scheduler_status(holder)
        self.asked[holder] = self.asked.get(holder, 0) + 1
        await msg.respond(json.dumps(self.status.get(holder, {})).encode())


def policy(name: str, honours: bool) -> dict[str, Any]:
    return {"policy": name, "leader": True, "honours_priority": honours}


@pytest.fixture
async def leader(nc: Client) -> AsyncIterator[StandInLeader]:
    stand_in = StandInLeader()
    subscription = await nc.subscribe(f"{subjects.PREFIX}.scheduler.*.status",
                                      cb=stand_in.answer)
    yield stand_in
    await subscription.unsubscribe()


@pytest.fixture
async def lease_stores(nc: Client) -> Stores:
    # made before admission opens the bucket, so the bucket keeps this TTL
    return await Stores.open(nc, lease_ttl_s=LEASE_TTL_S)


@pytest.fixture
async def api(nats_server: NatsServer, lease_stores: Stores) -> AsyncIterator[Api]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        yield Api(session, service.url)


async def hold_lease(stores: Stores, holder: str, at: float) -> None:
    await stores.lease.put(subjects.SCHEDULER_LEASE_KEY, codec.encode(Lease(holder, at)))


async def submit_with_priority(api: Api) -> int:
    return (await api.submit(spec(priority=3))).status


async def test_the_leader_is_asked_once_while_it_leads_not_once_per_submission(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    leader.status["sched-a"] = policy("fifo", honours=True)
    started = time.time()
    await hold_lease(lease_stores, "sched-a", started)

    statuses = [await submit_with_priority(api) for _ in range(5)]
    # renewals of the same term
    await hold_lease(lease_stores, "sched-a", started + 1.0)
    statuses.append(await submit_with_priority(api))

    assert statuses == [201] * 6
    assert leader.asked == {"sched-a": 1}


async def test_another_leader_is_asked_by_the_next_submission(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    leader.status["sched-a"] = policy("fifo", honours=True)
    leader.status["sched-b"] = policy("ones", honours=False)
    await hold_lease(lease_stores, "sched-a", time.time())
    assert await submit_with_priority(api) == 201

    await hold_lease(lease_stores, "sched-b", time.time())
    refused = await api.submit(spec(priority=3))

    assert refused.status == 422
    assert refused.problem["field"] == "priority"
    assert "ones does not honour priorities" in refused.problem["detail"]
    assert leader.asked == {"sched-a": 1, "sched-b": 1}


async def test_a_holder_that_leads_again_after_its_lease_expired_is_asked_again(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    leader.status["sched-a"] = policy("fifo", honours=True)
    # renewed a TTL ago: not lapsed yet (that takes two), but the same holder's next
    # lease, renewed now, is of a new term: this one had to expire first
    await hold_lease(lease_stores, "sched-a", time.time() - LEASE_TTL_S)
    assert await submit_with_priority(api) == 201

    # restarted with another policy
    leader.status["sched-a"] = policy("ones", honours=False)
    await hold_lease(lease_stores, "sched-a", time.time())

    assert await submit_with_priority(api) == 422
    assert leader.asked == {"sched-a": 2}


async def test_without_a_lease_a_priority_is_taken_and_the_next_leader_is_asked(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    leader.status["sched-b"] = policy("ones", honours=False)
    await hold_lease(lease_stores, "sched-b", time.time())
    assert await submit_with_priority(api) == 422

    await lease_stores.lease.delete(subjects.SCHEDULER_LEASE_KEY)
    assert await submit_with_priority(api) == 201
    await hold_lease(lease_stores, "sched-b", time.time())

    assert await submit_with_priority(api) == 422
    assert leader.asked == {"sched-b": 2}


async def test_an_unanswered_or_undecided_leader_is_not_remembered(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    # a leader still building its state says neither yes nor no
    leader.status["sched-a"] = {"policy": "ones", "leader": True, "honours_priority": None}
    await hold_lease(lease_stores, "sched-a", time.time())
    assert await submit_with_priority(api) == 201

    leader.status["sched-a"] = policy("ones", honours=False)

    assert await submit_with_priority(api) == 422
    assert leader.asked == {"sched-a": 2}


async def test_a_job_without_a_priority_never_asks_the_leader(
    api: Api, lease_stores: Stores, leader: StandInLeader
):
    leader.status["sched-a"] = policy("ones", honours=False)
    await hold_lease(lease_stores, "sched-a", time.time())

    assert (await api.submit(spec())).status == 201
    assert leader.asked == {}


# ---------------------------------------------------------------------- tokens


def refused(auth: Authenticator, header: str | None) -> bool:
    try:
        auth.tenant(header)
    except ProblemError as exc:
        return exc.problem("/").status == 401
    return False


def test_an_accepted_header_is_remembered_and_nothing_else_is_let_in():
    auth = Authenticator({"tok-alpha": "alpha"})

    assert auth.tenant("Bearer tok-alpha") == "alpha"
    assert auth.tenant("Bearer tok-alpha") == "alpha"
    assert auth.tenant("bearer  tok-alpha ") == "alpha"
    for wrong in ("Bearer tok-alph", "Bearer tok-alphaa", "Basic tok-alpha", "tok-alpha",
                  "Bearer", "", None):
        assert refused(auth, wrong), wrong
    assert set(auth._accepted) == {"Bearer tok-alpha", "bearer  tok-alpha "}


def test_the_remembered_headers_stay_bounded():
    auth = Authenticator({"tok-alpha": "alpha"})

    for spaces in range(MAX_ACCEPTED_HEADERS + 10):
        assert auth.tenant("Bearer tok-alpha" + " " * spaces) == "alpha"

    assert len(auth._accepted) <= MAX_ACCEPTED_HEADERS
    assert refused(auth, "Bearer tok-beta")
