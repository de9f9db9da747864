"""Test-time augmentation for a segmenter, inside the graph: each view transforms the images,
the network runs on them, and the view maps its logits back onto the input's pixels (a flip
flipped back, a quarter turn turned back, a rescaled image's logits resized back to the input's
size) before the views' logits are averaged. The views are the shared TTA vocabulary's
(ttc/testtime/transforms.py, one class per transform); unlike ttach's, they and their merge are
part of the module, so they export to one ONNX graph with dynamic batch, height and width (a
quarter turn of a non-square image is a view of the other shape, which the graph takes).

Views: `--tta_transforms` for segmentation, read by views.py. The identity view is always first.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ttc.tasks.segment.views import parse_view_specs
from ttc.testtime.transforms import View, image_views


def parse_views(spec: str) -> list[View]:
    """`hflip,rot90,scale:0.75,1.25` → the views, the identity first (views.py reads the
    spec)."""
    return image_views(parse_view_specs(spec)[1:], "mask")


class SegmentationTTA(nn.Module):
    """`net` (images → logits (N, C, H, W)) under `views`: the mean of the views' logits, each
    mapped back onto the input's pixels."""

    def __init__(self, net: nn.Module, views: Sequence[View]) -> None:
        super().__init__()
        self.net = net
        self.views = list(views)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        logits = [view.deaugment_mask(self.net(view.augment(x)), size) for view in self.views]
        return torch.stack(logits).mean(0)
