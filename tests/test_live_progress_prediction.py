"""ONES's progress predictor, live: real workers report their epochs, the predictor
service learns from the jobs of a model that finished, and the live scheduler running
ONES takes the next job's remaining time from it, also after a predictor restart."""

from __future__ import annotations

import time
from pathlib import Path

from nats.aio.client import Client

from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.predictor_client import PredictorClient
from gpusched.libs.common.schemas import JobState, Prediction, RemainingRequest
from gpusched.services.nodeagent.cluster import EmulatedCluster
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.progress import SOURCE_PROGRESS
from gpusched.services.predictor.service import PredictorService
from gpusched.services.scheduler.live import SchedulerService
from gpusched.services.scheduler.live.state import build_snapshot
from tests.limits import process_limit_s
from tests.live import fast_scheduler, spec, store_job, wait_state
from tests.test_nodeagent_service import PROCESS_TIMINGS

#: a light model and a data set of 512 iterations per epoch: a few progress lines each
MODEL, BATCH, DATASET = "ncf", 16, 8192
EPOCH = DATASET // BATCH
#: the jobs that finish, and how many epochs each runs
FINISHED, EPOCHS = 3, 5
#: what the next job declares: far more epochs than any job of its model took
DECLARED_EPOCHS = 400


def job_spec(epochs: int):
    return spec(
        model=MODEL, batch_size=BATCH, iterations=epochs * EPOCH, dataset_size=DATASET,
        checkpoint_every=10**6,
    )  # fmt: skip


async def test_after_jobs_of_a_model_finish_ones_gets_the_next_jobs_remaining_time_from_them(
    nats_server: NatsServer, stores: Stores, nc: Client, tmp_path: Path
):
    cluster = EmulatedCluster.of(
        nats_server.url, 1, 1, work_dir=tmp_path / "work", jobs_mode="process",
        heartbeat_s=0.2, progress_s=0.2, **PROCESS_TIMINGS,
    )  # fmt: skip
    predictor_config = PredictorConfig(nats_url=nats_server.url)
    client = PredictorClient(nc, timeout_s=5.0)
    limit = process_limit_s(FINISHED + 2)
    async with cluster, SchedulerService(fast_scheduler(nats_server.url, policy="ones")) as sched:
        async with PredictorService(predictor_config) as predictor:
            for _ in range(FINISHED):
                done = await store_job(stores, job_spec(EPOCHS))
                await wait_state(stores, done, JobState.SUCCEEDED, timeout_s=limit)

            async def trained() -> bool:
                learned = predictor.progress.predictor
                return learned.trained and learned.finished_jobs == FINISHED

            await wait_until(trained, timeout_s=limit, every_s=0.1)
            # every finished job's history reached the epochs it ran
            assert [h[-1].epochs for h in predictor.progress.finished] == [EPOCHS] * FINISHED

            running = await store_job(stores, job_spec(DECLARED_EPOCHS))
            await wait_state(stores, running, JobState.RUNNING, timeout_s=limit)

            async def predicted_by_progress() -> Prediction | None:
                answer = await ask(client, sched, running)
                return answer if answer is not None and answer.source == SOURCE_PROGRESS else None

            first = await wait_until(predicted_by_progress, timeout_s=limit, every_s=0.2)
            # the finished jobs took EPOCHS epochs: far fewer iterations left than declared
            assert first.value < planned(sched, running)
            print(
                "records per finished job:",
                [len(h) for h in predictor.progress.finished],
                f"remaining: predicted {first.value:.0f}, declared {planned(sched, running):.0f}",
            )

            # the scheduler asked too, and ONES's view of the job carries that time
            async def scheduler_took_it() -> bool:
                job = sched.scheduler.jobs.get(running) if sched.scheduler else None
                return job is not None and job.predicted_remaining is not None

            await wait_until(scheduler_took_it, timeout_s=limit, every_s=0.1)
            scheduler = sched.scheduler
            assert scheduler is not None and scheduler.layout is not None
            snapshot = build_snapshot(
                time.time(), scheduler.layout, scheduler.jobs, scheduler.estimates,
                scheduler.policy,
            )  # fmt: skip
            [view] = [v for v in snapshot.running if v.job_id == running]
            job = scheduler.jobs[running]
            plain_s = (job.record.total_iterations - job.iteration) * job.est_iteration_s
            assert view.est_remaining_s < plain_s

        # a restarted predictor retrains on the stored histories before it answers
        async with PredictorService(predictor_config) as restarted:
            assert restarted.progress.predictor.trained
            assert restarted.progress.predictor.finished_jobs == FINISHED
            again = await ask(client, sched, running)
            assert again is not None and again.source == SOURCE_PROGRESS
            assert again.value < planned(sched, running)
            print(f"after a restart: {again.value:.0f} of {planned(sched, running):.0f}")


def planned(sched: SchedulerService, job_id: str) -> float:
    assert sched.scheduler is not None
    job = sched.scheduler.jobs[job_id]
    return float(job.record.total_iterations - job.iteration)


async def ask(client: PredictorClient, sched: SchedulerService, job_id: str) -> Prediction | None:
    """The predictor's remaining iterations of a running job, as the scheduler asks."""
    if sched.scheduler is None or job_id not in sched.scheduler.jobs:
        return None
    job = sched.scheduler.jobs[job_id]
    return await client.remaining(
        RemainingRequest(
            job_id=job_id, model=MODEL, batch_size=BATCH, iteration=job.iteration,
            planned=planned(sched, job_id),
        )
    )  # fmt: skip
