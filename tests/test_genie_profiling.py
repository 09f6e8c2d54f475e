"""GENIE's profiling run and platform model: the link fit, a real measurement between two
local processes, a node agent's profiling run of the real worker that the predictor
keeps across a restart and the live scheduler's estimates follow, and GENIE's order and
placement worked out by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.compute_model import (
    ComputeProfiled,
    compute_line,
    platform_of,
)
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.predictor_client import PredictorClient
from gpusched.libs.common.schemas import (
    ComputePoint,
    ComputeProfile,
    JobState,
    LinkPoint,
    LinkProfile,
)
from gpusched.libs.core.platform import PlatformModel, fit_link
from gpusched.libs.core.profiles.builtin import Network, load_builtin
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.live import SchedulerService
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.genie import swaf_key
from tests.builders import TablePerf, cluster, pending, running, snapshot
from tests.limits import process_limit_s
from tests.live import fast_scheduler, spec, store_job, wait_state
from tests.test_nodeagent_service import PROCESS_TIMINGS

NETWORK = load_builtin()[1]
SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)


def link_points(platform: PlatformModel, noise: float = 0.0) -> list[tuple[float, float]]:
    """All-reduces between two ranks of one node, as the model says, with a relative
    error alternating +noise, -noise."""
    return [
        (x, platform.allreduce_s(x, 2, 1) * (1 + noise * (-1) ** i)) for i, x in enumerate(SIZES)
    ]


def test_profiling_compute_is_off_by_default_and_switched_on_by_its_variable():
    assert PredictorConfig().profile_compute is False
    on = PredictorConfig.from_env({"GPUSCHED_PREDICTOR_PROFILE_COMPUTE": "1"})
    assert on.profile_compute is True
    with pytest.raises(ValueError, match="GPUSCHED_PREDICTOR_PROFILE_COMPUTE"):
        PredictorConfig.from_env({"GPUSCHED_PREDICTOR_PROFILE_COMPUTE": "often"})
    with pytest.raises(ValueError, match=r"^profile_compute must be true or false"):
        PredictorConfig(profile_compute="yes")  # type: ignore[arg-type]


# ---- the platform model --------------------------------------------------------------


def test_the_link_fit_recovers_a_known_latency_and_bandwidth_from_synthetic_all_reduces():
    known = PlatformModel(2.0, 50e-6, 1.0, 200e-6)
    fitted = fit_link(link_points(known))
    assert fitted.latency_s == pytest.approx(50e-6, rel=1e-9)
    assert fitted.gb_per_s == pytest.approx(2.0, rel=1e-9)
    assert fitted.rms_error_s == pytest.approx(0.0, abs=1e-12)
    # with +-2 % noise on every point the figures stay within a few per cent
    noisy = fit_link(link_points(known, noise=0.02))
    assert noisy.gb_per_s == pytest.approx(2.0, rel=0.05)
    assert noisy.latency_s == pytest.approx(50e-6, rel=0.5)
    assert noisy.rms_error_s > 0


@settings(deadline=None, max_examples=60)
@given(
    latency=st.floats(0.0, 1e-3),
    gb_s=st.floats(0.05, 500.0),
)
def test_the_fit_inverts_the_model_of_two_ranks_on_one_node(latency: float, gb_s: float):
    fitted = fit_link(link_points(PlatformModel(gb_s, latency, gb_s, latency)))
    assert fitted.gb_per_s == pytest.approx(gb_s, rel=1e-6)
    assert fitted.latency_s == pytest.approx(latency, rel=1e-6, abs=1e-12)


def test_a_fit_needs_two_sizes_and_times_that_grow_and_says_so_naming_points():
    with pytest.raises(ValueError, match=r"^points: need all-reduces of at least two sizes"):
        fit_link([(1e6, 0.001), (1e6, 0.002)])
    with pytest.raises(ValueError, match=r"^points: the all-reduce time does not grow"):
        fit_link([(1e3, 0.002), (1e6, 0.001)])
    with pytest.raises(ValueError, match=r"^points: seconds must be > 0"):
        fit_link([(1e3, 0.0), (1e6, 0.001)])


def test_a_negative_intercept_is_refitted_through_the_origin():
    # times that extrapolate below 0 at 0 bytes: latency 0, bandwidth from the slope
    fitted = fit_link([(1e6, 0.5e-3), (2e6, 1.6e-3)])
    assert fitted.latency_s == 0.0
    assert fitted.gb_per_s == pytest.approx(1 / ((0.5e-3 * 1e6 + 1.6e-3 * 2e6) / 5e12) / 1e9)


@pytest.mark.parametrize(
    "figures, field",
    [
        ((0.0, 0.0, 1.0, 0.0), "intra_gb_s"),
        ((1.0, -1e-6, 1.0, 0.0), "intra_latency_s"),
        ((1.0, 0.0, math.inf, 0.0), "inter_gb_s"),
        ((1.0, 0.0, 1.0, math.nan), "inter_latency_s"),
    ],
)
def test_bad_figures_are_refused_naming_the_field(figures: tuple[float, ...], field: str):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        PlatformModel(*figures)


def test_the_all_reduce_is_the_built_in_ring_formula_plus_the_hops_inside_the_servers():
    network = Network(100.0, 12.5, 5e-5)
    configured = PlatformModel.configured(network)
    for gpus, nodes in [(1, 1), (2, 1), (8, 1), (2, 2), (8, 2), (16, 4)]:
        # the built-in formula takes MB
        assert configured.allreduce_s(40e6, gpus, nodes) == network.allreduce_s(40.0, gpus, nodes)
    # 4 GPUs on 2 servers: 2 (4-1)/4 x 40 MB at 12.5 GB/s, 2 inter hops of 50 us, and
    # 2 x (4 - 2) intra hops of 10 us
    with_hops = PlatformModel(100.0, 10e-6, 12.5, 5e-5)
    assert with_hops.allreduce_s(40e6, 4, 2) == pytest.approx(
        1.5 * 40e6 / 12.5e9 + 2 * 5e-5 + 4 * 10e-6
    )
    # one GPU all-reduces nothing
    assert with_hops.allreduce_s(40e6, 1, 1) == 0.0
    with pytest.raises(ValueError, match="3 GPUs cannot span 4 nodes"):
        with_hops.allreduce_s(1.0, 3, 4)


@settings(deadline=None, max_examples=80)
@given(
    intra=st.tuples(st.floats(0.1, 200.0), st.floats(0.0, 1e-3)),
    inter=st.tuples(st.floats(0.1, 200.0), st.floats(0.0, 1e-3)),
    nbytes=st.floats(0.0, 1e10),
    gpus=st.integers(1, 32),
    nodes=st.integers(1, 32),
)
def test_more_servers_or_more_bytes_never_make_an_all_reduce_faster(
    intra: tuple[float, float], inter: tuple[float, float], nbytes: float, gpus: int,
    nodes: int,
):  # fmt: skip
    # whatever the configured figures say (a network faster than the measured loopback)
    platform = PlatformModel(intra[0], intra[1], inter[0], inter[1])
    nodes = min(nodes, gpus)
    here = platform.allreduce_s(nbytes, gpus, nodes)
    assert here >= 0
    if nodes < gpus:
        assert platform.allreduce_s(nbytes, gpus, nodes + 1) >= here * (1 - 1e-12)
    assert platform.allreduce_s(nbytes * 2 + 1, gpus, nodes) >= here


def test_a_prediction_at_every_placement_adds_the_all_reduce_to_the_compute():
    platform = PlatformModel(10.0, 0.0, 1.0, 1e-3)
    table = platform.placements(lambda n: 0.8 / n, 1e9, gpus_per_node=2, nodes=2)
    # n GPUs over k servers: 1 over 1, 2 over 1 or 2, 3 and 4 over 2
    assert sorted(table) == [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)]
    assert table[1, 1] == (0.8, 0.0)
    # 2 GPUs in one server: 0.4 s compute + 1 GB at 10 GB/s
    assert table[2, 1].iteration_s == pytest.approx(0.4 + 0.1)
    assert table[2, 1].latency_s == pytest.approx(0.1)
    # across 2 servers: 1 GB at 1 GB/s and 2 hops of 1 ms
    assert table[2, 2].iteration_s == pytest.approx(0.4 + 1.0 + 0.002)
    assert table[2, 1].rate == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"^compute_s must be > 0"):
        platform.predict(0.0, 1e9, 1, 1)


# ---- estimates from a compute profile ------------------------------------------------


def compute_profile(
    points: list[tuple[int, float]], links: LinkProfile | None = None, model_bytes: int = 10**8
) -> ComputeProfile:
    return ComputeProfile(
        model="resnet50", node="n", measured_at=0.0, device="cpu", iterations=20,
        points=[ComputePoint(*p) for p in points], model_bytes=model_bytes, links=links,
    )  # fmt: skip


def test_the_compute_line_goes_through_the_two_batches_and_never_below_zero():
    assert compute_line(compute_profile([(32, 0.5), (16, 0.3)])) == pytest.approx((0.1, 0.0125))
    # one point: flat; a line that would start below 0 goes through the origin instead
    assert compute_line(compute_profile([(8, 0.2)])) == (0.2, 0.0)
    t0, slope = compute_line(compute_profile([(32, 0.9), (16, 0.3)]))
    assert t0 == 0.0 and slope == pytest.approx(1.2 / 48)
    # a smaller batch measured slower (noise): flat at the mean
    assert compute_line(compute_profile([(32, 0.3), (16, 0.5)])) == pytest.approx((0.4, 0.0))


def test_a_profiled_model_is_timed_from_its_compute_line_and_measured_links():
    links = LinkProfile(
        node="n", measured_at=0.0, backend="gloo", address="127.0.0.1", shared_machine=True,
        points=[LinkPoint(int(x), t) for x, t in link_points(PlatformModel(2.0, 1e-4, 2.0, 1e-4))],
    )  # fmt: skip
    profile = compute_profile([(32, 0.5), (16, 0.3)], links=links)
    truth = TablePerf(iter_s={"resnet50": 7.0, "bert": 3.0})
    model = ComputeProfiled(truth, {"resnet50": profile}, NETWORK)
    # one GPU at batch 32: the measured 0.5 s; 4 GPUs at 64 per 16: 0.3 s + a ring
    # all-reduce of 100 MB (2 x 3/4 x 100 MB at 2 GB/s, 6 hops of 100 us)
    assert model.iteration_time("resnet50", 32, 1, 1) == pytest.approx(0.5)
    assert model.iteration_time("resnet50", 64, 4, 1) == pytest.approx(0.3 + 0.075 + 6e-4)
    # the cluster's nodes share the machine: the same loopback between them
    assert model.platform("resnet50").inter_gb_s == pytest.approx(2.0)
    # 2 accumulation steps compute two half batches and all-reduce once
    assert model.iteration_time("resnet50", 64, 1, 1, 2) == pytest.approx(1.0)
    # other models are the wrapped model's
    assert model.iteration_time("bert", 32, 4, 2) == 3.0
    # on separate machines the configured network is the link between them
    apart = platform_of(msgspec.structs.replace(links, shared_machine=False), NETWORK)
    assert apart.inter_gb_s == NETWORK.inter_node_gb_per_s
    assert platform_of(None, NETWORK) == PlatformModel.configured(NETWORK)


# ---- a real measurement ----------------------------------------------------------------


def test_a_real_measurement_between_two_local_processes_gives_positive_finite_figures():
    # the node agent's measuring process: the worker's model on the CPU, then gloo
    # all-reduces with a second process it starts
    command = [
        sys.executable, "-m", "gpusched.services.nodeagent.compute_profiling",
        "--model", "resnet50",
        "--batch-sizes", "16,8", "--iterations", "20", "--links",
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=process_limit_s(2), check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    (b1, t1), (b2, t2) = measured["points"]
    assert (b1, b2) == (16, 8) and t1 > 0 and t2 > 0
    assert measured["model_bytes"] > 0
    fitted = fit_link(measured["links"])
    assert math.isfinite(fitted.gb_per_s) and fitted.gb_per_s > 0
    assert math.isfinite(fitted.latency_s) and fitted.latency_s >= 0
    platform = PlatformModel.measured(fitted, fitted, NETWORK)
    sizes = [platform.predict(t1, nbytes, 2, 1) for nbytes in (1e3, 1e6, 1e8)]
    assert sizes[0].iteration_s < sizes[1].iteration_s < sizes[2].iteration_s
    print(
        f"loopback gloo all-reduce, 2 ranks: {fitted.gb_per_s:.2f} GB/s, "
        f"{fitted.latency_s * 1e6:.0f} us per hop (rms {fitted.rms_error_s * 1e6:.0f} us); "
        f"resnet50 stand-in: {t1 * 1e3:.1f} ms at 16, {t2 * 1e3:.1f} ms at 8, "
        f"{measured['model_bytes']} parameter bytes"
    )


# ---- live ------------------------------------------------------------------------------


async def test_a_job_of_an_unprofiled_model_has_its_node_profile_it_and_the_estimates_follow(
    nats_server: NatsServer, stores: Stores, nc, tmp_path: Path
):
    model, batch = "vgg16", 16
    cluster_ = EmulatedCluster.of(
        nats_server.url, 2, 1, work_dir=tmp_path / "work", jobs_mode="process",
        heartbeat_s=0.2, progress_s=0.2, **PROCESS_TIMINGS,
    )  # fmt: skip
    predictor_config = PredictorConfig(nats_url=nats_server.url, profile_compute=True)
    client = PredictorClient(nc, timeout_s=5.0)
    limit = process_limit_s(4)
    async with cluster_, SchedulerService(fast_scheduler(nats_server.url, policy="genie")) as sched:
        async with PredictorService(predictor_config) as predictor:
            assert await client.compute_profile(model) is None

            async def leading() -> bool:
                return sched.scheduler is not None

            await wait_until(leading, timeout_s=limit, every_s=0.05)
            assert sched.scheduler is not None
            builtin_s = sched.scheduler.estimates.iteration_time(model, batch, 1, 1)
            builtin_spread_s = sched.scheduler.estimates.iteration_time(model, batch, 2, 2)
            job = await store_job(stores, spec(model=model, batch_size=batch, iterations=3))
            await wait_state(stores, job, JobState.SUCCEEDED, timeout_s=limit)

            async def stored() -> ComputeProfile | None:
                return predictor.compute.get(model)

            profile = await wait_until(stored, timeout_s=limit, every_s=0.1)
            # a second job of a profiled model profiles nothing again
            again = await store_job(stores, spec(model=model, batch_size=batch, iterations=2))
            await wait_state(stores, again, JobState.SUCCEEDED, timeout_s=limit)
            assert predictor.compute.get(model) == profile

        assert profile.node in {agent.info.name for agent in cluster_.agents}
        assert profile.device == "cpu" and profile.iterations == 20
        assert [p.batch_size for p in profile.points] == [batch, batch // 2]
        assert profile.model_bytes > 0
        assert profile.links is not None and profile.links.shared_machine
        assert [p.nbytes for p in profile.links.points] == list(SIZES)

        # the scheduler's estimates of the model follow the published profile
        async def followed() -> bool:
            scheduler = sched.scheduler
            return scheduler is not None and isinstance(scheduler.scaled.inner, ComputeProfiled)

        await wait_until(followed, timeout_s=limit, every_s=0.1)
        assert sched.scheduler is not None
        estimates = sched.scheduler.estimates
        measured = {p.batch_size: p.iteration_s for p in profile.points}
        t0, slope = compute_line(profile)
        alone = estimates.iteration_time(model, batch, 1, 1)
        assert alone == pytest.approx(t0 + slope * batch)
        assert alone != builtin_s
        if slope > 0 and t0 > 0:  # the line through both points (unless noise bent it)
            assert alone == pytest.approx(measured[batch])
        platform = platform_of(profile.links, NETWORK)
        spread = estimates.iteration_time(model, batch, 2, 2)
        assert spread == pytest.approx(
            t0 + slope * batch / 2 + platform.allreduce_s(profile.model_bytes, 2, 2)
        )
        assert spread != builtin_spread_s
        # another model keeps the built-in estimate
        assert estimates.iteration_time("bert", 32, 1, 1) == pytest.approx(
            load_builtin()[0]["bert"].compute_s(32) * sched.scheduler.config.time_scale
        )
        fit = fit_link([(p.nbytes, p.seconds) for p in profile.links.points])
        print(
            f"{model} at {batch}: builtin {builtin_s * 1e3:.1f} ms, measured "
            f"{measured[batch] * 1e3:.2f} ms ({measured[batch // 2] * 1e3:.2f} ms at "
            f"{batch // 2}); 2 GPUs on 2 nodes {spread * 1e3:.2f} ms; links "
            f"{fit.gb_per_s:.2f} GB/s, {fit.latency_s * 1e6:.0f} us"
        )

        # a restarted predictor still has it, and answers it to whoever asks
        began = time.time()
        async with PredictorService(PredictorConfig(nats_url=nats_server.url)):
            assert await client.compute_profile(model) == profile
            assert profile.measured_at < began
            assert await client.compute_profile("bert") is None


# ---- GENIE's order and placement, by hand ----------------------------------------------

PERF = TablePerf(iter_s={"a": 1.0}, spread_penalty=2.0)


def test_genie_orders_three_deadline_jobs_by_their_waiting_allowance():
    # at 100: `long` may wait 1000 - 100 - 300 = 600 s, `short` 400 - 100 - 50 = 250 s,
    # `mid` 500 - 100 - 200 = 200 s, whatever their submission order
    jobs = [
        replace(pending("long", 300.0, submit=0.0), deadline=1000.0),
        replace(pending("short", 50.0, submit=1.0), deadline=400.0),
        replace(pending("mid", 200.0, submit=2.0), deadline=500.0),
    ]
    keys = {j.job_id: swaf_key(j, 100.0) for j in jobs}
    assert [k[1] for k in (keys["mid"], keys["short"], keys["long"])] == [200.0, 250.0, 600.0]
    assert sorted(keys, key=keys.__getitem__) == ["mid", "short", "long"]
    # one free GPU: `mid` gets it, the others wait
    decision = make_policy("genie").decide(snapshot(cluster(1, 1), PERF, jobs, now=100.0))
    assert [s.job_id for s in decision.starts] == ["mid"]


def test_genie_gives_a_deadline_job_the_cheapest_placement_that_meets_it():
    # two servers of two GPUs; one GPU of n0 is busy. A 2-GPU job fits on n0's free
    # GPU and one of n1 (twice as slow: 2 x 2 x 100 GPU-seconds) or on n1 alone (200)
    busy = running("r", 500.0, (0,))
    job = replace(pending("dl", 100.0, gpus=2), deadline=400.0)
    decision = make_policy("genie").decide(snapshot(cluster(2, 2), PERF, [job], [busy]))
    assert [(s.job_id, s.gpu_ids) for s in decision.starts] == [("dl", (2, 3))]


def test_genie_runs_a_hopeless_job_after_every_other():
    # `hopeless` came first but can no longer make its deadline (100 s of work, 50 s
    # left); `none` has no deadline, `ok` can meet its own: one free GPU goes to `ok`
    jobs = [
        replace(pending("hopeless", 100.0, submit=0.0), deadline=50.0),
        pending("none", 500.0, submit=1.0),
        replace(pending("ok", 100.0, submit=2.0), deadline=1000.0),
    ]
    keys = {j.job_id: swaf_key(j, 0.0) for j in jobs}
    assert sorted(keys, key=keys.__getitem__) == ["ok", "none", "hopeless"]
    decision = make_policy("genie").decide(snapshot(cluster(1, 1), PERF, jobs))
    assert [s.job_id for s in decision.starts] == ["ok"]
    assert "can no longer meet its deadline" in decision.why("hopeless")
    # with three free GPUs all start, the hopeless one too (after the others)
    decision = make_policy("genie").decide(snapshot(cluster(1, 3), PERF, jobs))
    assert [s.job_id for s in decision.starts] == ["ok", "none", "hopeless"]
