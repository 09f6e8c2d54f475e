"""(data, tensor, pipeline)-parallel training of a tiny MLP, on the CPU with gloo.

A job with ``tensor_parallel`` t or ``pipeline_parallel`` p above 1 trains an MLP of
``p * ceil(depth / p)`` blocks, each ``Linear(in, width) -> ReLU -> Linear(width, out)``
(ReLU between blocks; the first block reads the zoo MLP's 32 features, the last gives its
10 classes), on the zoo MLP's data:

- **Tensor parallelism** (Megatron-LM style, Shoeybi et al. 2019): in each block the first
  linear layer is split column-parallel (each of the ``t`` ranks holds ``width / t`` of its
  output units) and the second row-parallel (each holds the matching ``width / t`` input
  columns); the partial outputs are summed with one all-reduce in the tensor group in the
  forward pass, and the gradient of the block's input with one all-reduce in the backward
  pass (:class:`ReduceFromTensorGroup`, :class:`CopyToTensorGroup`).
- **Pipeline parallelism** (GPipe schedule, Huang et al. 2019): stage ``s`` holds blocks
  ``s*k .. (s+1)*k - 1``. A replica's share of the global batch is cut into
  ``max(accum_steps, p)`` micro-batches (at most one per sample); every stage runs all
  forwards, sending each micro-batch's activation to the next stage, then all backwards
  in reverse, sending each input gradient back. The last stage computes the loss.
- **Data parallelism**: replica ``r`` takes its share of every global batch as the
  data-parallel worker does; after the backward pass the gradients are summed in the data
  group (the ``d`` ranks of the same stage and tensor index). Each sample's loss is
  weighted by ``1 / B``, so the update is that of the whole batch's mean loss.

Rank ``(replica * p + stage) * t + tensor_index`` (:mod:`.degrees`). Rank 0 reports
progress (the batch loss, summed over the last stages by an all-reduce) and commits
checkpoints. A checkpoint is one file per (stage, tensor index) shard, written by replica
0's ranks under ``checkpoint_dir/dtp-<iteration>/``, then, after all shards are durable,
``checkpoint.pt`` naming that directory (written last, so a preemption in between resumes
from the previous complete checkpoint). A run resumes with any number of replicas (a
resize) but only with the same t and p.

The block structure, the checkpoint layout and running every stage on the CPU are ours,
not a paper's.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional

from gpusched.libs.sdk import JobContext, save_atomically
from gpusched.services.nodeagent.worker.catalog import ModelSpec
from gpusched.services.nodeagent.worker.degrees import Degrees, Position
from gpusched.services.nodeagent.worker.pipeline import (
    DataSet,
    DecodedCache,
    InputPipeline,
    cache_budget_bytes,
)
from gpusched.services.nodeagent.worker.schedule import Ramp
from gpusched.services.nodeagent.worker.training import (
    CheckpointMismatchError,
    DataParallel,
    DebugHooks,
    Outcome,
    Resources,
    TrainingOptions,
    make_optimizer,
    process_group,
    resumed_rate,
    train_loop,
)
from gpusched.services.nodeagent.worker.zoo import CLASSES, MLP_FEATURES, SyntheticData

log = structlog.get_logger("gpusched.worker")

#: version of the (d, t, p) checkpoint layout
DTP_CHECKPOINT_FORMAT = 1
SHARDS_PREFIX = "dtp-"

Group = Any  # a torch.distributed ProcessGroup, None for a group of one


# ---- tensor parallelism ------------------------------------------------------------------


class CopyToTensorGroup(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor group backward (the input
    of a column-parallel layer feeds every rank's shard)."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorGroup(torch.autograd.Function):
    """Sum of the ranks' partial outputs forward (a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: Group) -> Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


@dataclass(frozen=True, slots=True)
class BlockShape:
    inputs: int
    hidden: int
    outputs: int


def block_shapes(spec: ModelSpec, pipeline: int) -> list[BlockShape]:
    """The MLP's blocks: ``p * ceil(depth / p)`` of them, ``width`` hidden units each."""
    count = pipeline * math.ceil(spec.depth / pipeline)
    sizes = [MLP_FEATURES] + [spec.width] * (count - 1) + [CLASSES]
    return [BlockShape(sizes[i], spec.width, sizes[i + 1]) for i in range(count)]


def full_weights(shape: BlockShape, seed: int, block: int) -> dict[str, Tensor]:
    """A block's unsplit weights, as ``nn.Linear`` initialises them, from (seed, block)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + block)

    def uniform(*size: int, fan_in: int) -> Tensor:
        bound = 1 / math.sqrt(fan_in)
        return (torch.rand(*size, generator=generator) * 2 - 1) * bound

    return {
        "w1": uniform(shape.hidden, shape.inputs, fan_in=shape.inputs),
        "b1": uniform(shape.hidden, fan_in=shape.inputs),
        "w2": uniform(shape.outputs, shape.hidden, fan_in=shape.hidden),
        "b2": uniform(shape.outputs, fan_in=shape.hidden),
    }


class ParallelBlock(nn.Module):
    """Rank ``tensor_index``'s shard of one block: columns of the first layer, rows of the
    second, the second's bias whole (added once, after the sum)."""

    def __init__(
        self,
        weights: dict[str, Tensor],
        tensor_index: int,
        tensor: int,
        group: Group,
        last: bool,
    ) -> None:
        super().__init__()
        hidden = weights["w1"].shape[0]
        part = hidden // tensor
        columns = slice(tensor_index * part, (tensor_index + 1) * part)
        self.w1 = nn.Parameter(weights["w1"][columns].clone())
        self.b1 = nn.Parameter(weights["b1"][columns].clone())
        self.w2 = nn.Parameter(weights["w2"][:, columns].clone())
        self.b2 = nn.Parameter(weights["b2"].clone())
        self.group = group
        self.last = last

    def forward(self, inputs: Tensor) -> Tensor:
        if self.group is not None:
            inputs = CopyToTensorGroup.apply(inputs, self.group)
        hidden = functional.relu(functional.linear(inputs, self.w1, self.b1))
        outputs = functional.linear(hidden, self.w2)
        if self.group is not None:
            outputs = ReduceFromTensorGroup.apply(outputs, self.group)
        outputs = outputs + self.b2
        return outputs if self.last else functional.relu(outputs)


def build_stage(
    spec: ModelSpec, seed: int, degrees: Degrees, position: Position, group: Group
) -> nn.Sequential:
    """This rank's part of the model: its stage's blocks, split over the tensor group."""
    shapes = block_shapes(spec, degrees.pipeline)
    per_stage = len(shapes) // degrees.pipeline
    first = position.stage * per_stage
    return nn.Sequential(*(
        ParallelBlock(
            full_weights(shapes[b], seed, b), position.tensor_index, degrees.tensor, group,
            last=b == len(shapes) - 1,
        )
        for b in range(first, first + per_stage)
    ))


def unsplit_mlp(spec: ModelSpec, seed: int, pipeline: int) -> nn.Sequential:
    """The same MLP in one piece (``nn.Linear`` layers with the same weights)."""
    layers: list[nn.Module] = []
    shapes = block_shapes(spec, pipeline)
    for b, shape in enumerate(shapes):
        weights = full_weights(shape, seed, b)
        first = nn.Linear(shape.inputs, shape.hidden)
        second = nn.Linear(shape.hidden, shape.outputs)
        with torch.no_grad():
            first.weight.copy_(weights["w1"])
            first.bias.copy_(weights["b1"])
            second.weight.copy_(weights["w2"])
            second.bias.copy_(weights["b2"])
        layers += [first, nn.ReLU(), second]
        if b < len(shapes) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ---- process groups ----------------------------------------------------------------------


@dataclass(frozen=True)
class Groups:
    """This rank's tensor, pipeline and data groups (None where the group is one rank)."""

    tensor: Group
    pipeline: Group
    data: Group


def new_groups(degrees: Degrees, position: Position) -> Groups:
    """Every rank creates every group, in the same order, as ``new_group`` requires."""
    mine: dict[str, Group] = {"tensor": None, "pipeline": None, "data": None}
    layouts: list[tuple[str, list[int]]] = []
    if degrees.tensor > 1:
        layouts += [("tensor", degrees.tensor_group(r, s))
                    for r in range(degrees.data) for s in range(degrees.pipeline)]
    if degrees.pipeline > 1:
        layouts += [("pipeline", degrees.pipeline_group(r, i))
                    for r in range(degrees.data) for i in range(degrees.tensor)]
    if degrees.data > 1:
        layouts += [("data", degrees.data_group(s, i))
                    for s in range(degrees.pipeline) for i in range(degrees.tensor)]
    rank = degrees.rank(position.replica, position.stage, position.tensor_index)
    for kind, ranks in layouts:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine[kind] = group
    return Groups(**mine)


# ---- training ----------------------------------------------------------------------------


def split_range(positions: range, parts: int) -> list[range]:
    """``positions`` in ``parts`` consecutive pieces, the first ones one longer."""
    size, larger = divmod(len(positions), parts)
    pieces, start = [], positions.start
    for part in range(parts):
        length = size + (1 if part < larger else 0)
        pieces.append(range(start, start + length))
        start += length
    return pieces


class DtpTrainer:
    """One rank of a (d, t, p) run; the default process group must be up."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        batch_size: int,
        accum_steps: int,
        options: TrainingOptions,
        degrees: Degrees,
        rank: int,
        checkpoint_dir: Path,
        threads: int | None = None,
    ) -> None:
        if batch_size < degrees.data:
            raise ValueError(
                f"batch_size {batch_size} leaves no sample for some of {degrees.data} replicas"
            )
        if spec.width % degrees.tensor:
            raise ValueError(
                f"width {spec.width} is not divisible by tensor_parallel {degrees.tensor}"
            )
        self.spec, self.options, self.degrees = spec, options, degrees
        self.batch_size, self.accum_steps = batch_size, accum_steps
        self.rank = rank
        self.checkpoint_dir = checkpoint_dir
        self.threads = threads
        self.position = degrees.position(rank)
        self.groups = new_groups(degrees, self.position)
        self.stage = build_stage(spec, options.seed, degrees, self.position, self.groups.tensor)
        shapes = block_shapes(spec, degrees.pipeline)
        #: the features a stage receives from the one before it
        self.width_in = shapes[self.position.stage * len(shapes) // degrees.pipeline].inputs
        self.base_batch_size = options.base_batch_size or batch_size
        self.ramp = Ramp.constant(options.rule(self.base_batch_size).rate(batch_size))
        self.learning_rate = self.ramp.end_lr
        self.optimizer = make_optimizer(self.stage, self.learning_rate)
        self.samples_seen = 0
        data_set = DataSet(options.seed, options.dataset_size, options.cpu_cost)
        self.pipeline = InputPipeline(data_set, DecodedCache(cache_budget_bytes(None, 0)))
        self.data = SyntheticData(spec, options.seed, self.pipeline)

    def allocate(self, resources: Resources) -> None:
        """Torch threads per core of this rank's part of the allocation, and its cache of
        decoded samples within its memory (the inputs are prepared in this process)."""
        torch.set_num_threads(self.threads or resources.cores)
        self.pipeline.cache.resize(cache_budget_bytes(resources.mem_gb, 0))

    def description(self) -> dict[str, Any]:
        p = self.position
        return {
            "zoo": "mlp", "width": self.spec.width, "depth": self.spec.depth, "device": "cpu",
            "ranks": self.degrees.ranks, "data_parallel": self.degrees.data,
            "tensor_parallel": self.degrees.tensor,
            "pipeline_parallel": self.degrees.pipeline, "replica": p.replica,
            "stage": p.stage, "tensor_index": p.tensor_index,
        }

    @property
    def first_stage(self) -> bool:
        return self.position.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.position.stage == self.degrees.pipeline - 1

    def _neighbour(self, step: int) -> int:
        p = self.position
        return self.degrees.rank(p.replica, p.stage + step, p.tensor_index)

    def _micro_batches(self, start: int) -> list[range]:
        share = split_range(range(start, start + self.batch_size), self.degrees.data)[
            self.position.replica
        ]
        count = min(max(self.accum_steps, self.degrees.pipeline), len(share))
        return split_range(share, count)

    def step(
        self, iteration: int, after_accumulation_step: Callable[[int], None] | None = None
    ) -> float:
        """One iteration (GPipe: all forwards, then all backwards); returns the global
        batch's mean loss (the same on every rank). ``after_accumulation_step`` is called
        after each micro-batch's forward pass."""
        self.learning_rate = self.ramp.at(iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        self.optimizer.zero_grad(set_to_none=True)
        micro = self._micro_batches(self.samples_seen)
        kept: list[tuple[Tensor, Tensor]] = []
        batch_loss = torch.zeros(())
        for positions in micro:
            if self.first_stage or self.last_stage:
                inputs, targets = self.data.samples(positions)
            if self.first_stage:
                received = inputs
            else:
                received = torch.empty(len(positions), self.width_in)
                dist.recv(received, src=self._neighbour(-1), group=self.groups.pipeline)
                received.requires_grad_()
            outputs = self.stage(received)
            if self.last_stage:
                loss = functional.cross_entropy(outputs, targets) * (
                    len(positions) / self.batch_size
                )
                batch_loss += loss.detach()
                kept.append((received, loss))
            else:
                dist.send(outputs.detach(), dst=self._neighbour(1), group=self.groups.pipeline)
                kept.append((received, outputs))
            if after_accumulation_step is not None:
                after_accumulation_step(len(kept) - 1)
        for received, result in reversed(kept):
            if self.last_stage:
                result.backward()
            else:
                grad = torch.empty_like(result)
                dist.recv(grad, src=self._neighbour(1), group=self.groups.pipeline)
                result.backward(grad)
            if not self.first_stage:
                assert received.grad is not None
                dist.send(received.grad, dst=self._neighbour(-1), group=self.groups.pipeline)
        self._sum_gradients()
        self.optimizer.step()
        self.samples_seen += self.batch_size
        # the batch loss: the last stages' tensor-index-0 ranks hold it, one per replica
        counted = self.last_stage and self.position.tensor_index == 0
        total = batch_loss.reshape(1) if counted else torch.zeros(1)
        dist.all_reduce(total)
        return float(total)

    def _sum_gradients(self) -> None:
        if self.groups.data is None:
            return
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.groups.data)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def agree_to_stop(self, wants_to_stop: bool) -> bool:
        flag = torch.tensor([1 if wants_to_stop else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def metrics(self) -> dict[str, Any]:
        return {"epoch": self.samples_seen / self.options.dataset_size,
                "lr": self.learning_rate, "accuracy": None}

    # ---- checkpoints -------------------------------------------------------------------
    def _identity(self) -> tuple[Any, ...]:
        return (DTP_CHECKPOINT_FORMAT, self.spec.width, self.spec.depth, self.options.seed,
                self.degrees.tensor, self.degrees.pipeline)

    def save(self, ctx: JobContext, iteration: int) -> None:
        """Every rank calls it: replica 0's ranks write their shards, rank 0 commits."""
        checkpoint_dir = self.checkpoint_dir
        shards = checkpoint_dir / f"{SHARDS_PREFIX}{iteration}"
        p = self.position
        if p.replica == 0:
            save_atomically(
                {"iteration": iteration, "model": self.stage.state_dict(),
                 "optimizer": self.optimizer.state_dict()},
                shards / f"stage{p.stage}-tensor{p.tensor_index}.pt",
            )
        dist.barrier()
        if not self.is_main:
            return
        width, depth, seed, tensor, pipeline = self._identity()[1:]
        save_atomically(
            {"format": DTP_CHECKPOINT_FORMAT, "layout": "dtp", "iteration": iteration,
             "width": width, "depth": depth, "seed": seed, "tensor_parallel": tensor,
             "pipeline_parallel": pipeline, "shards": shards.name,
             "samples_seen": self.samples_seen, "base_batch_size": self.base_batch_size,
             "lr_ramp": self.ramp.to_state()},
            checkpoint_dir / "checkpoint.pt",
        )
        for old in checkpoint_dir.glob(f"{SHARDS_PREFIX}*"):
            if old.name != shards.name:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, state: dict[str, Any]) -> int:
        saved = (state.get("format") if state.get("layout") == "dtp" else None,
                 state.get("width"), state.get("depth"), state.get("seed"),
                 state.get("tensor_parallel", 1), state.get("pipeline_parallel", 1))
        if saved != self._identity():
            raise CheckpointMismatchError(
                "checkpoint (format, width, depth, seed, tensor_parallel, pipeline_parallel) "
                f"= {saved} does not match this run {self._identity()}: a (d, t, p) job "
                "resumes only with the same model, seed, t and p"
            )
        p = self.position
        shard = torch.load(
            self.checkpoint_dir / state["shards"] / f"stage{p.stage}-tensor{p.tensor_index}.pt",
            weights_only=True,
        )
        self.stage.load_state_dict(shard["model"])
        self.optimizer.load_state_dict(shard["optimizer"])
        iteration = int(state["iteration"])
        self.samples_seen = int(state["samples_seen"])
        self.base_batch_size, self.ramp, self.learning_rate = resumed_rate(
            self.options, state, self.batch_size, iteration
        )
        return iteration


def run_dtp_job(
    ctx: JobContext,
    spec: ModelSpec,
    options: TrainingOptions,
    parallel: DataParallel,
    degrees: Degrees,
    hooks: DebugHooks | None = None,
    threads: int | None = None,
) -> Outcome:
    """Train this rank of a (d, t, p) job from its last checkpoint up to
    ``ctx.total_iterations`` or until told to stop; either way end with a checkpoint."""
    bound = log.bind(job_id=ctx.job_id, run_id=ctx.run_id, rank=parallel.rank)
    with process_group(parallel, "cpu"):
        trainer = DtpTrainer(
            spec, batch_size=ctx.batch_size, accum_steps=ctx.accum_steps, options=options,
            degrees=degrees, rank=parallel.rank, checkpoint_dir=ctx.checkpoint_dir,
            threads=threads,
        )
        trainer.allocate(Resources.of(ctx, parallel.local_ranks))
        return train_loop(ctx, trainer, hooks or DebugHooks(), bound, parallel.local_ranks)
