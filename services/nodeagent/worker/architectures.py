"""The real architectures the worker trains (on a GPU by default), with their synthetic data
and losses. Compact definitions of our own, layer for layer those of the published models
(the parameter counts in :mod:`.registry` are what these build; a test holds them against
torchvision's, Hugging Face's and the papers' figures). The networks are in
:mod:`.networks` (a module per kind), their data and losses in :mod:`.tasks`; here, the
input layer, which network and task a model name gets, and the worker's one interface
to a real architecture or a stand-in.

Data. Samples come through the same CPU input pipeline as the stand-ins' (:mod:`.pipeline`):
sample ``p`` is a function of (seed, p), so a resumed run sees what an uninterrupted one
would. Token models get token ids made from the pipeline's images on the CPU; image,
speech and Atari models get the pipeline's 3x16x16 images themselves, which the network's
first, parameter-free layer (:class:`Resize`) resizes on the device to the real input
(3x224x224, a 1x161xT spectrogram, 4x84x84 frames): the host does the pipeline's work and
the GPU sees the real shape, without a full-size image crossing the bus. Targets come from
fixed random "teachers" seeded with the seed alone.

Unlike the stand-ins, real models keep their batch normalisation and dropout, so splitting
a batch into accumulation steps changes the batch statistics (as it does for anyone's
ResNet): the gradient of ``k`` steps is close to, not equal to, the whole batch's.
Inception v3's auxiliary classifier needs two or more samples per accumulation step (its
batch normalisation sees one value per channel), as torchvision's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from gpusched.services.nodeagent.worker.catalog import ModelSpec
from gpusched.services.nodeagent.worker.networks.atari import ATARI_ACTIONS, ActorCritic, nature_cnn
from gpusched.services.nodeagent.worker.networks.language import (
    GPT2_VOCABULARY,
    LM_VOCABULARY,
    Bert,
    Gpt2,
    LstmLanguageModel,
    TranslationTransformer,
)
from gpusched.services.nodeagent.worker.networks.recommendation import NeuMF
from gpusched.services.nodeagent.worker.networks.speech import DeepSpeech2
from gpusched.services.nodeagent.worker.networks.vision import (
    VGG16,
    VGG19,
    BasicBlock,
    Bottleneck,
    YoloV3,
    googlenet,
    inception_v3,
    resnet,
    shufflenet_v2,
    vgg,
)
from gpusched.services.nodeagent.worker.pipeline import (
    RECORD_CHANNELS,
    DataSet,
    DecodedCache,
    InputPipeline,
)
from gpusched.services.nodeagent.worker.registry import (
    ATARI_FRAMES,
    ATARI_SIZE,
    SPECTROGRAM_BINS,
    RealSpec,
)
from gpusched.services.nodeagent.worker.tasks import (
    CausalLanguageModel,
    Detection,
    ImageClassification,
    MaskedLanguageModel,
    Recommendation,
    Reinforcement,
    SpeechRecognition,
    Task,
    Translation,
    argmax_correct,
)
from gpusched.services.nodeagent.worker.zoo import VOCABULARY, SyntheticData, build_model, loss_of

AnySpec = ModelSpec | RealSpec


# ---------------------------------------------------------------------- input


class Resize(nn.Module):
    """The pipeline's 3-channel images as ``channels`` x ``height`` x ``width`` (1 channel:
    their mean; 4: the three and their mean), bilinear. No parameters."""

    def __init__(self, channels: int, height: int, width: int) -> None:
        super().__init__()
        self.channels, self.size = channels, (height, width)

    def forward(self, images: Tensor) -> Tensor:
        mean = images.mean(dim=1, keepdim=True)
        if self.channels == 1:
            images = mean
        elif self.channels == RECORD_CHANNELS + 1:
            images = torch.cat([images, mean], dim=1)
        return functional.interpolate(images, size=self.size, mode="bilinear", align_corners=False)


class Resized(nn.Module):
    def __init__(self, resize: Resize, body: nn.Module) -> None:
        super().__init__()
        self.resize, self.body = resize, body

    def forward(self, images: Tensor) -> Tensor:
        return self.body(self.resize(images))


# ---------------------------------------------------------------------- registry


NCF_SHAPES = {"ncf": (6040, 3706, (512, 256, 128, 64)),
              "ncf_ml20m": (138_493, 26_744, (256, 256, 128, 64))}  # fmt: skip
BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "resnet18": lambda _: resnet(BasicBlock, (2, 2, 2, 2), 1000),
    "resnet50": lambda _: resnet(Bottleneck, (3, 4, 6, 3), 1000),
    "resnet18_cifar": lambda _: resnet(BasicBlock, (2, 2, 2, 2), 10, cifar=True),
    "vgg16": lambda _: vgg(VGG16, 1000),
    "vgg19": lambda _: vgg(VGG19, 1000),
    "shufflenet_v2": lambda _: shufflenet_v2(1000),
    "googlenet": lambda _: googlenet(1000),
    "inception_v3": lambda _: inception_v3(1000),
    "yolov3": lambda _: YoloV3(80),
    "bert_base": lambda _: Bert(),
    "gpt2_small": lambda _: Gpt2(),
    "transformer_base": TranslationTransformer,
    "lstm_lm": lambda _: LstmLanguageModel(),
    "deepspeech2": lambda _: DeepSpeech2(),
    "ncf": lambda _: NeuMF(*NCF_SHAPES["ncf"]),
    "ncf_ml20m": lambda _: NeuMF(*NCF_SHAPES["ncf_ml20m"]),
    "dqn": lambda _: nn.Sequential(*nature_cnn(), nn.Linear(512, ATARI_ACTIONS)),
    "a2c": lambda _: ActorCritic(),
}


def _network(spec: RealSpec) -> nn.Module:
    """The network of a spec; image-like inputs get their :class:`Resize` in front."""
    size = spec.input_size or 1
    body = BUILDERS[spec.architecture](size)
    kind = spec.info.kind
    if kind == "image":
        return Resized(Resize(RECORD_CHANNELS, size, size), body)
    if kind == "spectrogram":
        return Resized(Resize(1, SPECTROGRAM_BINS, size), body)
    if kind == "frames":
        return Resized(Resize(ATARI_FRAMES, ATARI_SIZE, ATARI_SIZE), body)
    return body


def _task(spec: RealSpec, seed: int) -> Task:
    size = spec.input_size or 0
    key = spec.architecture
    if key == "yolov3":
        return Detection(seed, 80, size)
    if key == "bert_base":
        return MaskedLanguageModel(seed, size)
    if key == "gpt2_small":
        return CausalLanguageModel(seed, GPT2_VOCABULARY, size)
    if key == "lstm_lm":
        return CausalLanguageModel(seed, LM_VOCABULARY, size)
    if key == "transformer_base":
        return Translation(seed, size)
    if key == "deepspeech2":
        return SpeechRecognition(seed, size)
    if key in NCF_SHAPES:
        users, items, _ = NCF_SHAPES[key]
        return Recommendation(seed, users, items)
    if key in ("dqn", "a2c"):
        return Reinforcement(seed, actor_critic=key == "a2c")
    aux_weight = {"googlenet": 0.3, "inception_v3": 0.4}.get(key, 0.0)
    return ImageClassification(seed, 10 if key == "resnet18_cifar" else 1000, aux_weight)


def build_real(spec: RealSpec) -> nn.Module:
    """A freshly initialised real network (from torch's global RNG: seed it first)."""
    return _network(spec)


def count_parameters(spec: RealSpec) -> int:
    """Trainable parameters of the architecture, built on the meta device (no weights)."""
    with torch.device("meta"):
        network = _network(spec)
    return sum(p.numel() for p in network.parameters() if p.requires_grad)


class RealData:
    """Labelled batches of a real architecture, from the input pipeline's images (see the
    module's docstring); the same interface as the stand-ins' :class:`SyntheticData`."""

    def __init__(self, spec: RealSpec, seed: int, pipeline: InputPipeline | None = None) -> None:
        self.spec, self.seed = spec, seed
        self.pipeline = pipeline or InputPipeline(DataSet(seed), DecodedCache(0))
        self.task = _task(spec, seed)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return self.task.labelled(images)

    def samples(self, positions: range) -> tuple[Tensor, Tensor]:
        return self.labelled(self.pipeline.images(positions))

    def batch(self, iteration: int, batch_size: int) -> tuple[Tensor, Tensor]:
        if iteration < 0 or batch_size < 1:
            raise ValueError(f"need iteration >= 0, batch_size >= 1; got {iteration}, {batch_size}")
        return self.samples(range(iteration * batch_size, (iteration + 1) * batch_size))


def build_network(spec: AnySpec) -> nn.Module:
    return build_real(spec) if isinstance(spec, RealSpec) else build_model(spec)


def data_for(spec: AnySpec, seed: int, pipeline: InputPipeline) -> SyntheticData | RealData:
    if isinstance(spec, RealSpec):
        return RealData(spec, seed, pipeline)
    return SyntheticData(spec, seed, pipeline)


def correct_of(
    spec: AnySpec, data: SyntheticData | RealData, outputs: Tensor, targets: Tensor
) -> tuple[float, int]:
    """Right predictions of a batch and how many were counted (per token for token models)."""
    if isinstance(data, RealData):
        return data.task.correct(outputs, targets)
    assert isinstance(spec, ModelSpec)
    if spec.zoo == "transformer":
        outputs = outputs.reshape(-1, VOCABULARY)
    return argmax_correct(outputs, targets.reshape(-1))


def loss_function(
    spec: AnySpec, data: SyntheticData | RealData
) -> Callable[[Tensor, Tensor], Tensor]:
    if isinstance(data, RealData):
        return data.task.loss
    assert isinstance(spec, ModelSpec)
    return lambda outputs, targets: loss_of(spec, outputs, targets)


def identity(spec: AnySpec) -> dict[str, Any]:
    """What a checkpoint records of the model, and a resumed run must match."""
    if isinstance(spec, RealSpec):
        return {"network": spec.architecture, "input_size": spec.input_size}
    return {"zoo": spec.zoo, "width": spec.width, "depth": spec.depth}


def description(spec: AnySpec) -> dict[str, Any]:
    """What log lines and profile reports say about the model: ``architecture`` is
    ``real`` (with the ``network`` and its parameters) or ``stand-in`` (the zoo model)."""
    if isinstance(spec, RealSpec):
        return {"architecture": "real", **identity(spec), "parameters": spec.info.parameters}
    return {"architecture": "stand-in", **identity(spec)}
