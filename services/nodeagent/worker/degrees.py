"""A job's (data, tensor, pipeline) degrees and where a rank sits among them (no torch here,
so a bad layout is refused before torch loads).

Rank layout (the scheduler's mapper orders a job's GPUs so that tensor groups fall inside a
node): ``rank = (replica * p + stage) * t + tensor_index``. The ``t`` ranks of a tensor
group are consecutive, the ``p`` stages of one replica follow each other, and replicas
come last.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched.libs.sdk.context import DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL


class DegreesError(ValueError):
    """The degrees do not fit the job's ranks; the message names the variable."""


@dataclass(frozen=True, slots=True)
class Position:
    replica: int
    stage: int
    tensor_index: int


@dataclass(frozen=True, slots=True)
class Degrees:
    data: int = 1
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for variable, degree in (
            (DATA_PARALLEL, self.data),
            (TENSOR_PARALLEL, self.tensor),
            (PIPELINE_PARALLEL, self.pipeline),
        ):
            if degree < 1:
                raise DegreesError(f"{variable}: must be >= 1, got {degree}")

    @property
    def ranks(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def model_parallel(self) -> bool:
        """True when the model itself is split (tensor or pipeline parallelism)."""
        return self.tensor * self.pipeline > 1

    def position(self, rank: int) -> Position:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is outside 0..{self.ranks - 1}")
        return Position(
            replica=rank // (self.tensor * self.pipeline),
            stage=rank // self.tensor % self.pipeline,
            tensor_index=rank % self.tensor,
        )

    def rank(self, replica: int, stage: int, tensor_index: int) -> int:
        return (replica * self.pipeline + stage) * self.tensor + tensor_index

    def tensor_group(self, replica: int, stage: int) -> list[int]:
        return [self.rank(replica, stage, i) for i in range(self.tensor)]

    def pipeline_group(self, replica: int, tensor_index: int) -> list[int]:
        return [self.rank(replica, s, tensor_index) for s in range(self.pipeline)]

    def data_group(self, stage: int, tensor_index: int) -> list[int]:
        return [self.rank(r, stage, tensor_index) for r in range(self.data)]


def degrees_for(
    ranks: int, data: int | None, tensor: int = 1, pipeline: int = 1
) -> Degrees:
    """The degrees of a job of ``ranks`` processes; ``data`` None: what the ranks leave
    over tensor x pipeline. A product other than ``ranks`` is refused naming the variable."""
    model_parallel = tensor * pipeline
    if data is None:
        if ranks % model_parallel:
            variable = TENSOR_PARALLEL if ranks % tensor else PIPELINE_PARALLEL
            raise DegreesError(
                f"{variable}: tensor_parallel {tensor} x pipeline_parallel {pipeline} = "
                f"{model_parallel} does not divide the job's {ranks} ranks (one per GPU)"
            )
        data = ranks // model_parallel
    degrees = Degrees(data, tensor, pipeline)
    if degrees.ranks != ranks:
        raise DegreesError(
            f"{DATA_PARALLEL}: data_parallel {data} x tensor_parallel {tensor} x "
            f"pipeline_parallel {pipeline} = {degrees.ranks}, but the job has {ranks} ranks "
            "(one per GPU)"
        )
    return degrees
