"""The predictor service and its client against a real nats-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.predictor_client import (
    PredictorClient,
    PredictorError,
    PredictorUnavailable,
)
from gpusched.libs.common.schemas import (
    JobProgressEvent,
    JobRecord,
    JobSpec,
    JobState,
    JobStateEvent,
    Prediction,
    PredictRequest,
    Progress,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.shape import JobShape
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.model import Learned
from gpusched.services.predictor.service import SERVICE_NAME, PredictorService, settle

TRUTH = ProfilePerformanceModel.builtin()
RESNET = PredictRequest(model="resnet50", batch_size=64)


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[PredictorService]:
    config = PredictorConfig(nats_url=nats_server.url, history_weight=0.5)
    async with PredictorService(config) as running:
        yield running


@pytest.fixture
def client(nc: Client) -> PredictorClient:
    return PredictorClient(nc, timeout_s=2.0)


def progress(
    job_id: str,
    iteration: int,
    iteration_s: float,
    model: str = "resnet50",
    batch_size: int = 64,
    co_runners: tuple[str, ...] = (),
) -> JobProgressEvent:
    return JobProgressEvent(
        job_id=job_id,
        run_id=1,
        node="n0",
        model=model,
        batch_size=batch_size,
        gpus=1,
        co_runners=list(co_runners),
        iteration_s=iteration_s,
        progress=Progress(iteration=iteration),
    )


async def publish(nc: Client, event: JobProgressEvent) -> None:
    await nc.publish(subjects.job_progress(event.node, event.job_id), codec.encode(event),
                     headers=codec.headers())


async def raw_request(nc: Client, subject: str, payload: bytes, json_payload: bool = False):
    headers = None if json_payload else codec.headers()
    return await nc.request(subject, payload, timeout=2.0, headers=headers)


# ---------------------------------------------------------------------- discovery


async def test_the_service_answers_ping_and_info_with_its_name_and_endpoints(
    nc: Client, service: PredictorService
):
    ping = json.loads((await nc.request(f"$SRV.PING.{SERVICE_NAME}", timeout=2.0)).data)
    assert ping["name"] == SERVICE_NAME and ping["id"] == service.service_id
    info = json.loads((await nc.request(f"$SRV.INFO.{SERVICE_NAME}", timeout=2.0)).data)
    assert info["name"] == SERVICE_NAME and info["description"]
    assert {e["subject"] for e in info["endpoints"]} == {
        subjects.PREDICT_ITERATIONS,
        subjects.PREDICT_THROUGHPUT,
        subjects.PREDICT_SLOWDOWN,
        subjects.PREDICT_CPU_PROFILE,
        subjects.PREDICT_REMAINING,
        subjects.PREDICT_SIZE_ERROR,
        subjects.PREDICT_COMPUTE_PROFILE,
        subjects.PREDICT_MEASURED_PROFILE,
    }
    assert {e["name"] for e in info["endpoints"]} == {
        "iterations", "throughput", "slowdown", "cpu_profile", "remaining", "size_error",
        "compute_profile", "measured_profile",
    }


async def test_stats_count_requests_and_errors_per_endpoint(
    nc: Client, service: PredictorService, client: PredictorClient
):
    await client.throughput(RESNET)
    await client.throughput(RESNET)
    with pytest.raises(PredictorError):
        await client.throughput(PredictRequest(model="alexnet", batch_size=1))
    await client.iterations(RESNET)
    stats = json.loads((await nc.request(f"$SRV.STATS.{SERVICE_NAME}", timeout=2.0)).data)
    by_name = {e["name"]: e for e in stats["endpoints"]}
    assert by_name["throughput"]["num_requests"] == 3
    assert by_name["throughput"]["num_errors"] == 1
    assert by_name["iterations"]["num_requests"] == 1
    assert by_name["slowdown"]["num_requests"] == 0


# ---------------------------------------------------------------------- answers


async def test_throughput_before_any_history_is_the_profile_figure(
    service: PredictorService, client: PredictorClient
):
    answer = await client.throughput(RESNET)
    expected_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
    assert answer.iteration_s == pytest.approx(expected_s)
    assert answer.value == pytest.approx(64 / expected_s)
    assert answer.source == "profile"


async def test_throughput_moves_toward_measured_times_after_progress_events(
    nc: Client, service: PredictorService, client: PredictorClient
):
    profiled_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
    measured_s = 2 * profiled_s
    for iteration in range(1, 6):
        await publish(nc, progress("job-1", iteration, measured_s))

    async def learned() -> Prediction | None:
        answer = await client.throughput(RESNET)
        # weight 0.5, five samples: factor 2 - 0.5 ** 5
        expected = profiled_s * (2 - 0.5**5)
        return answer if answer.iteration_s == pytest.approx(expected) else None

    answer = await wait_until(learned, timeout_s=5)
    assert answer.source == "profile+history"
    assert profiled_s < answer.iteration_s < measured_s


async def test_slowdown_is_at_least_one_and_learns_from_a_co_located_job(
    nc: Client, service: PredictorService, client: PredictorClient
):
    request = PredictRequest(model="resnet50", batch_size=64, partner="bert", partner_batch_size=32)
    before = await client.slowdown(request)
    profiled = TRUTH.colocation_slowdown(JobShape("resnet50", 64, 1, 1), JobShape("bert", 32, 1, 1))
    assert before.value == pytest.approx(profiled) and before.value >= 1
    assert before.source == "profile"

    exclusive_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
    await publish(nc, progress("partner", 1, 0.5, model="bert", batch_size=32))
    await publish(nc, progress("job-1", 1, exclusive_s * profiled * 2, co_runners=("partner",)))

    async def corrected() -> bool:
        return (await client.slowdown(request)).source == "profile+history"

    await wait_until(corrected, timeout_s=5)
    after = await client.slowdown(request)
    # weight 0.5 toward twice the profile's figure
    assert after.value == pytest.approx(profiled * 1.5)


async def succeed(nc: Client, stores: Stores, job_id: str, model: str, iterations: int) -> None:
    spec = JobSpec(name="train", model=model, batch_size=8, iterations=iterations)
    record = JobRecord(
        id=job_id, tenant="t", spec=spec, total_iterations=iterations, submitted_at=1.0,
        state=JobState.SUCCEEDED,
    )
    await stores.jobs.put(job_id, codec.encode(record))
    event = JobStateEvent(job_id=job_id, state=JobState.SUCCEEDED, at=2.0)
    await nc.publish(subjects.job_state(job_id), codec.encode(event), headers=codec.headers())


async def test_a_succeeded_job_teaches_the_iterations_of_its_model_once(
    nc: Client, stores: Stores, service: PredictorService, client: PredictorClient
):
    assert (await client.iterations(RESNET)).source == "default"
    await succeed(nc, stores, "job-9", "resnet50", 4321)
    await succeed(nc, stores, "job-9", "resnet50", 4321)  # a repeated event
    await succeed(nc, stores, "job-10", "bert", 100)
    bert = PredictRequest(model="bert", batch_size=8)

    async def learned() -> bool:
        return (await client.iterations(bert)).source == "history"

    # events are handled in order, so job-9's are done once job-10's is
    await wait_until(learned, timeout_s=5)
    answer = await client.iterations(RESNET)
    assert (answer.value, answer.source) == (4321.0, "history")
    text = service.metrics_text().decode()
    assert 'gpusched_predictor_observations_total{kind="completion",result="learned"} 2.0' in text


# ---------------------------------------------------------------------- errors


async def test_an_unknown_model_gets_a_404_error_listing_the_valid_names(
    nc: Client, service: PredictorService
):
    payload = codec.encode(PredictRequest(model="alexnet", batch_size=8))
    reply = await raw_request(nc, subjects.PREDICT_THROUGHPUT, payload)
    assert reply.headers is not None
    assert reply.headers[ERROR_CODE_HEADER] == "404"
    assert "alexnet" in reply.headers[ERROR_HEADER]
    assert "resnet50" in reply.headers[ERROR_HEADER]


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (b"\xc1\xc1", "MessagePack"),
        (b"", "empty request"),
        (msgspec.msgpack.encode({"model": "resnet50", "batch_size": 0}), "batch_size"),
        (msgspec.msgpack.encode({"batch_size": 8}), "model"),
        (codec.encode(PredictRequest(model="resnet50", batch_size=8, gpus=1, nodes=2)), "nodes"),
    ],
)
async def test_a_malformed_request_gets_a_400_error_naming_the_problem(
    nc: Client, service: PredictorService, payload: bytes, named: str
):
    reply = await raw_request(nc, subjects.PREDICT_THROUGHPUT, payload)
    assert reply.headers is not None
    assert reply.headers[ERROR_CODE_HEADER] == "400"
    assert named in reply.headers[ERROR_HEADER]


async def test_a_slowdown_without_a_partner_is_a_400_naming_partner(
    service: PredictorService, client: PredictorClient
):
    with pytest.raises(PredictorError) as caught:
        await client.slowdown(RESNET)
    assert caught.value.code == "400"
    assert caught.value.description.startswith("partner:")


async def test_a_bad_message_on_the_learning_subjects_does_not_stop_the_service(
    nc: Client, service: PredictorService, client: PredictorClient
):
    await nc.publish(subjects.job_progress("n0", "junk"), b"\x00not msgpack")
    await nc.publish(subjects.job_state("junk"), b"{}")
    await publish(nc, progress("junk", 1, 1.0, model="no-such-model"))
    await publish(nc, progress("job-1", 1, 10.0))

    async def learned() -> bool:
        return (await client.throughput(RESNET)).source == "profile+history"

    await wait_until(learned, timeout_s=5)
    text = service.metrics_text().decode()
    assert 'gpusched_predictor_observations_total{kind="progress",result="invalid"} 2.0' in text


# ---------------------------------------------------------------------- encodings, client


async def test_a_json_request_gets_a_json_reply(nc: Client, service: PredictorService):
    payload = b'{"model": "resnet50", "batch_size": 64, "iterations": 10}'
    reply = await raw_request(nc, subjects.PREDICT_ITERATIONS, payload, json_payload=True)
    assert reply.headers is not None and reply.headers["Content-Type"] == "application/json"
    assert json.loads(reply.data) == {
        "model": "resnet50",
        "kind": "iterations",
        "value": 10.0,
        "iteration_s": None,
        "samples_per_s": None,
        "source": "declared",
    }


async def test_a_bad_json_request_gets_a_400_naming_the_field(
    nc: Client, service: PredictorService
):
    payload = b'{"model": "resnet50", "batch_size": "many"}'
    reply = await raw_request(nc, subjects.PREDICT_THROUGHPUT, payload, json_payload=True)
    assert reply.headers is not None
    assert reply.headers[ERROR_CODE_HEADER] == "400"
    assert "JSON" in reply.headers[ERROR_HEADER]
    assert "$.batch_size" in reply.headers[ERROR_HEADER]


async def test_a_messagepack_reply_carries_the_codec_headers(
    nc: Client, service: PredictorService
):
    reply = await raw_request(nc, subjects.PREDICT_THROUGHPUT, codec.encode(RESNET))
    assert reply.headers is not None
    assert reply.headers["Content-Type"] == codec.CONTENT_TYPE
    assert codec.decode(reply.data, Prediction).kind == "throughput"


async def test_the_client_raises_unavailable_when_no_service_runs(nc: Client):
    client = PredictorClient(nc, timeout_s=0.5)
    with pytest.raises(PredictorUnavailable):
        await client.throughput(RESNET)


async def test_the_client_raises_the_services_error_code_and_description(
    service: PredictorService, client: PredictorClient
):
    with pytest.raises(PredictorError) as caught:
        await client.iterations(PredictRequest(model="alexnet", batch_size=8))
    assert caught.value.code == "404"
    assert "alexnet" in caught.value.description


def test_a_client_timeout_must_be_positive(nc: Client):
    with pytest.raises(ValueError, match="timeout_s"):
        PredictorClient(nc, timeout_s=0)


# ---------------------------------------------------------------------- metrics, restart


async def test_metrics_are_served_over_http(nats_server: NatsServer, client: PredictorClient):
    config = PredictorConfig(nats_url=nats_server.url, metrics_port=0, metrics_host="127.0.0.1")
    async with PredictorService(config) as service:
        await client.throughput(RESNET)
        assert service.metrics_url is not None
        async with aiohttp.ClientSession() as http, http.get(service.metrics_url) as response:
            assert response.status == 200
            text = await response.text()
    assert 'gpusched_predictor_requests_total{code="200",endpoint="throughput"} 1.0' in text
    assert "gpusched_predictor_request_seconds_bucket" in text


async def test_the_service_answers_again_after_nats_restarts(
    nats_server: NatsServer, service: PredictorService, client: PredictorClient, nc: Client
):
    nats_server.restart()

    async def answered() -> bool:
        try:
            await client.throughput(RESNET)
        except PredictorUnavailable:
            return False
        return True

    assert await wait_until(answered, timeout_s=10, every_s=0.1)


async def test_a_subscription_answers_from_another_connection_once_settled(
    nats_server: NatsServer, nc: Client
):
    async with connection(nats_server.url, "responder") as responder:
        for i in range(30):

            async def echo(msg: Msg) -> None:
                await msg.respond(msg.data)

            await responder.subscribe(f"echo.{i}", cb=echo)
            await settle(responder)
            assert (await nc.request(f"echo.{i}", b"hi", timeout=2.0)).data == b"hi"


async def test_what_was_learned_survives_a_restart_of_the_predictor(
    nats_server: NatsServer, nc: Client, client: PredictorClient
):
    config = PredictorConfig(nats_url=nats_server.url, history_weight=0.5)
    factor = 2 - 0.5**5
    async with PredictorService(config) as first:
        for iteration in range(1, 6):
            await publish(nc, progress("job-1", iteration, 2 * TRUTH.iteration_time(
                "resnet50", 64, 1, 1)))
        await wait_until(
            lambda: first.predictor.solo_factor("resnet50", 64, 1) == pytest.approx(factor)
        )
    async with PredictorService(config) as second:
        assert second.predictor.solo_factor("resnet50", 64, 1) == pytest.approx(factor)
        answer = await client.throughput(RESNET)
    assert answer.source == "profile+history"


async def test_learning_is_saved_while_the_predictor_runs(
    nats_server: NatsServer, nc: Client, stores: Stores
):
    config = PredictorConfig(nats_url=nats_server.url, save_every_s=0.05)
    bucket = await stores.predictor_bucket()

    async def saved() -> Learned | None:
        try:
            entry = await bucket.get(subjects.PREDICTOR_LEARNED_KEY)
        except KeyNotFoundError:
            return None
        return codec.decode(entry.value or b"", Learned)

    async with PredictorService(config):
        assert await saved() is None  # nothing learned, nothing written
        await publish(nc, progress("job-2", 1, 0.5))
        learned: Learned = await wait_until(saved, timeout_s=5)
    # (model, batch, GPUs, GPU type): node n0 is not registered, so of no known type
    assert [entry.key for entry in learned.solo] == [["resnet50", 64, 1, ""]]
    assert learned.solo[0].samples == 1


async def test_an_unreadable_saved_state_is_ignored_and_the_profiles_answer(
    nats_server: NatsServer, stores: Stores, client: PredictorClient
):
    bucket = await stores.predictor_bucket()
    await bucket.put(subjects.PREDICTOR_LEARNED_KEY, b"\xc1 not messagepack")
    async with PredictorService(PredictorConfig(nats_url=nats_server.url)) as service:
        assert service.predictor.solo_factor("resnet50", 64, 1) == 1.0
        answer = await client.throughput(RESNET)
    assert answer.source == "profile"


async def test_stop_ends_a_periodic_save_that_lost_its_cancellation(nats_server: NatsServer):
    # a KV put's acknowledgement arriving as stop cancels the save loses the cancellation
    # (asyncio.wait_for in Python 3.11): the loop slept on and stop waited for it forever
    service = PredictorService(PredictorConfig(nats_url=nats_server.url, save_every_s=0.01))
    await service.start()
    saving = asyncio.Event()
    lost = 0

    async def save_losing_its_cancellation() -> None:
        nonlocal lost
        if lost:
            return
        saving.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost += 1

    service._save_learned = save_losing_its_cancellation  # type: ignore[method-assign]
    await asyncio.wait_for(saving.wait(), timeout=5)
    stopping = asyncio.create_task(service.stop())
    done, _ = await asyncio.wait({stopping}, timeout=20)  # (wait_for would cancel it)
    if not done:
        stopping.cancel()
        await asyncio.wait({stopping}, timeout=20)
    assert done, "stop still waited for the save loop after 20 s"
    assert lost == 1
    assert service.service_id is None
