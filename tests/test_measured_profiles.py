"""Measured profiles per GPU type: the file format and its reader, the performance model
that times jobs from measured figures, the predictor that keeps them per type in KV and
learns on top of them, a node agent that measures a model the first time it runs it,
the live scheduler that follows them, and ``simulate --profiles``."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from typer.testing import CliRunner

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.measured import from_wire, to_wire
from gpusched.libs.common.natsauth import nodeagent_user
from gpusched.libs.common.predictor_client import PredictorClient
from gpusched.libs.common.schemas import (
    CommandReply,
    GpuInfo,
    GpuProfileRequest,
    JobProgressEvent,
    MeasuredProfile,
    NodeInfo,
    PredictRequest,
    Progress,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.measured import MeasuredPerformance
from gpusched.libs.core.profiles.measured import (
    GpuProfile,
    MeasuredPoint,
    MeasuredProfileError,
    ModelFigures,
    gpu_type_key,
    parse_profile,
    profile_document,
    read_profile,
    shipped_gpu_profiles,
    with_figures,
    write_profile,
)
from gpusched.services.cli.main import app
from gpusched.services.nodeagent.agent import NodeAgent
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.measured_profiles import StoredMeasured
from gpusched.services.predictor.model import RATIO_BOUNDS, BaselinePredictor
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.live import SchedulerService
from tests.limits import process_limit_s
from tests.live import fast_scheduler
from tests.test_nats_auth import as_user, creds, server  # noqa: F401 - fixtures
from tests.test_nodeagent_service import agent_config, listen, send, start

TRUTH = ProfilePerformanceModel.builtin()
ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"
H100_TYPE = "h100-80gb-hbm3"
runner = CliRunner()


def figures(
    model: str, points: dict[int, tuple[float, float]], architecture: str = "stand-in",
    device: str = "cuda",
) -> ModelFigures:  # fmt: skip
    return ModelFigures(
        model=model, architecture=architecture, device=device, torch="2.4.1+cu121",
        measured_at="2025-01-31T12:00:00Z",
        points=tuple(MeasuredPoint(b, t, m) for b, (t, m) in points.items()),
    )  # fmt: skip


def profile_of(*models: ModelFigures, gpu_name: str = H100) -> GpuProfile:
    return GpuProfile(gpu_name, gpu_type_key(gpu_name), {m.model: m for m in models})


def hundredfold(model: str = "resnet50", batches: tuple[int, ...] = (32, 64)) -> ModelFigures:
    """A model measured 100x faster than the research profile says, at ``batches``."""
    return figures(
        model, {b: (TRUTH.iteration_time(model, b, 1, 1) / 100, 1000.0 + b) for b in batches}
    )


# ---- the format ---------------------------------------------------------------------


def test_gpu_type_keys_drop_vendor_words_and_join_the_rest_with_dashes():
    assert gpu_type_key("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_type_key("Tesla V100-SXM2-32GB") == "v100-sxm2-32gb"
    assert gpu_type_key("V100-32GB") == "v100-32gb"
    assert gpu_type_key("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert len(gpu_type_key("x" * 200)) == 64
    with pytest.raises(ValueError, match="no type key"):
        gpu_type_key("NVIDIA")


def test_a_written_profile_reads_back_equal(tmp_path: Path):
    written = profile_of(
        hundredfold(),
        figures("bert", {8: (0.02, 3000.0)}, architecture="real"),
        gpu_name=H100,
    )
    path = tmp_path / "h100.json"
    write_profile(path, written)
    assert read_profile(path) == written
    document = json.loads(path.read_text())
    assert document["format"] == "gpusched-measured-profile" and document["version"] == 1
    assert document["gpu_type"] == H100_TYPE
    point = document["models"]["bert"]["points"][0]
    assert set(point) == {"batch_size", "iteration_s", "memory_mb"}


def test_a_profile_travels_as_a_message_and_comes_back_equal():
    sent = profile_of(hundredfold())
    message = codec.decode(codec.encode(to_wire(sent)), MeasuredProfile)
    assert from_wire(message) == sent
    # the message's JSON is a file the reader takes
    assert parse_profile(json.loads(msgspec.json.encode(message))) == sent


def bad(document: dict, where: list[str | int], value: object) -> dict:
    changed = json.loads(json.dumps(document))
    target = changed
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return changed


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        (["format"], "something-else", "'format'"),
        (["version"], 2, "'version'"),
        (["gpu_type"], "H100 80GB", "'gpu_type'"),
        (["models"], {}, "'models'"),
        (["models", "resnet50", "architecture"], "imagined", "'architecture'"),
        (["models", "resnet50", "points"], [], "'points'"),
        (["models", "resnet50", "points", 0, "iteration_s"], -1.0, "[0], field 'iteration_s'"),
        (["models", "resnet50", "points", 0, "batch_size"], 0, "[0], field 'batch_size'"),
        (["models", "resnet50", "points", 1, "memory_mb"], "a lot", "[1], field 'memory_mb'"),
        (["models", "resnet50", "points", 1, "batch_size"], 32, "a batch_size appears twice"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, where: list[str | int], value: object, named: str
):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad(profile_document(profile_of(hundredfold())), where, value)))
    with pytest.raises(MeasuredProfileError) as refused:
        read_profile(path)
    assert str(path) in str(refused.value) and named in str(refused.value)


def test_a_missing_or_broken_file_is_refused_naming_it(tmp_path: Path):
    with pytest.raises(MeasuredProfileError, match="no such file"):
        read_profile(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"format":\n  oops}')
    with pytest.raises(MeasuredProfileError, match=r"broken.json, line 2: not valid JSON"):
        read_profile(broken)


def test_figures_interpolate_between_batches_and_memory_never_falls():
    noisy = figures("resnet50", {16: (0.010, 900.0), 32: (0.014, 880.0), 64: (0.030, 1500.0)})
    assert noisy.iteration_s(24) == pytest.approx(0.012)
    assert noisy.iteration_s(48) == pytest.approx(0.022)
    assert noisy.iteration_s(8) is None and noisy.iteration_s(65) is None
    assert noisy.memory_mb(32) == 900.0  # not below the smaller batch's
    assert noisy.memory_mb(48) == pytest.approx(1200.0)


def test_new_figures_merge_with_old_ones_but_emulated_ones_never_replace_a_gpus():
    old = profile_of(figures("resnet50", {32: (0.01, 900.0)}))
    more = figures("resnet50", {64: (0.02, 1500.0)})
    merged = with_figures(old, H100, more).models["resnet50"]
    assert [p.batch_size for p in merged.points] == [32, 64]
    emulated = figures("resnet50", {32: (5.0, 1.0)}, architecture="emulated", device="emulated")
    assert with_figures(old, H100, emulated).models["resnet50"] == old.models["resnet50"]
    real = figures("resnet50", {128: (0.05, 2500.0)}, architecture="real")
    assert with_figures(old, H100, real).models["resnet50"] == real  # another architecture


# ---- the performance model ------------------------------------------------------------


def test_a_measured_model_is_timed_from_its_figures_and_others_from_the_research_profile():
    measured = figures("resnet50", {32: (0.0010, 1000.0), 64: (0.0016, 1600.0)})
    model = MeasuredPerformance(TRUTH, profile_of(measured))
    one = lambda b: TRUTH.iteration_time("resnet50", b, 1, 1)  # noqa: E731
    assert model.iteration_time("resnet50", 48, 1, 1) == pytest.approx(0.0013)
    # beyond the measured batches: the nearest point, scaled as the research profile scales
    assert model.iteration_time("resnet50", 128, 1, 1) == pytest.approx(
        0.0016 * one(128) / one(64)
    )
    # several GPUs: the measured compute plus the research profile's all-reduce
    assert model.iteration_time("resnet50", 128, 2, 2) == pytest.approx(
        0.0016 + TRUTH.iteration_time("resnet50", 128, 2, 2) - one(64)
    )
    assert model.gpu_memory_mb("resnet50", 48) == pytest.approx(1300.0)
    assert model.gpu_memory_mb("resnet50", 96) == pytest.approx(
        1600.0 + TRUTH.gpu_memory_mb("resnet50", 96) - TRUTH.gpu_memory_mb("resnet50", 64)
    )
    assert model.iteration_time("bert", 32, 1, 1) == TRUTH.iteration_time("bert", 32, 1, 1)
    assert model.gpu_memory_mb("bert", 32) == TRUTH.gpu_memory_mb("bert", 32)


@given(
    t32=st.floats(1e-5, 10.0), t64=st.floats(1e-5, 10.0), batch=st.integers(1, 1024),
    gpus=st.integers(1, 16), accum=st.integers(1, 4),
)  # fmt: skip
def test_measured_times_keep_the_performance_model_contract(
    t32: float, t64: float, batch: int, gpus: int, accum: int
):
    model = MeasuredPerformance(
        TRUTH, profile_of(figures("vgg16", {32: (t32, 900.0), 64: (t64, 800.0)}))
    )
    times = [model.iteration_time("vgg16", batch, gpus, nodes, accum) for nodes in (1, 2)
             if nodes <= gpus]  # fmt: skip
    assert all(t > 0 for t in times)
    assert times == sorted(times)  # a wider spread is never faster
    assert times[0] >= model.iteration_time("vgg16", batch, gpus, 1)  # nor accumulation
    assert model.gpu_memory_mb("vgg16", batch) <= model.gpu_memory_mb("vgg16", batch + 1)


# ---- the predictor: measured figures under the learned correction ---------------------


def event(node: str, iteration: int, iteration_s: float, job_id: str = "job-1") -> JobProgressEvent:
    return JobProgressEvent(
        job_id=job_id, run_id=1, node=node, model="resnet50", batch_size=64, gpus=1,
        iteration_s=iteration_s, progress=Progress(iteration=iteration),
    )  # fmt: skip


def test_a_hundredfold_faster_gpu_is_estimated_from_its_figures_not_pinned_by_the_cap():
    research_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
    real_s = research_s / 100 * 1.02  # the figure, 2 % off
    request = PredictRequest(model="resnet50", batch_size=64, gpu_type=H100_TYPE)

    without = BaselinePredictor(TRUTH, history_weight=0.5)
    for i in range(1, 30):
        without.observe_progress(event("h-0", i, real_s), H100_TYPE)
    pinned = without.throughput(request).iteration_s
    assert pinned == pytest.approx(research_s * RATIO_BOUNDS[0])  # 5x too slow

    measured = BaselinePredictor(TRUTH, history_weight=0.5)
    measured.observe_measured(profile_of(hundredfold()), ["resnet50"])
    first = measured.throughput(request)
    assert first.source == "measured"
    assert first.iteration_s == pytest.approx(research_s / 100)
    for i in range(1, 30):
        measured.observe_progress(event("h-0", i, real_s), H100_TYPE)
    learned = measured.throughput(request)
    assert learned.source == "measured+history"
    assert learned.iteration_s == pytest.approx(real_s, rel=0.01)
    # a job on another type keeps the research profile
    other = measured.throughput(PredictRequest(model="resnet50", batch_size=64))
    assert other.iteration_s == pytest.approx(research_s)


def test_new_figures_drop_the_learned_correction_of_their_type_only():
    predictor = BaselinePredictor(TRUTH, history_weight=0.5)
    research_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
    for i in range(1, 6):
        predictor.observe_progress(event("h-0", i, research_s / 10, "job-h"), H100_TYPE)
        predictor.observe_progress(event("v-0", i, research_s * 2, "job-v"), "v100-32gb")
    assert predictor.solo_factor("resnet50", 64, 1, H100_TYPE) < 0.5
    predictor.observe_measured(profile_of(hundredfold()), ["resnet50"])
    assert predictor.solo_factor("resnet50", 64, 1, H100_TYPE) == 1.0
    assert predictor.solo_factor("resnet50", 64, 1, "v100-32gb") > 1.5
    # what is learned per type survives a restart; a key stored before types is typeless
    restored = BaselinePredictor(TRUTH, history_weight=0.5)
    learned = predictor.learned()
    old = msgspec.structs.replace(learned.solo[0], key=["resnet50", 64, 1])
    assert restored.restore(msgspec.structs.replace(learned, solo=[*learned.solo, old])) == 2
    assert restored.solo_factor("resnet50", 64, 1, "v100-32gb") > 1.5
    assert restored.solo_factor("resnet50", 64, 1) == learned.solo[0].value


# ---- the predictor service over NATS --------------------------------------------------


async def hand_in(nc: Client, node: str, profile: GpuProfile) -> CommandReply:
    reply = await nc.request(
        subjects.node_measured_profile(node), codec.encode(to_wire(profile)), timeout=5,
        headers=codec.headers(),
    )  # fmt: skip
    return codec.decode(reply.data, CommandReply)


async def test_the_predictor_keeps_figures_per_gpu_type_serves_them_and_learns_on_them(
    nats_server: NatsServer, nc: Client, stores: Stores
):
    client = PredictorClient(nc, timeout_s=5.0)
    published = await listen(nc, subjects.ALL_GPU_PROFILES, MeasuredProfile)
    # without the shipped H100 figures: the type starts with none
    config = PredictorConfig(nats_url=nats_server.url, history_weight=0.5,
                             shipped_profiles=False)  # fmt: skip
    async with PredictorService(config) as predictor:
        assert await client.measured_profile(H100_TYPE) is None
        assert (await hand_in(nc, "h-0", profile_of(hundredfold()))).ok
        stored = await client.measured_profile(H100_TYPE)
        assert stored is not None and from_wire(stored) == profile_of(hundredfold())
        assert await client.measured_profile(H100_TYPE, "resnet50", 64) is not None
        assert await client.measured_profile(H100_TYPE, "resnet50", 16) is None
        assert await client.measured_profile(H100_TYPE, "bert") is None
        assert await client.measured_profile("v100-32gb") is None
        # a second type is kept beside the first
        v100 = profile_of(figures("bert", {32: (0.3, 5000.0)}), gpu_name="Tesla V100-SXM2-32GB")
        assert (await hand_in(nc, "v-0", v100)).ok
        assert await client.measured_profile("v100-sxm2-32gb", "bert", 32) is not None

        # a job on a node of the type is estimated from its figures, and learns on them
        research_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
        node = NodeInfo(name="h-1", gpus=[GpuInfo(0, "GPU-1", H100, 81559)], cpus=8,
                        host_mem_gb=64.0)  # fmt: skip
        await stores.nodes.put("h-1", codec.encode(node))
        request = PredictRequest(model="resnet50", batch_size=64, gpu_type=H100_TYPE)
        assert (await client.throughput(request)).iteration_s == pytest.approx(research_s / 100)
        real_s = research_s / 100 * 1.02
        for i in range(1, 12):
            await nc.publish(
                subjects.job_progress("h-1", "job-1"), codec.encode(event("h-1", i, real_s)),
                headers=codec.headers(),
            )  # fmt: skip

        async def learned() -> bool:
            answer = await client.throughput(request)
            return answer.source == "measured+history" and answer.iteration_s == pytest.approx(
                real_s, rel=0.01
            )

        assert await wait_until(learned, timeout_s=10)
        assert predictor.predictor.solo_factor("resnet50", 64, 1, H100_TYPE) == pytest.approx(
            1.02, rel=0.01
        )

    assert sorted(p.gpu_type for p in published.items) == [H100_TYPE, "v100-sxm2-32gb"]
    # a restarted predictor has every type back from its bucket
    async with PredictorService(
        PredictorConfig(nats_url=nats_server.url, shipped_profiles=False)
    ):
        again = await client.measured_profile(H100_TYPE)
        assert again is not None and from_wire(again) == profile_of(hundredfold())
        assert await client.measured_profile("v100-sxm2-32gb", "bert") is not None


async def test_a_fresh_predictor_times_h100_jobs_from_the_shipped_figures_until_nodes_measure(
    nats_server: NatsServer, nc: Client, stores: Stores
):
    client = PredictorClient(nc, timeout_s=5.0)
    shipped = next(p for p in shipped_gpu_profiles() if p.gpu_type == H100_TYPE)
    shipped_resnet = shipped.models["resnet50"]
    async with PredictorService(PredictorConfig(nats_url=nats_server.url)):
        answer = await client.measured_profile(H100_TYPE, "resnet50")
        assert answer is not None
        assert from_wire(answer).models["resnet50"] == shipped_resnet
        batch = shipped_resnet.points[0].batch_size
        request = PredictRequest(model="resnet50", batch_size=batch, gpu_type=H100_TYPE)
        assert (await client.throughput(request)).iteration_s == pytest.approx(
            shipped_resnet.points[0].iteration_s
        )
        # a node's own figures of another architecture replace the shipped ones
        assert (await hand_in(nc, "h-0", profile_of(hundredfold()))).ok
        mine = await client.measured_profile(H100_TYPE, "resnet50")
        assert mine is not None and from_wire(mine).models["resnet50"] == hundredfold()
        assert await client.measured_profile(H100_TYPE, "bert") is not None
    # only the node's own figures were saved; the shipped ones come back from the release
    entry = await (await stores.predictor_bucket()).get(subjects.PREDICTOR_MEASURED_KEY)
    saved = codec.decode(entry.value or b"", StoredMeasured)
    assert [sorted(from_wire(p).models) for p in saved.profiles] == [["resnet50"]]
    async with PredictorService(PredictorConfig(nats_url=nats_server.url)):
        again = await client.measured_profile(H100_TYPE)
        assert again is not None
        assert from_wire(again).models["resnet50"] == hundredfold()
        assert from_wire(again).models["bert"] == shipped.models["bert"]


async def test_unreadable_figures_are_refused_with_the_reason(
    nats_server: NatsServer, nc: Client
):
    async with PredictorService(PredictorConfig(nats_url=nats_server.url)):
        reply = await nc.request(
            subjects.node_measured_profile("h-0"), b"\x01", timeout=5, headers=codec.headers()
        )
        answer = codec.decode(reply.data, CommandReply)
        assert not answer.ok and "unreadable measured profile" in answer.error


# ---- node agents ----------------------------------------------------------------------


async def test_a_node_agent_hands_in_figures_the_first_time_it_runs_a_model_at_a_batch(
    nats_server: NatsServer, nc: Client, tmp_path: Path
):
    client = PredictorClient(nc, timeout_s=5.0)
    gpu_type = gpu_type_key("V100-32GB")
    from_a = await listen(nc, subjects.node_measured_profile("gpu-a"), MeasuredProfile)
    from_b = await listen(nc, subjects.node_measured_profile("gpu-b"), MeasuredProfile)
    config_a = agent_config(nats_server.url, tmp_path / "a", name="gpu-a")
    config_b = agent_config(nats_server.url, tmp_path / "b", name="gpu-b")
    predictor_config = PredictorConfig(nats_url=nats_server.url)
    agents = (NodeAgent(config_a), NodeAgent(config_b))
    async with PredictorService(predictor_config) as predictor, agents[0], agents[1]:
        assert (await send(nc, start("a1", model="resnet50", batch_size=64), "gpu-a")).ok

        async def stored(batch: int) -> GpuProfile | None:
            found = predictor.measured.get(gpu_type)
            held = found is not None and "resnet50" in found.models
            return found if held and found.models["resnet50"].has_batch(batch) else None

        profile = await wait_until(lambda: stored(64), timeout_s=15)
        resnet = profile.models["resnet50"]
        assert resnet.architecture == "emulated" and resnet.node == "gpu-a"
        assert [p.batch_size for p in resnet.points] == [32, 64]
        for point in resnet.points:  # an emulated GPU runs at the ground truth's speed
            assert point.iteration_s == TRUTH.iteration_time("resnet50", point.batch_size, 1, 1)
            assert point.memory_mb == TRUTH.gpu_memory_mb("resnet50", point.batch_size)

        # another node of the type finds the figures stored and measures only what is new
        assert (await send(nc, start("b1", model="resnet50", batch_size=64), "gpu-b")).ok
        assert (await send(nc, start("b2", model="resnet50", batch_size=16,
                                     gpus=(1,)), "gpu-b")).ok  # fmt: skip
        await wait_until(lambda: stored(16), timeout_s=15)
        # and answers a measurement asked for
        reply = await nc.request(
            subjects.node_gpu_profile("gpu-b"),
            codec.encode(GpuProfileRequest(model="bert", batch_sizes=[4, 8])), timeout=10,
            headers=codec.headers(),
        )  # fmt: skip
        asked = codec.decode(reply.data, MeasuredProfile)
        assert [p.batch_size for p in asked.models["bert"].points] == [4, 8]
        assert await client.measured_profile(gpu_type, "bert", 8) is not None

    assert [sorted(m.models) for m in from_a.items] == [["resnet50"]]
    batches = [[p.batch_size for p in m.models[name].points]
               for m in from_b.items for name in m.models]  # fmt: skip
    assert batches == [[8, 16], [4, 8]]


async def test_with_nats_users_a_node_hands_in_figures_and_the_scheduler_hears_them(
    as_user, server: NatsServer, creds, tmp_path: Path  # noqa: F811
):
    agent = await as_user(nodeagent_user("node-0"))
    scheduler = await as_user("scheduler")
    heard = await listen(scheduler.nc, subjects.ALL_GPU_PROFILES, MeasuredProfile)
    config = NodeAgentConfig(name="node-0", gpus=2, work_dir=tmp_path / "work")
    predictor_config = PredictorConfig(nats_url=creds.url("predictor", server.url))
    async with PredictorService(predictor_config) as predictor, NodeAgent(config, nc=agent.nc):
        # the predictor reads a node's GPU type from its registration
        assert await predictor.measured.gpu_type_of("node-0") == "v100-32gb"
        started = await scheduler.nc.request(
            subjects.node_command("node-0"), codec.encode(start("j1", batch_size=32)),
            timeout=5, headers=codec.headers(),
        )  # fmt: skip
        assert codec.decode(started.data, CommandReply).ok
        await wait_until(lambda: heard.items, timeout_s=15)
    assert heard.items[0].gpu_type == "v100-32gb"
    assert [p.batch_size for p in heard.items[0].models["resnet50"].points] == [16, 32]
    assert not [e for e in agent.errors if "permissions violation" in e.lower()], agent.errors


async def test_the_live_scheduler_times_jobs_on_its_gpu_type_from_the_published_figures(
    nats_server: NatsServer, nc: Client, tmp_path: Path
):
    cluster = EmulatedCluster.of(
        nats_server.url, 1, 2, work_dir=tmp_path / "work", gpu_model="H100-80GB",
        heartbeat_s=0.2,
    )  # fmt: skip
    h100 = "h100-80gb"
    limit = process_limit_s(1)
    predictor_config = PredictorConfig(nats_url=nats_server.url)
    scheduler_config = fast_scheduler(nats_server.url)
    async with cluster, PredictorService(predictor_config) as predictor, SchedulerService(
        scheduler_config
    ) as sched:

        async def leading() -> bool:
            return sched.scheduler is not None and sched.scheduler.gpu_types.main == h100

        await wait_until(leading, timeout_s=limit)
        assert sched.scheduler is not None
        scale = sched.scheduler.config.time_scale
        research_s = TRUTH.iteration_time("resnet50", 64, 1, 1)
        assert sched.scheduler.estimates.iteration_time("resnet50", 64, 1, 1) == (
            pytest.approx(research_s * scale)
        )
        await predictor.measured.store(profile_of(hundredfold(), gpu_name="H100-80GB"))

        async def followed() -> bool:
            scheduler = sched.scheduler
            return scheduler is not None and h100 in scheduler.gpu_types.profiles

        await wait_until(followed, timeout_s=limit)
        estimates = sched.scheduler.estimates
        assert estimates.iteration_time("resnet50", 64, 1, 1) == pytest.approx(
            research_s / 100 * scale
        )
        assert estimates.gpu_memory_mb("resnet50", 64) == pytest.approx(1064.0)
        assert estimates.iteration_time("bert", 32, 1, 1) == pytest.approx(
            TRUTH.iteration_time("bert", 32, 1, 1) * scale
        )


def test_the_shipped_measurements_are_a_cpu_one_of_every_stand_in_and_an_h100_one():
    shipped = sorted((ROOT / "libs/core/builtin/measured").glob("*.json"))
    assert [p.name for p in shipped] == ["cpu-amd-epyc.json", "h100-80gb-hbm3.json"]
    h100 = read_profile(shipped[1])
    assert (h100.gpu_name, h100.gpu_type) == (H100, H100_TYPE)
    assert {"resnet50", "bert", "gpt2"} <= set(h100.models)
    for measured in h100.models.values():
        assert (measured.architecture, measured.device) == ("real", "cuda")
        assert measured.torch.endswith("+cu130") and measured.measured_at
    # the only GPU measurement the predictor starts with
    assert [p.gpu_type for p in shipped_gpu_profiles()] == [H100_TYPE]
    profile = read_profile(shipped[0])
    assert profile.gpu_name.startswith("CPU ") and profile.gpu_type.startswith("cpu-")
    assert set(profile.models) == set(TRUTH.models())
    for measured in profile.models.values():
        assert (measured.architecture, measured.device) == ("stand-in", "cpu")
        assert measured.torch and measured.measured_at


# ---- the simulator and the command line -----------------------------------------------


def run_simulation(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, float]]:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "job_id,submit_time,gpus,model,batch_size,iterations\n"
        "r,0,1,resnet50,64,10000\nb,0,1,bert,32,1000\n"
    )
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "simulate", "--trace", str(trace), "--format", "native", "--cluster", "1x2",
        "--policy", "fifo", "--out", str(out), *args,
    ])  # fmt: skip
    jct: dict[str, float] = {}
    if result.exit_code == 0:
        import csv

        with (out / "jobs.csv").open() as rows:
            jct = {row["job_id"]: float(row["jct_s"]) for row in csv.DictReader(rows)}
    return result.exit_code, result.output, jct


def test_simulate_with_profiles_times_the_models_of_the_file_from_its_figures(tmp_path: Path):
    path = tmp_path / "h100.json"
    write_profile(path, profile_of(hundredfold()))
    code, output, research = run_simulation(tmp_path)
    assert code == 0, output
    code, output, measured = run_simulation(tmp_path, "--profiles", str(path))
    assert code == 0, output
    assert research["r"] == pytest.approx(10_000 * TRUTH.iteration_time("resnet50", 64, 1, 1))
    assert measured["r"] == pytest.approx(research["r"] / 100)
    assert measured["b"] == research["b"]  # bert is not in the file


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (None, "no such file"),
        ("[1, 2", "not valid JSON"),
        (json.dumps({"format": "gpusched-measured-profile", "version": 1}), "'gpu_name'"),
        (
            json.dumps(profile_document(profile_of(figures("alexnet-x", {8: (0.1, 1.0)})))),
            "none of its models (alexnet-x)",
        ),
    ],
)
def test_simulate_refuses_a_missing_or_bad_profiles_file_naming_the_option(
    tmp_path: Path, content: str | None, named: str
):
    path = tmp_path / "profiles.json"
    if content is not None:
        path.write_text(content)
    code, output, _ = run_simulation(tmp_path, "--profiles", str(path))
    assert code == 2
    assert "--profiles" in output and named in " ".join(output.split())


def test_gpusched_profile_measures_the_workers_stand_in_and_writes_a_file(tmp_path: Path):
    out = tmp_path / "cpu.json"
    result = runner.invoke(app, [
        "profile", "cifar10", "--batch", "4", "--batch", "8", "--device", "cpu",
        "--repeats", "2", "--warmup", "1", "--out", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    profile = read_profile(out)
    assert profile.gpu_type.startswith("cpu-")
    cifar = profile.models["cifar10"]
    assert (cifar.architecture, cifar.device) == ("stand-in", "cpu")
    assert [p.batch_size for p in cifar.points] == [4, 8]
    assert all(p.iteration_s > 0 and p.memory_mb > 0 for p in cifar.points)
    # a second model is added to the same file
    again = runner.invoke(app, [
        "profile", "ncf", "--batch", "8", "--device", "cpu", "--repeats", "2", "--out", str(out),
    ])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert sorted(read_profile(out).models) == ["cifar10", "ncf"]
