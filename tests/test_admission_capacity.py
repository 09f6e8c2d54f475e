"""What admission tells a submitter at once about the cluster it submits to, and the
cluster view's utilisation figures: a real nats-server, the real service on a free port,
real HTTP. Node registrations and telemetry are written where node agents would write
them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import GpuInfo, GpuTelemetry, NodeInfo, Telemetry
from gpusched.services.admission import AdmissionConfig, AdmissionService
from tests.test_admission_api import Api, spec


def node(name: str, gpus: int = 4, memory_mb: int = 32768) -> NodeInfo:
    return NodeInfo(
        name=name, cpus=32, host_mem_gb=256,
        gpus=[GpuInfo(index=i, uuid=f"GPU-{name}-{i}", model="V100", memory_mb=memory_mb)
              for i in range(gpus)],
    )  # fmt: skip


@pytest.fixture
async def api(nats_server: NatsServer) -> AsyncIterator[Api]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens={"tok-alpha": "alpha"})
    async with AdmissionService(config) as service, aiohttp.ClientSession() as session:
        yield Api(session, service.url)


async def register(api: Api, stores: Stores, *nodes: NodeInfo) -> None:
    """Register the nodes and wait until admission's mirror of the registry has them."""
    for info in nodes:
        await stores.nodes.put(info.name, codec.encode(info))

    async def seen() -> bool:
        view = (await api.get("/v1/cluster")).body
        return bool(view["totals"]["nodes"] == len(nodes))

    await wait_until(seen, timeout_s=10)


async def test_a_job_larger_than_the_whole_cluster_is_accepted_with_a_warning_saying_so(
    api: Api, stores: Stores
):
    await register(api, stores, node("node-a"), node("node-b"))

    answer = await api.submit(spec(gpus=64))

    assert answer.status == 201
    assert answer.body["state"] == "QUEUED"
    assert answer.body["warnings"] == [
        "the cluster cannot hold 64 GPUs today: it has 8 in all, at most 4 on a node "
        "(2 nodes registered); the job waits until nodes join"
    ]
    stored = await api.get(f"/v1/jobs/{answer.body['id']}")
    assert stored.status == 200 and "warnings" not in stored.body


async def test_a_job_spanning_nodes_within_the_clusters_gpus_gets_no_warning(
    api: Api, stores: Stores
):
    await register(api, stores, node("node-a"), node("node-b"))

    spanning = await api.submit(spec(gpus=6))
    small = await api.submit(spec(gpus=1))

    assert (spanning.status, spanning.body["warnings"]) == (201, [])
    assert (small.status, small.body["warnings"]) == (201, [])


async def test_a_job_whose_smallest_sub_batch_fits_no_gpu_is_warned_about_gpu_memory(
    api: Api, stores: Stores
):
    # resnet50 at batch 64 on one GPU, split into 16 steps of 4 samples, holds 2,400 MiB
    # by the built-in profiles; these GPUs have 2,000
    await register(api, stores, node("node-a", memory_mb=2000))

    answer = await api.submit(spec(model="resnet50", batch_size=64, gpus=1))

    assert answer.status == 201
    assert answer.body["warnings"] == [
        "no GPU can hold this job today: it needs 2400 MiB per GPU even at a sub-batch of "
        "4; the largest GPU has 2000 MiB (1 node registered); the job waits until a larger "
        "one joins"
    ]


async def test_a_job_submitted_before_any_node_registers_is_told_it_waits_for_one(api: Api):
    answer = await api.submit(spec())

    assert answer.status == 201
    assert answer.body["warnings"] == [
        "no node has registered yet: the job waits until one does"
    ]


async def test_an_idempotent_replay_carries_the_warnings_too(api: Api, stores: Stores):
    await register(api, stores, node("node-a", gpus=2))

    first = await api.submit(spec(gpus=4), key="big-job")
    again = await api.submit(spec(gpus=4), key="big-job")

    assert (first.status, again.status) == (201, 200)
    assert again.body["id"] == first.body["id"]
    assert again.body["warnings"] == first.body["warnings"]
    assert "cannot hold 4 GPUs" in first.body["warnings"][0]


async def test_the_openapi_document_describes_the_warnings_of_a_submission(api: Api):
    document = (await api.get("/openapi.json")).body

    created = document["paths"]["/v1/jobs"]["post"]["responses"]["201"]
    schema = created["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/SubmittedJob"}
    warnings = document["components"]["schemas"]["SubmittedJob"]["properties"]["warnings"]
    assert warnings["type"] == "array"


# ---------------------------------------------------------------------- utilisation


def sample(at: float, utils: list[float]) -> Telemetry:
    return Telemetry(
        node="node-a", at=at,
        gpus=[GpuTelemetry(index=i, uuid=f"GPU-node-a-{i}", util=util, fb_used_mib=0,
                           fb_free_mib=32768, power_w=100, temp_c=40)
              for i, util in enumerate(utils)],
    )  # fmt: skip


async def test_the_cluster_view_averages_gpu_utilisation_over_the_last_minute(
    api: Api, stores: Stores, nc: Client
):
    await register(api, stores, node("node-a"))
    now = time.time()
    # older than the window: left out; then all four busy, then two of them freed
    for at, utils in ((now - 120, [0.0] * 4), (now - 30, [100.0] * 4),
                      (now - 1, [100.0, 100.0, 0.0, 0.0])):
        await nc.publish(subjects.node_telemetry("node-a"), codec.encode(sample(at, utils)))

    async def latest_shown() -> dict[str, Any] | None:
        view = (await api.get("/v1/cluster")).body
        return view if view["nodes"][0]["telemetry_at"] == pytest.approx(now - 1) else None

    view = await wait_until(latest_shown, timeout_s=10)
    totals = view["totals"]
    assert totals["util_window_s"] == 60.0
    # (4 x 100 + 2 x 100) over 8 readings; the sample of two minutes ago is not in it
    assert totals["window_gpu_util"] == pytest.approx(75.0)
    # the latest sample alone
    assert totals["mean_gpu_util"] == pytest.approx(50.0)


async def test_the_cluster_view_has_no_windowed_utilisation_without_recent_telemetry(
    api: Api, stores: Stores, nc: Client
):
    await register(api, stores, node("node-a"))
    stale = time.time() - 300
    await nc.publish(subjects.node_telemetry("node-a"), codec.encode(sample(stale, [90.0] * 4)))

    async def shown() -> dict[str, Any] | None:
        view = (await api.get("/v1/cluster")).body
        return view if view["nodes"][0]["telemetry_at"] else None

    view = await wait_until(shown, timeout_s=10)
    assert view["totals"]["window_gpu_util"] is None
    assert view["totals"]["mean_gpu_util"] == pytest.approx(90.0)
