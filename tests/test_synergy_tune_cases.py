"""Synergy-TUNE on worked examples from DESIGN.md section 5 (Synergy), each computed by
hand in its docstring and checked against ``synergy-fifo`` to the last CPU and GB.

Every cluster is made of Synergy's servers: 8 GPUs, 24 CPUs and 500 GB each, so the fair
share of one GPU is 24/8 = 3 CPUs and 500/8 = 62.5 GB. Node 0 holds GPUs 0-7, node 1
GPUs 8-15. Best-case vectors are per GPU:

| model | CPUs | GB    | speed-up | against the fair share          |
|-------|------|-------|----------|---------------------------------|
| both  | 6    | 125   | 2.0      | above fair in both              |
| cpu   | 6    | 62.5  | 1.5      | above fair in CPUs only         |
| mixed | 9    | 20    | 1.4      | CPUs above fair, memory below   |
| light | 1    | 20    | 1.0      | below fair in both (DESIGN's example) |
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpusched.libs.core.decision import Decision, decision_problems
from gpusched.libs.core.perf import CpuMemDemand, demand_on_node
from gpusched.libs.core.snapshot import JobView
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.synergy import fair_share
from tests.builders import TablePerf, cluster, pending, running, snapshot

PERF = TablePerf(
    iter_s={"both": 1.0, "cpu": 1.0, "mixed": 1.0, "light": 1.0},
    demand={
        "both": CpuMemDemand(6.0, 125.0, 2.0),
        "cpu": CpuMemDemand(6.0, 62.5, 1.5),
        "mixed": CpuMemDemand(9.0, 20.0, 1.4),
        "light": CpuMemDemand(1.0, 20.0, 1.0),
    },
)
SERVERS = cluster(2, 8, gpu_mem_mb=40_000, cpus=24, host_mem_gb=500.0)


def tune(run: Sequence[JobView] = (), queue: Sequence[JobView] = ()) -> Decision:
    snap = snapshot(SERVERS, PERF, list(queue), list(run))
    decision = make_policy("synergy-fifo").decide(snap)
    assert decision_problems(snap, decision) == []
    return decision


def allocations(
    decision: Decision,
) -> dict[str, tuple[tuple[int, ...], float | None, float | None]]:
    return {s.job_id: (s.gpu_ids, s.cpus, s.mem_gb) for s in decision.starts}


def reallocated(decision: Decision) -> dict[str, tuple[float, float]]:
    return {r.job_id: (r.cpus, r.mem_gb) for r in decision.reallocations}


def queued(job_id: str, model: str, gpus: int = 1, submit: float = 0.0) -> JobView:
    return pending(job_id, 100.0, gpus=gpus, submit=submit, model=model, batch=32 * gpus)


def holding(
    job_id: str, model: str, gpus: range | tuple[int, ...], cpus: float, mem: float
) -> JobView:
    return running(
        job_id, 100.0, tuple(gpus), model=model, batch=32 * len(gpus), cpus=cpus, mem_gb=mem
    )


#: node 1 taken whole by a job at its best case (capped at the server's CPUs and memory)
NODE_1_FULL = holding("r1", "both", range(8, 16), 24.0, 500.0)


# ------------------------------------------------------------ best-case demand


def test_the_fair_share_of_a_synergy_server_is_3_cpus_and_62_5_gb_a_gpu() -> None:
    node = SERVERS.nodes[0]
    assert (fair_share(node, 1).cpus, fair_share(node, 1).mem_gb) == (3.0, 62.5)
    assert (fair_share(node, 4).cpus, fair_share(node, 4).mem_gb) == (12.0, 250.0)


def test_on_an_idle_cluster_every_job_gets_its_best_case_times_its_gpus() -> None:
    """Idle cluster, queue in arrival order:

    - b1 (both, 1 GPU): 1 x (6, 125) = (6 CPUs, 125 GB). One GPU goes to the node with
      the fewest idle GPUs; both have 8, the tie goes to node 0: GPU 0.
    - b2 (both, 2 GPUs): 2 x (6, 125) = (12, 250), on the first node with 2 idle GPUs:
      node 0 (7 idle), GPUs 1-2.
    - l4 (light, 4 GPUs): 4 x (1, 20) = (4, 80), less than its fair (12, 250): node 0
      has 5 idle, GPUs 3-6. Node 0 now holds 22 CPUs and 455 GB.
    """
    d = tune(
        queue=[queued("b1", "both"), queued("b2", "both", 2, 1.0), queued("l4", "light", 4, 2.0)]
    )
    assert allocations(d) == {
        "b1": ((0,), 6.0, 125.0),
        "b2": ((1, 2), 12.0, 250.0),
        "l4": ((3, 4, 5, 6), 4.0, 80.0),
    }
    assert d.reallocations == ()


def test_a_cpu_demand_beyond_the_server_is_capped_and_its_speedup_scaled() -> None:
    """mixed on 4 GPUs wants 4 x 9 = 36 CPUs > 24: capped at the server's 24 CPUs (6 per
    GPU); memory stays 4 x 20 = 80 GB. The speed-up scales as
    s = 1 + (s_best - 1)(24 - 3g)/(g cpu_best - 3g) = 1 + 0.4 x (24 - 12)/(36 - 12) = 1.2."""
    demand = demand_on_node(PERF.demand["mixed"], 4, 24, 8, 3.0, 62.5)
    assert (demand.cpus_per_gpu, demand.mem_gb_per_gpu) == (6.0, 20.0)
    assert demand.speedup == pytest.approx(1.2)
    assert allocations(tune(queue=[queued("m", "mixed", 4)])) == {"m": ((0, 1, 2, 3), 24.0, 80.0)}


def test_a_job_over_8_gpus_gets_the_fair_share_even_when_it_needs_less() -> None:
    """light on 10 GPUs spans two servers (8 on node 0, the most idle, then 2 on node 1):
    jobs over 8 GPUs get the fair share, 10 x (3, 62.5) = (30 CPUs, 625 GB), although
    light alone would want 10 x (1, 20)."""
    d = tune(queue=[queued("wide", "light", 10)])
    assert allocations(d) == {"wide": ((*range(10),), 30.0, 625.0)}


def test_best_case_on_any_server_comes_before_the_fair_share_on_the_preferred_one() -> None:
    """Five 1-GPU `both` jobs, (6, 125) each, on an idle cluster. The first four fill
    node 0's 24 CPUs and 500 GB exactly (GPUs 0-3; node 0 keeps 4 idle GPUs, the fewest,
    so they go there). The fifth still prefers node 0, where nothing is left; step (1)
    tries its best case on every candidate server before step (2) falls back to fair,
    so it gets (6, 125) on node 1, GPU 8."""
    d = tune(queue=[queued(f"b{i}", "both", submit=float(i)) for i in range(5)])
    assert allocations(d) == {
        "b0": ((0,), 6.0, 125.0),
        "b1": ((1,), 6.0, 125.0),
        "b2": ((2,), 6.0, 125.0),
        "b3": ((3,), 6.0, 125.0),
        "b4": ((8,), 6.0, 125.0),
    }


# ------------------------------------------------------------ fallback to fair


@pytest.mark.parametrize(("model", "given"), [("both", (3.0, 62.5)), ("mixed", (3.0, 20.0))])
def test_when_the_best_case_fits_nowhere_the_job_falls_back_to_at_most_fair(
    model: str, given: tuple[float, float]
) -> None:
    """Node 1 is full. On node 0, r0 holds GPUs 0-5 with 19 CPUs and 400 GB, so 5 CPUs and
    100 GB are free beside 2 idle GPUs.

    - j `both` wants (6, 125): it fits nowhere. It is above fair, so step (2) sets it to
      the fair share (3, 62.5), which fits on node 0: GPU 6.
    - j `mixed` wants (9, 20): no fit in 5 CPUs either. Step (2) brings each dimension to
      at most fair: CPUs to 3, memory stays at its 20 GB (a job that needs less than fair
      gets less).

    r0 holds 1 CPU and 25 GB above its fair (18, 375), but a fair share that fits is taken
    before anyone's excess, so nobody is reallocated; what is left does not bring r0
    (best case capped at the server, 24 CPUs and 500 GB) back up either."""
    d = tune([holding("r0", "both", range(6), 19.0, 400.0), NODE_1_FULL], [queued("j", model)])
    assert allocations(d) == {"j": ((6,), *given)}
    assert d.reallocations == ()


def test_a_job_that_needs_less_than_fair_waits_for_no_one() -> None:
    """light (1 CPU, 20 GB) with only 1 CPU and 20 GB free on node 0 (r0: 7 GPUs, 23 CPUs,
    480 GB; node 1 full): its best case fits as it is, on GPU 7."""
    d = tune([holding("r0", "both", range(7), 23.0, 480.0), NODE_1_FULL], [queued("j", "light")])
    assert allocations(d) == {"j": ((7,), 1.0, 20.0)}
    assert d.reallocations == ()


# ------------------------------------------------------------ taking the excess from victims


def test_victims_go_by_servers_spanned_then_cpu_per_gpu_until_the_shortfall_is_met() -> None:
    """Node 0, 1 idle GPU (7), no CPU free:

    | job  | model | GPUs                | holds         | fair     | above fair on node 0 |
    |------|-------|---------------------|---------------|----------|----------------------|
    | span | both  | 5, 6 (n0), 8, 9 (n1)| 13 CPU, 250 GB| 12, 250  | 0.5 CPU (half of 1)  |
    | hog  | cpu   | 0, 1                | 8, 125        | 6, 125   | 2 CPU (4 per GPU)    |
    | mid  | cpu   | 2, 3, 4             | 9.5, 187.5    | 9, 187.5 | 0.5 CPU (3.17/GPU)   |

    Node 0 uses 6.5 + 8 + 9.5 = 24 CPUs and 125 + 125 + 187.5 = 437.5 GB. Node 1 is full:
    span's other half (6.5, 125) and r1 on GPUs 10-15 (17.5, 375).

    j (light, 1 GPU) wants (1, 20): it does not fit (0 CPUs free), and nothing of it is
    above fair, so step (2) does not apply. Step (3) on node 0: shortfall 1 CPU (memory:
    62.5 GB free, enough). Victims in order: span first (two servers), giving 0.5; then
    hog (4 CPUs per GPU against mid's 3.17), giving 2: 2.5 >= 1, so mid is left alone.
    span drops to its fair share (12, 250) (a job across servers has the fair share as
    its floor), hog to min(best case, fair) = (6, 125). j gets (1, 20) on GPU 7."""
    run = [
        holding("span", "both", (5, 6, 8, 9), 13.0, 250.0),
        holding("hog", "cpu", (0, 1), 8.0, 125.0),
        holding("mid", "cpu", (2, 3, 4), 9.5, 187.5),
        holding("r1", "cpu", range(10, 16), 17.5, 375.0),
    ]
    d = tune(run, [queued("j", "light")])
    assert allocations(d) == {"j": ((7,), 1.0, 20.0)}
    assert reallocated(d) == {"hog": (6.0, 125.0), "span": (12.0, 250.0)}
    assert all("fair" in r.reason for r in d.reallocations)


def test_a_victim_drops_to_its_fair_share_throughput_not_below() -> None:
    """Node 0: v (mixed, GPUs 0-1) holds 9 CPUs and 40 GB (best case 18 CPUs, 40 GB); w
    (both, GPUs 2-6) holds its fair 15 CPUs and 437.5 GB. 0 CPUs and 22.5 GB free beside
    GPU 7; node 1 full.

    j (cpu, 1 GPU) wants (6, 62.5): no fit; fair (3, 62.5) neither. Step (3): shortfall
    3 CPUs and 40 GB. Victims: v first (4.5 CPUs per GPU against w's 3), whose excess over
    its floor min(best case (18, 40), fair (6, 125)) = (6, 40) is 3 CPUs and no memory;
    still 40 GB short, so w too, whose floor is its fair share (15, 312.5): 125 GB.
    v drops to (6, 40), its memory staying at the 20 GB a GPU it needs (below fair: it
    runs as fast there as at fair), w to (15, 312.5). j gets (3, 62.5) on GPU 7."""
    run = [
        holding("v", "mixed", (0, 1), 9.0, 40.0),
        holding("w", "both", range(2, 7), 15.0, 437.5),
        NODE_1_FULL,
    ]
    d = tune(run, [queued("j", "cpu")])
    assert allocations(d) == {"j": ((7,), 3.0, 62.5)}
    assert reallocated(d) == {"v": (6.0, 40.0), "w": (15.0, 312.5)}


@pytest.mark.parametrize(
    ("gpus", "server", "victim", "gpu_ids", "dropped_to"),
    [
        # g > 1: the first server with g idle GPUs, node 0 (3 idle) before node 1 (2 idle)
        (2, 0, "a0", (5, 6), (15.0, 312.5)),
        # g = 1: the server with the fewest idle GPUs, node 1
        (1, 1, "a1", (14,), (18.0, 375.0)),
    ],
)
def test_the_victims_server_is_the_first_with_g_gpus_or_for_one_gpu_the_fullest(
    gpus: int, server: int, victim: str, gpu_ids: tuple[int, ...], dropped_to: tuple[float, float]
) -> None:
    """Node 0: a0 (cpu) on GPUs 0-4 holds all 24 CPUs and 312.5 GB (fair 15 CPUs, so 9
    above); GPUs 5-7 idle. Node 1: a1 (cpu) on GPUs 8-13 holds 24 CPUs and 375 GB (fair
    18, so 6 above); GPUs 14-15 idle. No CPU free anywhere, so a `cpu` job's best case
    (6 a GPU) and its fair share (3 a GPU) fit nowhere and step (3) picks a server:

    - 2 GPUs: node 0, the first with 2 idle. Shortfall 6 CPUs (fair share 6, 125); a0's
      9 above fair cover it: a0 drops to (15, 312.5); the job gets (6, 125) on GPUs 5-6.
    - 1 GPU: node 1, the fewest idle. Shortfall 3 CPUs; a1 drops to (18, 375); the job
      gets (3, 62.5) on GPU 14."""
    run = [
        holding("a0", "cpu", range(5), 24.0, 312.5),
        holding("a1", "cpu", range(8, 14), 24.0, 375.0),
    ]
    d = tune(run, [queued("j", "cpu", gpus)])
    fair = fair_share(SERVERS.nodes[server], gpus)
    assert allocations(d) == {"j": (gpu_ids, fair.cpus, fair.mem_gb)}
    assert reallocated(d) == {victim: dropped_to}


def test_reallocations_shrink_before_they_raise() -> None:
    """Node 0: victim (cpu, GPUs 0-6) holds all 24 CPUs and 437.5 GB (fair 21, 437.5);
    GPU 7 idle. Node 1 has no idle GPU: raised (both, GPUs 8-9) at fair (6, 125) and
    r3 (light, GPUs 10-15) at its best case (6, 120), 12 CPUs and 255 GB free.

    j (cpu, 1 GPU) fits only on node 0, where step (3) drops victim by 3 CPUs to
    (21, 437.5) and j gets (3, 62.5) on GPU 7. raised has room for its best case
    (12, 250) on node 1 and gets it back. The drop comes first (though "raised" sorts
    before "victim"), so that a driver applying them in order never overcommits a node."""
    run = [
        holding("victim", "cpu", range(7), 24.0, 437.5),
        holding("raised", "both", (8, 9), 6.0, 125.0),
        holding("r3", "light", range(10, 16), 6.0, 120.0),
    ]
    d = tune(run, [queued("j", "cpu")])
    assert allocations(d) == {"j": ((7,), 3.0, 62.5)}
    assert [(r.job_id, r.cpus, r.mem_gb) for r in d.reallocations] == [
        ("victim", 21.0, 437.5),
        ("raised", 12.0, 250.0),
    ]
