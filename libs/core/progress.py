"""How far along a training job is: a small MLP that predicts the fraction of its epochs
a job has done, learned from the jobs that finished (ONES's progress predictor).

Features of one epoch record: the data set's size (log), the epochs done (log1p), the
validation metric and the loss relative to their first-epoch values (1 where a job does
not report them). The network outputs the two parameters of a Beta distribution over
"fraction done" and is trained on every epoch of every finished job (epoch k of E gives
the target k / E) by maximum likelihood. ONES samples from that Beta; we use its mean,
so the same inputs always give the same answer.

Training is deterministic (seeded, double precision) and retrains as jobs finish: when
the number of finished jobs has grown by half (and by at least one) since the last
training, so a long trace trains a logarithmic number of times.

torch is imported on first training, so drivers that never predict progress never pay
for it; without torch (installed by the ``train`` extra) training raises
``MissingExtraError`` naming the extra.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpusched.libs.core.extras import TRAIN, require

#: a job needs this many epochs done before it gets a prediction (ONES's rule)
MIN_EPOCHS = 2.0
#: finished jobs of a data set that count as much as the prior estimate (see ``trust``)
PRIOR_JOBS = 3
#: a Beta target must stay inside (0, 1)
_EDGE = 1e-3


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """What a job reported after an epoch."""

    #: samples in one epoch of its data set
    epoch_samples: float
    #: epochs done so far (fractional after a resize mid-epoch)
    epochs: float
    #: validation metric now and after its first epoch; None: not reported
    metric: float | None = None
    first_metric: float | None = None
    #: training loss now and after its first epoch; None: not reported
    loss: float | None = None
    first_loss: float | None = None

    def features(self) -> list[float]:
        return [
            math.log10(max(self.epoch_samples, 1.0)),
            math.log1p(max(self.epochs, 0.0)),
            _ratio(self.metric, self.first_metric),
            _ratio(self.loss, self.first_loss),
        ]


def _ratio(now: float | None, first: float | None) -> float:
    if now is None or first is None or first == 0 or not math.isfinite(now / first):
        return 1.0
    return now / first


FEATURES = 4


@dataclass
class ProgressPredictor:
    """Fraction of its epochs a job has done, learned from finished jobs."""

    seed: int = 0
    hidden: int = 16
    steps: int = 150
    learning_rate: float = 0.01
    #: most epoch records kept for training (evenly thinned beyond it)
    max_records: int = 4_000
    #: most records one finished job contributes
    records_per_job: int = 50
    #: finished jobs needed before the first training
    min_jobs: int = 3
    #: retrain once the finished jobs have grown by this factor since the last training
    retrain_growth: float = 1.5
    _inputs: list[list[float]] = field(default_factory=list, repr=False)
    _targets: list[float] = field(default_factory=list, repr=False)
    _jobs: int = field(default=0, repr=False)
    #: data set size -> the most epochs a finished job of it took, and how many finished
    _longest: dict[float, float] = field(default_factory=dict, repr=False)
    _finished_of: dict[float, int] = field(default_factory=dict, repr=False)
    _trained_at: int = field(default=0, repr=False)
    _network: Any = field(default=None, repr=False)
    #: feature means and spreads of the training data: the network sees standardised
    #: inputs, which it fits far better than raw ones of different scales
    _centre: Any = field(default=None, repr=False)
    _spread: Any = field(default=None, repr=False)

    @property
    def trained(self) -> bool:
        return self._network is not None

    @property
    def finished_jobs(self) -> int:
        return self._jobs

    def add_finished(self, history: Sequence[EpochRecord]) -> None:
        """Every epoch of a job that finished: epoch ``k`` of ``E`` was ``k / E`` done."""
        total = max((r.epochs for r in history), default=0.0)
        if total <= 0:
            return
        step = max(1, math.ceil(len(history) / self.records_per_job))
        for record in history[::step]:
            self._inputs.append(record.features())
            self._targets.append(min(1 - _EDGE, max(_EDGE, record.epochs / total)))
        self._jobs += 1
        data_set = history[0].epoch_samples
        self._longest[data_set] = max(self._longest.get(data_set, 0.0), total)
        self._finished_of[data_set] = self._finished_of.get(data_set, 0) + 1
        if len(self._inputs) > self.max_records:
            keep = range(0, len(self._inputs), math.ceil(len(self._inputs) / self.max_records))
            self._inputs = [self._inputs[i] for i in keep]
            self._targets = [self._targets[i] for i in keep]

    def retrain_due(self) -> bool:
        jobs = self._jobs
        grown = max(self._trained_at + 1, self.retrain_growth * self._trained_at)
        return jobs >= self.min_jobs and jobs >= grown

    def train(self) -> None:
        require("torch", TRAIN, "the progress predictor")
        import torch

        # one thread: the network is tiny, so more threads only wait on each other (on a
        # busy machine a training took seconds instead of a fraction), and the answer
        # must not depend on how many cores the machine has
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._train(torch)
        finally:
            torch.set_num_threads(threads)

    def _train(self, torch: Any) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        network = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, self.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, self.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, 2),
        ).double()
        with torch.no_grad():
            for parameter in network.parameters():
                bound = 1 / math.sqrt(parameter.shape[-1])
                parameter.uniform_(-bound, bound, generator=generator)
        inputs = torch.tensor(self._inputs, dtype=torch.float64)
        self._centre = inputs.mean(dim=0)
        self._spread = inputs.std(dim=0, unbiased=False).clamp_min(1e-6)
        inputs = (inputs - self._centre) / self._spread
        targets = torch.tensor(self._targets, dtype=torch.float64)
        optimizer = torch.optim.Adam(network.parameters(), lr=self.learning_rate)
        for _ in range(self.steps):
            optimizer.zero_grad()
            alpha, beta = _beta(network(inputs))
            loss = -torch.distributions.Beta(alpha, beta).log_prob(targets).mean()
            loss.backward()
            optimizer.step()
        network.eval()
        self._network = network
        self._trained_at = self._jobs

    def fraction_done(self, record: EpochRecord) -> float | None:
        """The mean of the predicted Beta; None before training, before the job has done
        ``MIN_EPOCHS`` epochs, or for a data set no finished job has trained on (the
        network extrapolates badly there: it called jobs of an unseen data set nearly
        done when they had most of their epochs to go)."""
        if not self._predicts_for(record):
            return None
        import torch

        with torch.no_grad():
            inputs = torch.tensor([record.features()], dtype=torch.float64)
            inputs = (inputs - self._centre) / self._spread
            alpha, beta = _beta(self._network(inputs))
        mean = float(alpha[0] / (alpha[0] + beta[0]))
        return min(1 - _EDGE, max(_EDGE, mean))

    def _predicts_for(self, record: EpochRecord) -> bool:
        return (
            self._network is not None
            and record.epochs >= MIN_EPOCHS
            and record.epoch_samples in self._longest
        )

    def trust(self, record: EpochRecord) -> float:
        """How far to follow the prediction for this record's data set over a prior
        estimate: ``n / (n + PRIOR_JOBS)`` for ``n`` finished jobs of the data set
        learned from (0 where it gives no prediction)."""
        if not self._predicts_for(record):
            return 0.0
        finished = self._finished_of[record.epoch_samples]
        return finished / (finished + PRIOR_JOBS)

    def total_epochs(self, record: EpochRecord) -> float | None:
        """Epochs the job will take in all: ``epochs / fraction_done``, at least one more
        than done (it is still running) and at most twice the longest finished job of
        its data set (a small predicted fraction early on would otherwise make it
        hundreds of times too long)."""
        fraction = self.fraction_done(record)
        if fraction is None:
            return None
        longest = 2 * self._longest[record.epoch_samples]
        return max(record.epochs + 1, min(record.epochs / fraction, longest))

    def snapshot(self) -> ProgressPredictor:
        """A copy to train away from this predictor (in another thread, say) while this
        one goes on answering; :meth:`take_network` then installs its network here."""
        return copy.deepcopy(self)

    def take_network(self, trained: ProgressPredictor) -> None:
        """Predict with the network of ``trained`` (a :meth:`snapshot` of this predictor,
        trained since) from now on. Jobs added here meanwhile count from the next
        training on, as a retraining then sees them."""
        self._network, self._centre, self._spread = (
            trained._network,
            trained._centre,
            trained._spread,
        )
        self._trained_at = trained._trained_at


def blended_remaining_iterations(
    predictor: ProgressPredictor,
    last: EpochRecord,
    samples_done: float,
    batch_size: int,
    planned: float,
) -> float:
    """Iterations a job has left: ``planned`` (the estimate every policy uses) pulled
    towards the progress predictor's ``total_epochs`` as far as it is trusted for the
    job's data set (``trust``); ``planned`` where it gives no prediction. ``last`` is the
    job's latest epoch record and ``samples_done`` what it has trained on so far."""
    epochs = predictor.total_epochs(last)
    if epochs is None:
        return planned
    predicted = max(0.0, epochs * last.epoch_samples - samples_done)
    trust = predictor.trust(last)
    return trust * predicted / batch_size + (1 - trust) * planned


def _beta(output: Any) -> tuple[Any, Any]:
    import torch

    positive = torch.nn.functional.softplus(output) + 1e-3
    return positive[:, 0], positive[:, 1]
