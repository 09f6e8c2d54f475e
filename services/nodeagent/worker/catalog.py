"""Which zoo model stands in for a profile name, how big it is, and how much CPU work its
input pipeline does per sample (no torch import here).

On the CPU (and wherever its architecture choice says ``stand-in``) the worker does not
train the real ResNet-50 or BERT (:mod:`.architectures`, :mod:`.registry`): it trains a
tiny model of the same kind so that a job really computes, checkpoints and resumes on any
machine, including CPU-only ones. Image models train the CNN on image-shaped input,
language models the transformer encoder on token input, and everything else (speech,
recommendation, reinforcement learning) the MLP on feature vectors.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from gpusched.libs.core.profiles.builtin import load_builtin

ZooModel = Literal["mlp", "cnn", "transformer"]
ZOO_MODELS: tuple[ZooModel, ...] = ("mlp", "cnn", "transformer")

#: profile name (see libs/core/builtin/profiles.json) -> the zoo model trained for it
PROFILE_TO_ZOO: dict[str, ZooModel] = {
    # image
    "resnet18": "cnn",
    "resnet50": "cnn",
    "vgg16": "cnn",
    "vgg19": "cnn",
    "shufflenet_v2": "cnn",
    "cifar10": "cnn",
    "imagenet": "cnn",
    "yolov3": "cnn",
    # language
    "bert": "transformer",
    "gpt2": "transformer",
    "transformer": "transformer",
    "lm": "transformer",
    # speech, recommendation, reinforcement learning
    "deepspeech2": "mlp",
    "ncf": "mlp",
    "recommendation": "mlp",
    "dqn": "mlp",
    "a2c": "mlp",
}

#: (width, depth) per zoo model: a few milliseconds per iteration on one CPU thread
DEFAULT_SIZES: dict[ZooModel, tuple[int, int]] = {
    "mlp": (64, 2),
    "cnn": (16, 2),
    "transformer": (32, 2),
}
#: attention heads of the transformer encoder; its width must be a multiple
TRANSFORMER_HEADS = 4


class UnknownModelNameError(ValueError):
    pass


def zoo_model_for(name: str) -> ZooModel:
    """The zoo model for a profile name or a zoo name (case-insensitive)."""
    key = name.strip().lower()
    if key in PROFILE_TO_ZOO:
        return PROFILE_TO_ZOO[key]
    for zoo in ZOO_MODELS:
        if key == zoo:
            return zoo
    known = ", ".join(sorted({*PROFILE_TO_ZOO, *ZOO_MODELS}))
    raise UnknownModelNameError(f"unknown model {name!r}; known models: {known}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A zoo model and its size: ``width`` is hidden units (mlp), channels (cnn) or the
    embedding size (transformer); ``depth`` is the number of hidden layers, conv blocks or
    encoder layers."""

    zoo: ZooModel
    width: int
    depth: int

    def __post_init__(self) -> None:
        if self.zoo not in ZOO_MODELS:
            raise ValueError(f"zoo must be one of {ZOO_MODELS}, got {self.zoo!r}")
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.zoo == "transformer" and self.width % TRANSFORMER_HEADS:
            raise ValueError(
                f"width must be a multiple of {TRANSFORMER_HEADS} (attention heads) "
                f"for the transformer, got {self.width}"
            )

    @classmethod
    def for_model(
        cls, name: str, *, width: int | None = None, depth: int | None = None
    ) -> ModelSpec:
        zoo = zoo_model_for(name)
        default_width, default_depth = DEFAULT_SIZES[zoo]
        return cls(
            zoo=zoo,
            width=default_width if width is None else width,
            depth=default_depth if depth is None else depth,
        )


#: filter passes per sample of a model whose best-case CPU speed-up (its Synergy
#: sensitivity class in libs/core/builtin/profiles.json) is 2x; a model with speed-up s
#: gets (s - 1) times as many, so one that gains nothing from CPUs does no passes
DECODE_PASSES_AT_DOUBLE_SPEED = 6
AUGMENT_PASSES_AT_DOUBLE_SPEED = 3


@dataclass(frozen=True, slots=True)
class CpuCost:
    """Per-sample CPU work of a model's input pipeline: filter passes to decode a raw
    record (what a cache of decoded samples saves) and to augment it (redone every epoch).
    Every sample also gets the fixed work of a crop, a flip and a brightness change."""

    decode_passes: int = 0
    augment_passes: int = 0

    def __post_init__(self) -> None:
        if self.decode_passes < 0 or self.augment_passes < 0:
            raise ValueError(
                f"passes must be >= 0, got decode {self.decode_passes}, "
                f"augment {self.augment_passes}"
            )


@functools.cache
def _cpu_speedups() -> dict[str, float]:
    profiles, _ = load_builtin()
    return {name: profile.cpu_mem.speedup for name, profile in profiles.items()}


def cpu_cost_for(name: str) -> CpuCost:
    """The input-pipeline cost of a profile name, from its CPU sensitivity: the models
    that Synergy's profiles find CPU-bound do the most work per sample; zoo names and
    CPU-insensitive models only the fixed work."""
    gain = max(0.0, _cpu_speedups().get(name.strip().lower(), 1.0) - 1.0)
    return CpuCost(
        decode_passes=math.ceil(DECODE_PASSES_AT_DOUBLE_SPEED * gain - 1e-9),
        augment_passes=math.ceil(AUGMENT_PASSES_AT_DOUBLE_SPEED * gain - 1e-9),
    )
