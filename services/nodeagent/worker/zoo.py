"""The zoo: three tiny trainable models and their deterministic synthetic data.

No model uses batch normalisation or dropout: every sample's loss depends only on that
sample and the weights, so splitting a batch into accumulation steps yields the same
gradient as the whole batch, and training is a pure function of (seed, iteration).

The data of iteration ``i`` is drawn from a generator seeded with (seed, i), so a run
resumed from a checkpoint sees exactly the batches an uninterrupted run would. Targets
come from a fixed random "teacher" (seeded with the seed alone) so that the loss falls.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional

from services.nodeagent.worker.catalog import TRANSFORMER_HEADS, ModelSpec

MLP_FEATURES = 32
CLASSES = 10
IMAGE_CHANNELS = 3
IMAGE_SIZE = 16
#: the CNN pools its feature map down to this many pixels per side before the classifier
CNN_POOLED_SIZE = 4
VOCABULARY = 64
SEQUENCE_LENGTH = 16

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
    """Batches as a pure function of (seed, iteration, batch size), generated on the CPU."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        teacher = torch.Generator().manual_seed(_mixed_seed(seed, -1))
        if spec.zoo == "mlp":
            self._teacher = torch.randn(MLP_FEATURES, CLASSES, generator=teacher)
        elif spec.zoo == "cnn":
            pooled = IMAGE_CHANNELS * CNN_POOLED_SIZE**2
            self._teacher = torch.randn(pooled, CLASSES, generator=teacher)
        else:
            self._teacher = torch.randint(1, VOCABULARY, (1,), generator=teacher)

    def batch(self, iteration: int, batch_size: int) -> tuple[Tensor, Tensor]:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        generator = torch.Generator().manual_seed(_mixed_seed(self.seed, iteration))
        if self.spec.zoo == "mlp":
            features = torch.randn(batch_size, MLP_FEATURES, generator=generator)
            return features, (features @ self._teacher).argmax(dim=1)
        if self.spec.zoo == "cnn":
            shape = (batch_size, IMAGE_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
            images = torch.randn(shape, generator=generator)
            pooled = functional.adaptive_avg_pool2d(images, CNN_POOLED_SIZE).flatten(1)
            return images, (pooled @ self._teacher).argmax(dim=1)
        tokens = torch.randint(0, VOCABULARY, (batch_size, SEQUENCE_LENGTH), generator=generator)
        # each target mixes a token with its left neighbour, so attention is needed
        previous = functional.pad(tokens[:, :-1], (1, 0))
        return tokens, (tokens + int(self._teacher) * previous) % VOCABULARY
