"""Test-time augmentation for a segmenter, inside the graph: each view transforms the images,
the network runs on them, and the view maps its logits back onto the input's pixels (a flip
flipped back, a rescaled image's logits resized back to the input's size) before the views'
logits are averaged. As ttach, a view is one small class; unlike ttach's, the views and their
merge are part of the module, so they export to one ONNX graph with dynamic batch, height and
width.

Views (`--tta_transforms` for segmentation, issue 43): `hflip`, `vflip`, `scale:F[,F...]`
(each F a factor in (0, 4], e.g. `scale:0.75,1.25`). The identity view is always first.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from utils import ConfigError

MAX_SCALE = 4.0
VIEW_NAMES = "hflip, vflip, scale:F[,F...] (0 < F <= 4)"


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def back(self, logits: torch.Tensor, size: Sequence) -> torch.Tensor:
        return logits


class HorizontalFlip(Identity):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1)

    def back(self, logits: torch.Tensor, size: Sequence) -> torch.Tensor:
        return logits.flip(-1)


class VerticalFlip(Identity):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-2)

    def back(self, logits: torch.Tensor, size: Sequence) -> torch.Tensor:
        return logits.flip(-2)


class Rescale(Identity):
    """The image resized by `factor` (bilinear); its logits resized back to the input's size."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=self.factor, mode="bilinear", align_corners=False)

    def back(self, logits: torch.Tensor, size: Sequence) -> torch.Tensor:
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


def parse_views(spec: str) -> list[Identity]:
    """`hflip,vflip,scale:0.75,1.25` → the views, the identity first. A bare number after a
    scale continues it (`scale:0.75,1.25` is two scales)."""
    views: list[Identity] = [Identity()]
    scaling = False
    for word in (w.strip() for w in spec.split(",")):
        if word in ("hflip", "vflip"):
            views.append(HorizontalFlip() if word == "hflip" else VerticalFlip())
            scaling = False
        elif word.startswith("scale:") or (scaling and word):
            views.append(Rescale(_factor(word.removeprefix("scale:"), spec)))
            scaling = True
        elif word:
            raise ConfigError(f"--tta_transforms {spec!r}: {word!r} is not a segmentation view",
                              f"use {VIEW_NAMES}")
    if len(views) == 1:
        raise ConfigError(f"--tta_transforms {spec!r} names no view", f"use {VIEW_NAMES}")
    return views


def _factor(text: str, spec: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = float("nan")
    if not 0 < factor <= MAX_SCALE or factor == 1:
        raise ConfigError(f"--tta_transforms {spec!r}: scale {text!r} is not a factor in "
                          f"(0, {MAX_SCALE:g}] other than 1", "e.g. scale:0.75,1.25")
    return factor


class SegmentationTTA(nn.Module):
    """`net` (images → logits (N, C, H, W)) under `views`: the mean of the views' logits, each
    mapped back onto the input's pixels."""

    def __init__(self, net: nn.Module, views: Sequence[Identity]) -> None:
        super().__init__()
        self.net = net
        self.views = nn.ModuleList(views)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        logits = [view.back(self.net(view(x)), size) for view in self.views]
        return torch.stack(logits).mean(0)
