"""The zoo: three tiny trainable models and their deterministic synthetic data.

No model uses batch normalisation or dropout: every sample's loss depends only on that
sample and the weights, so splitting a batch into accumulation steps yields the same
gradient as the whole batch, and training is a pure function of the seed and the sample
stream.

The inputs come from the input pipeline (:mod:`.pipeline`): sample ``p`` of the stream is
a function of (seed, p), so a run resumed from a checkpoint sees exactly the samples an
uninterrupted run would. Targets come from a fixed random "teacher" (seeded with the seed
alone) so that the loss falls.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional

from gpusched.services.nodeagent.worker.catalog import TRANSFORMER_HEADS, ModelSpec
from gpusched.services.nodeagent.worker.pipeline import (
    IMAGE_SIZE,
    RECORD_CHANNELS,
    DataSet,
    DecodedCache,
    InputPipeline,
)

MLP_FEATURES = 32
CLASSES = 10
IMAGE_CHANNELS = RECORD_CHANNELS
#: the CNN pools its feature map down to this many pixels per side before the classifier
CNN_POOLED_SIZE = 4
VOCABULARY = 64
SEQUENCE_LENGTH = 16
#: how finely a projected pixel value is cut into tokens
TOKEN_LEVELS = 32

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MODULUS = 2**63


def _mixed_seed(seed: int, stream: int) -> int:
    return (seed * _SEED_MIX + stream + 1) % _SEED_MODULUS


class Mlp(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        features = MLP_FEATURES
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU()]
            features = width
        layers.append(nn.Linear(features, CLASSES))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.layers(inputs)


class Cnn(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = IMAGE_CHANNELS
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU()]
            channels = width
        layers.append(nn.AdaptiveAvgPool2d(CNN_POOLED_SIZE))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width * CNN_POOLED_SIZE**2, CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        return self.classifier(self.features(images).flatten(1))


class TransformerEncoder(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.zeros(SEQUENCE_LENGTH, width))
        layer = nn.TransformerEncoderLayer(
            d_model=width,
            nhead=TRANSFORMER_HEADS,
            dim_feedforward=2 * width,
            dropout=0.0,
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.encoder(self.embedding(tokens) + self.position)
        return self.head(hidden)


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised model (from torch's global RNG: seed it first)."""
    if spec.zoo == "mlp":
        return Mlp(spec.width, spec.depth)
    if spec.zoo == "cnn":
        return Cnn(spec.width, spec.depth)
    return TransformerEncoder(spec.width, spec.depth)


def loss_of(spec: ModelSpec, outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy per sample (per token for the transformer)."""
    if spec.zoo == "transformer":
        return functional.cross_entropy(outputs.reshape(-1, VOCABULARY), targets.reshape(-1))
    return functional.cross_entropy(outputs, targets)


class SyntheticData:
    """Labelled batches: the input pipeline's images made into each zoo model's inputs
    (the images for the CNN, features for the MLP, tokens for the transformer), with
    targets from a fixed random teacher (seeded with the seed alone) so that the loss
    falls. Both are functions of the images alone."""

    def __init__(self, spec: ModelSpec, seed: int, pipeline: InputPipeline | None = None) -> None:
        self.spec = spec
        self.seed = seed
        self.pipeline = pipeline or InputPipeline(DataSet(seed), DecodedCache(0))
        teacher = torch.Generator().manual_seed(_mixed_seed(seed, -1))
        pixels = IMAGE_CHANNELS * IMAGE_SIZE**2
        if spec.zoo == "mlp":
            self._projection = torch.randn(pixels, MLP_FEATURES, generator=teacher)
            self._teacher = torch.randn(MLP_FEATURES, CLASSES, generator=teacher)
        elif spec.zoo == "cnn":
            pooled = IMAGE_CHANNELS * CNN_POOLED_SIZE**2
            self._teacher = torch.randn(pooled, CLASSES, generator=teacher)
        else:
            self._projection = torch.randn(pixels, SEQUENCE_LENGTH, generator=teacher)
            self._teacher = torch.randint(1, VOCABULARY, (1,), generator=teacher)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of a batch of pipeline images."""
        if self.spec.zoo == "cnn":
            pooled = functional.adaptive_avg_pool2d(images, CNN_POOLED_SIZE).flatten(1)
            return images, (pooled @ self._teacher).argmax(dim=1)
        projected = images.flatten(1) @ self._projection / self._projection.shape[0] ** 0.5
        if self.spec.zoo == "mlp":
            return projected, (projected @ self._teacher).argmax(dim=1)
        tokens = (projected * TOKEN_LEVELS).floor().long() % VOCABULARY
        # each target mixes a token with its left neighbour, so attention is needed
        previous = functional.pad(tokens[:, :-1], (1, 0))
        return tokens, (tokens + int(self._teacher) * previous) % VOCABULARY

    def samples(self, positions: range) -> tuple[Tensor, Tensor]:
        """The labelled samples at ``positions`` of the sample stream."""
        return self.labelled(self.pipeline.images(positions))

    def batch(self, iteration: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """The batch of ``iteration`` of a run that keeps ``batch_size`` throughout."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.samples(range(iteration * batch_size, (iteration + 1) * batch_size))
