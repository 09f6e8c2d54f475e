"""The in-memory job index behind listings and quota checks."""

from __future__ import annotations

import msgspec

from gpusched.libs.common import codec
from gpusched.libs.common.schemas import JobRecord, JobSpec, JobState, Placement
from gpusched.services.admission.state import JobIndex


def record(job_id: str, tenant: str = "alpha", gpus: int = 1, **changes: object) -> bytes:
    spec = JobSpec(name="n", model="resnet50", batch_size=8, iterations=1, gpus=gpus)
    base = JobRecord(id=job_id, tenant=tenant, spec=spec, total_iterations=1, submitted_at=1.0)
    return codec.encode(msgspec.structs.replace(base, **changes))


def test_a_late_update_never_undoes_a_newer_revision():
    index = JobIndex()
    index.apply(5, "j1", record("j1", state=JobState.RUNNING))

    applied = index.apply(3, "j1", record("j1", state=JobState.QUEUED))

    assert not applied
    current = index.get("j1")
    assert current is not None
    assert current.state is JobState.RUNNING


def test_held_gpus_count_only_unfinished_jobs_of_the_tenant():
    index = JobIndex()
    index.apply(1, "j1", record("j1", gpus=4))
    index.apply(2, "j2", record("j2", gpus=2))
    index.apply(3, "j3", record("j3", tenant="beta", gpus=8))

    index.apply(4, "j1", record("j1", gpus=4, state=JobState.SUCCEEDED))

    assert index.held_gpus("alpha") == 2
    assert index.held_gpus("beta") == 8
    assert index.held_gpus("nobody") == 0


def test_a_deleted_job_leaves_listings_and_quota():
    index = JobIndex()
    index.apply(1, "j1", record("j1", gpus=3))

    index.apply(2, "j1", None)

    assert index.held_gpus("alpha") == 0
    assert index.page("alpha") == ([], None)
    assert len(index) == 0


def test_pages_follow_id_order_and_skip_other_states():
    index = JobIndex()
    for revision, job_id in enumerate(["j3", "j1", "j4", "j2"], start=1):
        state = JobState.RUNNING if job_id in ("j2", "j4") else JobState.QUEUED
        index.apply(revision, job_id, record(job_id, state=state))

    jobs, after = index.page("alpha", limit=3)
    assert [job.id for job in jobs] == ["j1", "j2", "j3"]
    assert after == "j3"
    rest, end = index.page("alpha", after=after, limit=3)
    assert [job.id for job in rest] == ["j4"]
    assert end is None
    running, _ = index.page("alpha", states={JobState.RUNNING})
    assert [job.id for job in running] == ["j2", "j4"]


def test_an_undecodable_record_is_skipped_and_the_last_good_one_kept():
    index = JobIndex()
    index.apply(1, "j1", record("j1", gpus=2))

    assert not index.apply(2, "j1", b"\xc1 not msgpack")

    assert index.held_gpus("alpha") == 2
    assert index.knows("j1")


def test_only_unfinished_placed_jobs_count_as_placed():
    index = JobIndex()
    placement = [Placement("n", [0])]
    index.apply(1, "j1", record("j1", state=JobState.RUNNING, placement=placement))
    index.apply(2, "j2", record("j2", state=JobState.FAILED, placement=placement))

    assert [job_id for job_id, _ in index.placed()] == ["j1"]
    index.apply(3, "j1", record("j1", state=JobState.SUCCEEDED, placement=placement))
    assert list(index.placed()) == []


def test_a_job_that_finishes_or_is_deleted_is_reported_once_with_its_tenant():
    finished: list[tuple[str, str]] = []
    index = JobIndex(on_finished=lambda tenant, job_id: finished.append((tenant, job_id)))
    index.apply(1, "j1", record("j1", gpus=2))
    index.apply(2, "j2", record("j2", tenant="beta"))
    index.apply(3, "j3", record("j3", state=JobState.SUCCEEDED))

    index.apply(4, "j1", record("j1", gpus=2, state=JobState.RUNNING))
    index.apply(5, "j1", record("j1", gpus=2, state=JobState.CANCELLED))
    index.apply(6, "j1", None)
    index.apply(7, "j2", None)

    assert finished == [("alpha", "j1"), ("beta", "j2")]
    assert (index.status("j1"), index.status("j3"), index.status("nope")) == (None, False, None)


def test_unfinished_lists_the_tenants_jobs_that_still_hold_gpus():
    index = JobIndex()
    index.apply(1, "j1", record("j1", gpus=2))
    index.apply(2, "j2", record("j2", gpus=3, state=JobState.RUNNING))
    index.apply(3, "j3", record("j3", tenant="beta"))
    index.apply(4, "j4", record("j4", state=JobState.FAILED))

    assert index.unfinished("alpha") == {"j1": 2, "j2": 3}
    assert index.status("j2") is True
