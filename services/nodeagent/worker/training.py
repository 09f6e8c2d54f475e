"""Training with gradient accumulation, periodic checkpoints and exact resumption.

One iteration processes the global batch ``B`` as ``k`` accumulation steps of ``B/k``
samples each, every step's loss scaled by ``1/k``, followed by one optimizer step: the
effective batch and the learning rate do not depend on ``k``, so the scheduler may change
``k`` between runs of the same job (for example when it moves the job to fewer GPUs).

The model trains on a single device. A job given several GPUs still uses only the first
visible one: data parallelism across GPUs is out of scope for this worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
from torch import Tensor, nn

from libs.sdk import JobContext
from services.nodeagent.worker.catalog import ModelSpec
from services.nodeagent.worker.zoo import SyntheticData, build_model, loss_of

log = structlog.get_logger("gpusched.worker")

#: version of the checkpoint layout written by :meth:`Trainer.state`
CHECKPOINT_FORMAT = 1
DEFAULT_LEARNING_RATE = 0.01
MOMENTUM = 0.9

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
) -> float:
    """One iteration: ``accum_steps`` forward/backward passes, then one optimizer step.

    Returns the loss of the whole batch. Gradients stay in ``.grad`` until the next call.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    batch_size = inputs.shape[0]
    if batch_size % accum_steps:
        raise ValueError(f"batch size {batch_size} must be divisible by accum_steps {accum_steps}")
    optimizer.zero_grad(set_to_none=True)
    batch_loss = torch.zeros((), device=inputs.device)
    for step, (step_inputs, step_targets) in enumerate(
        zip(inputs.chunk(accum_steps), targets.chunk(accum_steps), strict=True)
    ):
        loss = loss_function(model(step_inputs), step_targets) / accum_steps
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
    seed: int = 0
    learning_rate: float = DEFAULT_LEARNING_RATE

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass(frozen=True, slots=True)
class DebugHooks:
    """Test hooks: ``iteration_log`` gets one line per executed iteration; the iteration
    numbered ``hold_at_iteration`` pauses after its first accumulation step until a stop
    is requested, which makes a preemption land in the middle of an iteration."""

    iteration_log: Path | None = None
    hold_at_iteration: int | None = None


class Trainer:
    """A zoo model, its optimizer and its data, on one device."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        batch_size: int,
        accum_steps: int,
        device: str,
        options: TrainingOptions,
    ) -> None:
        if batch_size % accum_steps:
            raise ValueError(
                f"batch_size {batch_size} must be divisible by accum_steps {accum_steps}"
            )
        self.spec = spec
        self.batch_size = batch_size
        self.accum_steps = accum_steps
        self.device = torch.device(device)
        self.options = options
        torch.manual_seed(options.seed)
        self.model = build_model(spec).to(self.device)
        self.optimizer = make_optimizer(self.model, options.learning_rate)
        self.data = SyntheticData(spec, options.seed)

    def loss_function(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return loss_of(self.spec, outputs, targets)

    def step(
        self, iteration: int, after_accumulation_step: Callable[[int], None] | None = None
    ) -> float:
        """Train on the batch of ``iteration`` (0-based: the first iteration is 0)."""
        inputs, targets = self.data.batch(iteration, self.batch_size)
        return train_step(
            self.model,
            self.optimizer,
            self.loss_function,
            inputs.to(self.device, non_blocking=True),
            targets.to(self.device, non_blocking=True),
            self.accum_steps,
            after_accumulation_step,
        )

    def state(self, iteration: int) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "iteration": iteration,
            "zoo": self.spec.zoo,
            "width": self.spec.width,
            "depth": self.spec.depth,
            "seed": self.options.seed,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def restore(self, state: dict[str, Any]) -> int:
        """Load a checkpoint written by :meth:`state`; returns its iteration."""
        saved = (state.get("zoo"), state.get("width"), state.get("depth"), state.get("seed"))
        ours = (self.spec.zoo, self.spec.width, self.spec.depth, self.options.seed)
        if state.get("format") != CHECKPOINT_FORMAT or saved != ours:
            raise CheckpointMismatchError(
                f"checkpoint (format, zoo, width, depth, seed) = "
                f"({state.get('format')}, {', '.join(map(str, saved))}) does not match this "
                f"run ({CHECKPOINT_FORMAT}, {', '.join(map(str, ours))})"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["iteration"])


def run_job(
    ctx: JobContext,
    spec: ModelSpec,
    options: TrainingOptions,
    hooks: DebugHooks | None = None,
) -> Outcome:
    """Train from the last checkpoint up to ``ctx.total_iterations`` or until told to stop.

    Either way the run ends with a checkpoint at the iteration it reached, so a stopped job
    loses no work and a finished one restarts as finished.
    """
    hooks = hooks or DebugHooks()
    bound = log.bind(job_id=ctx.job_id, run_id=ctx.run_id)
    device = ctx.torch_device()
    if device != ctx.device:
        bound.warning("cuda unavailable, training on the cpu", requested=ctx.device)
    trainer = Trainer(
        spec,
        batch_size=ctx.batch_size,
        accum_steps=ctx.accum_steps,
        device=device,
        options=options,
    )
    state = ctx.load_checkpoint()
    iteration = 0 if state is None else trainer.restore(state)
    if iteration != ctx.start_iteration:
        bound.info(
            "start iteration hint differs from the checkpoint",
            hint=ctx.start_iteration,
            checkpoint=iteration,
        )
    bound.info(
        "training",
        zoo=spec.zoo,
        width=spec.width,
        depth=spec.depth,
        device=device,
        batch_size=ctx.batch_size,
        accum_steps=ctx.accum_steps,
        from_iteration=iteration,
        total_iterations=ctx.total_iterations,
    )
    last_checkpoint = iteration if state is not None else None

    def checkpoint(at: int) -> None:
        nonlocal last_checkpoint
        if last_checkpoint != at:
            ctx.save_checkpoint(trainer.state(at))
            last_checkpoint = at
        ctx.checkpointed(at)

    iteration_log = hooks.iteration_log.open("a", encoding="utf-8") if hooks.iteration_log else None
    try:
        ctx.start_clock()
        while iteration < ctx.total_iterations and not ctx.should_stop:
            hold = _hold_until_stopped(ctx) if iteration + 1 == hooks.hold_at_iteration else None
            loss = trainer.step(iteration, hold)
            iteration += 1
            if iteration_log is not None:
                iteration_log.write(f"{iteration}\n")
                iteration_log.flush()
            ctx.report(iteration, loss=loss, samples=ctx.batch_size)
            if iteration % ctx.checkpoint_every == 0 or iteration == ctx.total_iterations:
                checkpoint(iteration)
    finally:
        if iteration_log is not None:
            iteration_log.close()
    if iteration >= ctx.total_iterations:
        if last_checkpoint != iteration:
            checkpoint(iteration)
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
