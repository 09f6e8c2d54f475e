"""Every built-in model the worker trains: its real architecture, that architecture's
parameter count and input shape, and the stand-in it trains instead on a CPU (no torch
import here, so ``gpusched models`` runs where torch is not installed).

A model name is a profile name (``libs/core/builtin/profiles.json``) or one of the extra
architecture names below. The real architectures are defined in :mod:`.networks` and
built by :mod:`.architectures`; the parameter counts here are what building them counts
(a test builds every one and compares), within 2 % of the published figure where one is
published.

Which of the two a run trains is the worker's *architecture choice*: ``real``, ``stand-in``
or ``auto`` (the real one on a CUDA device, the stand-in on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpusched.services.nodeagent.worker.catalog import (
    DEFAULT_SIZES,
    PROFILE_TO_ZOO,
    ZOO_MODELS,
    UnknownModelNameError,
    ZooModel,
)

ArchitectureChoice = Literal["auto", "real", "stand-in"]
ARCHITECTURE_CHOICES: tuple[ArchitectureChoice, ...] = ("auto", "real", "stand-in")
#: the worker's variable for the choice (a node agent sets it for the runs it starts)
ARCHITECTURE_ENV = "GPUSCHED_WORKER_ARCHITECTURE"

#: how a sample reaches the network: an image, token ids, a source + target pair of token
#: sequences, a spectrogram, a (user, item) pair of ids, or a stack of Atari frames
InputKind = Literal["image", "tokens", "token_pair", "spectrogram", "ids", "frames"]
#: frequency bins of a DeepSpeech2 spectrogram (20 ms windows of 16 kHz audio)
SPECTROGRAM_BINS = 161
#: Atari frames: 4 stacked 84x84 grey frames
ATARI_FRAMES, ATARI_SIZE = 4, 84


class InputSizeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Architecture:
    """A real architecture: ``size`` is the default of the input dimension a run may change
    (``size_name``: image side, tokens or frames; None: the input is fixed), within
    ``min_size``..``max_size`` and a multiple of ``size_multiple``."""

    key: str
    text: str
    parameters: int
    #: the published count this one is held against, and its source
    published: str
    kind: InputKind
    size: int | None
    min_size: int = 1
    max_size: int | None = None
    size_multiple: int = 1

    @property
    def size_name(self) -> str:
        return {
            "image": "image side (pixels)",
            "tokens": "sequence length (tokens)",
            "token_pair": "source and target length (tokens)",
            "spectrogram": "spectrogram frames (10 ms each)",
        }.get(self.kind, "fixed")

    def check_size(self, size: int) -> int:
        """``size`` if this architecture takes it, else InputSizeError saying why."""
        if self.size is None:
            raise InputSizeError(f"{self.key} has a fixed input ({self.input_text()})")
        if size < self.min_size or (self.max_size is not None and size > self.max_size):
            high = f"..{self.max_size}" if self.max_size is not None else " or more"
            raise InputSizeError(
                f"the {self.size_name} of {self.key} must be {self.min_size}{high}, got {size}"
            )
        if size % self.size_multiple:
            raise InputSizeError(
                f"the {self.size_name} of {self.key} must be a multiple of "
                f"{self.size_multiple}, got {size}"
            )
        return size

    def input_shape(self, size: int | None = None) -> tuple[int, ...]:
        """One sample's shape as the network's first layer sees it."""
        n = self.size if size is None else size
        if self.kind == "ids":
            return (2,)
        if self.kind == "frames":
            return (ATARI_FRAMES, ATARI_SIZE, ATARI_SIZE)
        assert n is not None
        return {
            "image": (3, n, n),
            "tokens": (n,),
            "token_pair": (2 * n,),
            "spectrogram": (1, SPECTROGRAM_BINS, n),
        }[self.kind]

    def input_text(self, size: int | None = None) -> str:
        n = self.size if size is None else size
        shape = "x".join(map(str, self.input_shape(size)))
        return {
            "image": f"{shape} image",
            "tokens": f"{n} tokens",
            "token_pair": f"{n} source + {n} target tokens",
            "spectrogram": f"{shape} spectrogram ({n} frames)",
            "ids": "(user, item) ids",
            "frames": f"{shape} Atari frames",
        }[self.kind]


def _image(key: str, text: str, parameters: int, published: str, size: int = 224,
           min_size: int = 32, multiple: int = 1) -> Architecture:  # fmt: skip
    return Architecture(key, text, parameters, published, "image", size, min_size, None, multiple)


ARCHITECTURES: dict[str, Architecture] = {
    a.key: a
    for a in (
        _image("resnet18", "ResNet-18, 1000 classes", 11_689_512, "11,689,512 (torchvision)"),
        _image("resnet50", "ResNet-50, 1000 classes", 25_557_032, "25,557,032 (torchvision)"),
        _image(
            "resnet18_cifar",
            "ResNet-18 with the CIFAR stem (3x3 conv, no max-pool), 10 classes",
            11_173_962,
            "11,173,962 (kuangliu/pytorch-cifar)",
            size=32,
            min_size=8,
        ),
        _image("vgg16", "VGG-16, 1000 classes", 138_357_544, "138,357,544 (torchvision)"),
        _image("vgg19", "VGG-19, 1000 classes", 143_667_240, "143,667,240 (torchvision)"),
        _image(
            "shufflenet_v2",
            "ShuffleNet V2 x1.0, 1000 classes",
            2_278_604,
            "2,278,604 (torchvision)",
        ),
        _image(
            "googlenet",
            "GoogLeNet (Inception v1) with its two auxiliary classifiers, 1000 classes",
            13_004_888,
            "13,004,888 (torchvision, aux_logits=True)",
        ),
        _image(
            "inception_v3",
            "Inception v3 with its auxiliary classifier, 1000 classes",
            27_161_264,
            "27,161,264 (torchvision)",
            size=299,
            min_size=299,
        ),
        _image(
            "yolov3",
            "YOLOv3: Darknet-53 backbone, detection at three scales, 80 classes",
            61_949_149,
            "61,949,149 (ultralytics yolov3.yaml)",
            size=416,
            min_size=64,
            multiple=32,
        ),
        Architecture(
            "bert_base",
            "BERT-base encoder (12 layers, 768 wide, 12 heads) with its "
            "masked-LM head, vocabulary 30,522",
            109_514_298,
            "110 M (Devlin et al. 2019); 109,514,298 (Hugging Face BertForMaskedLM)",
            "tokens",
            128,
            2,
            512,
        ),
        Architecture(
            "gpt2_small",
            "GPT-2 small decoder (12 layers, 768 wide, 12 heads), tied LM head, vocabulary 50,257",
            124_439_808,
            "124,439,808 (Hugging Face GPT2LMHeadModel)",
            "tokens",
            1024,
            2,
            1024,
        ),
        Architecture(
            "transformer_base",
            "Transformer base encoder-decoder (6+6 layers, 512 wide, 8 heads), "
            "shared 37,000-token vocabulary",
            63_084_544,
            "65 M (Vaswani et al. 2017, rounded); 63,084,544 by its layer sizes",
            "token_pair",
            128,
            2,
            None,
        ),
        Architecture(
            "lstm_lm",
            "LSTM language model (2 layers, 200 wide), WikiText-2 vocabulary 33,278",
            13_987_678,
            "13,987,678 by the layer sizes of PyTorch's word_language_model",
            "tokens",
            35,
            2,
            None,
        ),
        Architecture(
            "deepspeech2",
            "DeepSpeech2: 2 conv layers, 5 bidirectional LSTM layers (1024), "
            "CTC over 29 characters",
            86_618_400,
            "86,618,400 by the layer sizes of deepspeech.pytorch's defaults",
            "spectrogram",
            1000,
            16,
            None,
        ),
        Architecture(
            "ncf",
            "NCF (NeuMF): MovieLens-1M (6,040 users, 3,706 items), 64 factors, 3 MLP layers",
            3_291_329,
            "3,291,329 by the layer sizes of He et al. 2017",
            "ids",
            None,
        ),
        Architecture(
            "ncf_ml20m",
            "NCF (NeuMF) at MLPerf's MovieLens-20M scale (138,493 users, 26,744 "
            "items), 64 factors, MLP 256-256-128-64",
            31_832_577,
            "31,832,577 by the layer sizes of the MLPerf reference",
            "ids",
            None,
        ),
        Architecture(
            "dqn",
            "DQN (the Nature Atari CNN), 18 actions",
            1_693_362,
            "1,693,362 by the layer sizes of Mnih et al. 2015",
            "frames",
            None,
        ),
        Architecture(
            "a2c",
            "A2C actor-critic (the Nature Atari CNN trunk), 18 actions",
            1_693_875,
            "1,693,875 by the layer sizes of Mnih et al. 2016",
            "frames",
            None,
        ),
    )
}

#: model name -> its real architecture (the profile names first, then extra names)
MODEL_ARCHITECTURES: dict[str, str] = {
    "resnet18": "resnet18",
    "resnet50": "resnet50",
    "vgg16": "vgg16",
    "vgg19": "vgg19",
    "shufflenet_v2": "shufflenet_v2",
    "cifar10": "resnet18_cifar",
    "imagenet": "resnet50",
    "yolov3": "yolov3",
    "bert": "bert_base",
    "gpt2": "gpt2_small",
    "transformer": "transformer_base",
    "lm": "lstm_lm",
    "deepspeech2": "deepspeech2",
    "ncf": "ncf",
    "recommendation": "ncf_ml20m",
    "dqn": "dqn",
    "a2c": "a2c",
    # not profiles: the worker trains them when asked by name
    "googlenet": "googlenet",
    "inception_v3": "inception_v3",
}
#: the stand-in of a model name that is not a profile
EXTRA_STAND_INS: dict[str, ZooModel] = {"googlenet": "cnn", "inception_v3": "cnn"}


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    architecture: Architecture
    #: what trains on the CPU (``auto``) or with ``stand-in``: a zoo model and its size
    stand_in: ZooModel
    #: whether the name is one of the profiles (what a job may name when submitted)
    profile: bool

    @property
    def stand_in_text(self) -> str:
        width, depth = DEFAULT_SIZES[self.stand_in]
        return f"{self.stand_in} {width}/{depth}"

    def as_json(self) -> dict[str, object]:
        arch = self.architecture
        return {
            "name": self.name,
            "architecture": arch.text,
            "architecture_key": arch.key,
            "parameters": arch.parameters,
            "published_parameters": arch.published,
            "input_shape": list(arch.input_shape()),
            "input": arch.input_text(),
            "input_size": arch.size,
            "input_size_name": arch.size_name,
            "stand_in": self.stand_in_text,
            "profile": self.profile,
        }


def builtin_models() -> list[BuiltinModel]:
    return [builtin_model(name) for name in MODEL_ARCHITECTURES]


def known_names() -> list[str]:
    """Every name the worker takes: model names and the zoo's own names."""
    return sorted({*MODEL_ARCHITECTURES, *ZOO_MODELS})


def unknown(name: str, known: list[str] | None = None) -> UnknownModelNameError:
    """The error of a name that is none of ``known`` (default: every name the worker takes)."""
    names = known_names() if known is None else known
    return UnknownModelNameError(f"unknown model {name!r}; known models: {', '.join(names)}")


def builtin_model(name: str) -> BuiltinModel:
    """The built-in model of a name (case-insensitive); UnknownModelNameError if none.
    The zoo's own names are no built-in model: they are stand-ins only."""
    key = name.strip().lower()
    if key not in MODEL_ARCHITECTURES:
        raise unknown(name, sorted(MODEL_ARCHITECTURES))
    stand_in = PROFILE_TO_ZOO.get(key) or EXTRA_STAND_INS[key]
    return BuiltinModel(
        key, ARCHITECTURES[MODEL_ARCHITECTURES[key]], stand_in, key in PROFILE_TO_ZOO
    )


@dataclass(frozen=True, slots=True)
class RealSpec:
    """A real architecture trained for a model name, at an input size (None: fixed input)."""

    model: str
    architecture: str
    input_size: int | None

    @classmethod
    def for_model(cls, name: str, *, input_size: int | None = None) -> RealSpec:
        """UnknownModelNameError for a name without a real architecture, InputSizeError
        for a size the architecture does not take."""
        model = builtin_model(name)
        arch = model.architecture
        size = arch.size if input_size is None else arch.check_size(input_size)
        return cls(model.name, arch.key, size)

    @property
    def info(self) -> Architecture:
        return ARCHITECTURES[self.architecture]


def wants_real(choice: ArchitectureChoice, device: str) -> bool:
    """Whether a run on ``device`` (``cuda``, ``cuda:1``, ``cpu``) trains real architectures."""
    if choice == "auto":
        return device.startswith("cuda")
    return choice == "real"


def architecture_choice(text: str, source: str) -> ArchitectureChoice:
    """The choice a flag or variable names; ValueError naming ``source`` otherwise."""
    value = text.strip().lower().replace("_", "-")
    for choice in ARCHITECTURE_CHOICES:
        if value == choice:
            return choice
    raise ValueError(f"{source}: must be one of {', '.join(ARCHITECTURE_CHOICES)}, got {text!r}")
