"""The live scheduler believes the size forest: jobs of a template that really ran far
fewer iterations than they declared teach the predictor, a new job of that template gets
the forest's figure in its record (HTTP view and all) over the jobs stream, the
scheduler's estimates (asrpt's pending reason, the deadline estimate's ``est_run_s``)
follow it, a restarted scheduler keeps it, a job of an unseen template keeps its
declared size, and a prediction that arrives while a job runs re-estimates it.

Everything is real: a nats-server, the admission API over HTTP, the predictor, the
scheduler and an emulated node whose jobs are real processes (``sh`` scripts that write
the progress contract's lines)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import StreamConfig

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.natsauth import Credentials
from gpusched.libs.common.schemas import JobRecord, JobState, SizePredicted
from gpusched.libs.core.size_predictor import OVERRUN_SHARE
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.predictor.sizes import predicted_size_msg_id
from gpusched.services.scheduler.live import LiveScheduler, SchedulerService
from gpusched.services.scheduler.live.state import believed_iterations, remaining_iterations
from tests.live import fast_scheduler, record, spec, store_job, wait_state

TOKENS = {"tok-alice": "alice", "tok-bob": "bob", "tok-carol": "carol"}
#: what every job of the template declares, and what each really ran
DECLARED = 20_000
TRUTHS = (200, 220, 240)
#: a job's whole round trip here (submit, start a tiny process, succeed, predict) takes
#: well under a second; each wait allows a hundred times that on a busy 2-core machine
WAIT_S = 60.0
MODEL, BATCH = "resnet50", 32
#: a job that ends early: its progress, then a done line, at N iterations
ENDS_AT = ('printf \'{"event":"progress","iteration":%s}\\n{"event":"done","iteration":%s}\\n\' '
           '"$0" "$0" >> "$GPUSCHED_PROGRESS_FILE"')


@dataclass
class Live:
    nats: NatsServer
    stores: Stores
    http: aiohttp.ClientSession
    admission: AdmissionService
    predictor: PredictorService
    scheduler: SchedulerService

    @property
    def leader(self) -> LiveScheduler:
        assert self.scheduler.scheduler is not None, "the scheduler does not lead"
        return self.scheduler.scheduler

    async def submit(self, tenant: str, name: str, **fields: Any) -> str:
        body = {"name": name, "model": MODEL, "batch_size": BATCH, "iterations": DECLARED,
                **fields}
        async with self.http.post(f"{self.admission.url}/v1/jobs", json=body,
                                  headers={"Authorization": f"Bearer tok-{tenant}"}) as answer:
            assert answer.status == 201, await answer.text()
            return str((await answer.json())["id"])

    async def view(self, job_id: str, tenant: str) -> dict[str, Any]:
        async with self.http.get(f"{self.admission.url}/v1/jobs/{job_id}",
                                 headers={"Authorization": f"Bearer tok-{tenant}"}) as answer:
            assert answer.status == 200, await answer.text()
            return dict(await answer.json())

    async def predicted(self, job_id: str, tenant: str) -> dict[str, Any]:
        """The job's HTTP view, as its tenant sees it, once it shows a prediction."""

        async def shown() -> dict[str, Any] | None:
            view = await self.view(job_id, tenant)
            return view if view["prediction_source"] is not None else None

        result: dict[str, Any] = await wait_until(shown, timeout_s=WAIT_S, every_s=0.05)
        return result


def nodes(url: str, tmp_path: Path) -> EmulatedCluster:
    """One node with one GPU: a running job keeps every other one waiting."""
    return EmulatedCluster.of(url, 1, 1, work_dir=tmp_path / "work", heartbeat_s=0.2,
                              telemetry_s=0.5, progress_s=0.2, time_scale=0.01)


@pytest.fixture
async def live(nats_server: NatsServer, stores: Stores, tmp_path: Path) -> AsyncIterator[Live]:
    admission = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS)
    predictor = PredictorConfig(nats_url=nats_server.url, save_every_s=0.2)
    async with (
        PredictorService(predictor) as predicting,
        AdmissionService(admission) as admitting,
        nodes(nats_server.url, tmp_path),
        SchedulerService(fast_scheduler(nats_server.url, policy="asrpt")) as scheduling,
        aiohttp.ClientSession() as http,
    ):
        yield Live(nats_server, stores, http, admitting, predicting, scheduling)


def reason_gpu_s(reason: str) -> float:
    """The predicted work asrpt's pending reason names (1 GPU: GPU-s are seconds)."""
    found = re.search(r"\((\d+) GPU-s predicted\)", reason)
    assert found, f"no predicted work in {reason!r}"
    return float(found.group(1))


async def teach_the_template(live: Live) -> None:
    """Three jobs of alice's template declare 20,000 iterations and end at 200-240."""
    ids = [
        await live.submit("alice", f"resnet-sweep-v{i}", command=["sh", "-c", ENDS_AT, str(n)])
        for i, n in enumerate(TRUTHS, start=1)
    ]
    for job_id, truth in zip(ids, TRUTHS, strict=True):
        done = await wait_state(live.stores, job_id, JobState.SUCCEEDED, timeout_s=WAIT_S)
        assert done.progress.iteration == truth  # what it ran, not what it declared

    async def learned() -> bool:
        report = live.predictor.sizes.report()
        return report.scored_jobs == len(TRUTHS) and not live.predictor.sizes.training

    await wait_until(learned, timeout_s=WAIT_S, every_s=0.05)
    assert live.predictor.sizes.forest.rows[-1].declared_iterations == DECLARED


async def test_a_learned_templates_job_is_believed_at_the_forests_size_across_a_restart(
    live: Live,
):
    await teach_the_template(live)
    # a job that never reports progress holds the one GPU; it declared 1 iteration, so
    # asrpt believes it nearly done and never preempts it for the jobs below
    blocker = await live.submit("bob", "blocker", iterations=1, command=["sleep", "600"])
    await wait_state(live.stores, blocker, JobState.RUNNING, timeout_s=WAIT_S)

    deadline = time.time() + 7 * 86_400  # far off: only so the scheduler stores est_run_s
    submitted = time.perf_counter()
    known = await live.submit("alice", "resnet-sweep-v9", deadline=deadline)
    unseen = await live.submit("carol", "fresh-idea-v1", deadline=deadline)

    view = await live.predicted(known, "alice")
    took = time.perf_counter() - submitted
    truth = sum(TRUTHS) / len(TRUTHS)
    assert view["prediction_source"] == "forest"
    assert view["predicted_iterations"] == pytest.approx(truth, rel=0.25)
    assert view["total_iterations"] == DECLARED and view["state"] == "QUEUED"
    other = await live.predicted(unseen, "carol")
    assert (other["prediction_source"], other["predicted_iterations"]) == ("declared", DECLARED)
    predicted = float(view["predicted_iterations"])

    async def estimated(job_id: str, iterations: float) -> JobRecord | None:
        """The job's record once the scheduler's stored estimate and asrpt's reason count
        ``iterations`` at the scheduler's current time per iteration."""
        current = await record(live.stores, job_id)
        iteration_s = live.leader.jobs[job_id].est_iteration_s
        expected = iterations * iteration_s
        est = current.est_run_s
        right = iteration_s > 0 and est is not None and est == pytest.approx(expected, rel=0.02)
        named = "GPU-s predicted" in current.pending_reason and reason_gpu_s(
            current.pending_reason) == pytest.approx(expected, rel=0.02, abs=1.0)
        return current if right and named else None

    known_record = await wait_until(lambda: estimated(known, predicted), timeout_s=WAIT_S)
    unseen_record = await wait_until(lambda: estimated(unseen, DECLARED), timeout_s=WAIT_S)
    assert known_record.est_run_s is not None and unseen_record.est_run_s is not None
    assert known_record.est_run_s < unseen_record.est_run_s / 50
    print(f"forest {predicted:.1f} iterations (truth {truth:.0f}, declared {DECLARED}) "
          f"in the record {took * 1000:.0f} ms after the submission; est_run_s "
          f"{known_record.est_run_s:.1f} s against {unseen_record.est_run_s:.1f} s declared")

    # a new leader takes the jobs from their records: the prediction is there, and no
    # message brings it again (the old leader acknowledged it)
    await live.scheduler.__aexit__(None, None, None)
    restarted_at = time.time()
    async with SchedulerService(fast_scheduler(live.nats.url, policy="asrpt")) as restarted:
        await wait_until(lambda: restarted.scheduler is not None and known in
                         restarted.scheduler.jobs and unseen in restarted.scheduler.jobs,
                         timeout_s=WAIT_S)
        assert restarted.scheduler is not None
        jobs = restarted.scheduler.jobs
        assert jobs[known].record.prediction_source == "forest"
        assert jobs[known].remaining_s() == pytest.approx(
            predicted * jobs[known].est_iteration_s)
        assert jobs[unseen].remaining_s() == pytest.approx(
            DECLARED * jobs[unseen].est_iteration_s)
        await handled_everything(live.stores)

        # its own estimate, stored: the known job waits only for the blocker, believed
        # done, so its expected end moves with the clock and is written again
        async def estimated_again() -> JobRecord | None:
            current = await record(live.stores, known)
            end, run_s = current.est_end_at, current.est_run_s
            fresh = end is not None and run_s is not None and end - run_s >= restarted_at
            return current if fresh else None

        again = await wait_until(estimated_again, timeout_s=WAIT_S)
        assert again.est_run_s == pytest.approx(
            predicted * jobs[known].est_iteration_s, rel=0.02)


async def handled_everything(stores: Stores) -> None:
    """Until the scheduler has handled (and acknowledged) every message of the stream."""

    async def done() -> bool:
        info = await stores.js.consumer_info(subjects.JOBS_STREAM, subjects.SCHEDULER_CONSUMER)
        return info.num_pending == 0 and info.num_ack_pending == 0

    await wait_until(done, timeout_s=WAIT_S, every_s=0.05)


#: the forest's figure told for a running job, below what it has already run
FOREST = 10.0


async def test_a_prediction_that_arrives_while_a_job_runs_re_estimates_it(
    nats_server: NatsServer, stores: Stores, tmp_path: Path
):
    # no predictor here: the test tells the scheduler what the predictor would
    async with nodes(nats_server.url, tmp_path), SchedulerService(
        fast_scheduler(nats_server.url)
    ) as scheduling:
        job_id = await store_job(stores, spec(model=MODEL, batch_size=BATCH,
                                              iterations=1_000_000))
        await wait_state(stores, job_id, JobState.RUNNING, timeout_s=WAIT_S)
        assert scheduling.scheduler is not None
        job = scheduling.scheduler.jobs[job_id]
        await wait_until(lambda: job.iteration > 2 * FOREST, timeout_s=WAIT_S)
        before = job.remaining_s()
        assert before == pytest.approx((1_000_000 - job.iteration) * job.est_iteration_s)

        # the forest says FOREST iterations: the job, past them, is believed to have
        # OVERRUN_SHARE of them left
        told = SizePredicted(job_id=job_id, iterations=FOREST, source="forest", at=time.time())
        await stores.js.publish(
            subjects.job_predicted_size(job_id), codec.encode(told),
            headers=codec.headers({"Nats-Msg-Id": predicted_size_msg_id(job_id)}),
        )
        changed = await wait_until(
            lambda: _with_prediction(stores, job_id), timeout_s=WAIT_S, every_s=0.05)
        assert (changed.predicted_iterations, changed.prediction_source) == (FOREST, "forest")
        current = scheduling.scheduler.jobs[job_id]
        assert current.iteration > FOREST
        assert current.remaining_s() == pytest.approx(
            OVERRUN_SHARE * FOREST * current.est_iteration_s)

        # a second figure for the same job does not replace the first
        later = msgspec.structs.replace(told, iterations=5_000.0)
        await stores.js.publish(subjects.job_predicted_size(job_id), codec.encode(later),
                                headers=codec.headers())
        await handled_everything(stores)
        assert (await record(stores, job_id)).predicted_iterations == FOREST


async def _with_prediction(stores: Stores, job_id: str) -> JobRecord | None:
    current = await record(stores, job_id)
    return current if current.prediction_source is not None else None


async def test_a_jobs_stream_made_before_predicted_sizes_gets_their_subject_from_the_predictor(
    tmp_path: Path,
):
    # ``gpusched up`` starts the predictor first, as its own NATS user
    credentials = Credentials.generate([])
    with NatsServer(store_dir=tmp_path / "nats", users=list(credentials.users.values())) as server:
        older = [s for s in subjects.JOBS_STREAM_SUBJECTS if s != subjects.ALL_JOB_PREDICTED_SIZES]
        async with connection(credentials.url("admission", server.url), "older") as nc:
            await nc.jetstream().add_stream(StreamConfig(name=subjects.JOBS_STREAM,
                                                         subjects=older))
        config = PredictorConfig(nats_url=credentials.url("predictor", server.url))
        async with PredictorService(config), connection(
            credentials.url("admission", server.url), "reader"
        ) as nc:
            info = await nc.jetstream().stream_info(subjects.JOBS_STREAM)
    assert sorted(info.config.subjects or []) == sorted(subjects.JOBS_STREAM_SUBJECTS)


# ---------------------------------------------------------------------- the rule


def _record(total: int, predicted: float | None, source: str | None) -> JobRecord:
    return JobRecord(id="j", tenant="t", spec=spec(iterations=total), total_iterations=total,
                     submitted_at=0.0, predicted_iterations=predicted,
                     prediction_source=source)  # type: ignore[arg-type]


@given(
    total=st.integers(1, 10**7),
    predicted=st.floats(1.0, 1e8),
    source=st.sampled_from(["forest", "declared", None]),
    done_share=st.floats(0.0, 1.5),
)
def test_remaining_iterations_stay_within_the_run_and_follow_only_the_forest(
    total: int, predicted: float, source: str | None, done_share: float
):
    done = int(total * done_share)
    job = _record(total, predicted, source)
    left = remaining_iterations(job, done)
    assert 0 <= left <= max(0, total - done)
    believed = believed_iterations(job)
    if source != "forest" or predicted >= total:
        assert believed == total and left == max(0, total - done)
    else:
        assert believed == predicted
        if done < total:  # while it can run, never believed finished
            assert left >= min(total - done, OVERRUN_SHARE * predicted) - 1e-9
            assert left == pytest.approx(
                min(total - done, max(predicted - done, OVERRUN_SHARE * predicted)))


def test_a_size_prediction_with_a_bad_field_is_refused_naming_it():
    for field, value in (("iterations", 0.0), ("source", "history"), ("job_id", "a.b")):
        fields = {"job_id": "j", "iterations": 10.0, "source": "forest", "at": 0.0,
                  field: value}
        with pytest.raises(msgspec.ValidationError, match=field):
            codec.decode(msgspec.msgpack.encode(fields), SizePredicted)
