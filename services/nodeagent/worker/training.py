"""Training with gradient accumulation, periodic checkpoints and exact resumption.

One iteration processes the global batch ``B`` as ``k`` accumulation steps of ``B/k``
samples each, every step's loss scaled by ``1/k``, followed by one optimizer step: the
effective batch and the learning rate do not depend on ``k``, so the scheduler may change
``k`` between runs of the same job (for example when it moves the job to fewer GPUs).

A job given several GPUs on its node trains data-parallel: one process per GPU (rank),
each taking its share of every global batch, with DistributedDataParallel averaging the
gradients (NCCL on GPUs, gloo on the CPU). Each sample's loss is weighted by its share of
the global batch, so any number of ranks and accumulation steps computes the gradient of
the same full-batch mean loss, and a checkpoint written by one shape resumes in another.

The inputs come through the CPU input pipeline (:mod:`.pipeline`), whose worker processes
and torch's threads follow the cores the run is pinned to, and whose cache of decoded
samples is bounded by the run's memory; both follow a reallocation while the job runs.
The learning rate follows the global batch (:mod:`.schedule`), and after every change
ramps to its new value over an epoch. Rank 0 measures the accuracy on a held-out set at
the end of every epoch and reports it with the epochs done and the rate.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import structlog
import torch
from torch import Tensor, nn

from gpusched.libs.sdk import JobContext, resident_set_mb
from gpusched.services.nodeagent.worker.architectures import (
    AnySpec,
    build_network,
    correct_of,
    data_for,
    description,
    identity,
    loss_function,
)
from gpusched.services.nodeagent.worker.catalog import CpuCost
from gpusched.services.nodeagent.worker.pipeline import (
    DEFAULT_DATASET_SIZE,
    DataSet,
    DecodedCache,
    InputPipeline,
    cache_budget_bytes,
    held_out_images,
    workers_for,
)
from gpusched.services.nodeagent.worker.schedule import LearningRateRule, Ramp, epoch_iterations

log = structlog.get_logger("gpusched.worker")

#: version of the checkpoint layout written by :meth:`Trainer.state`
CHECKPOINT_FORMAT = 2
DEFAULT_LEARNING_RATE = 0.01
MOMENTUM = 0.9
#: samples of the held-out set the accuracy is measured on
HELD_OUT_SAMPLES = 64

LossFunction = Callable[[Tensor, Tensor], Tensor]
Outcome = Literal["done", "stopped"]


class CheckpointMismatchError(RuntimeError):
    pass


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_function: LossFunction,
    inputs: Tensor,
    targets: Tensor,
    accum_steps: int,
    after_accumulation_step: Callable[[int], None] | None = None,
    *,
    share: float = 1.0,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> float:
    """One iteration: ``accum_steps`` forward/backward passes, then one optimizer step.

    ``share`` is this rank's gradient weight (its samples over the global batch, times the
    number of ranks that average their gradients); 1 for a single process. ``no_sync``
    skips the gradient all-reduce of every accumulation step but the last.

    Returns this rank's part of the batch loss. Gradients stay in ``.grad`` until the
    next call.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    batch_size = inputs.shape[0]
    if batch_size < accum_steps:
        raise ValueError(f"batch size {batch_size} is below accum_steps {accum_steps}")
    optimizer.zero_grad(set_to_none=True)
    batch_loss = torch.zeros((), device=inputs.device)
    steps = zip(
        inputs.tensor_split(accum_steps), targets.tensor_split(accum_steps), strict=True
    )
    for step, (step_inputs, step_targets) in enumerate(steps):
        last = step == accum_steps - 1
        weight = share * step_inputs.shape[0] / batch_size
        with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
            loss = loss_function(model(step_inputs), step_targets) * weight
            loss.backward()
        batch_loss += loss.detach()
        if after_accumulation_step is not None:
            after_accumulation_step(step)
    optimizer.step()
    return float(batch_loss)


def make_optimizer(model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=MOMENTUM)


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    """``learning_rate`` applies at a global batch of ``base_batch_size`` (None: the
    batch the job was checkpointed with first, else this run's) and scales linearly with
    the batch up to ``max_lr``; the data set has ``dataset_size`` samples, each costing
    ``cpu_cost`` in the input pipeline."""

    seed: int = 0
    learning_rate: float = DEFAULT_LEARNING_RATE
    max_lr: float | None = None
    base_batch_size: int | None = None
    dataset_size: int = DEFAULT_DATASET_SIZE
    cpu_cost: CpuCost = field(default_factory=CpuCost)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.max_lr is not None and not self.max_lr > 0:
            raise ValueError(f"max_lr must be > 0, got {self.max_lr}")
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ValueError(f"base_batch_size must be >= 1, got {self.base_batch_size}")
        if self.dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {self.dataset_size}")

    def rule(self, base_batch: int) -> LearningRateRule:
        return LearningRateRule(self.learning_rate, base_batch, self.max_lr)


@dataclass(frozen=True, slots=True)
class Resources:
    """This process's part of the run's allocation: cores (its pipeline workers and torch
    threads) and host memory (its cache; None: no allocation)."""

    cores: int = 1
    mem_gb: float | None = None

    @classmethod
    def of(cls, ctx: JobContext, ranks: int = 1) -> Resources:
        """An equal part of the job's allocation on this node for each of its ``ranks``."""
        ranks = max(1, ranks)
        mem_gb = None if ctx.mem_gb is None else ctx.mem_gb / ranks
        return cls(max(1, ctx.cpu_threads // ranks), mem_gb)


@dataclass(frozen=True, slots=True)
class DebugHooks:
    """Test hooks: ``iteration_log`` gets one line per executed iteration; the iteration
    numbered ``hold_at_iteration`` pauses after its first accumulation step until a stop
    is requested, which makes a preemption land in the middle of an iteration."""

    iteration_log: Path | None = None
    hold_at_iteration: int | None = None


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This process's place among the ranks of a data-parallel run."""

    rank: int
    world_size: int
    #: where the ranks meet, e.g. ``tcp://127.0.0.1:29500``
    init_method: str
    #: rank among the job's processes on this node: its GPU is ``cuda:<local_rank>``
    local_rank: int = 0
    timeout_s: float = 300.0
    #: the job's processes on this node, which share its cores and memory there
    local_ranks: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")


@contextlib.contextmanager
def process_group(parallel: DataParallel | None, device: str) -> Iterator[None]:
    """Join the ranks (NCCL on CUDA, gloo on the CPU) for the block; nothing for one rank."""
    if parallel is None or parallel.world_size == 1:
        yield
        return
    import torch.distributed as dist

    if device.startswith("cuda"):
        # NCCL's own buffers go to the current device: make it this rank's GPU
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=parallel.init_method,
        rank=parallel.rank,
        world_size=parallel.world_size,
        timeout=datetime.timedelta(seconds=parallel.timeout_s),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class Trainer:
    """A zoo model or a real architecture, its optimizer and its data, on one device (one rank of a
    data-parallel run when ``parallel`` is given; the process group must be up).

    With ``resources`` the trainer sets torch's threads (``threads``, default one per
    core) and runs its input pipeline on worker processes, one per core; without, it
    leaves torch's threads alone and prepares its inputs in this process. Call
    :meth:`close` when done: it stops the workers.
    """

    def __init__(
        self,
        spec: AnySpec,
        *,
        batch_size: int,
        accum_steps: int,
        device: str,
        options: TrainingOptions,
        parallel: DataParallel | None = None,
        resources: Resources | None = None,
        threads: int | None = None,
    ) -> None:
        ranks = parallel.world_size if parallel is not None else 1
        if batch_size < ranks * accum_steps:
            raise ValueError(
                f"batch_size {batch_size} leaves no sample for some of {ranks} ranks x "
                f"{accum_steps} accumulation steps"
            )
        self.spec = spec
        self.batch_size = batch_size
        self.accum_steps = accum_steps
        self.device = torch.device(device)
        self.options = options
        self.parallel = parallel if ranks > 1 else None
        self.threads = threads
        torch.manual_seed(options.seed)
        #: the bare model: its state is what checkpoints hold, whatever the number of ranks
        self.net = build_network(spec).to(self.device)
        self.model: nn.Module = self.net
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        if self.parallel is not None:
            self._ddp = nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
            self.model = self._ddp
        self.base_batch_size = options.base_batch_size or batch_size
        self.ramp = Ramp.constant(options.rule(self.base_batch_size).rate(batch_size))
        self.learning_rate = self.ramp.end_lr
        self.optimizer = make_optimizer(self.net, self.learning_rate)
        #: samples of the global batch stream trained on so far, by all ranks
        self.samples_seen = 0
        self.accuracy: float | None = None
        data_set = DataSet(options.seed, options.dataset_size, options.cpu_cost)
        self.pipeline = InputPipeline(data_set, DecodedCache(cache_budget_bytes(None, 0)))
        self.data = data_for(spec, options.seed, self.pipeline)
        self._loss = loss_function(spec, self.data)
        self._held_out: tuple[Tensor, Tensor] | None = None
        self.resources: Resources | None = None
        if resources is not None:
            self.allocate(resources)

    def allocate(self, resources: Resources) -> None:
        """Follow a (new) allocation: torch threads and pipeline workers per core, the
        cache within the memory the process does not already hold."""
        torch.set_num_threads(self.threads or resources.cores)
        cache = self.pipeline.cache
        held_by_others = resident_set_mb() * 2**20 - cache.nbytes
        cache.resize(cache_budget_bytes(resources.mem_gb, held_by_others))
        self.pipeline.set_workers(workers_for(resources.cores))
        self.resources = resources

    def close(self) -> None:
        self.pipeline.close()

    def loss_function(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return self._loss(outputs, targets)

    @property
    def epochs(self) -> float:
        """Epochs done: passes over the data set, fractions included."""
        return self.samples_seen / self.options.dataset_size

    def _share(self, start: int) -> range:
        """This rank's positions of the global batch that starts at ``start``."""
        if self.parallel is None:
            return range(start, start + self.batch_size)
        rank, ranks = self.parallel.rank, self.parallel.world_size
        # the parts of tensor_split: the first batch % ranks ranks take one more
        size, larger = divmod(self.batch_size, ranks)
        first = start + rank * size + min(rank, larger)
        return range(first, first + size + (1 if rank < larger else 0))

    def step(
        self, iteration: int, after_accumulation_step: Callable[[int], None] | None = None
    ) -> float:
        """Train on the next global batch of the sample stream as iteration ``iteration``
        (0-based: the first iteration is 0; it sets the learning rate of the ramp)."""
        inputs, targets = self.data.samples(self._share(self.samples_seen))
        # the workers prepare the next batch while this one trains
        self.pipeline.prefetch(self._share(self.samples_seen + self.batch_size))
        share, no_sync = 1.0, None
        if self.parallel is not None and self._ddp is not None:
            # DDP averages over ranks; this weight turns the average into the full-batch mean
            share = self.parallel.world_size * inputs.shape[0] / self.batch_size
            no_sync = self._ddp.no_sync
        self.learning_rate = self.ramp.at(iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        loss = train_step(
            self.model,
            self.optimizer,
            self.loss_function,
            inputs.to(self.device, non_blocking=True),
            targets.to(self.device, non_blocking=True),
            self.accum_steps,
            after_accumulation_step,
            share=share,
            no_sync=no_sync,
        )
        size = self.options.dataset_size
        epoch_before = self.samples_seen // size
        self.samples_seen += self.batch_size
        if self.samples_seen // size > epoch_before and self.is_main:
            self.accuracy = self.evaluate()
        return loss

    def evaluate(self) -> float:
        """Accuracy on the held-out set (per token for token models), in parts of at most
        one accumulation step's samples, so that it fits where training does."""
        if self._held_out is None:
            images = held_out_images(self.pipeline.data, HELD_OUT_SAMPLES)
            self._held_out = self.data.labelled(images)
        part = max(1, self.batch_size // self.accum_steps)
        was_training = self.net.training
        self.net.eval()
        right, counted = 0.0, 0
        with torch.no_grad():
            for inputs, targets in zip(*(t.split(part) for t in self._held_out), strict=True):
                outputs = self.net(inputs.to(self.device))
                hits, count = correct_of(self.spec, self.data, outputs, targets.to(self.device))
                right, counted = right + hits, counted + count
        self.net.train(was_training)
        return right / max(1, counted)

    def metrics(self) -> dict[str, Any]:
        """What a progress line says about training and the input pipeline."""
        return {
            "epoch": self.epochs,
            "lr": self.learning_rate,
            "accuracy": self.accuracy,
            "data_workers": self.pipeline.workers,
            "cached_samples": len(self.pipeline.cache),
            "decoded_samples": self.pipeline.decoded,
        }

    def agree_to_stop(self, wants_to_stop: bool) -> bool:
        """True when any rank was told to stop: every rank then ends at the same iteration."""
        if self.parallel is None:
            return wants_to_stop
        import torch.distributed as dist

        flag = torch.tensor([1 if wants_to_stop else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def is_main(self) -> bool:
        """The rank that reports progress and writes checkpoints."""
        return self.parallel is None or self.parallel.rank == 0

    def description(self) -> dict[str, Any]:
        """What the ``training`` log line says about this trainer."""
        cost = self.options.cpu_cost
        return {
            **description(self.spec),
            "device": str(self.device),
            "ranks": self.parallel.world_size if self.parallel is not None else 1,
            "data_workers": self.pipeline.workers,
            "cpu_cost": [cost.decode_passes, cost.augment_passes],
        }

    def save(self, ctx: JobContext, iteration: int) -> None:
        """Rank 0 writes the checkpoint; the other ranks hold the same weights."""
        if self.is_main:
            ctx.save_checkpoint(self.state(iteration))

    def state(self, iteration: int) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "iteration": iteration,
            **identity(self.spec),
            "seed": self.options.seed,
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "samples_seen": self.samples_seen,
            "base_batch_size": self.base_batch_size,
            "lr_ramp": self.ramp.to_state(),
            "accuracy": self.accuracy,
        }

    def restore(self, state: dict[str, Any]) -> int:
        """Load a checkpoint written by :meth:`state`; returns its iteration. A run with
        another global batch than the checkpoint's starts a ramp to its rate."""
        model = identity(self.spec)
        saved = (*(state.get(key) for key in model), state.get("seed"))
        ours = (*model.values(), self.options.seed)
        if state.get("format") != CHECKPOINT_FORMAT or saved != ours:
            raise CheckpointMismatchError(
                f"checkpoint (format, {', '.join(model)}, seed) = "
                f"({state.get('format')}, {', '.join(map(str, saved))}) does not match this "
                f"run ({CHECKPOINT_FORMAT}, {', '.join(map(str, ours))})"
            )
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        iteration = int(state["iteration"])
        self.samples_seen = int(state["samples_seen"])
        self.accuracy = state["accuracy"]
        self.base_batch_size, self.ramp, self.learning_rate = resumed_rate(
            self.options, state, self.batch_size, iteration
        )
        return iteration


def resumed_rate(
    options: TrainingOptions, state: dict[str, Any], batch_size: int, iteration: int
) -> tuple[int, Ramp, float]:
    """A run resumed from ``state`` at ``iteration`` with global batch ``batch_size``: its
    base batch, its learning-rate ramp (to the rate of its batch, over an epoch) and the
    rate reached."""
    base_batch_size = options.base_batch_size or int(state["base_batch_size"])
    rate = options.rule(base_batch_size).rate(batch_size)
    epoch = epoch_iterations(options.dataset_size, batch_size)
    ramp = Ramp.from_state(state["lr_ramp"]).towards(rate, iteration, epoch)
    return base_batch_size, ramp, ramp.at(iteration - 1)


def run_job(
    ctx: JobContext,
    spec: AnySpec,
    options: TrainingOptions,
    hooks: DebugHooks | None = None,
    parallel: DataParallel | None = None,
    threads: int | None = None,
) -> Outcome:
    """Train from the last checkpoint up to ``ctx.total_iterations`` or until told to stop.

    Either way the run ends with a checkpoint at the iteration it reached, so a stopped job
    loses no work and a finished one restarts as finished. With ``parallel``, this process
    is one rank: rank 0 reports and checkpoints, and all ranks stop at the same iteration.
    The run uses the cores and memory of ``ctx`` (its part of them with several ranks on
    the node), and ``threads`` torch threads if given.
    """
    hooks = hooks or DebugHooks()
    rank = parallel.rank if parallel is not None else 0
    bound = log.bind(job_id=ctx.job_id, run_id=ctx.run_id, rank=rank)
    device = ctx.torch_device()
    if device != ctx.device:
        bound.warning("cuda unavailable, training on the cpu", requested=ctx.device)
    if device == "cuda" and parallel is not None:
        device = f"cuda:{parallel.local_rank}"
    ranks = parallel.local_ranks if parallel is not None else 1
    with process_group(parallel, device):
        trainer = Trainer(
            spec,
            batch_size=ctx.batch_size,
            accum_steps=ctx.accum_steps,
            device=device,
            options=options,
            parallel=parallel,
            resources=Resources.of(ctx, ranks),
            threads=threads,
        )
        try:
            return train_loop(ctx, trainer, hooks, bound, ranks)
        finally:
            trainer.close()


class LoopTrainer(Protocol):
    """What the training loop needs of a trainer: :class:`Trainer`, or one rank of a
    (d, t, p) run (:class:`gpusched.services.nodeagent.worker.dtp.DtpTrainer`)."""

    ramp: Ramp

    @property
    def is_main(self) -> bool: ...

    def description(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> int: ...

    def save(self, ctx: JobContext, iteration: int) -> None: ...

    def allocate(self, resources: Resources) -> None: ...

    def agree_to_stop(self, wants_to_stop: bool) -> bool: ...

    def step(
        self, iteration: int, after_accumulation_step: Callable[[int], None] | None = None
    ) -> float: ...

    def metrics(self) -> dict[str, Any]: ...


def train_loop(
    ctx: JobContext, trainer: LoopTrainer, hooks: DebugHooks, bound: Any, ranks: int
) -> Outcome:
    state = ctx.load_checkpoint()
    iteration = 0 if state is None else trainer.restore(state)
    if iteration != ctx.start_iteration and trainer.is_main:
        bound.info(
            "start iteration hint differs from the checkpoint",
            hint=ctx.start_iteration,
            checkpoint=iteration,
        )
    bound.info(
        "training",
        **trainer.description(),
        batch_size=ctx.batch_size,
        accum_steps=ctx.accum_steps,
        from_iteration=iteration,
        total_iterations=ctx.total_iterations,
        lr=trainer.ramp.end_lr,
        lr_ramp=trainer.ramp.to_state(),
    )
    last_checkpoint = iteration if state is not None else None

    def checkpoint(at: int) -> None:
        nonlocal last_checkpoint
        if last_checkpoint != at:
            trainer.save(ctx, at)
            last_checkpoint = at
        if trainer.is_main:
            ctx.checkpointed(at)

    log_path = hooks.iteration_log if trainer.is_main else None
    iteration_log = log_path.open("a", encoding="utf-8") if log_path else None
    try:
        ctx.start_clock()
        while iteration < ctx.total_iterations and not trainer.agree_to_stop(ctx.should_stop):
            hold = _hold_until_stopped(ctx) if iteration + 1 == hooks.hold_at_iteration else None
            if ctx.refresh_allocation():
                # reallocated while running: the process was re-pinned to other cores
                trainer.allocate(Resources.of(ctx, ranks))
                bound.info("reallocated", cpus=list(ctx.cpus), mem_gb=ctx.mem_gb)
            loss = trainer.step(iteration, hold)
            iteration += 1
            if iteration_log is not None:
                iteration_log.write(f"{iteration}\n")
                iteration_log.flush()
            ctx.report(iteration, loss=loss, samples=ctx.batch_size, metrics=trainer.metrics())
            if iteration % ctx.checkpoint_every == 0 or iteration == ctx.total_iterations:
                checkpoint(iteration)
    finally:
        if iteration_log is not None:
            iteration_log.close()
    if iteration >= ctx.total_iterations:
        if last_checkpoint != iteration:
            checkpoint(iteration)
        if trainer.is_main:
            ctx.done(iteration)
        bound.info("done", iteration=iteration)
        return "done"
    checkpoint(iteration)
    bound.info("stopped", iteration=iteration)
    return "stopped"


def _hold_until_stopped(ctx: JobContext) -> Callable[[int], None]:
    def hold(step: int) -> None:
        if step == 0:
            while not ctx.should_stop:
                time.sleep(0.01)

    return hold
