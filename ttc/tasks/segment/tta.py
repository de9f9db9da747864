"""Test-time augmentation for a segmenter, inside the graph: each view transforms the images,
the network runs on them, and the view maps its logits back onto the input's pixels (a flip
flipped back, a rescaled image's logits resized back to the input's size) before the views'
logits are averaged. As ttach, a view is one small class; unlike ttach's, the views and their
merge are part of the module, so they export to one ONNX graph with dynamic batch, height and
width.

Views (`--tta_transforms` for segmentation, read by views.py): `hflip`, `vflip`,
`scale:F[,F...]` (each F a factor in (0, 4], e.g. `scale:0.75,1.25`). The identity view is
always first.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ttc.tasks.segment.views import parse_view_specs

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


VIEWS = {"identity": Identity, "hflip": HorizontalFlip, "vflip": VerticalFlip}


def parse_views(spec: str) -> list[Identity]:
    """`hflip,vflip,scale:0.75,1.25` → the views' modules, the identity first (views.py reads
    the spec)."""
    return [Rescale(factor) if name == "scale" else VIEWS[name]()
            for name, factor in parse_view_specs(spec)]


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
