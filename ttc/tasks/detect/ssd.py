"""torchvision's SSDlite320 (MobileNetV3-Large) as a detector of this tool
(`--arch ssdlite320_mobilenet_v3_large`): torchvision's own network, anchors, matching and loss
(`SSD.compute_loss`: smooth-L1 boxes and cross-entropy classes with 3:1 hard negatives), and our
graph contract after it: every anchor's decoded box and class scores are the candidates that
nms.py's class-aware NonMaxSuppression takes, like CenterNet's cells.

What torchvision's SSD does in its GeneralizedRCNNTransform is done here, in traceable tensor
code, so that the ONNX graph keeps a dynamic batch, height and width (torchvision's own export
fixes the batch): pixels in [0, 1] (a grayscale image repeated to three channels), resized to
SIZE x SIZE (bilinear, as the transform's fixed_size does), normalised by (x - 0.5) / 0.5; boxes
decoded with the BoxCoder's weights (10, 10, 5, 5) against the anchors, which are constant at
SIZE (computed once, not saved), and scaled back to the input's pixels. Scores are the softmax
over the background and the classes, the background dropped: (N, K, A).

The state dict's keys are torchvision's under `body.`, so `--pretrained` loads its COCO weights
(SSDLite320_MobileNet_V3_Large_Weights.COCO_V1) by name; the class head, sized for COCO's 91,
does not match another class count and starts fresh. Importing this module imports torch.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SIZE = 320  # the network's input side: every image is resized to it (the name's 320)
MEAN, STD = 0.5, 0.5  # torchvision's image_mean/image_std for SSDlite: [0, 1] → [-1, 1]
BOX_WEIGHTS = (10.0, 10.0, 5.0, 5.0)  # torchvision's BoxCoder for SSD
MAX_LOG_SCALE = math.log(1000.0 / 16)  # BoxCoder's clamp of the width and height codes
SSD_ARCHS = ("ssdlite320_mobilenet_v3_large",)


class TorchvisionSSD(nn.Module):
    """torchvision's SSDlite320 (weights=None, weights_backbone=None: nothing downloaded) with
    K + 1 classes (0: background) behind our contract: `candidates(pixels)` gives (boxes
    (N, A, 4) xyxy in input pixels, scores (N, K, A)); `detection_loss(images, boxes)` its
    training loss; forward returns the raw heads (bbox_regression, cls_logits)."""

    def __init__(self, arch: str, in_channels: int, num_classes: int, **_: object) -> None:
        super().__init__()
        from torchvision.models import detection

        if arch not in SSD_ARCHS:
            raise ValueError(f"{arch} is not one of {', '.join(SSD_ARCHS)}")
        self.in_channels = int(in_channels)
        self.body = getattr(detection, arch)(weights=None, weights_backbone=None,
                                             num_classes=num_classes + 1)
        self.register_buffer("anchors", self._anchors(), persistent=False)

    def _anchors(self) -> torch.Tensor:
        """The default boxes (A, 4) xyxy at SIZE pixels: the same for every image, since every
        image is resized to SIZE."""
        from torchvision.models.detection.image_list import ImageList

        with torch.no_grad():
            blank = torch.zeros(1, 3, SIZE, SIZE)
            features = list(self.body.backbone.eval()(blank).values())
            anchors = self.body.anchor_generator(ImageList(blank, [(SIZE, SIZE)]), features)
        self.body.backbone.train()
        return anchors[0]

    def network_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (N, C, H, W) in [0, 1] → what torchvision's transform gives the backbone."""
        if pixels.shape[1] == 1:
            pixels = pixels.expand(-1, 3, -1, -1)
        resized = F.interpolate(pixels, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        return (resized - MEAN) / STD

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = list(self.body.backbone(self.network_input(pixels)).values())
        heads = self.body.head(features)
        return heads["bbox_regression"], heads["cls_logits"]

    def candidates(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every anchor's box (N, A, 4), xyxy in the input's pixels and clipped to it, and its
        class scores (N, K, A) (softmax, background dropped)."""
        regression, logits = self(pixels)
        boxes = decode(regression, self.anchors)
        height, width = pixels.shape[-2:]
        xs = (boxes[..., 0::2] * (width / SIZE)).clamp(min=0).clamp(max=width)
        ys = (boxes[..., 1::2] * (height / SIZE)).clamp(min=0).clamp(max=height)
        boxes = torch.stack([xs[..., 0], ys[..., 0], xs[..., 1], ys[..., 1]], dim=-1)
        return boxes, torch.softmax(logits, dim=-1)[..., 1:].transpose(1, 2)

    def detection_loss(self, images: torch.Tensor, boxes: Sequence[np.ndarray]
                       ) -> tuple[torch.Tensor, dict[str, float]]:
        """torchvision's SSD loss for a batch: each image's (k, 5) boxes [class, x1, y1, x2,
        y2] in its pixels, scaled to SIZE, matched to the anchors by its proposal matcher."""
        return self.outputs_loss(self(images), images, boxes)

    def outputs_loss(self, outputs: tuple[torch.Tensor, torch.Tensor], images: torch.Tensor,
                     boxes: Sequence[np.ndarray]) -> tuple[torch.Tensor, dict[str, float]]:
        """detection_loss of this network's `outputs` on `images` (the forward pass run by the
        caller: a Ray worker's goes through DistributedDataParallel)."""
        from torchvision.ops import box_iou

        regression, logits = outputs
        height, width = images.shape[-2:]
        device = self.anchors.device
        scale = torch.tensor([SIZE / width, SIZE / height] * 2, device=device)
        targets, matched = [], []
        for rows in boxes:
            rows = torch.as_tensor(np.asarray(rows, np.float32).reshape(-1, 5), device=device)
            target = {"boxes": rows[:, 1:] * scale, "labels": rows[:, 0].long() + 1}
            targets.append(target)
            matched.append(self.body.proposal_matcher(box_iou(target["boxes"], self.anchors))
                           if len(rows) else torch.full((len(self.anchors),), -1,
                                                        dtype=torch.int64, device=device))
        losses = self.body.compute_loss(
            targets, {"bbox_regression": regression, "cls_logits": logits},
            [self.anchors] * len(targets), matched)
        total = losses["bbox_regression"] + losses["classification"]
        return total, {"boxes": float(losses["bbox_regression"].detach()),
                       "classes": float(losses["classification"].detach()),
                       "total": float(total.detach())}


def decode(codes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """torchvision's BoxCoder.decode_single for a batch: codes (N, A, 4) against anchors (A, 4)
    → boxes (N, A, 4) xyxy."""
    widths, heights = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    centre_x, centre_y = anchors[:, 0] + 0.5 * widths, anchors[:, 1] + 0.5 * heights
    wx, wy, ww, wh = BOX_WEIGHTS
    x = codes[..., 0] / wx * widths + centre_x
    y = codes[..., 1] / wy * heights + centre_y
    half_w = 0.5 * torch.exp((codes[..., 2] / ww).clamp(max=MAX_LOG_SCALE)) * widths
    half_h = 0.5 * torch.exp((codes[..., 3] / wh).clamp(max=MAX_LOG_SCALE)) * heights
    return torch.stack([x - half_w, y - half_h, x + half_w, y + half_h], dim=-1)


def ssd_architecture(arch: str):
    """The record of a torchvision SSD for the data: its channels and class count."""

    def record(preprocessing: dict, num_classes: int) -> dict:
        return {"name": "TorchvisionSSD", "arch": arch,
                "in_channels": int(preprocessing["channels"]),
                "image_size": list(preprocessing["image_size"]), "num_classes": num_classes}

    return record


# --pretrained: torchvision's COCO weights of each SSD, from the torch hub cache
COCO_WEIGHTS = {"ssdlite320_mobilenet_v3_large": "SSDLite320_MobileNet_V3_Large_Weights"}
