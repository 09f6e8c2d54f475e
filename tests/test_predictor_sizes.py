"""The predictor's size forest live: a recurring workload submitted through a real
admission service over HTTP, its completions fed as job records and state events on a
real nats-server, the forest's error read from the predictor, its metrics and admission's
route, and a restarted predictor answering from what it kept in KV."""

from __future__ import annotations

import statistics
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.predictor_client import PredictorClient
from gpusched.libs.common.schemas import (
    JobRecord,
    JobState,
    JobStateEvent,
    PredictRequest,
    Progress,
    SizeErrorReport,
)
from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.jobs import JobSpec as CoreJobSpec
from gpusched.libs.core.recurring import RecurringConfig, recurring_jobs
from gpusched.libs.core.size_predictor import SizeRow
from gpusched.services.admission import AdmissionConfig, AdmissionService
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.service import PredictorService
from gpusched.services.predictor.sizes import (
    DATASET_LABEL,
    SizeLearner,
    StoredGuess,
    StoredRow,
    StoredScore,
    StoredSizes,
)

PERF = ProfilePerformanceModel.builtin()
#: 4 users with 15 templates between them (seed 1): most templates recur within 100 jobs
JOBS, _ = recurring_jobs(100, PERF, seed=1, arrival_rate_per_h=40,
                         config=RecurringConfig(users=4))
USERS = sorted({job.user for job in JOBS})
TOKENS = {f"tok-{user}": user for user in USERS}
#: a job's round trip (submit, predict, complete, score) takes about 20 ms here and a
#: retrain on 100 rows about 50 ms; each wait is hundreds of times that
WAIT_S = 30.0


@dataclass
class Cluster:
    """A predictor and an admission service on one nats-server."""

    nats: NatsServer
    nc: Client
    stores: Stores
    predictor: PredictorService
    admission: AdmissionService
    http: aiohttp.ClientSession

    @property
    def client(self) -> PredictorClient:
        return PredictorClient(self.nc, timeout_s=5.0)

    async def report(self) -> SizeErrorReport:
        return await self.client.size_error()

    async def submit(self, job: CoreJobSpec) -> str:
        """Submit ``job`` as its user would, declaring its declared iterations."""
        body = {
            "name": job.name,
            "model": job.model,
            "gpus": job.gpus,
            "batch_size": job.batch_size,
            "iterations": round(job.declared_iterations or job.iterations),
            "labels": {DATASET_LABEL: job.dataset},
        }
        headers = {"Authorization": f"Bearer tok-{job.user}"}
        async with self.http.post(
            f"{self.admission.url}/v1/jobs", json=body, headers=headers
        ) as response:
            assert response.status == 201, await response.text()
            return str((await response.json())["id"])

    async def succeed(self, job_id: str, iterations: int) -> None:
        """What the scheduler does when a job's run exits 0 after ``iterations``."""
        entry = await self.stores.jobs.get(job_id)
        record = codec.decode(entry.value or b"", JobRecord)
        done = msgspec.structs.replace(
            record, state=JobState.SUCCEEDED, progress=Progress(iteration=iterations)
        )
        await self.stores.jobs.put(job_id, codec.encode(done))
        event = JobStateEvent(job_id=job_id, state=JobState.SUCCEEDED, at=0.0)
        await self.nc.publish(
            subjects.job_state(job_id), codec.encode(event), headers=codec.headers()
        )

    async def run(self, jobs: list[CoreJobSpec]) -> list[str]:
        """Each job submitted, predicted, run and scored in turn; the forest retrained
        before the next is submitted."""
        ids = []
        for job in jobs:
            before = await self.report()
            job_id = await self.submit(job)

            async def predicted(job_id: str = job_id) -> bool:
                return job_id in self.predictor.sizes.pending

            await wait_until(predicted, timeout_s=WAIT_S, every_s=0.005)
            await self.succeed(job_id, max(1, round(job.iterations)))

            async def scored(wanted: int = before.scored_jobs + 1) -> bool:
                return (await self.report()).scored_jobs == wanted

            await wait_until(scored, timeout_s=WAIT_S, every_s=0.005)
            await self.predictor.sizes.wait_trained()
            ids.append(job_id)
        return ids


def predictor_config(nats_url: str) -> PredictorConfig:
    return PredictorConfig(nats_url=nats_url, metrics_port=0, save_every_s=0.2)


@pytest.fixture
async def cluster(
    nats_server: NatsServer, nc: Client, stores: Stores
) -> AsyncIterator[Cluster]:
    admission_config = AdmissionConfig(nats_url=nats_server.url, port=0, tokens=TOKENS)
    async with (
        PredictorService(predictor_config(nats_server.url)) as predictor,
        AdmissionService(admission_config) as admission,
        aiohttp.ClientSession() as http,
    ):
        yield Cluster(nats_server, nc, stores, predictor, admission, http)


def mape(predicted: list[float], truth: list[float]) -> float:
    return statistics.mean(abs(p - t) / t for p, t in zip(predicted, truth, strict=True))


def later_mape(first: SizeErrorReport, last: SizeErrorReport) -> float:
    """MAPE of the jobs scored between two cumulative reports."""
    assert first.mape is not None and last.mape is not None
    total = last.mape * last.scored_jobs - first.mape * first.scored_jobs
    return total / (last.scored_jobs - first.scored_jobs)


# ---------------------------------------------------------------------- learning live


async def test_the_forests_error_falls_as_recurring_jobs_complete(cluster: Cluster):
    half = len(JOBS) // 2
    await cluster.run(JOBS[:half])
    early = await cluster.report()
    await cluster.run(JOBS[half:])
    final = await cluster.report()

    assert early.scored_jobs == half and final.scored_jobs == len(JOBS)
    assert final.training_rows == len(JOBS) and final.pending_jobs == 0
    assert final.retrains > 1
    assert early.mape is not None
    later = later_mape(early, final)
    declared = mape([j.declared_iterations or 0 for j in JOBS[half:]],
                    [j.iterations for j in JOBS[half:]])
    print(f"size MAPE: first {half} jobs {early.mape:.3f}, later {len(JOBS) - half} "
          f"{later:.3f} (declared {declared:.3f}); within 25 % at the end "
          f"{final.within_25:.2f}, fallbacks {final.fallback_jobs}, "
          f"retrains {final.retrains}")
    print(msgspec.json.encode(final).decode())
    assert later < early.mape
    assert later < declared / 2
    # the shares are cumulative and nested
    assert final.within_10 is not None and final.within_25 is not None
    assert final.within_50 is not None
    assert 0 <= final.within_10 <= final.within_25 <= final.within_50 <= 1


async def test_a_learned_template_gets_the_forest_and_an_unseen_one_its_declared_size(
    cluster: Cluster,
):
    await cluster.run(JOBS[:30])
    known = JOBS[0]
    asked = PredictRequest(
        model=known.model, batch_size=known.batch_size, gpus=known.gpus,
        iterations=round(known.declared_iterations or 1), tenant=known.user,
        name=known.name.rsplit("-", 1)[0] + "-v99", dataset=known.dataset,
    )
    answer = await cluster.client.iterations(asked)
    assert answer.source == "forest"
    assert answer.value != asked.iterations

    unseen = msgspec.structs.replace(asked, tenant="nobody", name="fresh-idea-v1",
                                     iterations=777)
    answer = await cluster.client.iterations(unseen)
    assert (answer.source, answer.value) == ("declared", 777.0)
    # an old request, without the submission fields, is answered as before
    plain = PredictRequest(model=known.model, batch_size=known.batch_size, iterations=5)
    answer = await cluster.client.iterations(plain)
    assert (answer.source, answer.value) == ("declared", 5.0)


async def test_a_job_that_fails_is_never_scored_and_a_repeated_success_counts_once(
    cluster: Cluster,
):
    failed = await cluster.submit(JOBS[0])
    await wait_until(lambda: failed in cluster.predictor.sizes.pending, timeout_s=WAIT_S)
    event = JobStateEvent(job_id=failed, state=JobState.FAILED, at=0.0)
    await cluster.nc.publish(subjects.job_state(failed), codec.encode(event),
                             headers=codec.headers())
    await wait_until(lambda: not cluster.predictor.sizes.pending, timeout_s=WAIT_S)

    [done] = await cluster.run(JOBS[1:2])
    await cluster.succeed(done, 12345)  # the same SUCCEEDED event again
    await cluster.run(JOBS[2:3])  # a barrier: the predictor handled the repeat before
    report = await cluster.report()
    assert (report.scored_jobs, report.training_rows) == (2, 2)


# ---------------------------------------------------------------------- reported


def gauges(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("gpusched_predictor_size_")
    }


async def test_metrics_and_the_admission_route_give_the_predictors_figures(cluster: Cluster):
    url = f"{cluster.admission.url}/v1/predictor/size-error"
    auth = {"Authorization": f"Bearer tok-{USERS[0]}"}
    assert cluster.predictor.metrics_url is not None
    async with cluster.http.get(cluster.predictor.metrics_url) as response:
        before = gauges(await response.text())
    assert before[("gpusched_predictor_size_scored_jobs", ())] == 0
    assert before[("gpusched_predictor_size_mape_ratio", ())] != before[
        ("gpusched_predictor_size_mape_ratio", ())
    ]  # NaN before any job is scored

    await cluster.run(JOBS[:20])
    report = await cluster.report()
    async with cluster.http.get(cluster.predictor.metrics_url) as response:
        scraped = gauges(await response.text())
    assert scraped == {
        ("gpusched_predictor_size_mape_ratio", ()): report.mape,
        ("gpusched_predictor_size_scored_jobs", ()): 20.0,
        ("gpusched_predictor_size_within_ratio", (("within", "0.1"),)): report.within_10,
        ("gpusched_predictor_size_within_ratio", (("within", "0.25"),)): report.within_25,
        ("gpusched_predictor_size_within_ratio", (("within", "0.5"),)): report.within_50,
    }

    async with cluster.http.get(url, headers=auth) as response:
        assert response.status == 200
        assert msgspec.json.decode(await response.read(), type=SizeErrorReport) == report
    async with cluster.http.get(url) as response:
        assert response.status == 401

    await cluster.predictor.stop()
    async with cluster.http.get(url, headers=auth) as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["type"].endswith("predictor-unavailable")


# ---------------------------------------------------------------------- kept in KV


async def test_a_restarted_predictor_answers_with_the_forest_at_once(cluster: Cluster):
    await cluster.run(JOBS[:40])
    kept = await cluster.report()
    known = JOBS[0]
    asked = PredictRequest(
        model=known.model, batch_size=known.batch_size, gpus=known.gpus,
        iterations=round(known.declared_iterations or 1), tenant=known.user,
        name=known.name, dataset=known.dataset,
    )
    await cluster.predictor.stop()  # saves on stop

    async with PredictorService(predictor_config(cluster.nats.url)) as restarted:
        answer = await cluster.client.iterations(asked)
        assert answer.source == "forest"
        again = await cluster.client.size_error()
        assert again.scored_jobs == kept.scored_jobs == 40
        assert again.mape == pytest.approx(kept.mape)
        assert again.training_rows == 40
        assert restarted.sizes.forest.retrains == 1  # retrained once, on every row


# ---------------------------------------------------------------------- stored form


rows = st.builds(
    StoredRow,
    user=st.text(max_size=20), name=st.text(max_size=60), dataset=st.text(max_size=20),
    model=st.sampled_from(PERF.models()), batch_size=st.integers(1, 4096),
    gpus=st.integers(1, 64), tensor_parallel=st.just(1), pipeline_parallel=st.just(1),
    declared_iterations=st.none() | st.floats(1, 1e9),
    iterations=st.floats(1, 1e9),
)


@settings(max_examples=50, deadline=None)
@given(
    stored_rows=st.lists(rows, max_size=300),
    guesses=st.integers(0, 300),
    scores=st.integers(0, 300),
    limit=st.integers(0, 40_000),
)
def test_the_stored_form_always_fits_its_limit_dropping_the_oldest_first(
    stored_rows: list[StoredRow], guesses: int, scores: int, limit: int
):
    stored = StoredSizes(
        rows=stored_rows,
        pending=[StoredGuess(f"p{i}", 10.0, "declared") for i in range(guesses)],
        scored=[StoredScore(f"s{i}", 10.0, 12.0, "forest") for i in range(scores)],
    )
    learner = SizeLearner()
    learner.forest.rows = [SizeRow(**msgspec.structs.asdict(r)) for r in stored.rows]
    for guess in stored.pending:
        learner.pending[guess.job_id] = (guess.predicted, guess.source)
    for score in stored.scored:
        learner.errors.add(score.job_id, score.predicted, score.truth, score.source)

    kept = learner.stored(limit)

    assert len(msgspec.msgpack.encode(kept)) <= max(limit, len(msgspec.msgpack.encode(
        StoredSizes(config=kept.config))))
    # what is kept is the newest of each list
    assert kept.rows == stored.rows[len(stored.rows) - len(kept.rows):]
    assert kept.pending == stored.pending[len(stored.pending) - len(kept.pending):]
    assert kept.scored == stored.scored[len(stored.scored) - len(kept.scored):]
    assert learner.stored() == StoredSizes(config=kept.config, rows=stored.rows,
                                           pending=stored.pending, scored=stored.scored)


def test_a_stored_form_of_another_version_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^version"):
        SizeLearner.restore(StoredSizes(version=99))
    with pytest.raises(ValueError, match=r"^config"):
        SizeLearner.restore(StoredSizes(config={"trees": 3}))
