"""The shared NATS plumbing against a real nats-server."""

from __future__ import annotations

import msgspec
import pytest

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.schemas import JobSpec, StartJob, StopJob


async def test_opening_the_stores_twice_is_harmless_and_keeps_records(nc, stores: Stores):
    await stores.jobs.put("job-1", b"x")
    again = await Stores.open(nc)
    assert (await again.jobs.get("job-1")).value == b"x"


async def test_a_duplicate_msg_id_is_stored_once(stores: Stores):
    first = await stores.js.publish(
        subjects.job_submitted("a"), b"1", headers={"Nats-Msg-Id": "a"}
    )
    second = await stores.js.publish(
        subjects.job_submitted("a"), b"1", headers={"Nats-Msg-Id": "a"}
    )
    assert second.duplicate and first.seq == second.seq


async def test_listing_keys_of_an_empty_bucket_gives_none(stores: Stores):
    assert await stores.job_ids() == []


async def test_listing_keys_sees_every_live_key_and_skips_deleted_and_purged_ones(
    stores: Stores,
):
    for index in range(2_500):
        await stores.jobs.put(f"job{index}", b"x")
    await stores.jobs.delete("job7")
    await stores.jobs.purge("job8")
    await stores.jobs.put("job9", b"rewritten")

    keys = await stores.job_ids()

    assert len(keys) == len(set(keys)) == 2_498
    assert "job7" not in keys and "job8" not in keys and "job9" in keys
    # the listing leaves no consumer behind on the bucket's stream
    info = await stores.js.stream_info(f"KV_{subjects.JOBS_BUCKET}")
    assert info.state.consumer_count == 0


async def test_a_key_written_just_before_listing_is_always_listed(stores: Stores):
    for attempt in range(30):
        await stores.nodes.put(f"node{attempt}", b"x")
        assert f"node{attempt}" in await stores.node_names()


def test_commands_round_trip_through_messagepack_as_a_tagged_union():
    spec = JobSpec(name="n", model="resnet50", batch_size=32, iterations=5)
    start = StartJob(job_id="j", run_id=3, spec=spec, total_iterations=5, gpus=[0, 1])
    assert codec.decode(codec.encode(start), StartJob | StopJob) == start
    stop = StopJob(job_id="j", run_id=3, reason="preempt")
    assert codec.decode(codec.encode(stop), StartJob | StopJob) == stop


def test_a_bad_field_is_named_in_the_validation_error():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.gpus"):
        msgspec.json.decode(
            b'{"name":"n","model":"m","batch_size":1,"gpus":0}', type=JobSpec
        )


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a b"])
def test_subject_builders_refuse_ids_that_would_break_a_subject(bad: str):
    with pytest.raises(ValueError):
        subjects.job_state(bad)
