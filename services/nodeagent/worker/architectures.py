"""The real architectures the worker trains (on a GPU by default), with their synthetic data
and losses. Compact definitions of our own, layer for layer those of the published models
(the parameter counts in :mod:`.registry` are what these build; a test holds them against
torchvision's, Hugging Face's and the papers' figures).

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

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional

from gpusched.services.nodeagent.worker.catalog import ModelSpec
from gpusched.services.nodeagent.worker.pipeline import (
    IMAGE_SIZE,
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
from gpusched.services.nodeagent.worker.zoo import VOCABULARY, SyntheticData, build_model, loss_of

AnySpec = ModelSpec | RealSpec
IGNORE = -100

_SEED_MIX = 0x9E3779B97F4A7C15


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _SEED_MIX + 7919 * stream + 1) % 2**63)


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


def _conv_bn(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
             padding: int | tuple[int, int] = 0, eps: float = 1e-5) -> list[nn.Module]:  # fmt: skip
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(cout, eps=eps),
    ]


# ---------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.residual = nn.Sequential(
            *_conv_bn(cin, width, 3, stride, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(width, out, 3, 1, 1),
        )
        self.shortcut = _shortcut(cin, out, stride)

    def forward(self, x: Tensor) -> Tensor:
        return functional.relu(self.residual(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        nn.Module.__init__(self)
        out = width * self.expansion
        self.residual = nn.Sequential(
            *_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, out, 1),
        )  # fmt: skip
        self.shortcut = _shortcut(cin, out, stride)


def _shortcut(cin: int, out: int, stride: int) -> nn.Module:
    if stride == 1 and cin == out:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(cin, out, 1, stride))


def resnet(block: type[BasicBlock], blocks: Sequence[int], classes: int, cifar: bool = False
           ) -> nn.Sequential:  # fmt: skip
    """torchvision's ResNet; ``cifar``: the 3x3 stem without max-pool of CIFAR ResNets."""
    stem: list[nn.Module] = (
        [*_conv_bn(3, 64, 3, 1, 1), nn.ReLU(inplace=True)]
        if cifar
        else [*_conv_bn(3, 64, 7, 2, 3), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    )
    layers: list[nn.Module] = []
    cin = 64
    for stage, count in enumerate(blocks):
        width = 64 * 2**stage
        for index in range(count):
            layers.append(block(cin, width, 2 if stage > 0 and index == 0 else 1))
            cin = width * block.expansion
    return nn.Sequential(
        *stem, *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)
    )


# ---------------------------------------------------------------------- VGG


VGG16 = (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0)
VGG19 = (64, 64, 0, 128, 128, 0, *[256] * 4, 0, *[512] * 4, 0, *[512] * 4, 0)


def vgg(config: Sequence[int], classes: int) -> nn.Sequential:
    """torchvision's VGG without batch normalisation (0 in ``config``: a max-pool)."""
    layers: list[nn.Module] = []
    cin = 3
    for width in config:
        if width == 0:
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU(inplace=True)]
            cin = width
    return nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Linear(512 * 49, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, classes),
    )  # fmt: skip


# ---------------------------------------------------------------------- ShuffleNet V2


class ShuffleUnit(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        self.branch1: nn.Module = nn.Identity()
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                *_conv_bn(cin, half, 1), nn.ReLU(inplace=True),
            )  # fmt: skip
        first = cin if stride > 1 else half
        self.branch2 = nn.Sequential(
            *_conv_bn(first, half, 1), nn.ReLU(inplace=True),
            nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False), nn.BatchNorm2d(half),
            *_conv_bn(half, half, 1), nn.ReLU(inplace=True),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            kept, worked = x.chunk(2, dim=1)
            out = torch.cat([kept, self.branch2(worked)], dim=1)
        else:
            out = torch.cat([self.branch1(x), self.branch2(x)], dim=1)
        batch, channels, height, width = out.shape
        # the channel shuffle of two groups
        return out.view(batch, 2, channels // 2, height, width).transpose(1, 2).flatten(1, 2)


def shufflenet_v2(classes: int) -> nn.Sequential:
    """torchvision's ShuffleNet V2 x1.0."""
    layers: list[nn.Module] = [
        *_conv_bn(3, 24, 3, 2, 1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 24
    for repeats, cout in ((4, 116), (8, 232), (4, 464)):
        layers += [
            ShuffleUnit(cin, cout, 2),
            *(ShuffleUnit(cout, cout, 1) for _ in range(repeats - 1)),
        ]
        cin = cout
    return nn.Sequential(
        *layers, *_conv_bn(cin, 1024, 1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1024, classes),
    )  # fmt: skip


# ---------------------------------------------------------------------- GoogLeNet, Inception v3


def conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
         padding: int | tuple[int, int] = 0) -> nn.Sequential:  # fmt: skip
    """The Inception family's conv: no bias, batch norm (eps 0.001), ReLU."""
    return nn.Sequential(*_conv_bn(cin, cout, kernel, stride, padding, eps=1e-3), nn.ReLU(True))


class Branches(nn.Module):
    """Parallel branches whose outputs are concatenated along the channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


def _pool(kind: str, kernel: int = 3, stride: int = 1, padding: int = 1) -> nn.Module:
    if kind == "max":
        return nn.MaxPool2d(kernel, stride, padding, ceil_mode=True)
    return nn.AvgPool2d(kernel, stride, padding)


def googlenet_block(cin: int, c1: int, r3: int, c3: int, r5: int, c5: int, pool: int) -> Branches:
    # torchvision's "5x5" branch has a 3x3 kernel, which its parameter count reflects
    return Branches(
        conv(cin, c1, 1),
        nn.Sequential(conv(cin, r3, 1), conv(r3, c3, 3, padding=1)),
        nn.Sequential(conv(cin, r5, 1), conv(r5, c5, 3, padding=1)),
        nn.Sequential(_pool("max"), conv(cin, pool, 1)),
    )


class AuxiliaryHead(nn.Sequential):
    """GoogLeNet's auxiliary classifier."""

    def __init__(self, cin: int, classes: int) -> None:
        super().__init__(
            nn.AdaptiveAvgPool2d(4), conv(cin, 128, 1), nn.Flatten(),
            nn.Linear(2048, 1024), nn.ReLU(inplace=True), nn.Dropout(0.7),
            nn.Linear(1024, classes),
        )  # fmt: skip


class WithAuxiliaries(nn.Module):
    """A network in stages whose auxiliary heads read the output of some stages. Training
    returns the main logits and every auxiliary head's, side by side (``B x C(1 + heads)``);
    evaluation the main ones only."""

    def __init__(self, stages: Sequence[nn.Module], heads: dict[int, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.heads = nn.ModuleDict({str(at): head for at, head in heads.items()})

    def forward(self, x: Tensor) -> Tensor:
        auxiliary: list[Tensor] = []
        for index, stage in enumerate(self.stages):
            x = stage(x)
            if self.training and str(index) in self.heads:
                auxiliary.append(self.heads[str(index)](x))
        return torch.cat([x, *auxiliary], dim=1)


def googlenet(classes: int) -> WithAuxiliaries:
    """torchvision's GoogLeNet with ``aux_logits=True``."""
    pool = _pool("max", 3, 2, 0)
    stem = nn.Sequential(
        conv(3, 64, 7, 2, 3), pool, conv(64, 64, 1), conv(64, 192, 3, padding=1),
        _pool("max", 3, 2, 0),
        googlenet_block(192, 64, 96, 128, 16, 32, 32),
        googlenet_block(256, 128, 128, 192, 32, 96, 64), _pool("max", 3, 2, 0),
        googlenet_block(480, 192, 96, 208, 16, 48, 64),
    )  # fmt: skip
    middle = nn.Sequential(
        googlenet_block(512, 160, 112, 224, 24, 64, 64),
        googlenet_block(512, 128, 128, 256, 24, 64, 64),
        googlenet_block(512, 112, 144, 288, 32, 64, 64),
    )
    top = nn.Sequential(
        googlenet_block(528, 256, 160, 320, 32, 128, 128), _pool("max", 2, 2, 0),
        googlenet_block(832, 256, 160, 320, 32, 128, 128),
        googlenet_block(832, 384, 192, 384, 48, 128, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1024, classes),
    )  # fmt: skip
    return WithAuxiliaries(
        [stem, middle, top], {0: AuxiliaryHead(512, classes), 1: AuxiliaryHead(528, classes)}
    )


def _avg_pool_then(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(_pool("avg"), conv(cin, cout, 1))


def inception_a(cin: int, pool: int) -> Branches:
    return Branches(
        conv(cin, 64, 1),
        nn.Sequential(conv(cin, 48, 1), conv(48, 64, 5, padding=2)),
        nn.Sequential(conv(cin, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, padding=1)),
        _avg_pool_then(cin, pool),
    )


def inception_b(cin: int) -> Branches:
    return Branches(
        conv(cin, 384, 3, 2),
        nn.Sequential(conv(cin, 64, 1), conv(64, 96, 3, padding=1), conv(96, 96, 3, 2)),
        nn.MaxPool2d(3, 2),
    )


def inception_c(cin: int, c7: int) -> Branches:
    def row(a: int, b: int) -> nn.Module:
        return conv(a, b, (1, 7), padding=(0, 3))

    def column(a: int, b: int) -> nn.Module:
        return conv(a, b, (7, 1), padding=(3, 0))

    return Branches(
        conv(cin, 192, 1),
        nn.Sequential(conv(cin, c7, 1), row(c7, c7), column(c7, 192)),
        nn.Sequential(conv(cin, c7, 1), column(c7, c7), row(c7, c7), column(c7, c7), row(c7, 192)),
        _avg_pool_then(cin, 192),
    )


def inception_d(cin: int) -> Branches:
    return Branches(
        nn.Sequential(conv(cin, 192, 1), conv(192, 320, 3, 2)),
        nn.Sequential(
            conv(cin, 192, 1),
            conv(192, 192, (1, 7), padding=(0, 3)),
            conv(192, 192, (7, 1), padding=(3, 0)),
            conv(192, 192, 3, 2),
        ),
        nn.MaxPool2d(3, 2),
    )


def _split_3x3(cin: int) -> Branches:
    return Branches(conv(cin, 384, (1, 3), padding=(0, 1)), conv(cin, 384, (3, 1), padding=(1, 0)))


def inception_e(cin: int) -> Branches:
    return Branches(
        conv(cin, 320, 1),
        nn.Sequential(conv(cin, 384, 1), _split_3x3(384)),
        nn.Sequential(conv(cin, 448, 1), conv(448, 384, 3, padding=1), _split_3x3(384)),
        _avg_pool_then(cin, 192),
    )


def inception_v3(classes: int) -> WithAuxiliaries:
    """torchvision's Inception v3 (``aux_logits=True``)."""
    lower = nn.Sequential(
        conv(3, 32, 3, 2), conv(32, 32, 3), conv(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
        conv(64, 80, 1), conv(80, 192, 3), nn.MaxPool2d(3, 2),
        inception_a(192, 32), inception_a(256, 64), inception_a(288, 64), inception_b(288),
        inception_c(768, 128), inception_c(768, 160), inception_c(768, 160),
        inception_c(768, 192),
    )  # fmt: skip
    upper = nn.Sequential(
        inception_d(768), inception_e(1280), inception_e(2048),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(2048, classes),
    )  # fmt: skip
    auxiliary = nn.Sequential(
        nn.AvgPool2d(5, 3), conv(768, 128, 1), conv(128, 768, 5),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(768, classes),
    )  # fmt: skip
    return WithAuxiliaries([lower, upper], {0: auxiliary})


# ---------------------------------------------------------------------- YOLOv3

YOLO_ANCHORS = 3
YOLO_STRIDES = (32, 16, 8)


def dark(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        *_conv_bn(cin, cout, kernel, stride, kernel // 2), nn.LeakyReLU(0.1, inplace=True)
    )


class DarkResidual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            dark(channels, channels // 2, 1), dark(channels // 2, channels, 3)
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


def _darknet_stage(cin: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(dark(cin, 2 * cin, 3, 2), *(DarkResidual(2 * cin) for _ in range(blocks)))


class YoloV3(nn.Module):
    """Darknet-53 and the three detection heads of yolov3.cfg. The output is every anchor
    of every cell of the three scales (largest stride first), ``B x cells x (5 + classes)``:
    box (4), objectness, class logits."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.outputs = 5 + classes
        self.c3 = nn.Sequential(dark(3, 32, 3), _darknet_stage(32, 1), _darknet_stage(64, 2),
                                _darknet_stage(128, 8))  # fmt: skip
        self.c4 = _darknet_stage(256, 8)
        self.c5 = _darknet_stage(512, 4)
        self.necks = nn.ModuleList(
            self._neck(cin, width) for cin, width in ((1024, 512), (768, 256), (384, 128))
        )
        self.detect = nn.ModuleList(
            nn.Sequential(dark(w, 2 * w, 3), nn.Conv2d(2 * w, YOLO_ANCHORS * self.outputs, 1))
            for w in (512, 256, 128)
        )
        self.lateral = nn.ModuleList(dark(w, w // 2, 1) for w in (512, 256))

    @staticmethod
    def _neck(cin: int, width: int) -> nn.Sequential:
        return nn.Sequential(
            dark(cin, width, 1), dark(width, 2 * width, 3), dark(2 * width, width, 1),
            dark(width, 2 * width, 3), dark(2 * width, width, 1),
        )  # fmt: skip

    def forward(self, images: Tensor) -> Tensor:
        c3 = self.c3(images)
        c4 = self.c4(c3)
        x = self.c5(c4)
        skips = [c4, c3]
        maps: list[Tensor] = []
        for scale in range(3):
            x = self.necks[scale](x)
            maps.append(self.detect[scale](x))
            if scale < 2:
                up = functional.interpolate(self.lateral[scale](x), scale_factor=2.0)
                x = torch.cat([up, skips[scale]], dim=1)
        batch = images.shape[0]
        return torch.cat(
            [
                m.view(batch, YOLO_ANCHORS, self.outputs, *m.shape[2:])
                .permute(0, 1, 3, 4, 2)
                .reshape(batch, -1, self.outputs)
                for m in maps
            ],
            dim=1,
        )


def yolo_cells(size: int) -> int:
    return sum(YOLO_ANCHORS * (size // stride) ** 2 for stride in YOLO_STRIDES)


# ---------------------------------------------------------------------- transformers

BERT_VOCABULARY, BERT_POSITIONS, BERT_MASK_TOKEN = 30_522, 512, 103
GPT2_VOCABULARY, GPT2_POSITIONS = 50_257, 1024
TRANSLATION_VOCABULARY = 37_000


def _encoder(width: int, heads: int, layers: int, ff: int, *, pre_norm: bool,
             eps: float) -> nn.TransformerEncoder:  # fmt: skip
    layer = nn.TransformerEncoderLayer(
        width, heads, ff, dropout=0.1, activation="gelu", layer_norm_eps=eps,
        batch_first=True, norm_first=pre_norm,
    )  # fmt: skip
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _init_like_bert(
    module: nn.Module, std: float = 0.02, *, scaled: tuple[str, ...] = (), layers: int = 1
) -> None:
    """BERT's and GPT-2's initialisation: weights normal (std 0.02), biases 0, norms 1;
    weights whose name ends in ``scaled`` (GPT-2's residual projections) by 1/sqrt(2 layers)."""
    for name, parameter in module.named_parameters():
        if parameter.dim() == 1:
            nn.init.ones_(parameter) if "norm" in name else nn.init.zeros_(parameter)
        else:
            factor = (2 * layers) ** -0.5 if name.endswith(scaled) else 1.0
            nn.init.normal_(parameter, std=std * factor)


class Bert(nn.Module):
    """BERT-base with its masked-LM head (the decoder tied to the token embedding). A
    sequence is two segments of half its length."""

    def __init__(self) -> None:
        super().__init__()
        width = 768
        self.tokens = nn.Embedding(BERT_VOCABULARY, width)
        self.positions = nn.Embedding(BERT_POSITIONS, width)
        self.segments = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.encoder = _encoder(width, 12, 12, 3072, pre_norm=False, eps=1e-12)
        self.transform = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width, eps=1e-12)
        )
        self.bias = nn.Parameter(torch.zeros(BERT_VOCABULARY))
        _init_like_bert(self)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        where = torch.arange(length, device=tokens.device)
        segment = (where >= length // 2).long()
        hidden = self.tokens(tokens) + self.positions(where) + self.segments(segment)
        hidden = self.encoder(self.dropout(self.norm(hidden)))
        return functional.linear(self.transform(hidden), self.tokens.weight, self.bias)


class Gpt2(nn.Module):
    """GPT-2 small: pre-norm causal blocks, learned positions, LM head tied to the tokens."""

    def __init__(self) -> None:
        super().__init__()
        width = 768
        self.tokens = nn.Embedding(GPT2_VOCABULARY, width)
        self.positions = nn.Embedding(GPT2_POSITIONS, width)
        self.dropout = nn.Dropout(0.1)
        self.blocks = _encoder(width, 12, 12, 4 * width, pre_norm=True, eps=1e-5)
        self.norm = nn.LayerNorm(width)
        _init_like_bert(self, scaled=("out_proj.weight", "linear2.weight"), layers=12)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        where = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.tokens(tokens) + self.positions(where))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return functional.linear(self.norm(hidden), self.tokens.weight)


def sinusoids(length: int, width: int) -> Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(1e4) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


class TranslationTransformer(nn.Module):
    """The Transformer base: shared source/target embedding tied to the output projection,
    sinusoidal positions. Its input is the source tokens followed by the decoder's input
    (the target shifted right), each ``length`` long."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.width = 512
        self.embedding = nn.Embedding(TRANSLATION_VOCABULARY, self.width)
        self.register_buffer("positions", sinusoids(length, self.width), persistent=False)
        self.transformer = nn.Transformer(self.width, 8, 6, 6, 2048, dropout=0.1, batch_first=True)
        nn.init.normal_(self.embedding.weight, std=self.width**-0.5)

    def _embed(self, tokens: Tensor) -> Tensor:
        positions = self.get_buffer("positions")
        return self.embedding(tokens) * math.sqrt(self.width) + positions[: tokens.shape[1]]

    def forward(self, pair: Tensor) -> Tensor:
        source, target = pair.chunk(2, dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], device=pair.device)
        hidden = self.transformer(
            self._embed(source), self._embed(target), tgt_mask=mask, tgt_is_causal=True
        )
        return functional.linear(hidden, self.embedding.weight)


# ---------------------------------------------------------------------- recurrent

LM_VOCABULARY = 33_278
SPEECH_CHARACTERS = 29


class LstmLanguageModel(nn.Module):
    """PyTorch's word_language_model (LSTM, 2 layers of 200, dropout 0.2, untied)."""

    def __init__(self, width: int = 200, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(LM_VOCABULARY, width)
        self.dropout = nn.Dropout(0.2)
        self.lstm = nn.LSTM(width, width, layers, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(width, LM_VOCABULARY)
        for weight in (self.embedding.weight, self.decoder.weight):
            nn.init.uniform_(weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden, _ = self.lstm(self.dropout(self.embedding(tokens)))
        return self.decoder(self.dropout(hidden))


class SequenceNorm(nn.Module):
    """Batch normalisation over every (sample, frame) of a ``B x T x H`` sequence."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.flatten(0, 1)).view_as(x)


class BidirectionalLayer(nn.Module):
    """deepspeech.pytorch's BatchRNN: optional sequence norm, a bidirectional LSTM whose
    two directions are summed."""

    def __init__(self, cin: int, width: int, norm: bool) -> None:
        super().__init__()
        self.norm: nn.Module = SequenceNorm(cin) if norm else nn.Identity()
        self.lstm = nn.LSTM(cin, width, bidirectional=True, batch_first=True)
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.norm(x))
        return out[..., : self.width] + out[..., self.width :]


class DeepSpeech2(nn.Module):
    """deepspeech.pytorch's DeepSpeech2 (its defaults: LSTM, 5 layers of 1024, 161 bins).
    Output: per-frame character logits, ``B x frames/2 x 29``."""

    def __init__(self, width: int = 1024, layers: int = 5) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), (2, 2), (20, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
            nn.Conv2d(32, 32, (21, 11), (2, 1), (10, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
        )  # fmt: skip
        bins = (SPECTROGRAM_BINS + 40 - 41) // 2 + 1
        bins = (bins + 20 - 21) // 2 + 1
        self.rnns = nn.Sequential(
            BidirectionalLayer(32 * bins, width, norm=False),
            *(BidirectionalLayer(width, width, norm=True) for _ in range(layers - 1)),
        )
        self.head = nn.Sequential(
            SequenceNorm(width), nn.Linear(width, SPEECH_CHARACTERS, bias=False)
        )

    def forward(self, spectrogram: Tensor) -> Tensor:
        features = self.conv(spectrogram)  # B x 32 x bins x frames
        sequence = features.flatten(1, 2).transpose(1, 2)  # B x frames x 32*bins
        return self.head(self.rnns(sequence))


def speech_frames(frames: int) -> int:
    """Output frames of DeepSpeech2 for ``frames`` input frames (the first conv halves them)."""
    return (frames + 2 * 5 - 11) // 2 + 1


# ---------------------------------------------------------------------- NCF, Atari


class NeuMF(nn.Module):
    """NCF's NeuMF: a matrix-factorisation and an MLP path over user and item embeddings.
    Input: ``B x 2`` (user, item) ids; output: one logit per pair."""

    def __init__(self, users: int, items: int, mlp: Sequence[int], factors: int = 64) -> None:
        super().__init__()
        self.users, self.items = users, items
        self.mf_user, self.mf_item = nn.Embedding(users, factors), nn.Embedding(items, factors)
        half = mlp[0] // 2
        self.mlp_user, self.mlp_item = nn.Embedding(users, half), nn.Embedding(items, half)
        layers: list[nn.Module] = []
        for cin, cout in itertools.pairwise(mlp):
            layers += [nn.Linear(cin, cout), nn.ReLU(inplace=True)]
        self.mlp = nn.Sequential(*layers)
        self.predict = nn.Linear(factors + mlp[-1], 1)

    def forward(self, pairs: Tensor) -> Tensor:
        user, item = pairs[:, 0], pairs[:, 1]
        mf = self.mf_user(user) * self.mf_item(item)
        mlp = self.mlp(torch.cat([self.mlp_user(user), self.mlp_item(item)], dim=1))
        return self.predict(torch.cat([mf, mlp], dim=1)).squeeze(1)


ATARI_ACTIONS = 18


def nature_cnn() -> list[nn.Module]:
    return [
        nn.Conv2d(ATARI_FRAMES, 32, 8, 4), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 4, 2), nn.ReLU(inplace=True),
        nn.Conv2d(64, 64, 3, 1), nn.ReLU(inplace=True), nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512), nn.ReLU(inplace=True),
    ]  # fmt: skip


class ActorCritic(nn.Module):
    """Output: the policy's action logits and the state's value, ``B x (actions + 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*nature_cnn())
        self.policy, self.value = nn.Linear(512, ATARI_ACTIONS), nn.Linear(512, 1)

    def forward(self, frames: Tensor) -> Tensor:
        hidden = self.trunk(frames)
        return torch.cat([self.policy(hidden), self.value(hidden)], dim=1)


# ---------------------------------------------------------------------- tasks


class Task(Protocol):
    """A real architecture's synthetic data and loss."""

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of a batch of pipeline images, on the CPU."""
        ...

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor: ...

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """How many of the predictions that accuracy counts are right, out of how many."""
        ...


POOLED = 4
PIXELS = RECORD_CHANNELS * IMAGE_SIZE**2


def _pooled(images: Tensor) -> Tensor:
    return functional.adaptive_avg_pool2d(images, POOLED).flatten(1)


def _projected(images: Tensor, projection: Tensor) -> Tensor:
    """Roughly standard normal features of each image, one per column of ``projection``."""
    return images.flatten(1) @ projection / math.sqrt(PIXELS)


def _argmax_correct(logits: Tensor, targets: Tensor) -> tuple[float, int]:
    return float((logits.argmax(dim=-1) == targets).sum()), targets.numel()


class ImageClassification:
    """Classes from a teacher over the pooled image; with auxiliary heads (GoogLeNet,
    Inception) the loss adds theirs at ``aux_weight``."""

    def __init__(self, seed: int, classes: int, aux_weight: float = 0.0) -> None:
        self.classes, self.aux_weight = classes, aux_weight
        self.teacher = torch.randn(
            RECORD_CHANNELS * POOLED**2, classes, generator=_generator(seed, 1)
        )

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return images, (_pooled(images) @ self.teacher).argmax(dim=1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        main, *auxiliary = outputs.split(self.classes, dim=1)
        loss = functional.cross_entropy(main, targets)
        for logits in auxiliary:
            loss = loss + self.aux_weight * functional.cross_entropy(logits, targets)
        return loss

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return _argmax_correct(outputs[:, : self.classes], targets)


class Detection:
    """YOLO targets per anchor cell (objectness, class, box in 0..1): ``objects`` cells of
    each image hold an object. The loss: objectness BCE over every cell, class cross entropy
    and box MSE over the cells with an object."""

    def __init__(self, seed: int, classes: int, size: int, objects: int = 4) -> None:
        self.classes, self.cells = classes, yolo_cells(size)
        generator = _generator(seed, 2)
        self.where = torch.randn(PIXELS, objects, generator=generator)
        self.boxes = torch.randn(PIXELS, 4 * objects, generator=generator)
        self.teacher = torch.randn(
            RECORD_CHANNELS * POOLED**2, objects * classes, generator=generator
        )

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        batch = images.shape[0]
        cells = (_projected(images, self.where).abs() * 1e4).long() % self.cells
        objects = cells.shape[1]
        classes = (_pooled(images) @ self.teacher).view(batch, objects, -1).argmax(dim=2)
        boxes = torch.sigmoid(_projected(images, self.boxes)).view(batch, objects, 4)
        targets = torch.zeros(batch, self.cells, 6)
        rows = torch.arange(batch)[:, None].expand(batch, objects)
        targets[rows, cells] = torch.cat(
            [torch.ones(batch, objects, 1), classes[..., None].float(), boxes], dim=2
        )
        return images, targets

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        present = targets[..., 0] > 0
        objectness = functional.binary_cross_entropy_with_logits(outputs[..., 4], targets[..., 0])
        found, wanted = outputs[present], targets[present]
        boxes = functional.mse_loss(torch.sigmoid(found[:, :4]), wanted[:, 2:])
        classes = functional.cross_entropy(found[:, 5:], wanted[:, 1].long())
        return objectness + boxes + classes

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        present = targets[..., 0] > 0
        return _argmax_correct(outputs[present][:, 5:], targets[present][:, 1].long())


def _token_walk(images: Tensor, projection: Tensor, vocabulary: int, step: int) -> Tensor:
    """Token sequences in which each token is its predecessor plus ``step`` plus 0..2,
    from a start and the increments drawn from the image (``length`` = projection columns)."""
    features = _projected(images, projection)
    start = (features[:, :1].abs() * vocabulary).long()
    increments = step + (features[:, 1:] > 0).long() + (features[:, 1:] > 1).long()
    return torch.cat([start, start + increments.cumsum(dim=1)], dim=1) % vocabulary


class CausalLanguageModel:
    """Next-token prediction over ``length`` tokens."""

    def __init__(self, seed: int, vocabulary: int, length: int) -> None:
        self.vocabulary = vocabulary
        self.projection = torch.randn(PIXELS, length + 1, generator=_generator(seed, 3))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        tokens = _token_walk(images, self.projection, self.vocabulary, 7)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.cross_entropy(outputs.reshape(-1, self.vocabulary), targets.reshape(-1))

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return _argmax_correct(outputs, targets)


class MaskedLanguageModel(CausalLanguageModel):
    """BERT's masked-LM: about 15 % of the tokens (at least one per sequence) are replaced
    by [MASK]; targets are the originals there and ignored elsewhere."""

    def __init__(self, seed: int, length: int) -> None:
        super().__init__(seed, BERT_VOCABULARY, length)
        self.masked = torch.rand(PIXELS, length, generator=_generator(seed, 4))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        tokens = _token_walk(images, self.projection, self.vocabulary, 7)[:, :-1]
        masked = _projected(images, self.masked).abs() % 1.0 < 0.15
        masked[:, 1] = True
        targets = torch.where(masked, tokens, IGNORE)
        return torch.where(masked, BERT_MASK_TOKEN, tokens), targets

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        counted = targets != IGNORE
        return _argmax_correct(outputs[counted], targets[counted])


class Translation(CausalLanguageModel):
    """A source sequence and its "translation" (reversed, each token mapped); the decoder
    reads the target shifted right behind a start token. Label smoothing 0.1, as the
    Transformer paper trains."""

    def __init__(self, seed: int, length: int) -> None:
        super().__init__(seed, TRANSLATION_VOCABULARY, length - 1)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        source = _token_walk(images, self.projection, self.vocabulary, 3)
        target = (source.flip(1) * 5 + 2) % self.vocabulary
        decoder = functional.pad(target[:, :-1], (1, 0), value=1)
        return torch.cat([source, decoder], dim=1), target

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.cross_entropy(
            outputs.reshape(-1, self.vocabulary), targets.reshape(-1), label_smoothing=0.1
        )


class SpeechRecognition:
    """CTC over the frames of the network's output: each image's transcript is
    ``frames/4`` of its output frames' worth of characters (1..28; 0 is the blank)."""

    def __init__(self, seed: int, frames: int) -> None:
        self.frames = speech_frames(frames)
        self.length = max(1, self.frames // 4)
        self.projection = torch.randn(PIXELS, self.length, generator=_generator(seed, 5))

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        features = _projected(images, self.projection)
        return images, 1 + (features.abs() * 100).long() % (SPEECH_CHARACTERS - 1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        batch, frames = outputs.shape[:2]
        log_probs = functional.log_softmax(outputs, dim=2).transpose(0, 1)
        return functional.ctc_loss(
            log_probs, targets,
            torch.full((batch,), frames, dtype=torch.long),
            torch.full((batch,), targets.shape[1], dtype=torch.long),
            zero_infinity=True,
        )  # fmt: skip

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """Characters of the greedy decoding at their place in the transcript."""
        right = 0.0
        for best, transcript in zip(outputs.argmax(dim=2), targets, strict=True):
            decoded = torch.unique_consecutive(best)
            decoded = decoded[decoded != 0][: transcript.numel()]
            right += float((decoded == transcript[: decoded.numel()]).sum())
        return right, targets.numel()


class Recommendation:
    """(user, item) pairs drawn from the image; a pair is positive when the teacher's user
    and item scores sum above 0. Binary cross entropy on the logit."""

    def __init__(self, seed: int, users: int, items: int) -> None:
        generator = _generator(seed, 6)
        self.users, self.items = users, items
        self.projection = torch.randn(PIXELS, 2, generator=generator)
        self.user_score = torch.randn(users, generator=generator)
        self.item_score = torch.randn(items, generator=generator)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        draws = (_projected(images, self.projection).abs() * 1e6).long()
        pairs = torch.stack([draws[:, 0] % self.users, draws[:, 1] % self.items], dim=1)
        positive = self.user_score[pairs[:, 0]] + self.item_score[pairs[:, 1]] > 0
        return pairs, positive.float()

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return functional.binary_cross_entropy_with_logits(outputs, targets)

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        return float(((outputs > 0).float() == targets).sum()), targets.numel()


class Reinforcement:
    """Atari-like transitions: the teacher's action and its return for each frame stack
    (targets ``B x 2``). DQN: Huber loss of Q(s, a) against the return; A2C: policy
    gradient with the advantage, value regression and an entropy bonus."""

    def __init__(self, seed: int, actor_critic: bool) -> None:
        self.actor_critic = actor_critic
        generator = _generator(seed, 7)
        pooled = RECORD_CHANNELS * POOLED**2
        self.actions = torch.randn(pooled, ATARI_ACTIONS, generator=generator)
        self.returns = torch.randn(pooled, 1, generator=generator)

    def labelled(self, images: Tensor) -> tuple[Tensor, Tensor]:
        pooled = _pooled(images)
        action = (pooled @ self.actions).argmax(dim=1, keepdim=True).float()
        value = torch.tanh(pooled @ self.returns)
        return images, torch.cat([action, value], dim=1)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        action, value = targets[:, 0].long(), targets[:, 1]
        if not self.actor_critic:
            chosen = outputs.gather(1, action[:, None]).squeeze(1)
            return functional.smooth_l1_loss(chosen, value)
        logits, estimate = outputs[:, :-1], outputs[:, -1]
        log_policy = functional.log_softmax(logits, dim=1)
        advantage = (value - estimate).detach()
        policy = -(log_policy.gather(1, action[:, None]).squeeze(1) * advantage).mean()
        entropy = -(log_policy.exp() * log_policy).sum(dim=1).mean()
        return policy + 0.5 * functional.mse_loss(estimate, value) - 0.01 * entropy

    def correct(self, outputs: Tensor, targets: Tensor) -> tuple[float, int]:
        """A2C: the policy's best action is the teacher's; DQN: Q(s, a) within 0.1 of the
        return."""
        action, value = targets[:, 0].long(), targets[:, 1]
        if self.actor_critic:
            return _argmax_correct(outputs[:, :-1], action)
        chosen = outputs.gather(1, action[:, None]).squeeze(1)
        return float(((chosen - value).abs() < 0.1).sum()), value.numel()


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


# ---------------------------------------------------------------------- either kind


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
    return _argmax_correct(outputs, targets.reshape(-1))


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
