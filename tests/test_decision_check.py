"""The check both drivers make of a policy's decision before applying it: what
``decision_problems`` finds on hand-built snapshots, the simulator stopping on it, and the
live scheduler refusing a decision that books one GPU twice."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import structlog

from gpusched.libs.core.decision import Decision, Preempt, Resize, Start, decision_problems
from gpusched.libs.core.snapshot import Snapshot
from gpusched.services.scheduler.live import Round
from gpusched.services.scheduler.live.state import Phase
from gpusched.services.scheduler.policies.base import Capabilities, QueueSort
from gpusched.services.scheduler.simulation.simulator import PolicyViolation, simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot
from tests.live import record, spec, store_job
from tests.test_scheduler_hardening import idle_scheduler, register_node

PERF = TablePerf(mem_mb={"a": 1000.0, "big": 6000.0}, iter_s={"a": 1.0, "big": 1.0})


def problems(snap: Snapshot, **actions: tuple) -> list[str]:
    return decision_problems(snap, Decision(**actions))


def two_running() -> Snapshot:
    """GPUs 0-3 of one node: r0 on GPU 0, r1 and r2 sharing GPU 1; p and q wait."""
    return snapshot(
        cluster(1, 4), PERF,
        pending_jobs=[pending("p", 10), pending("q", 10, share=False),
                      pending("wide", 10, gpus=2)],
        running_jobs=[running("r0", 10, (0,)), running("r1", 10, (1,)),
                      running("r2", 10, (1,))],
    )  # fmt: skip


def test_a_decision_within_the_cluster_has_no_problem():
    snap = two_running()
    decision = dict(starts=(Start("p", (2,)), Start("q", (3,)), Start("wide", (0, 2)),),
                    preemptions=(Preempt("r0", "for wide"),))
    assert problems(snap, **decision) == []


def test_only_a_pending_job_starts():
    snap = two_running()
    assert problems(snap, starts=(Start("r0", (2,)),)) == ["started r0, which is not pending"]
    assert problems(snap, starts=(Start("ghost", (2,)),)) == [
        "started ghost, which is not pending"
    ]
    assert problems(snap, starts=(Start("p", (2,)), Start("p", (3,)))) == [
        "started p, which is not pending"
    ]


def test_gpus_must_exist_be_distinct_and_as_many_as_the_job_asks():
    snap = two_running()
    assert problems(snap, starts=(Start("p", (7,)),)) == ["placed p on unknown GPU 7"]
    assert problems(snap, starts=(Start("wide", (2, 2)),)) == [
        "gave wide GPUs (2, 2); it needs 2 distinct"
    ]
    assert problems(snap, starts=(Start("wide", (2,)),)) == [
        "gave wide GPUs (2,); it needs 2 distinct"
    ]


def test_a_gpu_holds_at_most_its_limit_and_a_job_that_forbids_sharing_alone():
    snap = two_running()
    assert problems(snap, starts=(Start("p", (1,)),)) == ["placed p on full GPU 1"]
    assert problems(snap, starts=(Start("q", (0,)),)) == [
        "shared GPU 0 with a job that forbids it"
    ]
    # both start on the free GPU 2 in one decision: the second meets the first
    assert problems(snap, starts=(Start("p", (2,)), Start("q", (2,)))) == [
        "shared GPU 2 with a job that forbids it"
    ]
    # p alone may join r0; a third job on GPU 0 may not
    assert problems(snap, starts=(Start("p", (0,)), Start("wide", (0, 3)))) == [
        "placed wide on full GPU 0"
    ]


def test_a_gpu_holds_no_more_memory_than_it_has():
    snap = snapshot(
        cluster(1, 2), PERF,
        pending_jobs=[pending("b", 10, model="big"), pending("small", 10)],
        running_jobs=[running("r", 10, (0,), model="big")],
    )  # fmt: skip
    assert problems(snap, starts=(Start("b", (0,)),)) == [
        "overcommitted GPU 0: 12000 MiB > 10000 MiB"
    ]
    assert problems(snap, starts=(Start("small", (0,)),)) == []
    # accumulation steps shrink the per-GPU batch and with it the memory: 6000 x 0.5
    assert problems(snap, starts=(Start("b", (0,), accum_steps=4),)) == []


def test_accumulation_steps_leave_every_sub_batch_a_sample():
    snap = two_running()
    assert problems(snap, starts=(Start("p", (2,), accum_steps=0),)) == [
        "gave p accum_steps 0"
    ]
    assert problems(snap, starts=(Start("p", (2,), accum_steps=64),)) == [
        "gave p accum_steps 64"
    ]
    assert problems(snap, starts=(Start("p", (2,), accum_steps=32),)) == []


def test_only_a_running_job_is_preempted_or_resized():
    snap = two_running()
    assert problems(snap, preemptions=(Preempt("p", "x"),)) == [
        "preempted p, which is not running"
    ]
    assert problems(snap, preemptions=(Preempt("r0", "x"), Preempt("r0", "x"))) == [
        "preempted r0, which is not running"
    ]
    assert problems(snap, resizes=(Resize("p", (2,), batch_size=32),)) == [
        "resized p, which is not running"
    ]
    assert problems(snap, resizes=(Resize("r0", (), batch_size=32),)) == [
        "resized r0 to batch 32 on GPUs ()"
    ]


def test_a_resize_is_checked_as_a_start_with_the_new_shape():
    snap = two_running()
    assert problems(snap, resizes=(Resize("r0", (0, 2), batch_size=64, accum_steps=2),)) == []
    assert problems(snap, resizes=(Resize("r0", (0, 1), batch_size=64),)) == [
        "placed r0 on full GPU 1"
    ]
    assert problems(snap, resizes=(Resize("r0", (2,), batch_size=32, accum_steps=64),)) == [
        "gave r0 accum_steps 64"
    ]
    # the GPUs a resize leaves are free for the starts that follow it
    assert problems(snap, resizes=(Resize("r0", (2,), batch_size=32),),
                    starts=(Start("q", (0,)),)) == []  # fmt: skip


def test_the_gpus_a_preemption_frees_can_be_booked_by_the_same_decision():
    snap = two_running()
    assert problems(snap, preemptions=(Preempt("r1", "x"),), starts=(Start("p", (1,)),)) == []
    assert problems(snap, preemptions=(Preempt("r0", "x"),), starts=(Start("r0", (3,)),)) == []


@dataclass
class DoubleBooking:
    """A broken policy: every queued job (or the first ``most``) goes on GPU 0."""

    name: str = "double-booking"
    most: int | None = None
    preemptive: bool = False
    queue_sort: QueueSort | None = None
    capabilities = Capabilities()

    def decide(self, snapshot: Snapshot) -> Decision:
        queued = snapshot.pending[: self.most]
        return Decision(starts=tuple(Start(j.job_id, (0,)) for j in queued))


def test_the_simulator_stops_on_a_decision_with_a_problem():
    trace = [job("a", 0, share=False), job("b", 0)]
    with pytest.raises(PolicyViolation, match="double-booking shared GPU 0 with a job"):
        simulate(cluster(1, 2), trace, DoubleBooking(), PERF)


async def test_the_live_scheduler_refuses_a_decision_that_double_books_a_gpu(
    nats_server, nc, stores
):
    await register_node(stores)
    alone = [await store_job(stores, spec(allow_sharing=False)) for _ in range(2)]
    with structlog.testing.capture_logs() as logs:
        async with idle_scheduler(nats_server.url, nc, stores) as scheduler:
            scheduler.policy = DoubleBooking()
            await scheduler.handle(Round())
            assert scheduler.refused_decisions == 1
            assert [scheduler.jobs[j].phase for j in alone] == [Phase.WAITING] * 2
            for job_id in alone:
                stored = await record(stores, job_id)
                assert (stored.run_id, stored.placement) == (0, [])
            # the next round decides again, with a policy that keeps the limits
            scheduler.policy = DoubleBooking(name="first-only", most=1)
            await scheduler.handle(Round())
            assert scheduler.refused_decisions == 1
            phases = sorted(scheduler.jobs[j].phase for j in alone)
            assert phases == sorted([Phase.STARTING, Phase.WAITING])
    refused = [(e["policy"], e["problem"]) for e in logs if e["event"] == "decision refused"]
    assert refused == [("double-booking", "shared GPU 0 with a job that forbids it")]
