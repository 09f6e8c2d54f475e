"""Image networks: ResNet-18/50 (and the CIFAR ResNet-18), VGG-16/19, ShuffleNet V2 x1.0,
GoogLeNet, Inception v3 and YOLOv3 (Darknet-53), as torchvision, ultralytics and the
papers define them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional


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
