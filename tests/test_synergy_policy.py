"""Synergy-TUNE by hand on 2 nodes of 8 GPUs, 24 CPUs and 500 GB (fair share per GPU: 3
CPUs, 62.5 GB), and its invariants on random cluster states."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import product

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision, decision_problems
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.lifecycle import JobState
from gpusched.libs.core.perf import CpuMemDemand
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies import POLICIES, make_policy
from gpusched.services.scheduler.policies.synergy import LAS_ORDER, SynergyTune, las_key
from gpusched.services.scheduler.simulation.simulator import SimConfig, simulate
from gpusched.services.scheduler.simulation.synergy_opt import opt_jobs, synergy_opt
from tests.builders import TablePerf

FAIR_CPUS, FAIR_MEM = 3.0, 62.5


@dataclass(frozen=True)
class DemandPerf(TablePerf):
    """TablePerf with a best-case vector per model and a speed-up that is the best case's
    at or above that vector, 1.0 at or above min(best case, fair), and 0.5 below it."""

    demand: dict[str, CpuMemDemand] = field(
        default_factory=lambda: {
            "a": CpuMemDemand(6.0, 100.0, 1.5),  # wants more than fair
            "b": CpuMemDemand(1.0, 20.0, 1.0),  # needs less than fair
            "c": CpuMemDemand(4.0, 62.5, 1.2),  # CPU-hungry only
        }
    )

    def cpu_mem_demand(self, model: str) -> CpuMemDemand:
        self._check(model)
        return self.demand[model]

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        d = self.demand[model]
        eps = 1e-9
        if cpus_per_gpu >= d.cpus_per_gpu - eps and mem_gb_per_gpu >= d.mem_gb_per_gpu - eps:
            return d.speedup
        if (
            cpus_per_gpu >= min(d.cpus_per_gpu, FAIR_CPUS) - eps
            and mem_gb_per_gpu >= min(d.mem_gb_per_gpu, FAIR_MEM) - eps
        ):
            return 1.0
        return 0.5


PERF = DemandPerf(iter_s={"a": 1.0, "b": 1.0, "c": 1.0})


def synergy_cluster(nodes: int = 2) -> Cluster:
    return Cluster(
        tuple(Node(f"n{i}", 8, 40_000, cpus=24, host_mem_gb=500.0) for i in range(nodes))
    )


def queued(job_id: str, model: str = "a", gpus: int = 1, submit: float = 0.0) -> JobView:
    return JobView(job_id, submit, model, gpus, 32 * gpus, est_remaining_s=100.0, as_of=0.0)


def running(
    job_id: str,
    gpu_ids: tuple[int, ...],
    model: str = "a",
    cpus: float | None = None,
    mem_gb: float | None = None,
) -> JobView:
    g = len(gpu_ids)
    return JobView(
        job_id,
        0.0,
        model,
        g,
        32 * g,
        est_remaining_s=100.0,
        state=JobState.RUNNING,
        gpu_ids=gpu_ids,
        progress_rate=1.0,
        cpus=cpus,
        mem_gb=mem_gb,
    )


def snapshot(
    cluster: Cluster, run: tuple[JobView, ...] = (), pending: tuple[JobView, ...] = ()
) -> Snapshot:
    load = [0] * cluster.total_gpus
    mem = [0.0] * cluster.total_gpus
    for j in run:
        for g in j.gpu_ids:
            load[g] += 1
            mem[g] += PERF.gpu_memory_mb(j.model, j.batch_size / j.gpus)
    node_free = tuple(
        sum(1 for g in cluster.node_gpus(n) if load[g] == 0) for n in range(len(cluster.nodes))
    )
    return Snapshot(
        now=0.0,
        cluster=cluster,
        pending=pending,
        running=run,
        gpu_load=tuple(load),
        gpu_mem_used=tuple(mem),
        node_free=node_free,
        estimates=PERF,
    )


def decide(snap: Snapshot, policy: str = "synergy-fifo") -> Decision:
    decision = make_policy(policy).decide(snap)
    assert decision_problems(snap, decision) == []
    return decision


# ------------------------------------------------------------------ hand-computed


def test_best_case_fits_on_an_idle_cluster() -> None:
    d = decide(snapshot(synergy_cluster(), pending=(queued("j", "a", gpus=2),)))
    (start,) = d.starts
    # 2 x (6 CPUs, 100 GB), on the first node with 2 idle GPUs
    assert (start.cpus, start.mem_gb) == (12.0, 200.0)
    assert start.gpu_ids == (0, 1)
    assert d.reallocations == ()


def test_one_gpu_goes_to_the_node_with_fewest_idle_gpus() -> None:
    cl = synergy_cluster()
    busy = running("r", tuple(range(8, 14)), model="b", cpus=6.0, mem_gb=120.0)
    d = decide(snapshot(cl, (busy,), (queued("j"),)))
    (start,) = d.starts
    assert start.gpu_ids == (14,)  # node 1 has 2 idle GPUs, node 0 has 8
    assert (start.cpus, start.mem_gb) == (6.0, 100.0)


def test_falls_back_to_fair_when_the_best_case_does_not_fit() -> None:
    cl = synergy_cluster()
    left = running("r0", tuple(range(7)), cpus=21.0, mem_gb=437.5)  # at fair: 3 CPUs free
    right = running("r1", tuple(range(8, 16)), cpus=24.0, mem_gb=500.0)
    d = decide(snapshot(cl, (left, right), (queued("j"),)))
    (start,) = d.starts
    assert start.gpu_ids == (7,)
    assert (start.cpus, start.mem_gb) == (FAIR_CPUS, FAIR_MEM)
    assert d.reallocations == ()


def test_takes_the_excess_from_a_victim_which_drops_to_fair() -> None:
    cl = synergy_cluster()
    # node 0: v holds 18 CPUs on 2 GPUs (fair 6), w needs less than fair; 1 CPU free
    v = running("v", (0, 1), model="a", cpus=18.0, mem_gb=125.0)
    w = running("w", (2, 3, 4, 5, 6), model="b", cpus=5.0, mem_gb=100.0)
    full = running("r1", tuple(range(8, 16)), cpus=24.0, mem_gb=500.0)
    d = decide(snapshot(cl, (v, w, full), (queued("j"),)))
    (start,) = d.starts
    assert start.gpu_ids == (7,)
    # best case (6 CPUs) does not fit, fair (3 CPUs) neither: v gives up 12 CPUs
    assert (start.cpus, start.mem_gb) == (FAIR_CPUS, FAIR_MEM)
    (realloc,) = d.reallocations
    assert (realloc.job_id, realloc.cpus, realloc.mem_gb) == ("v", 6.0, 125.0)
    assert "fair" in realloc.reason


def test_a_job_that_needs_less_than_fair_gets_less() -> None:
    d = decide(snapshot(synergy_cluster(), pending=(queued("j", "b", gpus=4),)))
    (start,) = d.starts
    assert (start.cpus, start.mem_gb) == (4.0, 80.0)


def test_cpus_are_capped_at_the_node() -> None:
    d = decide(snapshot(synergy_cluster(), pending=(queued("j", "a", gpus=8),)))
    (start,) = d.starts
    assert (start.cpus, start.mem_gb) == (24.0, 500.0)  # 48 CPUs and 800 GB wanted


def test_a_job_wider_than_a_node_gets_the_fair_share() -> None:
    d = decide(snapshot(synergy_cluster(), pending=(queued("j", "a", gpus=12),)))
    (start,) = d.starts
    assert len(start.gpu_ids) == 12
    assert (start.cpus, start.mem_gb) == (12 * FAIR_CPUS, 12 * FAIR_MEM)


def test_backfills_past_a_job_that_does_not_fit() -> None:
    cl = synergy_cluster()
    left = running("r0", tuple(range(6)), cpus=18.0, mem_gb=375.0)
    right = running("r1", tuple(range(8, 16)), cpus=24.0, mem_gb=500.0)
    d = decide(snapshot(cl, (left, right), (queued("big", gpus=4), queued("small", submit=1.0))))
    assert [s.job_id for s in d.starts] == ["small"]
    assert d.why("big") == "needs 4 GPUs; 2 idle"  # written when asked for


def test_running_jobs_get_their_best_case_back_when_there_is_room() -> None:
    cl = synergy_cluster()
    v = running("v", (0, 1), model="a", cpus=6.0, mem_gb=125.0)
    d = decide(snapshot(cl, (v,)))
    (realloc,) = d.reallocations
    assert (realloc.cpus, realloc.mem_gb) == (12.0, 200.0)


def test_las_sorts_by_attained_service_then_most_gpus() -> None:
    a = queued("a", gpus=1)
    b = queued("b", gpus=4)
    assert sorted([a, b], key=las_key) == [b, a]
    assert make_policy("synergy-las").queue_sort == LAS_ORDER


def test_registered() -> None:
    for name in ("synergy-fifo", "synergy-srtf", "synergy-las"):
        assert name in POLICIES
        assert isinstance(make_policy(name), SynergyTune)
        assert make_policy(name).name == name


# ------------------------------------------------------------------ invariants

MODELS = ("a", "b", "c")


@st.composite
def cluster_states(draw: st.DrawFn) -> tuple[Snapshot, str]:
    """A 2-node cluster with running jobs at allocations TUNE could have given them (at
    least min(best case, fair), nodes within their CPUs and memory) and a queue."""
    cl = synergy_cluster()
    run: list[JobView] = []
    for node in range(2):
        cpus_left, mem_left = 24.0, 500.0
        gpus = list(cl.node_gpus(node))
        pos = 0
        while pos < len(gpus) and draw(st.booleans()):
            g = draw(st.integers(1, len(gpus) - pos))
            model = draw(st.sampled_from(MODELS))
            d = PERF.demand[model]
            floor_c = g * min(d.cpus_per_gpu, FAIR_CPUS)
            floor_m = g * min(d.mem_gb_per_gpu, FAIR_MEM)
            # reserve the floor of every GPU after this job so the rest can still run
            rest = len(gpus) - pos - g
            room_c = cpus_left - rest * FAIR_CPUS
            room_m = mem_left - rest * FAIR_MEM
            cpus = draw(st.floats(floor_c, max(floor_c, room_c)))
            mem = draw(st.floats(floor_m, max(floor_m, room_m)))
            cpus, mem = min(cpus, room_c), min(mem, room_m)
            if cpus < floor_c or mem < floor_m:
                break
            run.append(running(f"r{node}-{pos}", tuple(gpus[pos : pos + g]), model, cpus, mem))
            cpus_left -= cpus
            mem_left -= mem
            pos += g
    n_pending = draw(st.integers(0, 6))
    pending = tuple(
        queued(
            f"q{i}",
            draw(st.sampled_from(MODELS)),
            gpus=draw(st.sampled_from((1, 1, 2, 4, 8, 12))),
            submit=float(i),
        )
        for i in range(n_pending)
    )
    policy = draw(st.sampled_from(("synergy-fifo", "synergy-srtf", "synergy-las")))
    return snapshot(cl, tuple(run), pending), policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_states())
def test_tune_keeps_nodes_within_their_cpus_and_memory_and_everyone_at_least_fair(
    case: tuple[Snapshot, str],
) -> None:
    snap, name = case
    decision = make_policy(name).decide(snap)
    assert decision_problems(snap, decision) == []
    cl = snap.cluster
    jobs = {j.job_id: j for j in (*snap.running, *snap.pending)}
    alloc = {j.job_id: (j.cpus or 0.0, j.mem_gb or 0.0, j.gpu_ids) for j in snap.running}
    for r in decision.reallocations:
        assert jobs[r.job_id].running
        alloc[r.job_id] = (r.cpus, r.mem_gb, jobs[r.job_id].gpu_ids)
    for s in decision.starts:
        j = jobs[s.job_id]
        assert not j.running
        # all or nothing: every GPU it needs, each idle before and taken once
        assert len(set(s.gpu_ids)) == j.gpus
        assert all(snap.gpu_load[g] == 0 for g in s.gpu_ids)
        assert s.cpus is not None and s.mem_gb is not None
        alloc[s.job_id] = (s.cpus, s.mem_gb, s.gpu_ids)
    started = [g for s in decision.starts for g in s.gpu_ids]
    assert len(started) == len(set(started))
    used_c = [0.0] * len(cl.nodes)
    used_m = [0.0] * len(cl.nodes)
    for job_id, (cpus, mem, gpu_ids) in alloc.items():
        j = jobs[job_id]
        for g in gpu_ids:
            used_c[cl.gpu_node[g]] += cpus / len(gpu_ids)
            used_m[cl.gpu_node[g]] += mem / len(gpu_ids)
        speedup = PERF.cpu_mem_speedup(j.model, j.gpus, cpus / j.gpus, mem / j.gpus)
        assert speedup >= 1.0, (job_id, cpus, mem)
    for n, node in enumerate(cl.nodes):
        assert used_c[n] <= node.cpus + 1e-6
        assert used_m[n] <= node.host_mem_gb + 1e-6
    for job in snap.pending:
        if job.job_id not in {s.job_id for s in decision.starts}:
            assert decision.why(job.job_id)


# ------------------------------------------------------------------ OPT


def test_opt_matches_brute_force_on_a_tiny_instance() -> None:
    cpu_axis, mem_axis = (1.0, 3.0, 6.0), (20.0, 62.5, 100.0)
    jobs = opt_jobs(
        PERF, [("x", "a", 1), ("y", "a", 2), ("z", "b", 1), ("w", "c", 1)], cpu_axis, mem_axis
    )
    total_cpus, total_mem = 20.0, 400.0
    best = -1.0
    for choice in product(*(sorted(j.throughput) for j in jobs)):
        cpus = sum(c * j.gpus for (c, _), j in zip(choice, jobs, strict=True))
        mem = sum(m * j.gpus for (_, m), j in zip(choice, jobs, strict=True))
        gains = [j.throughput[cell] for cell, j in zip(choice, jobs, strict=True)]
        if cpus <= total_cpus and mem <= total_mem and min(gains) >= 1.0:
            best = max(best, sum(gains))
    result = synergy_opt(jobs, total_cpus, total_mem)
    assert result.total_throughput == pytest.approx(best)
    # the cells it chose fit and give that total
    assert sum(c * j.gpus for j in jobs for c in [result.cells[j.job_id][0]]) <= total_cpus
    assert sum(j.throughput[result.cells[j.job_id]] for j in jobs) == pytest.approx(best)


def test_opt_refuses_when_fair_shares_do_not_fit() -> None:
    jobs = opt_jobs(PERF, [("x", "a", 1)], (1.0, 3.0), (62.5,))
    with pytest.raises(ValueError):
        synergy_opt(jobs, 2.0, 100.0)


# ------------------------------------------------------------------ kept records


class AgainstFresh:
    """A policy kept across a simulation's decisions, each checked against the decision
    of a new policy object (which remembers nothing) on the same snapshot."""

    def __init__(self, kept: SynergyTune) -> None:
        self.kept = kept
        self.decisions = self.drops = self.raises = 0

    def __getattr__(self, attr: str) -> object:
        return getattr(self.kept, attr)  # name, preemptive, queue_sort

    def decide(self, snap: Snapshot) -> Decision:
        got = self.kept.decide(snap)
        want = make_policy(self.kept.name).decide(snap)
        assert got.starts == want.starts
        assert got.reallocations == want.reallocations
        assert dict(got.reasons) == dict(want.reasons)
        self.decisions += 1
        self.drops += sum(1 for r in got.reallocations if "fair" in r.reason)
        self.raises += sum(1 for r in got.reallocations if "best" in r.reason)
        return got


def synergy_trace(rows: list[tuple[float, int, str, int]]) -> list[JobSpec]:
    return [
        JobSpec(f"j{i}", submit, model, gpus, 32 * gpus, iterations)
        for i, (submit, gpus, model, iterations) in enumerate(rows)
    ]


def test_a_policy_kept_across_a_busy_run_decides_every_time_as_a_fresh_one() -> None:
    """Kept records of running jobs (reused while a job's view is the same object) give
    the decisions a new policy gives; the run takes from victims and raises jobs back."""
    rng = random.Random(3)
    rows = [
        (60.0 * i, rng.choice((1, 1, 2, 4, 8, 12)), rng.choice(MODELS), rng.randint(200, 4000))
        for i in range(80)
    ]
    policy = AgainstFresh(SynergyTune())
    result = simulate(
        synergy_cluster(), synergy_trace(rows), policy, PERF, config=SimConfig(round_s=300)
    )
    assert all(j.finish_time is not None for j in result.jobs)
    assert policy.drops > 0 and policy.raises > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.floats(0, 2000, allow_nan=False),
            st.sampled_from((1, 1, 2, 4, 8, 12)),
            st.sampled_from(MODELS),
            st.integers(50, 3000),
        ),
        min_size=1,
        max_size=25,
    ),
    name=st.sampled_from(("synergy-fifo", "synergy-srtf", "synergy-las")),
    round_s=st.sampled_from((None, 120.0)),
)
def test_kept_records_change_no_decision(
    rows: list[tuple[float, int, str, int]], name: str, round_s: float | None
) -> None:
    policy = AgainstFresh(make_policy(name))  # type: ignore[arg-type]
    simulate(
        synergy_cluster(), synergy_trace(rows), policy, PERF, config=SimConfig(round_s=round_s)
    )
    assert policy.decisions > 0
