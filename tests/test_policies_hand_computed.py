"""Small traces whose JCTs are worked out by hand (iterations = seconds: every model
runs one iteration per second alone, and sharing slows both jobs 1.25x).

The trace, on one node with two GPUs:
    j1 at t=0, 100 s, 1 GPU;  j2 at t=0, 50 s, 1 GPU;
    j3 at t=10, 10 s, 2 GPUs; j4 at t=20, 5 s, 1 GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from gpusched.libs.core.decision import Decision, Resize
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.base import Capabilities, Policy, QueueSort
from gpusched.services.scheduler.policies.preemptive import Tiresias
from gpusched.services.scheduler.simulation.simulator import PolicyViolation, SimConfig, simulate
from tests.builders import TablePerf, cluster, job

TRACE = [job("j1", 0, 100), job("j2", 0, 50), job("j3", 10, 10, gpus=2), job("j4", 20, 5)]


def finish_times(policy, trace=TRACE, overhead: float = 30.0) -> dict[str, float | None]:
    result = simulate(
        cluster(1, 2), trace, policy, TablePerf(), config=SimConfig(restart_overhead_s=overhead)
    )
    return {o.job_id: o.finish_time for o in result.jobs}


def test_fifo_lets_the_head_of_the_queue_block_everyone_behind_it():
    # j3 needs both GPUs and waits for j1 (t=100); j4, behind it, cannot jump ahead at t=50
    assert finish_times(make_policy("fifo")) == {"j1": 100, "j2": 50, "j3": 110, "j4": 115}


def test_sjf_runs_the_short_job_on_the_gpu_that_frees_first():
    # at t=50 one GPU frees: j4 (5 s) goes before j3 (10 s, needs 2); j3 waits for j1
    assert finish_times(make_policy("sjf")) == {"j1": 100, "j2": 50, "j3": 110, "j4": 55}


def test_srtf_preempts_longer_jobs_and_charges_the_restart_overhead():
    # t=10: j3 (10 s) evicts j1 (90 left) and j2 (40 left); t=20: j4 and j2 restart
    # (j2 pays 30 s of checkpoint restore); t=25: j1 restarts with its 30 s overhead
    assert finish_times(make_policy("srtf")) == {"j1": 145, "j2": 90, "j3": 20, "j4": 25}


def test_tiresias_demotes_jobs_past_a_threshold_and_preempts_them_for_new_ones():
    # with one threshold at 20 GPU-s, j1 and j2 drop to queue 1 at t=20 and j3 (queue 0)
    # evicts both; at t=30 j4 and j1 (overhead 30, 80 left) start; j2 starts at t=35
    policy = Tiresias(thresholds_gpu_s=(20.0,))
    assert finish_times(policy) == {"j1": 140, "j2": 95, "j3": 30, "j4": 35}


def test_sjf_bsbf_shares_when_the_pair_finishes_sooner_on_average():
    # t=10: j3 shares both GPUs (t_con 52.5 < t_seq 95 with j1, 27.5 < 45 with j2) and
    # runs 1.25x slower to t=22.5, costing j1 and j2 2.5 s each; at t=22.5 j4 shares with
    # j2 (30 s left, the smaller E_b) to t=28.75, costing j2 another 1.25 s
    assert finish_times(make_policy("sjf-bsbf")) == pytest.approx(
        {"j1": 102.5, "j2": 53.75, "j3": 22.5, "j4": 28.75}
    )


def test_sjf_bsbf_waits_when_interference_makes_sharing_slower_but_ffs_shares_anyway():
    # with a 2x slowdown, a 10 s job sharing with a 10 s resident lowers nothing:
    # t_con = 10/2 + (1 - 1/4) * 2 * 10 = 20 > t_seq = 10 + 10/2 = 15
    perf = TablePerf(default_slowdown=2.0)
    trace = [job("b", 0, 10), job("a", 0.5, 10)]
    for name, expected in (("sjf-bsbf", {"b": 10, "a": 20}), ("sjf-ffs", {"b": 19.5, "a": 20.0})):
        result = simulate(cluster(1, 1), trace, make_policy(name), perf)
        assert {o.job_id: o.finish_time for o in result.jobs} == pytest.approx(expected), name


def test_a_job_larger_than_the_cluster_is_reported_unschedulable_and_the_run_ends():
    trace = [job("ok", 0, 10), job("huge", 0, 10, gpus=64)]
    for name in ("fifo", "sjf", "srtf", "tiresias", "sjf-ffs", "sjf-bsbf"):
        result = simulate(cluster(1, 2), trace, make_policy(name), TablePerf())
        states = {o.job_id: (o.state, o.reason) for o in result.jobs}
        assert states["ok"][0] == "finished"
        assert states["huge"] == (
            "unschedulable",
            "unschedulable: needs 64 GPUs; the cluster has 2",
        )


def test_a_job_whose_memory_never_fits_is_unschedulable_with_the_numbers():
    perf = TablePerf(mem_mb={"a": 1000.0, "b": 80_000.0})
    trace = [job("fat", 0, 10, model="b", batch=32)]
    result = simulate(cluster(1, 2, gpu_mem_mb=16_000), trace, make_policy("sjf"), perf)
    (outcome,) = result.jobs
    assert outcome.state == "unschedulable"
    assert "MiB per GPU" in outcome.reason and "16000 MiB" in outcome.reason


def test_tiresias_runs_a_promoted_job_in_the_top_queue_until_it_earns_a_threshold_again():
    # one GPU, threshold 10 GPU-s, promotion after waiting as long as the job has run,
    # no restore overhead. t=10: A (10 s run) sinks, B (queue 0) evicts it. t=20: B sinks
    # and A, waiting 10 s, is promoted and evicts B. A's run counts from its promotion:
    # it stays in queue 0 to t=30, when B (waited 10 s) is promoted and evicts it. B sinks
    # at t=40 but stays ahead of A, both in queue 1, because running jobs come first in a
    # queue; it finishes at t=50 and A at t=60.
    policy = Tiresias(thresholds_gpu_s=(10.0,), promote_knob=1.0, min_wait_s=0.0)
    trace = [job("A", 0, 30), job("B", 5, 30)]
    result = simulate(cluster(1, 1), trace, policy, TablePerf(),
                      config=SimConfig(restart_overhead_s=0.0))
    assert {o.job_id: o.finish_time for o in result.jobs} == pytest.approx({"A": 60, "B": 50})
    assert result.preemptions == 3


@dataclass
class ResizeAt:
    """FIFO, plus one resize of a running job at the first decision from ``at`` on."""

    resize: Resize
    at: float
    inner: Policy = field(default_factory=lambda: make_policy("fifo"))
    name: str = "fifo+resize"
    preemptive: bool = False
    queue_sort: QueueSort | None = None
    capabilities = Capabilities()
    sent: bool = False

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.inner.decide(snapshot)
        if not self.sent and snapshot.now >= self.at:
            self.sent = True
            return replace(decision, resizes=(self.resize,))
        return decision


def test_a_resized_job_keeps_its_remaining_iterations_and_pays_the_restart_overhead():
    # j runs 100 iterations of 1 s on GPU 0; at t=20 (the arrival of k, which FIFO puts
    # on GPU 1) it moves to GPUs 2-3 with 4 accumulation steps, which makes an iteration
    # 4 ** 0.5 = 2 s: 30 s of restore, then 80 iterations of 2 s, so it ends at t=210
    perf = TablePerf(accum_exponent=0.5)
    policy = ResizeAt(Resize("j", (2, 3), batch_size=64, accum_steps=4), at=20.0)
    trace = [job("j", 0, 100), job("k", 20, 10)]
    result = simulate(cluster(1, 4), trace, policy, perf,
                      config=SimConfig(restart_overhead_s=30.0))
    assert {o.job_id: o.finish_time for o in result.jobs} == pytest.approx({"j": 210, "k": 30})
    assert (result.resizes, result.preemptions) == (1, 0)


def test_resizing_a_job_that_is_not_running_is_a_policy_violation():
    policy = ResizeAt(Resize("late", (0,), batch_size=32), at=0.0)
    with pytest.raises(PolicyViolation, match="resized late, which is not running"):
        simulate(cluster(1, 1), [job("late", 0, 10)], policy, TablePerf())
