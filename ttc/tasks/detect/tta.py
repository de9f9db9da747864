"""Box-fusing test-time augmentation for a detector, in one graph (issue 44, item 5): each view
transforms the images, the network and its decoding (nms.DetectionCandidates) run on the view,
and the view maps its candidate boxes back onto the input's pixels; fusion.py then merges the
views' detections inside the graph. The views are the shared TTA vocabulary's
(ttc/testtime/transforms.py, one class per transform: the ones that map boxes back, e.g.
`hflip`, `vflip`, `rot90`, `rot180`, `rot270`, `shift:PX`, `scale:F[,F...]`, `brightness:D`,
`contrast:F`), read by ttc/tasks/segment/views.py; the identity always first.

Mapping back, for a view of size (h, w) of an input of size (H, W):
- hflip: x → W - x (so x1' = W - x2, x2' = W - x1); vflip: y → H - y;
- rot90 (counter-clockwise, a view of size (W, H)): the view's (x, y) is the input's (W - y, x);
  rot270: (y, H - x); rot180: (W - x, H - y); the graph takes any size, so a non-square image
  is turned as it is;
- scale:F: the image is resized bilinearly to (floor(H F), floor(W F)) with the pixel grid of
  that real size (recompute_scale_factor, as ONNX Resize with sizes), so a view's pixel
  coordinate u is the input's u W / w: x × W / w, y × H / h (not 1 / F, which differs by the
  rounding of the size).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
import torch
from torch import nn

from ttc.tasks.detect.fusion import (FUSION_IOU, FusionSettings, fuse_candidates,
                                     view_output_names)
from ttc.tasks.detect.nms import DetectionCandidates, export_candidates
from ttc.testtime.transforms import View, image_views

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)


def parse_box_views(spec: str) -> list[View]:
    """`hflip,rot90,scale:0.75,1.25` → the views, the identity first (the spec read by
    segment/views.py; an empty one is the detector's default: flags.detector_views)."""
    from ttc.tasks.detect.flags import detector_views
    from ttc.tasks.segment.views import parse_view_specs

    return image_views(parse_view_specs(detector_views(spec), task="detection")[1:], "boxes")


class ViewCandidates(nn.Module):
    """`net` under `views`: per view, its candidates mapped back onto the input's pixels
    (boxes (N, A_v, 4), scores (N, K, A_v)), as 2V outputs: boxes of view 0, scores of view 0,
    boxes of view 1, ... (fusion.view_output_names)."""

    def __init__(self, net: nn.Module, views: Sequence[View]) -> None:
        super().__init__()
        self.candidates = DetectionCandidates(net)
        self.views = list(views)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        size = x.shape[-2:]
        outputs: list[torch.Tensor] = []
        for view in self.views:
            seen = view.augment(x)
            boxes, scores = self.candidates(seen)
            outputs += [view.deaugment_boxes(boxes, seen.shape[-2:], size), scores]
        return tuple(outputs)


def export_view_candidates(net: nn.Module, views: Sequence[View], example: np.ndarray,
                           opset: int) -> onnx.ModelProto:
    """ViewCandidates exported by torch.onnx.export (dynamo) with dynamic batch, height and
    width: input "image", the 2V outputs fusion.view_output_names names (export.py slims it
    and appends the fusion: fusion.append_fusion)."""
    return export_candidates(net, example, opset, wrapper=ViewCandidates(net, views).eval(),
                             output_names=view_output_names(len(views)))


def tta_reference(net: nn.Module, views: Sequence[View], settings: FusionSettings
                  ) -> Callable[[np.ndarray], list[Detections]]:
    """The TTA graph's computation in eager PyTorch and numpy (the export's check): the views'
    candidates, then fusion.fuse_candidates, per image."""
    wrapper = ViewCandidates(net, views).eval()

    def run(images: np.ndarray) -> list[Detections]:
        with torch.no_grad():
            outputs = [t.numpy() for t in wrapper(torch.from_numpy(np.ascontiguousarray(images)))]
        return fuse_candidates(outputs[0::2], outputs[1::2], settings)

    return run


def default_settings(nms, views: int, fusion_iou: float = FUSION_IOU) -> FusionSettings:
    """The fusion's settings from the bundle's NMS (training.NmsSettings)."""
    return FusionSettings(views=views, iou_threshold=nms.iou_threshold,
                          score_threshold=nms.score_threshold,
                          max_detections=nms.max_detections, fusion_iou=fusion_iou)

