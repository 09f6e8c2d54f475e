"""A decision's check looks up who holds a GPU from one index of the snapshot's running
jobs by GPU, built once; it must list what a scan of the running jobs lists: the jobs
on the GPU in the snapshot's order, less those the decision has moved so far."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.core.decision import Preempt, _Booking
from gpusched.libs.core.snapshot import Snapshot
from tests.builders import TablePerf, cluster, running

PERF = TablePerf(iter_s={"a": 1.0}, mem_mb={"a": 1000.0})


@settings(max_examples=80, deadline=None)
@given(
    placements=st.lists(
        st.sets(st.integers(0, 7), min_size=1, max_size=4), min_size=1, max_size=10
    ),
    moved=st.sets(st.integers(0, 9), max_size=4),
    order=st.permutations(range(8)),
)
def test_residents_from_the_index_are_those_a_scan_finds(placements, moved, order):
    views = tuple(
        running(f"r{i}", 100.0, tuple(sorted(gpus))) for i, gpus in enumerate(placements)
    )
    snap = Snapshot.of_jobs(0.0, cluster(2, 4, gpu_mem_mb=16_000), (), views, PERF)
    booking = _Booking(snap, PERF, own_allocations=False)
    looked = order[: len(order) // 2]
    for gpu in looked:  # some GPUs looked up before the decision moves anyone
        booking.gpu_residents(gpu)
    gone = [f"r{i}" for i in sorted(moved) if i < len(views)]
    for job_id in gone:
        assert booking.preempt(Preempt(job_id, "for a test")) == []
    for gpu in order:
        held_before = set() if gpu in looked else set(gone)
        scan = [
            v.job_id for v in views if gpu in v.gpu_ids and v.job_id not in held_before
        ]
        if gpu in looked:  # a preemption took the moved job off the list it was on
            scan = [j for j in scan if j not in gone]
        assert booking.gpu_residents(gpu) == scan, gpu
