"""GPU quotas shared by several admission instances on one NATS: the ledger in the
quota bucket, its releases when jobs end or submissions fail, and its reconciliation
after an instance died mid-submission. Real nats-server, real services, real HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.js.kv import KeyValue

from gpusched.libs.common import subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import JobState
from gpusched.services.admission import AdmissionConfig, AdmissionService, quota
from gpusched.services.admission.quota import Ledger, Reservation, ledger_key, read_ledger
from tests.test_admission_api import QUOTAS, TOKENS, Api, set_state, spec, stored_jobs


@pytest.fixture
async def quota_kv(stores: Stores) -> KeyValue:
    return await quota.open_bucket(stores.js)


async def used(kv: KeyValue, tenant: str = "capped") -> int:
    return (await read_ledger(kv, tenant))[1].used


async def reserved(kv: KeyValue, tenant: str = "capped") -> dict[str, int]:
    ledger = (await read_ledger(kv, tenant))[1]
    return {job_id: held.gpus for job_id, held in ledger.reservations.items()}


@pytest.fixture
async def two_apis(nats_server: NatsServer) -> AsyncIterator[tuple[Api, Api]]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with (
        AdmissionService(config) as first,
        AdmissionService(config) as second,
        aiohttp.ClientSession() as session,
    ):
        yield (Api(session, first.url, "tok-capped"), Api(session, second.url, "tok-capped"))


@pytest.fixture
async def capped(nats_server: NatsServer) -> AsyncIterator[Api]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        yield Api(session, service.url, "tok-capped")


# ---------------------------------------------------------------------- shared ledger


async def test_two_instances_together_never_accept_more_than_the_quota(
    two_apis: tuple[Api, Api], stores: Stores, quota_kv: KeyValue
):
    first, second = two_apis

    answers = await asyncio.gather(
        *(api.submit(spec(gpus=1)) for _ in range(8) for api in (first, second))
    )

    assert sorted(answer.status for answer in answers) == [201] * 4 + [403] * 12
    assert len(await stored_jobs(stores)) == 4
    accepted = {answer.body["id"] for answer in answers if answer.status == 201}
    assert await reserved(quota_kv) == {job_id: 1 for job_id in accepted}
    refusal = next(answer for answer in answers if answer.status == 403)
    assert refusal.problem["field"] == "gpus"
    assert refusal.problem["quota"] == 4


async def test_jobs_that_end_in_any_way_give_their_gpus_back_to_every_instance(
    two_apis: tuple[Api, Api], stores: Stores, quota_kv: KeyValue
):
    first, second = two_apis
    jobs = [
        (await first.submit(spec(gpus=2))).body["id"],
        (await second.submit(spec(gpus=1))).body["id"],
        (await first.submit(spec(gpus=1))).body["id"],
    ]
    assert await used(quota_kv) == 4
    assert (await second.submit(spec(gpus=1))).status == 403

    for job_id, state in zip(
        jobs, (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED), strict=True
    ):
        await set_state(stores, job_id, JobState.RUNNING)
        await set_state(stores, job_id, state)

    async def drained() -> bool:
        return await used(quota_kv) == 0

    await wait_until(drained, timeout_s=10)
    answers = await asyncio.gather(
        *(api.submit(spec(gpus=1)) for _ in range(4) for api in (first, second))
    )
    assert sorted(answer.status for answer in answers) == [201] * 4 + [403] * 4
    assert await used(quota_kv) == 4


async def test_unfinished_jobs_missing_from_the_ledger_are_entered_into_it(
    capped: Api,
    nats_server: NatsServer,
    quota_kv: KeyValue,
    monkeypatch: pytest.MonkeyPatch,
):
    # a job stored before the ledger existed (or a reservation released too early)
    job_id = (await capped.submit(spec(gpus=3))).body["id"]
    await quota_kv.put(ledger_key("capped"), quota._encoder.encode(Ledger()))
    monkeypatch.setattr(quota, "RECONCILE_S", 0.05)
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with AdmissionService(config):

        async def entered() -> bool:
            return await reserved(quota_kv) == {job_id: 3}

        await wait_until(entered, timeout_s=10)
    assert (await capped.submit(spec(gpus=2))).status == 403


# ---------------------------------------------------------------------- crash safety


async def test_a_reservation_whose_instance_died_before_storing_the_job_is_released(
    nats_server: NatsServer, quota_kv: KeyValue, monkeypatch: pytest.MonkeyPatch
):
    # what an instance killed between reserving and writing the record leaves behind:
    # one reservation an hour old, and one just made (its record may still be coming)
    abandoned = Reservation(3, time.time() - 3600)
    recent = Reservation(1, time.time() + 3600)
    ledger = Ledger({"j000000000000dead0001": abandoned, "j000000000000dead0002": recent})
    await quota_kv.put(ledger_key("capped"), quota._encoder.encode(ledger))
    monkeypatch.setattr(quota, "RECONCILE_S", 0.05)
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        capped = Api(session, service.url, "tok-capped")

        async def released() -> bool:
            return await reserved(quota_kv) == {"j000000000000dead0002": 1}

        await wait_until(released, timeout_s=10)
        assert (await capped.submit(spec(gpus=3))).status == 201
        assert (await capped.submit(spec(gpus=1))).status == 403


# ---------------------------------------------------------------------- failures


async def test_a_submit_that_fails_after_reserving_leaves_quota_usage_unchanged(
    capped: Api, stores: Stores, quota_kv: KeyValue
):
    kept = (await capped.submit(spec(gpus=1))).body["id"]
    # the record is written, then the stream is missing: the submission is withdrawn
    await stores.js.delete_stream(subjects.JOBS_STREAM)

    answer = await capped.submit(spec(gpus=3))

    assert answer.status == 503
    assert await reserved(quota_kv) == {kept: 1}
    assert set(await stored_jobs(stores)) == {kept}
