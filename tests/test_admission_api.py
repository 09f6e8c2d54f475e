"""The admission HTTP API end to end: a real nats-server, the real service on a free port,
real HTTP requests. There is no scheduler here: tests write records and publish state
events themselves where a scheduler would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    CancelRequest,
    GpuInfo,
    GpuTelemetry,
    JobProgressEvent,
    JobRecord,
    JobSpec,
    JobState,
    JobStateEvent,
    JobSubmitted,
    NodeInfo,
    Placement,
    Progress,
    StateChange,
    Telemetry,
    now,
)
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.admission.ids import idempotent_job_id
from gpusched.services.scheduler.live import SchedulerService
from tests.live import fast_scheduler

TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta", "tok-capped": "capped"}
QUOTAS = {"capped": 4}


def spec(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "train", "model": "resnet50", "batch_size": 64,
                            "iterations": 100}
    body.update(overrides)
    return {key: value for key, value in body.items() if value is not None}


@dataclass
class Answer:
    status: int
    headers: Any
    body: Any

    @property
    def problem(self) -> dict[str, Any]:
        content_type = self.headers.get("Content-Type", "")
        assert content_type.startswith("application/problem+json"), (self.status, self.body)
        assert isinstance(self.body, dict)
        assert self.body["status"] == self.status
        assert {"type", "title", "status", "detail"} <= set(self.body)
        return self.body


@dataclass
class Api:
    session: aiohttp.ClientSession
    url: str
    token: str | None = "tok-alpha"

    def as_tenant(self, token: str | None) -> Api:
        return Api(self.session, self.url, token)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        headers.update(extra or {})
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        data: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Answer:
        async with self.session.request(
            method, self.url + path, data=data, headers=self.headers(headers), params=params
        ) as response:
            raw = await response.read()
            body: Any = raw
            if "json" in response.headers.get("Content-Type", ""):
                body = json.loads(raw)
            return Answer(response.status, response.headers, body)

    async def submit(
        self, body: dict[str, Any] | None = None, *, key: str | None = None, **overrides: Any
    ) -> Answer:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        payload = json.dumps(body if body is not None else spec(**overrides))
        return await self.request("POST", "/v1/jobs", data=payload, headers=headers)

    async def post_raw(self, data: bytes | str, content_type: str) -> Answer:
        return await self.request(
            "POST", "/v1/jobs", data=data, headers={"Content-Type": content_type}
        )

    async def get(self, path: str, **params: str) -> Answer:
        return await self.request("GET", path, params=params or None)

    async def delete(self, path: str) -> Answer:
        return await self.request("DELETE", path)

    async def events(self, job_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Each server-sent event as (event name, decoded data) until the server ends
        the stream."""
        async with self.session.get(
            f"{self.url}/v1/jobs/{job_id}/events", headers=self.headers()
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            name = ""
            async for raw_line in response.content:
                line = raw_line.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    yield name, json.loads(line.removeprefix("data: "))


async def stored_jobs(stores: Stores) -> dict[str, JobRecord]:
    records = {}
    for key in await stores.job_ids():
        entry = await stores.jobs.get(key)
        assert entry.value is not None
        records[key] = codec.decode(entry.value, JobRecord)
    return records


async def stream_count(stores: Stores, subject: str = "gpusched.job.*.*") -> int:
    info = await stores.js.stream_info(subjects.JOBS_STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def stored_record(stores: Stores, job_id: str) -> JobRecord:
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    return codec.decode(entry.value, JobRecord)


async def set_state(stores: Stores, job_id: str, state: JobState, **changes: Any) -> JobRecord:
    """What the scheduler would do: a compare-and-set update of the record."""
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    record = codec.decode(entry.value, JobRecord)
    updated = msgspec.structs.replace(
        record,
        state=state,
        history=[*record.history, StateChange(state, now(), "test")],
        **changes,
    )
    await stores.jobs.update(job_id, codec.encode(updated), last=entry.revision)
    return updated


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[AdmissionService]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS, quotas=QUOTAS)
    async with AdmissionService(config) as running:
        yield running


@pytest.fixture
async def api(service: AdmissionService) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as session:
        yield Api(session, service.url)


# ---------------------------------------------------------------------- submitting


async def test_a_valid_submit_stores_a_queued_record_and_one_stream_message(
    api: Api, stores: Stores
):
    answer = await api.submit(spec(gpus=2))

    assert answer.status == 201
    job_id = answer.body["id"]
    assert answer.headers["Location"] == f"/v1/jobs/{job_id}"
    assert answer.body["state"] == "QUEUED"
    assert answer.body["tenant"] == "alpha"
    stored = await stored_record(stores, job_id)
    assert stored.state is JobState.QUEUED
    assert stored.total_iterations == 100
    assert stored.spec.gpus == 2
    assert [change.state for change in stored.history] == [JobState.QUEUED]
    assert stored.pending_reason
    assert await stream_count(stores) == 1
    message = await stores.js.get_last_msg(subjects.JOBS_STREAM, subjects.job_submitted(job_id))
    assert codec.decode(message.data, JobSubmitted).job_id == job_id
    assert message.headers is not None
    assert message.headers["Nats-Msg-Id"] == job_id
    assert message.headers["Content-Type"] == "application/msgpack"


async def test_job_ids_are_subject_safe_and_sort_by_submission_time(api: Api):
    first = (await api.submit()).body["id"]
    await asyncio.sleep(0.002)
    second = (await api.submit()).body["id"]

    assert first < second
    assert subjects.job_state(first)


async def test_a_yaml_body_is_accepted(api: Api, stores: Stores):
    body = "name: from-yaml\nmodel: bert\nbatch_size: 16\nepochs: 2\ndataset_size: 100\n"

    answer = await api.post_raw(body, "application/yaml")

    assert answer.status == 201, answer.body
    stored = await stored_record(stores, answer.body["id"])
    assert stored.spec.name == "from-yaml"
    assert stored.total_iterations == 13


@pytest.mark.parametrize(
    ("epochs", "dataset_size", "batch_size", "expected"),
    [(1, 100, 10, 10), (0.1, 30, 3, 1), (2.5, 7, 2, 9), (1e-6, 1, 1, 1)],
)
async def test_epochs_become_the_ceiling_of_epochs_times_samples_over_batch(
    api: Api, epochs: float, dataset_size: int, batch_size: int, expected: int
):
    answer = await api.submit(
        spec(iterations=None, epochs=epochs, dataset_size=dataset_size, batch_size=batch_size)
    )

    assert answer.status == 201, answer.body
    assert answer.body["total_iterations"] == expected


BAD_JSON_BODIES = [
    pytest.param("{not json", 400, None, id="broken-json"),
    pytest.param("[]", 422, None, id="not-an-object"),
    pytest.param(json.dumps(spec(gpus="two")), 422, "gpus", id="wrong-type"),
    pytest.param(json.dumps(spec(gpus=-1)), 422, "gpus", id="negative-gpus"),
    pytest.param(json.dumps(spec(gpus=0)), 422, "gpus", id="zero-gpus"),
    pytest.param(json.dumps(spec(colour="red")), 422, "colour", id="unknown-field"),
    pytest.param(json.dumps({"model": "resnet50", "batch_size": 1, "iterations": 1}), 422,
                 "name", id="missing-field"),
    pytest.param(json.dumps(spec(model="alexnet-9000")), 422, "model", id="unknown-model"),
    pytest.param(json.dumps(spec(command=[1])), 422, "command[0]", id="bad-command-item"),
    pytest.param(json.dumps(spec(labels={"a": 1})), 422, "labels", id="bad-label-value"),
    pytest.param(json.dumps(spec(epochs=1, dataset_size=10)), 422, "epochs",
                 id="iterations-and-epochs"),
    pytest.param(json.dumps(spec(iterations=None)), 422, "iterations", id="no-length"),
    pytest.param(json.dumps(spec(iterations=None, epochs=3)), 422, "dataset_size",
                 id="epochs-without-dataset-size"),
    pytest.param(json.dumps(spec(iterations=None, epochs=100000, dataset_size=10**9,
                                 batch_size=1)), 422, "epochs", id="too-many-iterations"),
    pytest.param(json.dumps(spec(batch_size=8, min_batch_size=16)), 422, "min_batch_size",
                 id="below-min-batch"),
    pytest.param(json.dumps(spec(batch_size=64, max_batch_size=32)), 422, "max_batch_size",
                 id="above-max-batch"),
    pytest.param(json.dumps(spec(gpus=8, tensor_parallel=2, data_parallel=2)), 422,
                 "data_parallel", id="parallelism-product"),
    pytest.param(json.dumps(spec(gpus=6, tensor_parallel=4)), 422, "tensor_parallel",
                 id="tensor-parallel-not-dividing"),
    pytest.param(json.dumps(spec(gpus=4, pipeline_parallel=3)), 422, "pipeline_parallel",
                 id="pipeline-parallel-not-dividing"),
    pytest.param(b'{"name": "tr\xb1in"}', 400, None, id="not-utf-8"),
    pytest.param("", 400, None, id="empty-body"),
    pytest.param("   \n", 400, None, id="blank-body"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_JSON_BODIES)
async def test_a_bad_json_body_gets_a_problem_naming_the_field_and_stores_nothing(
    api: Api, stores: Stores, body: str | bytes, status: int, field: str | None
):
    answer = await api.post_raw(body, "application/json")

    assert answer.status == status
    assert answer.problem.get("field") == field
    if field is not None:
        assert field.split("[")[0] in answer.problem["detail"]
    assert await stored_jobs(stores) == {}
    assert await stream_count(stores) == 0


BAD_YAML_BODIES = [
    pytest.param("name: [unclosed\n", 400, None, id="broken-yaml"),
    pytest.param("- just\n- a list\n", 422, None, id="a-list"),
    pytest.param("name: x\nmodel: resnet50\nbatch_size: many\niterations: 3\n", 422,
                 "batch_size", id="wrong-type"),
    pytest.param("name: x\nmodel: resnet50\nbatch_size: 1\niterations: 3\ndeadline: 2024-01-01\n",
                 422, "deadline", id="a-date"),
    pytest.param("a: &x [1]\nname: *x\n", 400, None, id="aliases"),
    pytest.param("[" * 10000, 400, None, id="deep-nesting"),
    pytest.param("name: x\nmodel: resnet50\nbatch_size: 1\niterations: 3\nlabels: {1: a}\n",
                 422, "labels", id="a-label-key-not-a-string"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_YAML_BODIES)
async def test_a_bad_yaml_body_gets_a_problem_naming_the_field_and_stores_nothing(
    api: Api, stores: Stores, body: str, status: int, field: str | None
):
    answer = await api.post_raw(body, "text/yaml")

    assert answer.status == status
    assert answer.problem.get("field") == field
    assert await stored_jobs(stores) == {}


async def test_an_unknown_model_problem_lists_the_known_models(api: Api):
    answer = await api.submit(spec(model="nope"))

    assert answer.status == 422
    assert "resnet50" in answer.problem["allowed"]
    assert "resnet50" in answer.problem["detail"]


async def test_an_unsupported_content_type_gets_415(api: Api, stores: Stores):
    answer = await api.post_raw(json.dumps(spec()), "text/plain")

    assert answer.status == 415
    assert answer.problem["field"] == "Content-Type"
    assert "application/json" in answer.headers["Accept-Post"]
    assert await stored_jobs(stores) == {}


async def test_a_body_over_the_limit_gets_413(api: Api, stores: Stores):
    oversized = json.dumps(spec(labels={f"k{i}": "v" * 200 for i in range(400)}))
    assert len(oversized) > 65536

    answer = await api.post_raw(oversized, "application/json")

    assert answer.status == 413
    assert "65536" in answer.problem["detail"]
    assert await stored_jobs(stores) == {}


async def test_a_chunked_body_over_the_limit_gets_413_too(api: Api, stores: Stores):
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 4096
        yield json.dumps(spec()).encode()

    async with api.session.post(
        f"{api.url}/v1/jobs", data=chunks(),
        headers=api.headers({"Content-Type": "application/json"}),
    ) as response:
        assert response.status == 413
        assert response.headers["Content-Type"].startswith("application/problem+json")
        body = await response.json(content_type=None)
    assert body["type"].endswith("payload-too-large")
    assert await stored_jobs(stores) == {}


async def test_an_unknown_route_gets_a_404_problem(api: Api):
    answer = await api.get("/v2/nothing")

    assert answer.status == 404
    assert answer.problem["instance"] == "/v2/nothing"


async def test_a_wrong_method_gets_a_405_problem_with_allow(api: Api):
    answer = await api.request("PUT", "/v1/jobs")

    assert answer.status == 405
    assert "POST" in answer.headers["Allow"]
    assert "PUT" in answer.problem["detail"]


@pytest.mark.parametrize("token", [None, "not-a-token"])
async def test_a_missing_or_unknown_token_gets_401_and_stores_nothing(
    api: Api, stores: Stores, token: str | None
):
    answer = await api.as_tenant(token).submit()

    assert answer.status == 401
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert answer.problem["type"].endswith("unauthorized")
    assert await stored_jobs(stores) == {}


async def test_a_non_bearer_authorization_is_refused(api: Api):
    answer = await api.request(
        "GET", "/v1/jobs", headers={"Authorization": "Basic dG9rLWFscGhhOg=="}
    )
    assert answer.status == 401


# ---------------------------------------------------------------------- idempotency


async def test_an_idempotent_retry_creates_one_job(api: Api, stores: Stores):
    first = await api.submit(key="retry-me")
    second = await api.submit(key="retry-me")

    assert first.status == 201
    assert second.status == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.body["id"] == first.body["id"]
    assert second.headers["Location"] == first.headers["Location"]
    assert list(await stored_jobs(stores)) == [first.body["id"]]
    assert await stream_count(stores) == 1


async def test_the_same_idempotency_key_of_two_tenants_makes_two_jobs(api: Api, stores: Stores):
    alpha = await api.submit(key="shared-key")
    beta = await api.as_tenant("tok-beta").submit(key="shared-key")

    assert alpha.status == beta.status == 201
    assert alpha.body["id"] != beta.body["id"]
    assert len(await stored_jobs(stores)) == 2


async def test_an_idempotency_key_reused_for_another_spec_is_refused(api: Api, stores: Stores):
    await api.submit(spec(gpus=1), key="k1")

    answer = await api.submit(spec(gpus=2), key="k1")

    assert answer.status == 422
    assert answer.problem["field"] == "Idempotency-Key"
    assert len(await stored_jobs(stores)) == 1


async def test_a_retry_republishes_a_submission_the_first_attempt_never_published(
    api: Api, stores: Stores
):
    # a crash between the two writes: the record exists, the stream never heard of it
    job_id = idempotent_job_id("alpha", "crashed")
    at = now()
    record = JobRecord(
        id=job_id, tenant="alpha", spec=msgspec.convert(spec(), JobSpec),
        total_iterations=100, submitted_at=at,
        history=[StateChange(JobState.QUEUED, at, "submitted")],
    )
    await stores.jobs.create(job_id, codec.encode(record))

    answer = await api.submit(key="crashed")

    assert answer.status == 200
    assert answer.body["id"] == job_id
    assert await stream_count(stores, subjects.job_submitted(job_id)) == 1


async def test_a_malformed_idempotency_key_is_refused(api: Api, stores: Stores):
    answer = await api.submit(key="x" * 300)

    assert answer.status == 400
    assert answer.problem["field"] == "Idempotency-Key"
    assert await stored_jobs(stores) == {}


# ---------------------------------------------------------------------- quota


async def test_a_submission_over_the_quota_is_refused_naming_gpus_and_the_quota(
    api: Api, stores: Stores
):
    capped = api.as_tenant("tok-capped")
    assert (await capped.submit(spec(gpus=3))).status == 201

    answer = await capped.submit(spec(gpus=2))

    assert answer.status == 403
    assert answer.problem["field"] == "gpus"
    assert answer.problem["quota"] == 4
    assert "4" in answer.problem["detail"]
    assert len(await stored_jobs(stores)) == 1
    assert await stream_count(stores) == 1


async def test_concurrent_submissions_never_exceed_the_quota(api: Api, stores: Stores):
    capped = api.as_tenant("tok-capped")

    answers = await asyncio.gather(*(capped.submit(spec(gpus=1)) for _ in range(10)))

    assert sorted(answer.status for answer in answers) == [201] * 4 + [403] * 6
    assert len(await stored_jobs(stores)) == 4


async def test_finished_jobs_give_their_gpus_back_to_the_quota(api: Api, stores: Stores):
    capped = api.as_tenant("tok-capped")
    job_id = (await capped.submit(spec(gpus=4))).body["id"]
    assert (await capped.submit(spec(gpus=1))).status == 403

    await set_state(stores, job_id, JobState.SUCCEEDED)

    async def accepted() -> bool:
        return (await capped.submit(spec(gpus=4))).status == 201

    await wait_until(accepted, timeout_s=5)


async def test_other_tenants_are_not_limited_by_a_quota(api: Api):
    answers = [await api.submit(spec(gpus=64)) for _ in range(3)]
    assert [answer.status for answer in answers] == [201, 201, 201]


# ---------------------------------------------------------------------- reading


async def test_a_job_reads_back_with_its_history_and_pending_reason(api: Api, stores: Stores):
    job_id = (await api.submit()).body["id"]
    await set_state(
        stores, job_id, JobState.RUNNING,
        placement=[Placement("node-a", [0, 1])], progress=Progress(iteration=7),
    )

    answer = await api.get(f"/v1/jobs/{job_id}")

    assert answer.status == 200
    assert answer.body["state"] == "RUNNING"
    assert [change["state"] for change in answer.body["history"]] == ["QUEUED", "RUNNING"]
    assert all(change["at"] > 0 for change in answer.body["history"])
    assert answer.body["placement"] == [{"node": "node-a", "gpus": [0, 1]}]
    assert answer.body["progress"]["iteration"] == 7
    assert "pending_reason" in answer.body


async def test_an_unknown_job_is_a_404_problem(api: Api):
    for path in ("/v1/jobs/j0000000000000000000", "/v1/jobs/bad.id"):
        answer = await api.get(path)
        assert answer.status == 404
        assert answer.problem["type"].endswith("job-not-found")


async def test_listing_pages_through_the_tenants_jobs_in_id_order(api: Api):
    ids = sorted([(await api.submit(spec(name=f"job-{i}"))).body["id"] for i in range(5)])

    first = await api.get("/v1/jobs", limit="2")
    second = await api.get("/v1/jobs", limit="2", after=first.body["next"])
    last = await api.get("/v1/jobs", limit="2", after=second.body["next"])

    assert [job["id"] for job in first.body["jobs"]] == ids[:2]
    assert [job["id"] for job in second.body["jobs"]] == ids[2:4]
    assert [job["id"] for job in last.body["jobs"]] == ids[4:]
    assert last.body["next"] is None


async def test_listing_filters_by_state(api: Api, stores: Stores):
    queued = (await api.submit()).body["id"]
    running = (await api.submit()).body["id"]
    await set_state(stores, running, JobState.RUNNING)

    async def listed(state: str) -> list[str]:
        return [job["id"] for job in (await api.get("/v1/jobs", state=state)).body["jobs"]]

    await wait_until(lambda: _equal(listed("RUNNING"), [running]), timeout_s=5)
    assert await listed("QUEUED") == [queued]
    assert sorted(await listed("queued,RUNNING")) == sorted([queued, running])


async def _equal(value: Any, expected: Any) -> bool:
    return (await value) == expected


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"state": "SLEEPING"}, "state"),
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"after": "a.b"}, "after"),
        ({"status": "RUNNING"}, "status"),
    ],
)
async def test_a_bad_list_parameter_gets_400_naming_it(
    api: Api, params: dict[str, str], field: str
):
    answer = await api.get("/v1/jobs", **params)

    assert answer.status == 400
    assert answer.problem["field"] == field


async def test_jobs_written_by_others_show_up_in_the_listing(api: Api, stores: Stores):
    job_id = (await api.submit()).body["id"]
    await set_state(stores, job_id, JobState.FAILED)

    async def failed() -> bool:
        jobs = (await api.get("/v1/jobs", state="FAILED")).body["jobs"]
        return [job["id"] for job in jobs] == [job_id]

    await wait_until(failed, timeout_s=5)


# ---------------------------------------------------------------------- tenants


async def test_a_tenant_sees_and_cancels_only_its_own_jobs(api: Api, stores: Stores):
    beta = api.as_tenant("tok-beta")
    alphas = (await api.submit()).body["id"]
    betas = (await beta.submit()).body["id"]

    assert [job["id"] for job in (await api.get("/v1/jobs")).body["jobs"]] == [alphas]
    assert [job["id"] for job in (await beta.get("/v1/jobs")).body["jobs"]] == [betas]
    assert (await beta.get(f"/v1/jobs/{alphas}")).status == 404
    assert (await beta.delete(f"/v1/jobs/{alphas}")).status == 404
    assert (await api.get(f"/v1/jobs/{betas}")).status == 404
    assert await stream_count(stores, subjects.job_cancel(alphas)) == 0


# ---------------------------------------------------------------------- cancelling


async def test_cancelling_a_queued_job_publishes_one_cancel_request(api: Api, stores: Stores):
    job_id = (await api.submit()).body["id"]

    first = await api.delete(f"/v1/jobs/{job_id}")
    second = await api.delete(f"/v1/jobs/{job_id}")

    assert first.status == second.status == 202
    assert first.body["id"] == job_id
    assert await stream_count(stores, subjects.job_cancel(job_id)) == 1
    message = await stores.js.get_last_msg(subjects.JOBS_STREAM, subjects.job_cancel(job_id))
    request = codec.decode(message.data, CancelRequest)
    assert (request.job_id, request.tenant) == (job_id, "alpha")
    assert message.headers is not None
    assert message.headers["Nats-Msg-Id"] == f"{job_id}-cancel"


async def test_cancelling_a_finished_job_is_a_409_problem(api: Api, stores: Stores):
    job_id = (await api.submit()).body["id"]
    await set_state(stores, job_id, JobState.SUCCEEDED)

    answer = await api.delete(f"/v1/jobs/{job_id}")

    assert answer.status == 409
    assert "SUCCEEDED" in answer.problem["detail"]
    assert await stream_count(stores, subjects.job_cancel(job_id)) == 0


# ---------------------------------------------------------------------- events


async def test_the_event_stream_forwards_states_and_progress_and_ends_on_a_terminal_state(
    api: Api, nc: Client, stores: Stores
):
    job_id = (await api.submit()).body["id"]
    received: list[tuple[str, dict[str, Any]]] = []

    async def follow() -> None:
        async for event in api.events(job_id):
            received.append(event)

    follower = asyncio.create_task(follow())
    await wait_until(lambda: received)
    running = JobStateEvent(job_id=job_id, state=JobState.RUNNING, at=now(),
                            placement=[Placement("node-a", [0])])
    await nc.publish(subjects.job_state(job_id), codec.encode(running), headers=codec.headers())
    progress = JobProgressEvent(job_id=job_id, run_id=1, node="node-a", model="resnet50",
                                batch_size=64, gpus=1, progress=Progress(iteration=5))
    await nc.publish(subjects.job_progress("node-a", job_id), codec.encode(progress))
    await wait_until(lambda: len(received) == 3)
    done = JobStateEvent(job_id=job_id, state=JobState.SUCCEEDED, at=now())
    await nc.publish(subjects.job_state(job_id), codec.encode(done))

    await asyncio.wait_for(follower, 5)
    assert [name for name, _ in received] == ["job", "state", "progress", "state"]
    assert received[0][1]["id"] == job_id
    assert received[1][1]["state"] == "RUNNING"
    assert received[1][1]["placement"] == [{"node": "node-a", "gpus": [0]}]
    assert received[2][1]["progress"]["iteration"] == 5
    assert received[3][1]["state"] == "SUCCEEDED"


async def test_the_event_stream_of_a_finished_job_sends_the_record_and_ends(
    api: Api, stores: Stores
):
    job_id = (await api.submit()).body["id"]
    await set_state(stores, job_id, JobState.CANCELLED)

    events = [event async for event in api.events(job_id)]

    assert [(name, data["state"]) for name, data in events] == [("job", "CANCELLED")]


async def test_another_tenants_event_stream_is_a_404(api: Api):
    job_id = (await api.submit()).body["id"]

    answer = await api.as_tenant("tok-beta").get(f"/v1/jobs/{job_id}/events")

    assert answer.status == 404
    assert answer.problem["type"].endswith("job-not-found")


async def test_stopping_the_service_ends_open_event_streams(nats_server: NatsServer):
    config = AdmissionConfig(nats_url=nats_server.url, port=0)
    async with aiohttp.ClientSession() as session:
        async with AdmissionService(config) as service:
            api = Api(session, service.url, token=None)
            job_id = (await api.submit()).body["id"]
            received: list[str] = []

            async def follow() -> None:
                with contextlib.suppress(aiohttp.ClientError):
                    async for name, _ in api.events(job_id):
                        received.append(name)

            follower = asyncio.create_task(follow())
            await wait_until(lambda: received)
        await asyncio.wait_for(follower, 5)
    assert received == ["job"]


# ---------------------------------------------------------------------- cluster


async def test_the_cluster_view_shows_gpus_their_jobs_telemetry_and_totals(
    api: Api, nc: Client, stores: Stores
):
    node = NodeInfo(
        name="node-a", cpus=32, host_mem_gb=256,
        gpus=[GpuInfo(index=i, uuid=f"GPU-{i}", model="A100", memory_mb=40960) for i in range(4)],
    )
    await stores.nodes.put(node.name, codec.encode(node))
    job_id = (await api.submit(spec(gpus=2))).body["id"]
    await set_state(stores, job_id, JobState.RUNNING, placement=[Placement("node-a", [1, 2])])
    sample = Telemetry(
        node="node-a", at=now(),
        gpus=[GpuTelemetry(index=1, uuid="GPU-1", util=80.0, fb_used_mib=1000,
                           fb_free_mib=39960, power_w=250, temp_c=60)],
    )

    async def shown() -> dict[str, Any] | None:
        await nc.publish(subjects.node_telemetry("node-a"), codec.encode(sample))
        view = (await api.get("/v1/cluster")).body
        ready = view["totals"]["busy_gpus"] == 2 and view["nodes"][0]["telemetry_at"]
        return view if ready else None

    view = await wait_until(shown, timeout_s=5)
    gpus = view["nodes"][0]["gpus"]
    assert [gpu["jobs"] for gpu in gpus] == [[], [job_id], [job_id], []]
    assert gpus[1]["telemetry"]["DCGM_FI_DEV_GPU_UTIL"] == 80.0
    assert gpus[0]["telemetry"] is None
    assert view["totals"] == {
        "nodes": 1, "gpus": 4, "busy_gpus": 2, "utilisation": 0.5, "mean_gpu_util": 80.0,
        "window_gpu_util": 80.0, "util_window_s": 60.0,
    }


async def test_the_cluster_view_needs_a_token(api: Api):
    assert (await api.as_tenant(None).get("/v1/cluster")).status == 401


# ---------------------------------------------------------------------- operations


async def test_openapi_is_valid_json_naming_every_route_without_a_token(api: Api):
    answer = await api.as_tenant(None).get("/openapi.json")

    assert answer.status == 200
    document = answer.body
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {
        "/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/events", "/v1/cluster", "/healthz",
        "/metrics", "/openapi.json", "/v1/predictor/size-error", "/v1/history/export",
    }
    assert {"post", "get"} <= set(document["paths"]["/v1/jobs"])
    assert {"get", "delete"} <= set(document["paths"]["/v1/jobs/{id}"])
    assert "gpus" in document["components"]["schemas"]["JobSpec"]["properties"]
    refs = [value for value in _walk(document) if isinstance(value, str)
            and value.startswith("#/components/schemas/")]
    assert refs
    for ref in refs:
        assert ref.removeprefix("#/components/schemas/") in document["components"]["schemas"]


def _walk(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [item for child in value.values() for item in _walk(child)]
    if isinstance(value, list):
        return [item for child in value for item in _walk(child)]
    return [value]


async def test_metrics_count_requests_by_route_and_status(api: Api):
    await api.submit()
    await api.submit(spec(gpus=0))
    await api.get("/nowhere")

    text = (await api.as_tenant(None).get("/metrics")).body.decode()

    assert 'gpusched_admission_requests_total{method="POST",route="/v1/jobs",status="201"} 1.0' \
        in text
    assert 'gpusched_admission_requests_total{method="POST",route="/v1/jobs",status="422"} 1.0' \
        in text
    assert 'route="unmatched",status="404"} 1.0' in text
    assert 'gpusched_admission_jobs_submitted_total{tenant="alpha"} 1.0' in text
    assert 'gpusched_admission_request_seconds_count{method="POST",route="/v1/jobs"} 2.0' in text


@pytest.fixture
async def leading(nats_server: NatsServer) -> AsyncIterator[SchedulerService]:
    """A scheduler holding the lease, as GET /healthz wants one."""
    async with SchedulerService(fast_scheduler(nats_server.url)) as scheduler:
        await wait_until(lambda: scheduler.is_leader, timeout_s=10)
        yield scheduler


async def test_healthz_answers_ok_without_a_token(api: Api, leading: SchedulerService):
    answer = await api.as_tenant(None).get("/healthz")

    assert answer.status == 200
    assert answer.body == {"status": "ok"}


async def test_healthz_is_degraded_while_no_scheduler_holds_the_lease(api: Api):
    answer = await api.as_tenant(None).get("/healthz")

    assert answer.status == 503
    assert answer.body == {"status": "degraded", "problems": ["no scheduler holds the lease"]}


async def test_without_nats_requests_get_503_and_the_service_recovers(
    api: Api, nats_server: NatsServer, stores: Stores, leading: SchedulerService
):
    before = (await api.submit()).body["id"]
    nats_server.stop()

    await wait_until(lambda: _status(api.as_tenant(None).get("/healthz"), 503), timeout_s=5)
    refused = await api.submit()
    assert refused.status == 503
    assert refused.problem["type"].endswith("nats-unavailable")
    assert refused.headers["Retry-After"] == "1"
    assert (await api.get(f"/v1/jobs/{before}")).status == 503

    nats_server.start()
    await wait_until(lambda: _status(api.as_tenant(None).get("/healthz"), 200), timeout_s=10)
    after = await api.submit()
    assert after.status == 201, after.body
    await wait_until(lambda: _status(api.get(f"/v1/jobs/{after.body['id']}"), 200))
    listed = {job["id"] for job in (await api.get("/v1/jobs")).body["jobs"]}
    assert listed == {before, after.body["id"]}
    # the job mirror follows the bucket again: a change written elsewhere shows up
    await set_state(stores, before, JobState.FAILED)

    async def failed() -> bool:
        jobs = (await api.get("/v1/jobs", state="FAILED")).body["jobs"]
        return [job["id"] for job in jobs] == [before]

    await wait_until(failed, timeout_s=5)


async def _status(answer: Any, expected: int) -> bool:
    return bool((await answer).status == expected)


async def test_an_open_api_serves_every_caller_as_the_default_tenant(
    nats_server: NatsServer, stores: Stores
):
    config = AdmissionConfig(nats_url=nats_server.url, port=0)
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        api = Api(session, service.url, token=None)
        answer = await api.submit()
        also = await api.as_tenant("anything").get(f"/v1/jobs/{answer.body['id']}")

    assert answer.status == 201
    assert answer.body["tenant"] == "default"
    assert also.status == 200


async def test_a_submission_the_stream_refuses_is_withdrawn_and_reported_503(
    api: Api, stores: Stores
):
    # without the stream nothing takes the submission: the record written just before
    # must not stay behind as a job nobody will ever schedule
    await stores.js.delete_stream(subjects.JOBS_STREAM)

    answer = await api.submit()

    assert answer.status == 503
    assert answer.problem["type"].endswith("store-unwritable")
    assert "nothing was stored" in answer.problem["detail"]
    assert await stored_jobs(stores) == {}
    assert await stores.live_job_ids() == []
    assert (await api.get("/v1/jobs")).body["jobs"] == []


async def test_mangled_bodies_never_get_a_server_error_and_only_accepted_ones_are_stored(
    api: Api, stores: Stores
):
    rng = random.Random(20240601)
    valid = json.dumps(spec(epochs=1.5, iterations=None, dataset_size=1000, labels={"a": "b"}))
    bodies = []
    for _ in range(150):
        body = bytearray(valid.encode())
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(body) + 1)
            action = rng.choice(("flip", "drop", "insert", "truncate"))
            if action == "insert" or position == len(body):
                body.insert(position, rng.choice(b'{}[]",:0123456789-.eE\\ntrufalse\xff'))
            elif action == "flip":
                body[position] = rng.randrange(256)
            elif action == "drop":
                del body[position]
            else:
                del body[position:]
        bodies.append(bytes(body))

    answers = await asyncio.gather(
        *(api.post_raw(body, rng.choice(["application/json", "application/yaml"]))
          for body in bodies)
    )

    assert all(answer.status in (201, 400, 422) for answer in answers)
    for answer in answers:
        if answer.status != 201:
            assert answer.problem["detail"]
    accepted = {answer.body["id"] for answer in answers if answer.status == 201}
    assert set(await stored_jobs(stores)) == accepted
    assert await stream_count(stores) == len(accepted)
