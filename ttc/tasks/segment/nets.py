"""The segmentation networks: a small U-Net of our own (the default, fast on CPU) and torchvision's
LR-ASPP and DeepLabV3 on MobileNetV3-Large, each described by a plain dict stored in the bundle
manifest (`SEGMENTATION_NETWORKS`: --arch → the function sizing it for the data) and rebuilt
from it (`SEGMENTATION_MODULES`: the record's "name" → the module, called with the record).

Every network takes what the deployed graph takes, pixels in [0, 1] of any height and width,
normalises them itself (the training split's per-channel mean and std, as the classifiers do),
and returns logits (N, classes, H, W) at the input's resolution.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ttc.nets.models import (IMAGENET_MEAN, IMAGENET_STD, SMALL_STEM_MAX_SIDE, adapt_stem,
                             calibrated_softmax, register_statistics)

UNET_WIDTHS = (16, 32, 64)
# The record's widths: one level more per halving of the image while the bottleneck stays at
# least UNET_BOTTLENECK_SIDE pixels (64 → 4 levels, bottleneck 8×8; 32 → 3), 2 to 5 levels.
UNET_LADDER = (16, 32, 64, 128, 256)
UNET_BOTTLENECK_SIDE = 8


def conv_block(channels_in: int, channels_out: int) -> nn.Sequential:
    """Two Conv(3×3)-BatchNorm-ReLU layers at one resolution."""
    layers: list[nn.Module] = []
    for channels in (channels_in, channels_out):
        layers += [nn.Conv2d(channels, channels_out, 3, padding=1, bias=False),
                   nn.BatchNorm2d(channels_out), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class UNet(nn.Module):
    """Normalise → encoder [block, MaxPool] per width but the last → bottleneck block (and
    Dropout) → decoder: per skip, bilinear upsampling to the skip's own size, concatenation,
    block → 1×1 head. Upsampling to the skip's size (not by a factor of 2) makes any height and
    width work, odd ones included, and exports with dynamic height and width."""

    def __init__(self, in_channels: int, num_classes: int,
                 widths: Sequence[int] = UNET_WIDTHS, dropout: float = 0.1,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError("a U-Net needs at least two widths (one skip)")
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        self.down = nn.ModuleList()
        channels = in_channels
        for width in widths[:-1]:
            self.down.append(conv_block(channels, width))
            channels = width
        self.pool = nn.MaxPool2d(2, ceil_mode=True)  # an odd side keeps its last row
        self.bottleneck = conv_block(channels, widths[-1])
        self.dropout = nn.Dropout(dropout)
        self.up = nn.ModuleList()
        channels = widths[-1]
        for width in reversed(widths[:-1]):
            self.up.append(conv_block(channels + width, width))
            channels = width
        self.head = nn.Conv2d(channels, num_classes, 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = (pixels - self.mean) / self.std
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.dropout(self.bottleneck(x))
        for block, skip in zip(self.up, reversed(skips)):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


# --arch → torchvision.models.segmentation's builder of that name.
TORCHVISION_SEGMENTERS = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large")


class TorchvisionSegmenter(nn.Module):
    """A torchvision segmentation network (weights=None, weights_backbone=None: nothing is
    downloaded) behind the same normalisation as UNet, returning its "out" logits (no auxiliary
    head); its state-dict keys sit under `body.` with torchvision's own names, so torchvision
    checkpoints load by name. The first conv takes `in_channels`; with `small_stem` it keeps the
    resolution (stride 1), which halves MobileNetV3's output stride (16 → 8) for small images.
    `normalization`: "data" (the training split's statistics) or "imagenet" (ImageNet weights)."""

    def __init__(self, arch: str, in_channels: int, num_classes: int, small_stem: bool = False,
                 normalization: str = "data", mean: list[float] | None = None,
                 std: list[float] | None = None, **_: object) -> None:
        super().__init__()
        from torchvision.models import segmentation  # 3 s to import: only for these networks

        if arch not in TORCHVISION_SEGMENTERS:
            raise ValueError(f"{arch} is not one of {', '.join(TORCHVISION_SEGMENTERS)}")
        if normalization == "imagenet":  # grayscale: the channel mean of ImageNet's statistics
            mean = IMAGENET_MEAN if in_channels == 3 else [sum(IMAGENET_MEAN) / 3]
            std = IMAGENET_STD if in_channels == 3 else [sum(IMAGENET_STD) / 3]
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        build = getattr(segmentation, arch)
        extra = {"aux_loss": False} if arch.startswith("deeplabv3") else {}
        self.body = build(weights=None, weights_backbone=None, num_classes=num_classes, **extra)
        # The backbone's first Conv2dNormActivation, where the classifiers' stem helper looks
        # for it (features[0]); it replaces that block's conv.
        adapt_stem(SimpleNamespace(features=[self.body.backbone["0"]]), in_channels, small_stem)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.body((pixels - self.mean) / self.std)["out"]


class SegmentationGraph(nn.Module):
    """What a segmentation export traces: logits (N, C, H, W), the calibrated probabilities
    softmax(logits / temperature) over the class axis (dim 1, not the last axis the classifiers'
    wrapper uses), and the mask (N, H, W), the argmax over classes, as int64."""

    def __init__(self, net: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.net = net
        self.temperature = float(temperature)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.net(pixels)
        return logits, calibrated_softmax(logits, self.temperature, dim=1), logits.argmax(dim=1)


# ----------------------------------------------------------------------------- the records


def unet_architecture(preprocessing: dict, num_classes: int) -> dict:
    """The default U-Net sized for the training images: a level per halving until the
    bottleneck is about 8 pixels wide (UNET_LADDER's widths), so its receptive field covers an
    object of half the image (at 64 pixels 4 levels, 488 k parameters; at 32 3, 118 k)."""
    height, width = preprocessing["image_size"]
    side, levels = min(height, width), 1
    while side >= 2 * UNET_BOTTLENECK_SIDE and levels < len(UNET_LADDER):
        side //= 2
        levels += 1
    return {"name": "UNet", "in_channels": int(preprocessing["channels"]),
            "image_size": [height, width], "num_classes": num_classes,
            "widths": list(UNET_LADDER[:max(2, levels)])}


def torchvision_segmenter_architecture(arch: str) -> Callable[[dict, int], dict]:
    def describe(preprocessing: dict, num_classes: int) -> dict:
        height, width = preprocessing["image_size"]
        return {"name": "TorchvisionSegmenter", "arch": arch,
                "in_channels": int(preprocessing["channels"]), "image_size": [height, width],
                "num_classes": num_classes,
                "small_stem": min(height, width) <= SMALL_STEM_MAX_SIDE,
                "normalization": "data"}
    return describe


# --arch → the function sizing that network for the data (preprocessing, classes) → the
# manifest's architecture record; the default first.
SEGMENTATION_NETWORKS: dict[str, Callable[[dict, int], dict]] = {
    "unet": unet_architecture,
    **{arch: torchvision_segmenter_architecture(arch) for arch in TORCHVISION_SEGMENTERS}}
# The record's "name" → the module it builds: cls(**record, mean=..., std=...).
SEGMENTATION_MODULES: dict[str, type[nn.Module]] = {
    "UNet": UNet, "TorchvisionSegmenter": TorchvisionSegmenter}
