"""Every number a job spec holds has a documented lower and upper bound; a value out of
range, however large, is a 422 naming the field, in JSON and in YAML, and reserves
nothing. Real nats-server, real service, real HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer
from gpusched.services.admission import AdmissionConfig, AdmissionService, quota
from gpusched.services.admission.quota import read_ledger
from tests.test_admission_api import QUOTAS, TOKENS, Api, spec, stored_jobs


@pytest.fixture
async def capped(nats_server: NatsServer) -> AsyncIterator[Api]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        yield Api(session, service.url, "tok-capped")


BEYOND_64_BITS = [2**64, 2**64 + 1, 10**30, -(2**63) - 1, -(10**30)]
INTEGER_FIELDS = [
    "gpus", "batch_size", "iterations", "dataset_size", "priority", "data_parallel",
    "tensor_parallel", "pipeline_parallel", "min_batch_size", "max_batch_size",
    "max_retries", "checkpoint_every",
]


@pytest.mark.parametrize("field", INTEGER_FIELDS)
async def test_integers_beyond_64_bits_are_refused_naming_the_field_and_reserve_nothing(
    capped: Api, stores: Stores, field: str
):
    for value in BEYOND_64_BITS:
        body = spec(**{field: value})
        if field == "dataset_size":
            body = spec(iterations=None, epochs=1, dataset_size=value)

        answer = await capped.submit(body)

        assert answer.status == 422, (field, value, answer.body)
        assert answer.problem["field"] == field
    assert (await read_ledger(await quota.open_bucket(stores.js), "capped"))[1].used == 0
    assert (await capped.submit(spec(gpus=4))).status == 201
    assert len(await stored_jobs(stores)) == 1


NUMBER_BOUNDS: dict[str, tuple[Any, Any]] = {
    "gpus": (0, 4097),
    "batch_size": (0, 1_048_577),
    "iterations": (0, 1_000_000_001),
    "epochs": (0, 100_001),
    "dataset_size": (0, 1_000_000_000_001),
    "priority": (-1001, 1001),
    "deadline": (-1, 4_102_444_801),
    "data_parallel": (0, 4097),
    "tensor_parallel": (0, 4097),
    "pipeline_parallel": (0, 4097),
    "min_batch_size": (0, 1_048_577),
    "max_batch_size": (0, 1_048_577),
    "cpus_per_gpu": (0, 1025),
    "mem_gb_per_gpu": (0, 65537),
    "max_retries": (-1, 101),
    "checkpoint_every": (0, 1_000_000_001),
}


@pytest.mark.parametrize("field", sorted(NUMBER_BOUNDS))
async def test_every_number_of_a_job_spec_has_both_bounds_in_json_and_yaml(
    capped: Api, stores: Stores, field: str
):
    for value in NUMBER_BOUNDS[field]:
        body = spec(**{field: value})
        if field in ("epochs", "dataset_size"):
            body = spec(iterations=None, **{"epochs": 1, "dataset_size": 100, field: value})
        as_yaml = "".join(f"{key}: {json.dumps(item)}\n" for key, item in body.items())

        answers = [
            await capped.submit(body),
            await capped.post_raw(as_yaml, "application/yaml"),
        ]

        for answer in answers:
            assert answer.status == 422, (field, value, answer.body)
            assert answer.problem["field"] == field
    assert await stored_jobs(stores) == {}


async def test_an_infinite_deadline_in_yaml_is_refused(capped: Api, stores: Stores):
    body = "name: n\nmodel: resnet50\nbatch_size: 8\niterations: 5\ndeadline: .inf\n"

    answer = await capped.post_raw(body, "application/yaml")

    assert answer.status == 422
    assert answer.problem["field"] == "deadline"
    assert await stored_jobs(stores) == {}
