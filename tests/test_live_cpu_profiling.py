"""Synergy's optimistic profiling, live: a node agent measures a model's CPU/memory
sensitivity with the real torch worker when a job of it first runs, the predictor keeps
the profile across a restart, and the scheduler's estimates take the model's best case
from it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nats.micro.request import ERROR_CODE_HEADER

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.cpu_sensitivity import Sensitivity
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.predictor_client import PredictorClient
from gpusched.libs.common.schemas import CpuProfile, CpuProfilePoint, CpuProfileRequest, JobState
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.nodeagent.cpu_profiling import cpu_counts
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.live import SchedulerService
from tests.limits import process_limit_s
from tests.live import fast_scheduler, spec, store_job, wait_state
from tests.test_nodeagent_service import PROCESS_TIMINGS

#: one node of 2 GPUs and 2 CPUs (the fair share: 1 CPU per GPU), on this machine's cores
GPUS, CPUS_PER_GPU, MEM_GB_PER_GPU = 2, 1, 16.0


def profile(points: list[tuple[int, float, float]], resident_gb: float = 0.5) -> CpuProfile:
    return CpuProfile(
        model="resnet18", node="n", measured_at=0.0, node_cpus=4, node_gpus=2,
        node_mem_gb=8.0, resident_gb=resident_gb, dataset_gb=1.0,
        points=[CpuProfilePoint(*p) for p in points],
    )  # fmt: skip


def test_cpu_counts_halve_from_all_the_cores_down_to_one():
    assert cpu_counts(12) == [12, 6, 3, 1]
    assert cpu_counts(2) == [2, 1]
    assert cpu_counts(1) == [1]


def test_a_measured_profile_is_normalised_at_the_fair_share_and_its_best_case_is_the_peak():
    # 4 CPUs and 8 GB over 2 GPUs: fair share 2 CPUs and 4 GB per GPU (all cached there)
    measured = Sensitivity(profile([(4, 1.0, 2.0), (2, 2.0, 3.0), (1, 4.0, 5.0)]))
    assert measured.speedup(2, 4.0) == pytest.approx(1.0)
    # between counts the time per sample is linear: 3 CPUs cached take 1.5 s per sample
    assert measured.speedup(3, 4.0) == pytest.approx(2.0 / 1.5)
    # cache model: 1 GB over the 0.5 GB resident caches half of the 1 GB data set
    assert measured.sample_s(4, 1.0) == pytest.approx(0.5 * 1.0 + 0.5 * 2.0)
    assert measured.sample_s(4, 0.2) == pytest.approx(2.0)
    best = measured.demand()
    assert (best.cpus_per_gpu, best.mem_gb_per_gpu) == (4.0, 1.5)
    assert best.speedup == pytest.approx(2.0)
    assert measured.gain_from_cores() == pytest.approx(5.0 / 2.0)


def test_the_best_case_takes_the_fewest_cpus_within_the_tolerance_of_the_peak():
    # 4 CPUs are 2 % faster than 2: noise, not a peak worth two more cores
    measured = Sensitivity(profile([(4, 0.98, 1.0), (2, 1.0, 1.0), (1, 3.0, 3.0)]))
    assert measured.demand().cpus_per_gpu == 2.0


async def test_the_predictor_answers_404_without_a_profile_and_502_when_no_node_measures(
    nats_server: NatsServer, nc
):
    async with PredictorService(PredictorConfig(nats_url=nats_server.url)):
        assert await PredictorClient(nc, timeout_s=5.0).cpu_profile("resnet18") is None
        wanted = CpuProfileRequest(model="resnet18", node="nowhere")
        reply = await nc.request(
            subjects.PREDICT_CPU_PROFILE, codec.encode(wanted), timeout=10,
            headers=codec.headers(),
        )  # fmt: skip
        assert (reply.headers or {}).get(ERROR_CODE_HEADER) == "502"


async def test_a_node_measures_a_cpu_hungry_model_gaining_more_from_cores_than_a_light_one(
    nats_server: NatsServer, stores: Stores, nc, tmp_path: Path
):
    cluster = EmulatedCluster.of(
        nats_server.url, 1, GPUS, cpus_per_gpu=CPUS_PER_GPU, host_mem_gb_per_gpu=MEM_GB_PER_GPU,
        work_dir=tmp_path / "work", jobs_mode="process", heartbeat_s=0.2, progress_s=0.2,
        # each point is the fastest of its rounds: a busy machine only slows a round down,
        # so more rounds bring both models' points closer to their work alone (the
        # comparison below swung on a loaded machine with 3)
        cpu_profile_rounds=8, **PROCESS_TIMINGS,
    )  # fmt: skip
    predictor_config = PredictorConfig(nats_url=nats_server.url, profile_cpu=True)
    client = PredictorClient(nc, timeout_s=5.0)
    limit = process_limit_s(3)
    measured: dict[str, CpuProfile] = {}
    scheduler_config = fast_scheduler(nats_server.url, policy="synergy-fifo")
    async with cluster, SchedulerService(scheduler_config) as sched:
        async with PredictorService(predictor_config) as predictor:
            # the first job of each model has its node measure the model, one after the
            # other (each measurement beside one starting job, so both alike)
            for model in ("resnet18", "vgg16"):
                job = await store_job(stores, spec(model=model, batch_size=8, iterations=3))
                await wait_state(stores, job, JobState.SUCCEEDED, timeout_s=limit)

                async def stored(model: str = model) -> CpuProfile | None:
                    return predictor.predictor.cpu_profile(model)

                measured[model] = await wait_until(stored, timeout_s=limit, every_s=0.1)
            # a second job of a measured model measures nothing again
            again = await store_job(stores, spec(model="resnet18", batch_size=8, iterations=2))
            await wait_state(stores, again, JobState.SUCCEEDED, timeout_s=limit)
            assert predictor.predictor.cpu_profile("resnet18") == measured["resnet18"]

        hungry, light = (Sensitivity(measured[m]) for m in ("resnet18", "vgg16"))
        for found in (hungry, light):
            assert [p.cpus for p in found.profile.points] == [2, 1]
            assert found.profile.node == cluster.agents[0].info.name
            assert found.profile.node_cpus == GPUS * CPUS_PER_GPU
            assert found.profile.resident_gb > 0 and found.profile.dataset_gb > 0
        # the input pipeline's work per sample makes the hungry model gain more from a
        # second core than the light one (with no cache, where it decodes every sample)
        assert hungry.gain_from_cores() > light.gain_from_cores()
        print(
            "gain from 2 cores over 1, no cache:",
            f"resnet18 {hungry.gain_from_cores():.2f}x, vgg16 {light.gain_from_cores():.2f}x",
        )

        # the scheduler's estimates follow the measured profiles (published on storing)
        async def followed() -> bool:
            scheduler = sched.scheduler
            return scheduler is not None and set(scheduler.scaled.measured) >= {"resnet18", "vgg16"}

        await wait_until(followed, timeout_s=limit, every_s=0.1)
        assert sched.scheduler is not None
        estimates = sched.scheduler.estimates
        assert estimates.cpu_mem_demand("resnet18") == hungry.demand()
        assert estimates.cpu_mem_speedup("vgg16", 1, 2.0, 1.0) == light.speedup(2.0, 1.0)

        # a restarted predictor still has them, and answers them to whoever asks
        began = time.time()
        async with PredictorService(predictor_config):
            for model, expected in measured.items():
                assert await client.cpu_profile(model) == expected
                assert expected.measured_at < began
            assert await client.cpu_profile("bert") is None
