"""CPU/memory-aware allocation in the simulator: what a job's allocation does to its
speed, reallocations between rounds, the binary speed model, the check that keeps every
node within its CPUs and memory, and the simulate options that set it up."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from click.testing import Result
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision, Reallocate, Start, decision_problems
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import CpuMemDemand, demand_on_node
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.cli.main import app
from gpusched.services.scheduler.policies.base import Capabilities
from gpusched.services.scheduler.simulation.runner import build_cluster
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from tests.builders import TablePerf, pending, running, snapshot

TRUTH = load_performance_model(None)
#: a model the built-in profiles call CPU/memory sensitive
SENSITIVE = "resnet18"


def synergy_cluster(nodes: int = 1) -> Cluster:
    """Synergy's servers: 8 GPUs, 24 CPUs and 500 GB, so 3 CPUs and 62.5 GB a GPU."""
    return Cluster(tuple(Node(f"s{i}", 8, cpus=24, host_mem_gb=500.0) for i in range(nodes)))


def one_job(gpus: int = 1, model: str = SENSITIVE, iterations: float = 1000.0) -> JobSpec:
    return JobSpec("j", 0.0, model, gpus, TRUTH.default_batch_size(model), iterations)


@dataclass
class Allocating:
    """Starts every pending job on the first free GPUs with ``cpus`` and ``mem_gb``; at a
    decision after ``realloc_after`` it gives running jobs ``realloc`` instead."""

    cpus: float | None = None
    mem_gb: float | None = None
    realloc_after: float | None = None
    realloc: tuple[float, float] = (6.0, 62.5)
    name: str = "allocating"
    preemptive: bool = False
    queue_sort: None = None
    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        free = [g for g, load in enumerate(snap.gpu_load) if load == 0]
        starts = []
        for view in snap.pending:
            if len(free) >= view.gpus:
                gpus, free = tuple(free[: view.gpus]), free[view.gpus :]
                starts.append(Start(view.job_id, gpus, cpus=self.cpus, mem_gb=self.mem_gb))
        reallocations = ()
        if self.realloc_after is not None and snap.now > self.realloc_after:
            reallocations = tuple(
                Reallocate(v.job_id, *self.realloc) for v in snap.running if v.cpus is None
            )
        return Decision(starts=tuple(starts), reallocations=reallocations)


def finish_time(policy: Allocating, job: JobSpec, config: SimConfig | None = None) -> float:
    result = simulate(synergy_cluster(), [job], policy, TRUTH, config=config)
    (outcome,) = result.jobs
    assert outcome.finish_time is not None
    return outcome.finish_time


def test_a_job_given_twice_the_fair_cpus_of_a_sensitive_model_runs_faster_by_the_truths_speedup():
    speedup = TRUTH.cpu_mem_speedup(SENSITIVE, 1, 6.0, 62.5)
    assert speedup > 1.0
    fair = finish_time(Allocating(), one_job())
    doubled = finish_time(Allocating(cpus=6.0, mem_gb=62.5), one_job())
    assert fair / doubled == pytest.approx(speedup, rel=1e-12)


def test_a_job_given_exactly_its_proportional_share_runs_as_one_given_none():
    assert finish_time(Allocating(cpus=3.0, mem_gb=62.5), one_job()) == finish_time(
        Allocating(), one_job()
    )


def test_a_reallocation_changes_the_speed_from_that_instant():
    alone = finish_time(Allocating(), one_job())
    round_s = alone / 4
    speedup = TRUTH.cpu_mem_speedup(SENSITIVE, 1, 6.0, 62.5)
    policy = Allocating(realloc_after=0.0)
    finished = finish_time(policy, one_job(), SimConfig(round_s=round_s))
    # a quarter of the work at the fair share, the rest sped up from the first round on
    assert finished == pytest.approx(round_s + (alone - round_s) / speedup, rel=1e-9)


def test_rounds_call_the_policy_without_events_and_stop_when_every_job_is_done():
    calls: list[float] = []

    @dataclass
    class Counting(Allocating):
        def decide(self, snap: Snapshot) -> Decision:
            calls.append(snap.now)
            return super().decide(snap)

    alone = finish_time(Allocating(), one_job())
    finish_time(Counting(), one_job(), SimConfig(round_s=alone / 10))
    assert len(calls) == 10  # at 0 (the arrival), then a round while it runs, 9 more
    assert calls == sorted(calls)


# ------------------------------------------------------------------ binary speed model


BINARY = load_performance_model(None, speed_model="binary")


@pytest.mark.parametrize("model", ["resnet18", "resnet50", "bert"])
def test_binary_mode_gives_the_best_case_speedup_only_at_the_full_vector(model: str):
    best = BINARY.cpu_mem_demand(model)
    assert BINARY.cpu_mem_speedup(model, 1, best.cpus_per_gpu, best.mem_gb_per_gpu) == (
        best.speedup
    )
    assert BINARY.cpu_mem_speedup(model, 1, 24.0, 500.0) == best.speedup
    assert BINARY.cpu_mem_speedup(model, 1, best.cpus_per_gpu - 0.5, 500.0) in (1.0, best.speedup)
    if best.cpus_per_gpu > 3.0:
        assert BINARY.cpu_mem_speedup(model, 1, best.cpus_per_gpu - 0.5, 500.0) == 1.0
    if best.mem_gb_per_gpu > 62.5:
        assert BINARY.cpu_mem_speedup(model, 1, 24.0, best.mem_gb_per_gpu - 1) == 1.0
    assert BINARY.cpu_mem_speedup(model, 1, 3.0, 62.5) == 1.0


def test_a_multi_gpu_demand_beyond_a_server_is_capped_and_its_speedup_scaled():
    demand = CpuMemDemand(9.0, 62.5, 2.4)
    assert demand_on_node(demand, 2, 24, 8, 3.0, 62.5) == demand  # 18 CPUs fit
    capped = demand_on_node(demand, 4, 24, 8, 3.0, 62.5)  # 36 CPUs do not
    assert capped.cpus_per_gpu == 6.0
    assert capped.speedup == pytest.approx(1 + 1.4 * (24 - 12) / (36 - 12))
    assert demand_on_node(demand, 16, 24, 8, 3.0, 62.5) == CpuMemDemand(3.0, 62.5, 1.0)
    best4 = BINARY.cpu_mem_demand("resnet18")
    four = demand_on_node(best4, 4, 24, 8, 3.0, 62.5)
    assert BINARY.cpu_mem_speedup("resnet18", 4, four.cpus_per_gpu, 125.0) == four.speedup
    assert BINARY.cpu_mem_speedup("resnet18", 16, 24.0, 500.0) == 1.0


def test_binary_mode_in_the_simulator_speeds_a_job_only_with_its_whole_vector():
    best = BINARY.cpu_mem_demand(SENSITIVE)
    job = one_job()

    def run(cpus: float, mem: float) -> float:
        result = simulate(synergy_cluster(), [job], Allocating(cpus=cpus, mem_gb=mem), BINARY)
        finished = result.jobs[0].finish_time
        assert finished is not None
        return finished

    fair = run(3.0, 62.5)
    assert fair / run(best.cpus_per_gpu, best.mem_gb_per_gpu) == pytest.approx(best.speedup)
    assert run(best.cpus_per_gpu, 62.5) == fair


# ------------------------------------------------------------------ the decision check

PERF = TablePerf(mem_mb={"a": 1000.0}, iter_s={"a": 1.0})


def small_node_snapshot() -> Snapshot:
    """One node of 4 GPUs, 12 CPUs and 100 GB (3 CPUs, 25 GB a GPU): r0 on GPU 0 holds
    6 CPUs and 25 GB; p and q wait."""
    node = Cluster((Node("box", 4, 10_000, cpus=12, host_mem_gb=100.0),))
    r0 = replace(running("r0", 10, (0,)), cpus=6.0, mem_gb=25.0)
    return snapshot(
        node, PERF, pending_jobs=[pending("p", 10), pending("q", 10)], running_jobs=[r0]
    )


def check(snap: Snapshot, **actions: tuple) -> list[str]:
    return decision_problems(snap, Decision(**actions))


def test_a_start_beyond_a_nodes_cpus_is_refused_naming_the_node():
    snap = small_node_snapshot()
    assert check(snap, starts=(Start("p", (1,), cpus=6.0),)) == []
    assert check(snap, starts=(Start("p", (1,), cpus=7.0),)) == [
        "gave p CPUs beyond node box's: 13 > 12"
    ]
    # the proportional share of a third GPU no longer fits beside 6 + 3 CPUs
    assert check(snap, starts=(Start("p", (1,), cpus=6.0), Start("q", (2,)))) == [
        "gave q CPUs beyond node box's: 15 > 12"
    ]


def test_a_start_beyond_a_nodes_memory_is_refused_naming_the_node():
    snap = small_node_snapshot()
    assert check(snap, starts=(Start("p", (1,), mem_gb=76.0),)) == [
        "gave p host memory beyond node box's: 101 GB > 100 GB"
    ]


def test_negative_or_non_finite_allocations_are_refused():
    snap = small_node_snapshot()
    assert check(snap, starts=(Start("p", (1,), cpus=-1.0),)) == ["gave p -1.0 CPUs"]
    assert check(snap, reallocations=(Reallocate("r0", 1.0, math.inf),)) == [
        "gave r0 inf GB of host memory"
    ]


def test_a_reallocation_of_a_job_not_running_is_refused():
    snap = small_node_snapshot()
    assert check(snap, reallocations=(Reallocate("p", 3.0, 25.0),)) == [
        "reallocated p, which is not running"
    ]
    assert check(snap, reallocations=(Reallocate("ghost", 3.0, 25.0),)) == [
        "reallocated ghost, which is not running"
    ]


def test_a_reallocation_within_the_node_passes_and_one_beyond_it_is_refused():
    snap = small_node_snapshot()
    assert check(snap, reallocations=(Reallocate("r0", 12.0, 100.0),)) == []
    # reallocations that fit are taken before the starts: here the start finds no room
    assert check(
        snap, starts=(Start("p", (1,)),), reallocations=(Reallocate("r0", 12.0, 25.0),)
    ) == ["gave p CPUs beyond node box's: 15 > 12"]


def test_a_victim_dropping_to_its_share_makes_room_for_a_start_in_the_same_decision():
    snap = small_node_snapshot()
    assert check(snap, reallocations=(Reallocate("r0", 12.0, 100.0),)) == []
    # with r0 already at 12 CPUs and 100 GB (all of the node), p fits only once r0 gives
    # some back
    node = Cluster((Node("box", 4, 10_000, cpus=12, host_mem_gb=100.0),))
    r0 = replace(running("r0", 10, (0,)), cpus=12.0, mem_gb=100.0)
    crowded = snapshot(node, PERF, pending_jobs=[pending("p", 10)], running_jobs=[r0])
    assert check(crowded, starts=(Start("p", (1,)),)) != []
    assert check(
        crowded, starts=(Start("p", (1,)),), reallocations=(Reallocate("r0", 6.0, 25.0),)
    ) == []


def test_jobs_sharing_a_gpu_without_an_allocation_count_its_share_once():
    node = Cluster((Node("box", 2, 10_000, cpus=6, host_mem_gb=50.0),))
    snap = snapshot(node, PERF, pending_jobs=[pending("p", 10)],
                    running_jobs=[running("r0", 10, (0,)), running("r1", 10, (0,))])  # fmt: skip
    assert check(snap, starts=(Start("p", (1,), cpus=3.0),)) == []
    assert check(snap, starts=(Start("p", (1,), cpus=3.5),)) == [
        "gave p CPUs beyond node box's: 6.5 > 6"
    ]


# ------------------------------------------------------------------ the invariant


@dataclass
class RandomAllocations:
    """Proposes random starts and reallocations, some beyond what nodes hold, and keeps
    each only where the check passes it (as a careful policy would)."""

    seed: int
    name: str = "random-allocations"
    preemptive: bool = False
    queue_sort: None = None
    capabilities = Capabilities()
    seen: list[Snapshot] = field(default_factory=list)

    def decide(self, snap: Snapshot) -> Decision:
        self.seen.append(snap)
        rng = random.Random(f"{self.seed}/{snap.now}")
        free = [g for g, load in enumerate(snap.gpu_load) if load == 0]
        kept = Decision()
        candidates: list[Start | Reallocate] = []
        for view in snap.pending:
            rng.shuffle(free)
            if len(free) >= view.gpus:
                allocation = [rng.choice([None, rng.uniform(0, 40)]) for _ in range(2)]
                candidates.append(Start(view.job_id, tuple(free[: view.gpus]), 1, (), *allocation))
        for view in snap.running:
            candidates.append(Reallocate(view.job_id, rng.uniform(0, 40), rng.uniform(0, 600)))
        for candidate in candidates:
            if isinstance(candidate, Start):
                # the proportional share is the fallback, so every job gets to run
                fair = replace(candidate, cpus=None, mem_gb=None)
                trials = [
                    Decision(starts=(*kept.starts, c), reallocations=kept.reallocations)
                    for c in (candidate, fair)
                ]
            else:
                reallocations = (*kept.reallocations, candidate)
                trials = [Decision(starts=kept.starts, reallocations=reallocations)]
            for trial in trials:
                if not decision_problems(snap, trial, TRUTH):
                    kept = trial
                    break
        return kept


def recomputed_use(snap: Snapshot) -> tuple[list[float], list[float]]:
    """Per-node CPUs and memory summed from the running jobs, naively."""
    cl = snap.cluster
    cpus, mem = [0.0] * len(cl.nodes), [0.0] * len(cl.nodes)
    share_gpus: set[int] = set()
    for view in snap.running:
        if view.cpus is None and view.mem_gb is None:
            share_gpus.update(view.gpu_ids)
            continue
        for gpu in view.gpu_ids:
            node = cl.nodes[cl.gpu_node[gpu]]
            cpus[cl.gpu_node[gpu]] += (
                node.fair_cpus_per_gpu if view.cpus is None else view.cpus / view.gpus
            )
            mem[cl.gpu_node[gpu]] += (
                node.fair_mem_gb_per_gpu if view.mem_gb is None else view.mem_gb / view.gpus
            )
    for gpu in share_gpus:
        node = cl.nodes[cl.gpu_node[gpu]]
        cpus[cl.gpu_node[gpu]] += node.fair_cpus_per_gpu
        mem[cl.gpu_node[gpu]] += node.fair_mem_gb_per_gpu
    return cpus, mem


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.sampled_from([1, 1, 2, 4, 8, 12]), min_size=1, max_size=12),
    models=st.lists(st.sampled_from(["resnet18", "resnet50", "bert", "dqn"]), min_size=1),
    round_s=st.sampled_from([None, 50.0, 300.0]),
)
def test_the_simulator_never_lets_a_node_exceed_its_cpus_or_memory(
    seed: int, sizes: list[int], models: list[str], round_s: float | None
):
    jobs = [
        JobSpec(f"j{i}", 30.0 * i, models[i % len(models)], gpus,
                TRUTH.default_batch_size(models[i % len(models)]), 2000.0 * (1 + i % 3))
        for i, gpus in enumerate(sizes)
    ]  # fmt: skip
    policy = RandomAllocations(seed)
    result = simulate(synergy_cluster(2), jobs, policy, TRUTH, config=SimConfig(round_s=round_s))
    assert all(j.finish_time is not None for j in result.jobs)
    for snap in policy.seen:
        cpus, mem = recomputed_use(snap)
        # the flag lets the check skip counting CPUs and memory: it must never be wrong
        assert snap.own_allocations == any(
            v.cpus is not None or v.mem_gb is not None for v in snap.running
        )
        assert snap.node_cpus_used == pytest.approx(cpus, abs=1e-6)
        assert snap.node_mem_used == pytest.approx(mem, abs=1e-6)
        for node, used_cpus, used_mem in zip(snap.cluster.nodes, cpus, mem, strict=True):
            assert used_cpus <= node.cpus + 1e-6
            assert used_mem <= node.host_mem_gb + 1e-6


# ------------------------------------------------------------------ Synergy's own models

DATA_DIR = Path(__file__).parents[2] / "shared" / "data"
SYNERGY_MODELS = ("alexnet", "deepspeech", "gnmt", "lstm", "m5", "mobilenet", "res18", "res50",
                  "shufflenet", "vae")  # fmt: skip


def test_with_the_data_dir_the_simulator_knows_synergys_models_by_their_own_names():
    if not (DATA_DIR / "profiles" / "synergy" / "models.json").is_file():
        pytest.skip(f"research data not found at {DATA_DIR}")
    truth = load_performance_model(DATA_DIR)
    assert set(SYNERGY_MODELS) <= set(truth.models())
    assert not set(SYNERGY_MODELS) & set(TRUTH.models())
    res18 = truth.cpu_mem_demand("res18")
    assert (res18.cpus_per_gpu, res18.mem_gb_per_gpu, res18.speedup) == (9.0, 62.5, 2.4)
    assert truth.cpu_mem_speedup("res18", 1, 9.0, 62.5) == pytest.approx(2.4, rel=0.01)
    # its iteration time at the fair share, as Synergy measured it
    assert truth.iteration_time("res18", 512, 1, 1) == pytest.approx(0.64)


def test_every_builtin_model_has_a_cpu_memory_sensitivity_of_the_projects_own():
    for model in TRUTH.models():
        demand = TRUTH.cpu_mem_demand(model)
        assert demand.speedup >= 1.0
        speedup = TRUTH.cpu_mem_speedup(model, 1, demand.cpus_per_gpu, demand.mem_gb_per_gpu)
        assert speedup == pytest.approx(demand.speedup)
    assert TRUTH.cpu_mem_demand(SENSITIVE).speedup > 1.0


# ------------------------------------------------------------------ simulate's options

runner = CliRunner()


def simulate_cli(tmp_path: Path, *options: str) -> Result:
    return runner.invoke(
        app, ["simulate", "--synthetic", "4", "--cluster", "2x8", "-p", "fifo",
              "--out", str(tmp_path / "out"), *options],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (("--cpus-per-node", "0"), "--cpus-per-node"),
        (("--cpus-per-node", "-3"), "--cpus-per-node"),
        (("--mem-gb-per-node", "0"), "--mem-gb-per-node"),
        (("--mem-gb-per-node", "-1.5"), "--mem-gb-per-node"),
        (("--round-s", "0"), "--round-s"),
        (("--round-s", "-300"), "--round-s"),
    ],
)
def test_a_bad_cpu_memory_or_round_option_is_a_one_line_error_naming_it(
    tmp_path: Path, options: tuple[str, ...], named: str
):
    result = simulate_cli(tmp_path, *options)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {named}")
    assert not (tmp_path / "out").exists()


def test_an_unknown_speed_model_is_refused_naming_the_option(tmp_path: Path):
    result = simulate_cli(tmp_path, "--speed-model", "fancy")
    assert result.exit_code == 2
    assert "--speed-model" in result.output


def test_the_summary_records_the_cpu_memory_and_round_settings(tmp_path: Path):
    result = simulate_cli(tmp_path, "--cpus-per-node", "24", "--mem-gb-per-node", "500",
                          "--speed-model", "binary", "--round-s", "300")  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"] == {
        "cpus_per_node": 24,
        "mem_gb_per_node": 500.0,
        "speed_model": "binary",
        "round_s": 300.0,
    }
    assert summary["policies"]["fifo"]["finished"] == 4


def test_without_the_options_the_summary_records_the_defaults(tmp_path: Path):
    result = simulate_cli(tmp_path)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"] == {
        "cpus_per_node": None,
        "mem_gb_per_node": None,
        "speed_model": "grid",
        "round_s": None,
    }


def test_the_node_options_set_every_nodes_cpus_and_memory():
    cluster = build_cluster("2x8", None, 24, 500.0)
    assert {(n.cpus, n.host_mem_gb) for n in cluster.nodes} == {(24, 500.0)}
    assert cluster.nodes[0].fair_cpus_per_gpu == 3.0
    assert cluster.nodes[0].fair_mem_gb_per_gpu == 62.5
