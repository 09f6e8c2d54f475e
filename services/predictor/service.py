"""The predictor as a NATS micro service.

Endpoints (group ``gpusched.predictor``, queue group ``q`` so instances share the load):
``iterations``, ``throughput`` and ``slowdown``, each taking a
:class:`~gpusched.libs.common.schemas.PredictRequest` and answering a
:class:`~gpusched.libs.common.schemas.Prediction`. A request is MessagePack, or JSON when its
payload starts with ``{`` (so ``nats req gpusched.predictor.throughput '{...}'`` works);
the reply uses the request's encoding. Errors carry the ``Nats-Service-Error`` and
``Nats-Service-Error-Code`` headers: 400 for a bad request (the description names the
field), 404 for an unknown model, 500 for anything else.

Every instance listens to all progress events (what it learns speeds from) and state
events (a SUCCEEDED job's record gives its model's iteration count).

``iterations`` uses the size forest of services/predictor/sizes.py: a request whose
template (tenant and job name stem) it has learned gets the forest's figure (source
``forest``), any other the baseline answer (the declared figure, source ``declared``,
where the request gives one). Every submission (``gpusched.job.<id>.submitted``) is
predicted so from the job's record, remembered, and stored in the jobs stream on
``gpusched.job.<id>.predicted_size`` for the scheduler; a SUCCEEDED job's record trains the
forest (in a thread) and scores that prediction. ``size_error`` answers the error
figures as a :class:`~gpusched.libs.common.schemas.SizeErrorReport` (any payload; JSON when it
starts with ``{``); the forest's rows and scores are kept under key ``size_rows``.

``remaining`` takes a :class:`~gpusched.libs.common.schemas.RemainingRequest` for a running job and
answers its remaining iterations (a ``Prediction`` of kind ``remaining``): the request's
plain estimate pulled towards ONES's progress predictor, trained on the epoch histories
of the jobs that finished, as far as it is trusted (services/predictor/progress.py;
source ``progress``), else the plain estimate (source ``planned``). The histories are
kept in the same bucket (key ``progress_histories``); a restarted predictor retrains on
them before it answers.

``cpu_profile`` takes a :class:`~gpusched.libs.common.schemas.CpuProfileRequest` and answers the
model's measured :class:`~gpusched.libs.common.schemas.CpuProfile` (404 when there is none;
services/predictor/cpu_profiler.py): a request naming a node has that node's agent
measure it first when none is stored or ``refresh`` is set, and with ``profile_cpu``
configured the predictor asks the node where a job of a model without one first runs.
Every profile stored is published on ``gpusched.model.<model>.cpu_profile`` (the
scheduler's estimates follow it) and kept with the rest of what was learned.
``compute_profile`` does the same for GENIE's
compute profiles (:class:`~gpusched.libs.common.schemas.ComputeProfileRequest`,
services/predictor/compute_profiles.py; ``profile_compute`` configured: measured where a
job of an unprofiled model first runs; published on
``gpusched.model.<model>.compute_profile``). ``measured_profile`` answers a GPU type's
measured profile (:class:`~gpusched.libs.common.schemas.MeasuredProfileRequest`,
services/predictor/measured_profiles.py): node agents hand their measurements in on
``gpusched.node.<node>.measured_profile``, and a request naming a GPU type is timed from
that type's figures. Requests are read and answered by services/predictor/requests.py,
counted in the metrics of services/predictor/metrics.py. What it learned is saved to
the KV bucket ``gpusched_predictor`` every ``save_every_s`` while it changes and
on stop, and read back at start, so a restarted predictor keeps its corrections.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

import msgspec
import structlog
from aiohttp import web
from nats import micro
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

from gpusched.libs.common import codec, natsauth, subjects
from gpusched.libs.common.bus import Stores, close_connection, connect, settle
from gpusched.libs.common.retry import backoff, retry
from gpusched.libs.common.schemas import (
    ComputeProfileRequest,
    CpuProfileRequest,
    JobProgressEvent,
    JobRecord,
    JobState,
    JobStateEvent,
    JobSubmitted,
    MeasuredProfileRequest,
    Prediction,
    PredictRequest,
    RemainingRequest,
    SizePredicted,
)
from gpusched.libs.common.tasks import cancel_and_wait, close_within
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.perf import UnknownModelError
from gpusched.services.predictor.compute_profiles import ComputeProfiler
from gpusched.services.predictor.config import PredictorConfig
from gpusched.services.predictor.cpu_profiler import CpuProfiler
from gpusched.services.predictor.measured_profiles import MeasuredProfiles
from gpusched.services.predictor.metrics import PredictorMetrics, serve_metrics
from gpusched.services.predictor.model import BaselinePredictor, Learned
from gpusched.services.predictor.progress import (
    DEFAULT_EPOCH_SAMPLES,
    ProgressLearner,
    StoredHistories,
)
from gpusched.services.predictor.requests import (
    BadRequest,
    decode_as,
    decode_or_400,
    one_line,
    serve,
)
from gpusched.services.predictor.sizes import (
    SOURCE_FOREST,
    SizeLearner,
    StoredSizes,
    predicted_size,
    predicted_size_msg_id,
    request_of,
)

SERVICE_NAME = "gpusched-predictor"
SERVICE_DESCRIPTION = (
    "Predicts iterations, throughput and co-location slowdown of training jobs from "
    "profiles corrected by measured progress"
)
#: SUCCEEDED job ids remembered so that a repeated state event is counted once
MAX_REMEMBERED_COMPLETIONS = 100_000
#: room left in a NATS message beside the stored size rows (headers, the KV subject)
STORED_HEADROOM_BYTES = 4096
#: one attempt to store a predicted size, and how many (0.1 s doubling to 2 s between)
PUBLISH_TIMEOUT_S = 2.0
SIZE_PUBLISH_ATTEMPTS = 8
#: the longest the save on stop may take (up to three KV puts, each of them bounded by
#: the JetStream publish timeout) before the predictor stops without it
SAVE_ON_STOP_S = 20.0

log = structlog.get_logger("gpusched.predictor")

Answer = Callable[[Any], Prediction]


def service_version() -> str:
    try:
        return metadata.version("gpusched")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class PredictorService:
    """``async with PredictorService(config) as service:`` runs it until the block ends."""

    def __init__(self, config: PredictorConfig, predictor: BaselinePredictor | None = None):
        self.config = config
        self.predictor = predictor or BaselinePredictor(
            load_performance_model(config.data_dir), history_weight=config.history_weight
        )
        self.metrics = PredictorMetrics()
        self.progress = ProgressLearner()
        self.sizes = SizeLearner()
        self._saved_sizes = 0
        #: job id -> samples in an epoch of its data set (from its record)
        self._epoch_samples: OrderedDict[str, float] = OrderedDict()
        self._saved_histories = 0
        self._training: asyncio.Task[None] | None = None
        self._nc: Client | None = None
        self._stores: Stores | None = None
        self._service: Service | None = None
        self._subscriptions: list[Subscription] = []
        self._http: web.AppRunner | None = None
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._learned_kv: KeyValue | None = None
        self._saved_changes = 0
        self._saver: asyncio.Task[None] | None = None
        #: set by stop: the periodic save ends even where a cancellation was lost
        self._stopping = False
        #: Synergy's CPU profiles (services/predictor/cpu_profiler.py)
        self.cpu = CpuProfiler(self.predictor, config.profile_timeout_s, self._save_learned)
        #: GENIE's compute profiles (services/predictor/compute_profiles.py)
        self.compute = ComputeProfiler(self.predictor, config.profile_timeout_s)
        #: measured profiles per GPU type (services/predictor/measured_profiles.py)
        self.measured = MeasuredProfiles(self.predictor, shipped=config.shipped_profiles)

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> PredictorService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self._stopping = False
        self._nc = await connect(self.config.nats_url, SERVICE_NAME)
        try:
            self._stores = await Stores.open(self._nc)
            self._learned_kv = await self._stores.predictor_bucket()
            await self._restore_learned()
            await self._restore_histories()
            await self._restore_sizes()
            self.cpu.start(self._nc)
            await self.compute.start(self._nc, self._learned_kv)
            await self.measured.start(self._nc, self._learned_kv, self._stores.nodes)
            self._service = await micro.add_service(
                self._nc,
                name=SERVICE_NAME,
                version=service_version(),
                description=SERVICE_DESCRIPTION,
                metadata={"data_dir": str(self.config.data_dir or "builtin")},
            )
            group = self._service.add_group(name=subjects.PREDICTOR_GROUP)
            endpoints: dict[str, Answer] = {
                subjects.PREDICT_ITERATIONS: self.iterations,
                subjects.PREDICT_THROUGHPUT: self.predictor.throughput,
                subjects.PREDICT_SLOWDOWN: self.predictor.slowdown,
            }
            for subject, answer in endpoints.items():
                name = subject.removeprefix(subjects.PREDICTOR_GROUP + ".")
                await group.add_endpoint(name=name, handler=self._handler(name, answer))
            await group.add_endpoint(
                name=subjects.PREDICT_REMAINING.removeprefix(subjects.PREDICTOR_GROUP + "."),
                handler=self._handler("remaining", self.progress.remaining, RemainingRequest),
            )
            await group.add_endpoint(
                name=subjects.PREDICT_CPU_PROFILE.removeprefix(subjects.PREDICTOR_GROUP + "."),
                handler=self._answer_cpu_profile,
            )
            await group.add_endpoint(
                name=subjects.PREDICT_COMPUTE_PROFILE.removeprefix(subjects.PREDICTOR_GROUP + "."),
                handler=self._answer_compute_profile,
            )
            await group.add_endpoint(
                name=subjects.PREDICT_MEASURED_PROFILE.removeprefix(subjects.PREDICTOR_GROUP + "."),
                handler=self._answer_measured_profile,
            )
            await group.add_endpoint(
                name=subjects.PREDICT_SIZE_ERROR.removeprefix(subjects.PREDICTOR_GROUP + "."),
                handler=self._answer_size_error,
            )
            self._subscriptions = [
                await self._nc.subscribe(subjects.ALL_JOB_PROGRESS, cb=self._on_progress),
                await self._nc.subscribe(subjects.ALL_JOB_STATES, cb=self._on_state),
                await self._nc.subscribe(subjects.ALL_JOB_SUBMISSIONS, cb=self._on_submitted),
            ]
            if self.config.metrics_port is not None:
                self._http = await serve_metrics(
                    self.config.metrics_host, self.config.metrics_port, self.metrics_text,
                    lambda: self._nc is not None and self._nc.is_connected,
                )
            self._saver = asyncio.create_task(self._save_periodically(), name="predictor-save")
            await settle(self._nc)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "predictor started",
            nats_url=natsauth.redact(self.config.nats_url),
            data_dir=str(self.config.data_dir or "builtin"),
            models=len(self.predictor.models()),
            metrics=self.metrics_url,
        )

    async def stop(self) -> None:
        """Stop learning and answering, save what changed, close. Every step is bounded
        (libs/common/tasks.py): one that hangs is logged and the rest still close."""
        self._stopping = True
        if self._training is not None:
            await cancel_and_wait(self._training)
            self._training = None
        await self.cpu.stop()
        await self.compute.stop()
        await self.measured.stop()
        await self.sizes.stop()
        if self._saver is not None:
            # a cancellation can be lost inside a KV put (asyncio.wait_for in Python
            # 3.11 returns a reply that arrives as it is cancelled): cancel_and_wait
            # cancels again, and _stopping ends the loop meanwhile
            saver, self._saver = self._saver, None
            await cancel_and_wait(saver)
            await close_within(self._save_learned(), "predictor: save on stop", SAVE_ON_STOP_S)
        if self._http is not None:
            http, self._http = self._http, None
            await close_within(http.cleanup(), "predictor: metrics server cleanup")
        if self._service is not None:
            service, self._service = self._service, None
            await close_within(service.stop(), "predictor: micro service stop")
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
        nc, self._nc = self._nc, None
        if nc is not None:
            await close_connection(nc, SERVICE_NAME)
            log.info("predictor stopped")

    @property
    def service_id(self) -> str | None:
        """This instance's id in ``$SRV`` answers (None when stopped)."""
        return self._service.id if self._service is not None else None

    @property
    def metrics_url(self) -> str | None:
        if self._http is None or not self._http.addresses:
            return None
        host, port = self._http.addresses[0][:2]
        return f"http://{host}:{port}/metrics"

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    # ----------------------------------------------------------------- requests

    def iterations(self, req: PredictRequest) -> Prediction:
        """The size forest's figure for a template it has learned, else the baseline's
        (which also checks the request)."""
        baseline = self.predictor.iterations(req)
        forest = self.sizes.predict(req)
        if forest is None:
            return baseline
        return Prediction(model=req.model, kind="iterations", value=forest, source=SOURCE_FOREST)

    def _handler(
        self, endpoint: str, answer: Answer, kind: type[msgspec.Struct] = PredictRequest
    ) -> Callable[[Request], Awaitable[None]]:
        async def handle(request: Request) -> None:
            await self._answer(endpoint, answer, request, kind)

        return handle

    async def _answer(
        self, endpoint: str, answer: Answer, request: Request, kind: type[msgspec.Struct]
    ) -> None:
        async def work() -> tuple[msgspec.Struct, bool]:
            try:
                req, as_json = decode_as(request.data, request.headers, kind)
                return answer(req), as_json
            except (BadRequest, ValueError) as exc:
                raise ServiceError("400", one_line(str(exc))) from None
            except UnknownModelError as exc:
                raise ServiceError("404", one_line(str(exc))) from None
            except Exception as exc:
                log.exception("prediction failed", endpoint=endpoint)
                raise ServiceError("500", one_line(f"internal error: {exc!r}")) from None

        await serve(self.metrics, endpoint, request, work)

    async def _answer_cpu_profile(self, request: Request) -> None:
        async def work() -> tuple[msgspec.Struct, bool]:
            wanted, as_json = decode_or_400(request, CpuProfileRequest)
            return await self.cpu.answer(wanted), as_json

        await serve(self.metrics, "cpu_profile", request, work)

    async def _answer_measured_profile(self, request: Request) -> None:
        async def work() -> tuple[msgspec.Struct, bool]:
            wanted, as_json = decode_or_400(request, MeasuredProfileRequest)
            return self.measured.answer(wanted), as_json

        await serve(self.metrics, "measured_profile", request, work)

    async def _answer_size_error(self, request: Request) -> None:
        async def work() -> tuple[msgspec.Struct, bool]:
            return self.sizes.report(), request.data.lstrip()[:1] == b"{"

        await serve(self.metrics, "size_error", request, work)

    async def _answer_compute_profile(self, request: Request) -> None:
        async def work() -> tuple[msgspec.Struct, bool]:
            wanted, as_json = decode_or_400(request, ComputeProfileRequest)
            return await self.compute.answer(wanted), as_json

        await serve(self.metrics, "compute_profile", request, work)

    # ----------------------------------------------------------------- learning

    async def _on_progress(self, msg: Msg) -> None:
        try:
            event = codec.decode(msg.data, JobProgressEvent)
        except msgspec.DecodeError as exc:
            self.metrics.observations.labels("progress", "invalid").inc()
            log.warning("unreadable progress event", subject=msg.subject, error=str(exc))
            return
        if not subjects.matches_sender(msg.subject, event.node, event.job_id):
            # the subject names the node that sent it; a payload naming another is forged
            self.metrics.observations.labels("progress", "invalid").inc()
            log.warning("progress event claiming another node or job dropped",
                        subject=msg.subject, claimed_node=event.node[:64])
            return
        if event.progress.epoch is not None:
            await self._observe_epochs(event)
        try:
            gpu_type = await self.measured.gpu_type_of(event.node)
            learned = self.predictor.observe_progress(event, gpu_type)
        except (UnknownModelError, ValueError) as exc:
            # a job running a model without a profile reports every second: stay quiet
            self.metrics.observations.labels("progress", "invalid").inc()
            log.debug("progress event not usable", job_id=event.job_id, error=str(exc))
            return
        except Exception:
            self.metrics.observations.labels("progress", "invalid").inc()
            log.exception("learning from a progress event failed", job_id=event.job_id)
            return
        self.metrics.observations.labels("progress", "learned" if learned else "ignored").inc()

    async def _on_state(self, msg: Msg) -> None:
        try:
            event = codec.decode(msg.data, JobStateEvent)
        except msgspec.DecodeError as exc:
            log.warning("unreadable state event", subject=msg.subject, error=str(exc))
            return
        try:
            if event.state.terminal:
                self.predictor.forget_job(event.job_id)
                self._epoch_samples.pop(event.job_id, None)
                if event.state is not JobState.SUCCEEDED:
                    self.progress.forget(event.job_id)
                    self.sizes.forget(event.job_id)
            if event.state is JobState.SUCCEEDED and event.job_id not in self._completed:
                await self._learn_completion(event.job_id)
            if self.config.profile_cpu and event.state is JobState.RUNNING and event.placement:
                assert self._stores is not None
                self.cpu.on_running(event, self._stores)
            if self.config.profile_compute and event.state is JobState.RUNNING and event.placement:
                assert self._stores is not None
                self.compute.on_running(event, self._stores)
        except Exception:
            self.metrics.observations.labels("completion", "invalid").inc()
            log.exception("learning from a completed job failed", job_id=event.job_id)

    async def _on_submitted(self, msg: Msg) -> None:
        """Predict a submitted job's iterations from its record, as ``iterations``
        answers, and remember it to score once the job succeeds."""
        assert self._stores is not None
        try:
            job_id = codec.decode(msg.data, JobSubmitted).job_id
            entry = await self._stores.jobs.get(job_id)
            record = codec.decode(entry.value or b"", JobRecord)
        except Exception as exc:  # unreadable, no record, NATS away: not predicted
            log.debug("submission not predicted", subject=msg.subject, error=repr(exc))
            return
        request = request_of(record)
        try:
            # a forest's prediction takes ~2.5 ms: beside the loop, which keeps answering
            guess = await asyncio.to_thread(self.iterations, request)
            value, source = guess.value, guess.source
        except (UnknownModelError, ValueError):  # a model without a profile
            value, source = float(record.total_iterations), "declared"
        self.sizes.submitted(job_id, value, source)
        await self._tell_size(predicted_size(job_id, value, source, time.time()))

    async def _tell_size(self, predicted: SizePredicted) -> None:
        """Store a job's predicted size in the jobs stream, for the scheduler, retried
        while the server does not acknowledge it (deduplicated by its message id)."""
        assert self._stores is not None
        js = self._stores.js
        data = codec.encode(predicted)
        headers = codec.headers({"Nats-Msg-Id": predicted_size_msg_id(predicted.job_id)})

        async def publish() -> None:
            await js.publish(subjects.job_predicted_size(predicted.job_id), data,
                             headers=headers, timeout=PUBLISH_TIMEOUT_S)

        delays = itertools.islice(backoff(0.1, 2.0), SIZE_PUBLISH_ATTEMPTS)
        try:
            await retry(publish, delays=delays)
        except Exception as exc:  # NATS away for long: the job keeps its declared size
            log.warning("predicted size not stored", job_id=predicted.job_id, error=repr(exc))

    async def _observe_epochs(self, event: JobProgressEvent) -> None:
        """Add the event's epoch to its job's history (the job's record gives the size
        of its data set, read once per job)."""
        samples = self._epoch_samples.get(event.job_id)
        if samples is None:
            assert self._stores is not None
            try:
                entry = await self._stores.jobs.get(event.job_id)
                spec = codec.decode(entry.value or b"", JobRecord).spec
            except Exception as exc:  # no record, or NATS away: the next event tries again
                log.debug("no data set size for a job", job_id=event.job_id, error=repr(exc))
                return
            samples = float(spec.dataset_size or DEFAULT_EPOCH_SAMPLES)
            self._epoch_samples[event.job_id] = samples
            while len(self._epoch_samples) > MAX_REMEMBERED_COMPLETIONS:
                self._epoch_samples.popitem(last=False)
        self.progress.observe(event.job_id, samples, event.batch_size, event.progress)

    def _retrain(self) -> None:
        """Retrain the progress predictor beside the event loop if that is due and no
        training runs (a training that ends checks again)."""
        if (
            self._training is None
            and not self._stopping
            and self.progress.predictor.retrain_due()
        ):
            self._training = asyncio.create_task(self._train(), name="progress-training")

    async def _train(self) -> None:
        try:
            while self.progress.predictor.retrain_due():
                trained = self.progress.predictor.snapshot()
                await asyncio.to_thread(trained.train)
                self.progress.predictor.take_network(trained)
                log.info("progress predictor trained", jobs=trained.finished_jobs)
        except Exception:
            log.exception("training the progress predictor failed")
        finally:
            self._training = None

    async def _learn_completion(self, job_id: str) -> None:
        bound = log.bind(job_id=job_id)
        assert self._stores is not None
        try:
            entry = await self._stores.jobs.get(job_id)
        except KeyNotFoundError:
            self.metrics.observations.labels("completion", "invalid").inc()
            bound.warning("succeeded job has no record")
            return
        if entry.value is None:
            return
        try:
            record = codec.decode(entry.value, JobRecord)
        except msgspec.DecodeError as exc:
            self.metrics.observations.labels("completion", "invalid").inc()
            bound.warning("unreadable job record", error=str(exc))
            return
        # the epochs it took, whatever its model
        if self.progress.finish(job_id, record.progress.iteration or record.total_iterations):
            self._retrain()
        if self.sizes.completed(job_id, record):
            self.metrics.size_errors(self.sizes.report())
            self.sizes.retrain_soon()
        try:
            self.predictor.observe_completion(record.spec.model, record.total_iterations)
        except (UnknownModelError, ValueError) as exc:
            self.metrics.observations.labels("completion", "invalid").inc()
            bound.debug("completed job not usable", error=str(exc))
            return
        self._completed[job_id] = None
        while len(self._completed) > MAX_REMEMBERED_COMPLETIONS:
            self._completed.popitem(last=False)
        self.metrics.observations.labels("completion", "learned").inc()
        bound.debug(
            "learned iterations", model=record.spec.model, iterations=record.total_iterations
        )

    # ----------------------------------------------------------------- persistence

    async def _restore_learned(self) -> None:
        assert self._learned_kv is not None
        try:
            entry = await self._learned_kv.get(subjects.PREDICTOR_LEARNED_KEY)
        except KeyNotFoundError:
            return
        if not entry.value:
            return
        try:
            learned = codec.decode(entry.value, Learned)
        except msgspec.DecodeError as exc:
            log.warning("stored learning unreadable; starting from the profiles", error=str(exc))
            return
        taken = self.predictor.restore(learned)
        self._saved_changes = self.predictor.changes
        log.info("restored what was learned", entries=taken)

    async def _restore_histories(self) -> None:
        """Take back the epoch histories and retrain on the finished ones before
        answering, so a restart loses no learned job."""
        assert self._learned_kv is not None
        try:
            entry = await self._learned_kv.get(subjects.PREDICTOR_HISTORIES_KEY)
            stored = codec.decode(entry.value or b"", StoredHistories)
        except KeyNotFoundError:
            return
        except msgspec.DecodeError as exc:
            log.warning("stored epoch histories unreadable; starting without", error=str(exc))
            return
        taken = self.progress.restore(stored)
        self._saved_histories = self.progress.changes
        self._retrain()
        if self._training is not None:
            await self._training
        log.info("restored epoch histories", histories=taken)

    async def _restore_sizes(self) -> None:
        """Take back the size forest's rows and scores and retrain on them (in a
        thread) before answering."""
        assert self._learned_kv is not None
        try:
            entry = await self._learned_kv.get(subjects.PREDICTOR_SIZES_KEY)
            stored = codec.decode(entry.value or b"", StoredSizes)
            self.sizes = await asyncio.to_thread(SizeLearner.restore, stored)
        except KeyNotFoundError:
            return
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("stored size rows unreadable; starting without", error=str(exc))
            return
        self.metrics.size_errors(self.sizes.report())
        log.info("restored the size forest", rows=len(self.sizes.forest.rows),
                 scored=len(self.sizes.errors.predictions))

    def _stored_sizes(self) -> StoredSizes:
        limit = self._nc.max_payload - STORED_HEADROOM_BYTES if self._nc is not None else None
        return self.sizes.stored(limit)

    async def _save_periodically(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.save_every_s)
            await self._save_learned()

    async def _save_learned(self) -> None:
        """Save what changed since the last save: the epoch histories, what else was
        learned."""
        histories = self.progress.changes
        if histories != self._saved_histories and await self._put(
            subjects.PREDICTOR_HISTORIES_KEY, self.progress.stored, "epoch histories"
        ):
            self._saved_histories = histories
        sizes = self.sizes.changes
        if sizes != self._saved_sizes and await self._put(
            subjects.PREDICTOR_SIZES_KEY, self._stored_sizes, "size rows"
        ):
            self._saved_sizes = sizes
        changes = self.predictor.changes
        if changes != self._saved_changes and await self._put(
            subjects.PREDICTOR_LEARNED_KEY, self.predictor.learned, "what was learned"
        ):
            self._saved_changes = changes

    async def _put(self, key: str, value: Callable[[], msgspec.Struct], what: str) -> bool:
        if self._learned_kv is None:
            return False
        try:
            await self._learned_kv.put(key, codec.encode(value()))
        except Exception as exc:  # NATS may be restarting: the next round tries again
            log.warning(f"saving {what} failed", error=str(exc))
            return False
        return True


async def run(config: PredictorConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set."""
    async with PredictorService(config):
        await stop.wait()
