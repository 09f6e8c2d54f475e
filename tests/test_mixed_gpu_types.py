"""Clusters of several GPU types: the --cluster groups and their errors, each model's
speed per type from its three sources (hand-computed), placement and the decision check
keeping a job on one type, and the simulator's times and GPU-hours per type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.cluster_file import cluster_document, cluster_from_document
from gpusched.libs.core.decision import Decision, Start, decision_problems
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.placement import (
    FREE,
    ContiguousGpus,
    FreeGpus,
    unschedulable_reason,
)
from gpusched.libs.core.profiles.measured import shipped_gpu_profiles
from gpusched.libs.core.snapshot import Snapshot
from gpusched.libs.core.type_speed import GAVEL, MEASURED, OURS, UNKNOWN, TypeSpeeds
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.simulation.runner import InputError, build_cluster
from gpusched.services.scheduler.simulation.simulator import simulate
from tests.builders import TablePerf, job, pending

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"
GAVEL_FILE = DATA_DIR / "profiles" / "gavel" / "simulation_throughputs.json"
PERF = TablePerf(iter_s={"a": 1.0}, mem_mb={"a": 1000.0})
BUILTIN = load_performance_model(None)


# ---- the --cluster spec ----------------------------------------------------------------


def test_a_spec_of_groups_gives_nodes_of_each_type_in_order() -> None:
    cluster = build_cluster("8x4:V100,8x4:P100,16x4:K80", None)
    assert cluster.total_gpus == 128
    assert cluster.gpu_types == ("v100", "p100", "k80")
    assert cluster.type_gpus == (32, 32, 64)
    assert cluster.mixed
    assert [n.name for n in cluster.nodes[7:9]] == ["node0007", "node0008"]
    assert cluster.nodes[8].gpu_model == "P100" and cluster.nodes[31].gpu_model == "K80"
    assert cluster.gpu_type[31] == 0 and cluster.gpu_type[32] == 1 and cluster.gpu_type[127] == 2


def test_a_plain_spec_is_one_generic_type_as_before() -> None:
    cluster = build_cluster("64x8", None)
    assert cluster == Cluster.uniform(64, 8)
    assert cluster.gpu_types == ("generic",) and not cluster.mixed


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("8x4:X100,8x4:K80", "unknown GPU type 'X100'"),
        ("8x4:V100,0x4:K80", "'0x4:K80': a group needs nodes >= 1"),
        ("8x4:V100,,8x4:K80", "an empty group"),
        ("8x4:V100,", "an empty group"),
        ("8x4:V100,8:K80", "'8:K80' is not NODESxGPUS"),
        ("8x4:", "unknown GPU type ''"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_group_and_the_option(spec: str, said: str) -> None:
    with pytest.raises(InputError, match="--cluster") as caught:
        build_cluster(spec, None)
    assert said in str(caught.value)


def test_the_command_line_refuses_an_unknown_gpu_type_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["simulate", "--trace", "synthetic:5", "--cluster", "2x4:V100,2x4:Z9",
         "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Z9" in lines[0] and "--cluster" in lines[0], result.output


def test_a_cluster_file_with_a_gpu_type_per_node_is_a_mixed_cluster() -> None:
    cluster = build_cluster("1x4:V100,2x2:K80", None)
    again = cluster_from_document(json.loads(json.dumps(cluster_document(cluster))))
    assert again == cluster and again.gpu_types == ("v100", "k80")


# ---- speed per type --------------------------------------------------------------------


def test_our_relative_speed_is_used_where_nothing_measured_the_pair() -> None:
    # V100 first: the reference; K80 at our 0.3, P100 at our 0.9 of a V100-class GPU
    speeds = TypeSpeeds(build_cluster("1x4:V100,1x4:K80,1x4:P100", None), BUILTIN, [])
    assert speeds.speed("resnet50", 32, 0) == 1.0
    assert speeds.speed("resnet50", 32, 1) == pytest.approx(0.3)
    assert speeds.speed("resnet50", 32, 2) == pytest.approx(0.9)
    assert speeds.source("resnet50", 32, 1) == OURS
    # K80 first: a V100 runs 1 / 0.3 times as fast as the reference
    flipped = TypeSpeeds(build_cluster("1x4:K80,1x4:V100", None), BUILTIN, [])
    assert flipped.speed("bert", 8, 1) == pytest.approx(1 / 0.3)


def test_a_type_of_no_known_family_runs_at_the_reference_speed_and_is_named() -> None:
    nodes = (Node("a", 2, gpu_model="V100"), Node("b", 2, gpu_model="G2"))
    speeds = TypeSpeeds(Cluster(nodes), BUILTIN, [])
    assert speeds.speed("resnet50", 32, 1) == 1.0
    assert speeds.source("resnet50", 32, 1) == UNKNOWN
    assert speeds.unknown() == ["g2"]


def test_a_measured_profile_gives_the_speed_of_the_models_it_measured() -> None:
    (h100,) = [p for p in shipped_gpu_profiles() if p.gpu_type.startswith("h100")]
    point = next(p for p in h100.models["resnet50"].points if p.batch_size == 64)
    speeds = TypeSpeeds(build_cluster("1x4:V100,1x4:H100", None), BUILTIN, [h100])
    # the analytic one-GPU time at 64 (the V100-class reference) over the measured one
    expected = BUILTIN.iteration_time("resnet50", 64, 1, 1) / point.iteration_s
    assert speeds.speed("resnet50", 64, 1) == pytest.approx(expected)
    assert speeds.source("resnet50", 64, 1) == MEASURED
    # a model it did not measure: our own H100 figure
    assert "yolov3" not in h100.models
    assert speeds.speed("yolov3", 8, 1) == pytest.approx(3.5)


@pytest.mark.skipif(not GAVEL_FILE.is_file(), reason="research data not available")
def test_gavel_gives_the_speed_of_a_model_with_a_gavel_job_type() -> None:
    truth = load_performance_model(DATA_DIR)
    assert truth.profile("resnet50").gavel_type == "ResNet-50"
    table = json.loads(GAVEL_FILE.read_text())
    key = "('ResNet-50 (batch size 64)', 1)"
    k80, p100, v100 = (table[gpu][key]["null"] for gpu in ("k80", "p100", "v100"))
    speeds = TypeSpeeds(build_cluster("1x4:P100,1x4:K80,1x4:V100", None), truth, [])
    # P100 is the reference: K80 at k80/p100 steps per second, V100 at v100/p100
    assert speeds.speed("resnet50", 64, 1) == pytest.approx(k80 / p100)
    assert speeds.speed("resnet50", 64, 2) == pytest.approx(v100 / p100)
    assert speeds.source("resnet50", 64, 1) == GAVEL
    # Gavel measured 16..128 for ResNet-50: a sub-batch of 50 takes the nearest, 64
    assert speeds.speed("resnet50", 50, 1) == pytest.approx(k80 / p100)


# ---- placement and the decision check -------------------------------------------------


def test_a_job_spread_over_nodes_takes_nodes_of_one_type() -> None:
    # V100: one node of 2; K80: two nodes of 2. Three GPUs fit the K80s only
    cluster = build_cluster("1x2:V100,2x2:K80", None)
    free = FreeGpus(Snapshot.of_idle_cluster(cluster, PERF))
    assert free.take(3) == [2, 3, 4]
    assert free.take(2) == [0, 1]  # best fit: the V100 node holds it alone
    assert free.total == 1 and free.take(1) == [5]


def test_a_job_larger_than_every_type_is_not_placed_though_enough_gpus_are_idle() -> None:
    cluster = build_cluster("2x2:V100,2x2:K80", None)
    snapshot = Snapshot.of_idle_cluster(cluster, PERF)
    assert FreeGpus(snapshot).take(5) is None
    reason = unschedulable_reason(pending("big", 100.0, gpus=5), snapshot)
    assert reason == (
        "unschedulable: needs 5 GPUs of one type; the most of one type are 4 (v100)"
    )


def test_a_contiguous_block_never_crosses_from_one_type_to_the_next() -> None:
    cluster = build_cluster("1x4:V100,1x4:K80", None)
    owner = np.full(8, FREE, dtype=np.int64)
    owner[[0, 1, 6, 7]] = 0  # free: GPUs 2, 3 (V100) and 4, 5 (K80), one run of 4
    line = ContiguousGpus(cluster, owner)
    assert line.best_block(2) in (2, 4)
    assert line.best_block(3) is None
    assert line.best_block(4) is None


def test_the_decision_check_refuses_a_start_on_gpus_of_two_types() -> None:
    cluster = build_cluster("1x2:V100,1x2:K80", None)
    snapshot = Snapshot.of_idle_cluster(cluster, PERF, (pending("j", 10.0, gpus=2),))
    assert decision_problems(snapshot, Decision(starts=(Start("j", (0, 1)),))) == []
    problems = decision_problems(snapshot, Decision(starts=(Start("j", (1, 2)),)))
    assert problems == [
        "gave j GPUs (1, 2) of several types (v100, k80); a job runs on GPUs of one type"
    ]


# ---- the simulator ---------------------------------------------------------------------


def test_a_job_on_a_slower_type_takes_longer_by_its_speed_and_each_type_counts_its_hours() -> (
    None
):
    # one V100 (the reference) and one K80 at our 0.3: two one-GPU jobs of 100 iterations
    # of 1 s each arrive together; fifo gives j1 the first idle GPU, j2 the K80
    cluster = build_cluster("1x1:V100,1x1:K80", None)
    jobs = [job("j1", 0.0, 100), job("j2", 0.0, 100)]
    result = simulate(cluster, jobs, make_policy("fifo"), PERF)
    by_id = {o.job_id: o for o in result.jobs}
    assert by_id["j1"].jct_s == pytest.approx(100.0)
    assert by_id["j2"].jct_s == pytest.approx(100 / 0.3)
    assert result.gpu_hours_by_type == pytest.approx({"v100": 100 / 3600, "k80": 100 / 0.3 / 3600})
    assert result.summary()["gpu_hours_by_type"] == result.gpu_hours_by_type
