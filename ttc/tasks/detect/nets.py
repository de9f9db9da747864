"""The detector: CenterNet ("Objects as Points", Zhou et al. 2019) of our own, small and fast on
a CPU, with TTFNet's box head (Liu et al. 2020, "Training-Time-Friendly Network"): an object is
the peak of its class's heatmap at output stride 4, and its box the four distances (left, top,
right, bottom) from that cell's centre, trained with GIoU over the cells near the object's
centre, which converges in a few epochs where CenterNet's size and offset L1 needs many and
gives boxes precise enough for mAP@[.5:.95].

Like the segmenters (ttc/tasks/segment/nets.py) the network takes what the deployed graph
takes, pixels in [0, 1] of any height and width (16 or more; not only multiples of 4: its
stride-2 convolutions round up, so the last cell covers the image's last rows), normalises them
itself, and is described by a plain dict in the manifest (`DETECTION_NETWORKS`: --arch → the
function sizing it; `DETECTION_MODULES`: the record's "name" → the module).

Its forward returns the raw heads (heatmap logits (N, K, h, w) and box distances before their
activation (N, 4, h, w), h = ceil(H / 4)); `detection_targets` and `detection_loss` train them
and `cell_boxes` decodes the distances into xyxy boxes in input pixels (ttc/tasks/detect/nms.py
puts the decoding and NMS into the graph).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ttc.nets.models import IMAGENET_MEAN, IMAGENET_STD, adapt_stem, register_statistics
from ttc.tasks.detect.ssd import SSD_ARCHS, TorchvisionSSD, ssd_architecture

STRIDE = 4  # output stride: one heatmap cell per 4x4 input pixels
# The record's widths: one encoder level per halving (the first at stride 2) while the deepest
# level stays at least DEEPEST_SIDE pixels (96 → 4 levels, deepest 6x6), 2 to 5 levels.
WIDTH_LADDER = (16, 32, 64, 96, 128)
DEEPEST_SIDE = 6
HEAD_WIDTH = 32
# MobileNetV3-Large's `features` blocks that end each stride (4, 8, 16, 32: 24, 40, 112 and 960
# channels) and the width its decoder joins them at
MOBILENET_TAPS = (3, 6, 12, 16)
DECODER_WIDTH = 64
HEATMAP_PRIOR = 0.1  # the heatmap's initial probability (bias = logit of it), as in CenterNet
DISTANCE_SCALE = 16.0  # a box side's distance = softplus(raw) * this, in input pixels (TTFNet)
# TTFNet's Gaussians: the heatmap's sigma is ALPHA * side / 6, the box head's cells those inside
# the central BETA of the box, weighted by a Gaussian of sigma BETA * side / 6
ALPHA, BETA = 0.54, 0.54
GIOU_WEIGHT = 5.0  # TTFNet's weight of the box loss against the heatmap's focal loss


def conv_bn_relu(channels_in: int, channels_out: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(channels_out), nn.ReLU(inplace=True)]


def head(channels_in: int, width: int, outputs: int, bias: float) -> nn.Sequential:
    """Conv(3×3)-ReLU-Conv(1×1), the last bias set to `bias`."""
    last = nn.Conv2d(width, outputs, 1)
    nn.init.constant_(last.bias, bias)
    return nn.Sequential(nn.Conv2d(channels_in, width, 3, padding=1), nn.ReLU(inplace=True),
                         last)


class CenterNet(nn.Module):
    """Normalise → encoder: per width a stride-2 Conv-BN-ReLU and a Conv-BN-ReLU (the first
    level at stride 2, the second at the output stride 4) → decoder: from the deepest level up
    to stride 4, bilinear upsampling to the skip's own size, concatenation, two Conv-BN-ReLU →
    Dropout → two heads: the class heatmap's logits (N, K, h, w) and the raw box distances
    (N, 4, h, w)."""

    def __init__(self, in_channels: int, num_classes: int,
                 widths: Sequence[int] = WIDTH_LADDER[:4], head_width: int = HEAD_WIDTH,
                 dropout: float = 0.0, mean: list[float] | None = None,
                 std: list[float] | None = None, **_: object) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError("a CenterNet needs at least two widths (stride 2 and 4)")
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        self.down = nn.ModuleList()
        channels = in_channels
        for width in widths:
            self.down.append(nn.Sequential(*conv_bn_relu(channels, width, stride=2),
                                           *conv_bn_relu(width, width)))
            channels = width
        self.up = nn.ModuleList()
        for width in reversed(widths[1:-1]):
            self.up.append(nn.Sequential(*conv_bn_relu(channels + width, width),
                                         *conv_bn_relu(width, width)))
            channels = width
        self.dropout = nn.Dropout(dropout)
        self.heatmap = head(channels, head_width, num_classes,
                            math.log(HEATMAP_PRIOR / (1 - HEATMAP_PRIOR)))
        self.box = head(channels, head_width, 4, 0.0)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (pixels - self.mean) / self.std
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        for block, skip in zip(self.up, reversed(skips[1:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        x = self.dropout(x)
        return self.heatmap(x), self.box(x)


class MobileNetCenterNet(nn.Module):
    """The same two heads on torchvision's MobileNetV3-Large (`--arch mobilenet_v3_large`;
    weights=None, `--pretrained true` loads its ImageNet classifier's weights from the torch hub
    cache): its `features` are the encoder, kept under `body.backbone.` with torchvision's names
    so that the classifier's `features.*` tensors load by name. An FPN-style decoder joins the
    last block at each stride (4, 8, 16, 32; MOBILENET_TAPS) top-down: a 1×1 Conv-BN-ReLU to
    `decoder_width` per level, bilinear upsampling to the finer level's size, a sum and a 3×3
    Conv-BN-ReLU, down to stride 4, then Dropout and the heads.
    `normalization`: "data" (the training split's statistics) or "imagenet" (--pretrained)."""

    def __init__(self, in_channels: int, num_classes: int, decoder_width: int = DECODER_WIDTH,
                 head_width: int = HEAD_WIDTH, dropout: float = 0.0,
                 normalization: str = "data", mean: list[float] | None = None,
                 std: list[float] | None = None, **_: object) -> None:
        super().__init__()
        from torchvision.models import mobilenet_v3_large

        if normalization == "imagenet":  # grayscale: the channel mean of ImageNet's statistics
            mean = IMAGENET_MEAN if in_channels == 3 else [sum(IMAGENET_MEAN) / 3]
            std = IMAGENET_STD if in_channels == 3 else [sum(IMAGENET_STD) / 3]
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        self.body = nn.Module()
        self.body.backbone = mobilenet_v3_large(weights=None).features
        adapt_stem(SimpleNamespace(features=[self.body.backbone[0]]), in_channels, False)
        widths = [self.body.backbone[k].out_channels for k in MOBILENET_TAPS]
        self.lateral = nn.ModuleList(
            nn.Sequential(nn.Conv2d(w, decoder_width, 1, bias=False),
                          nn.BatchNorm2d(decoder_width), nn.ReLU(inplace=True)) for w in widths)
        self.smooth = nn.ModuleList(nn.Sequential(*conv_bn_relu(decoder_width, decoder_width))
                                    for _ in widths[:-1])
        self.dropout = nn.Dropout(dropout)
        self.heatmap = head(decoder_width, head_width, num_classes,
                            math.log(HEATMAP_PRIOR / (1 - HEATMAP_PRIOR)))
        self.box = head(decoder_width, head_width, 4, 0.0)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (pixels - self.mean) / self.std
        taps = []
        for k, block in enumerate(self.body.backbone[:MOBILENET_TAPS[-1] + 1]):
            x = block(x)
            if k in MOBILENET_TAPS:
                taps.append(x)
        x = self.lateral[-1](taps[-1])
        for k in reversed(range(len(taps) - 1)):
            finer = self.lateral[k](taps[k])
            x = F.interpolate(x, size=finer.shape[-2:], mode="bilinear", align_corners=False)
            x = self.smooth[k](x + finer)
        x = self.dropout(x)
        return self.heatmap(x), self.box(x)


# ----------------------------------------------------------------------------- boxes


def output_size(height: int, width: int) -> tuple[int, int]:
    """The heads' height and width for an input's: ceil(side / 4) (two stride-2 convolutions
    with padding 1 each round up)."""
    return -(-int(height) // STRIDE), -(-int(width) // STRIDE)


def cell_boxes(raw: torch.Tensor) -> torch.Tensor:
    """The box head's raw distances (N, 4, h, w) → boxes (N, h, w, 4) xyxy in input pixels:
    each cell's centre ((j + 0.5) * STRIDE, (i + 0.5) * STRIDE) minus the left and top
    distances, plus the right and bottom ones (softplus(raw) * DISTANCE_SCALE, never negative:
    x1 ≤ x2)."""
    distances = F.softplus(raw) * DISTANCE_SCALE
    height, width = raw.shape[-2:]
    ys = (torch.arange(height, dtype=raw.dtype, device=raw.device) + 0.5) * STRIDE
    xs = (torch.arange(width, dtype=raw.dtype, device=raw.device) + 0.5) * STRIDE
    xs, ys = xs.view(1, 1, -1), ys.view(1, -1, 1)
    return torch.stack([xs - distances[:, 0], ys - distances[:, 1],
                        xs + distances[:, 2], ys + distances[:, 3]], dim=-1)


def giou_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - generalised IoU of matching xyxy boxes (..., 4), per box."""
    px1, py1, px2, py2 = predicted.unbind(-1)
    tx1, ty1, tx2, ty2 = target.unbind(-1)
    area_p = (px2 - px1).clamp(min=0) * (py2 - py1).clamp(min=0)
    area_t = (tx2 - tx1).clamp(min=0) * (ty2 - ty1).clamp(min=0)
    inter = ((torch.minimum(px2, tx2) - torch.maximum(px1, tx1)).clamp(min=0)
             * (torch.minimum(py2, ty2) - torch.maximum(py1, ty1)).clamp(min=0))
    union = area_p + area_t - inter
    hull = ((torch.maximum(px2, tx2) - torch.minimum(px1, tx1))
            * (torch.maximum(py2, ty2) - torch.minimum(py1, ty1)))
    iou = inter / union.clamp(min=1e-6)
    return 1 - iou + (hull - union) / hull.clamp(min=1e-6)


# ----------------------------------------------------------------------------- training targets


def _gaussian(h: int, w: int, centre: tuple[float, float], sigma: tuple[float, float]
              ) -> np.ndarray:
    """exp(-(dx² / 2σx² + dy² / 2σy²)) over the (h, w) cells, dx and dy from `centre` (x, y)."""
    ys, xs = np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None, :]
    return np.exp(-((xs - centre[0]) ** 2 / (2 * sigma[0] ** 2)
                    + (ys - centre[1]) ** 2 / (2 * sigma[1] ** 2))).astype(np.float32)


def _draw_object(targets: dict[str, np.ndarray], row: np.ndarray) -> None:
    """One object's heatmap peak (its class's plane: the maximum with its Gaussian, 1 at the
    cell holding its centre) and its box target on the cells within the central BETA of the
    box, weighted by a Gaussian summing to log(area) (TTFNet: larger boxes weigh more, but
    less than their area)."""
    heatmap, box, weight = targets["heatmap"], targets["box"], targets["weight"]
    h, w = weight.shape
    cls, x1, y1, x2, y2 = (float(v) for v in row)
    bw, bh = x2 - x1, y2 - y1
    cx, cy = (x1 + x2) / 2 / STRIDE, (y1 + y2) / 2 / STRIDE
    peak = (min(int(cx), w - 1), min(int(cy), h - 1))
    sigma = (max(ALPHA * bw / 6 / STRIDE, 0.1), max(ALPHA * bh / 6 / STRIDE, 0.1))
    np.maximum(heatmap[int(cls)], _gaussian(h, w, peak, sigma), out=heatmap[int(cls)])
    centres_x, centres_y = np.arange(w) + 0.5, np.arange(h) + 0.5
    inside = ((np.abs(centres_y - cy) <= BETA * bh / 2 / STRIDE)[:, None]
              & (np.abs(centres_x - cx) <= BETA * bw / 2 / STRIDE)[None, :])
    inside[peak[1], peak[0]] = True
    spread = _gaussian(h, w, (cx - 0.5, cy - 0.5), (max(BETA * bw / 6 / STRIDE, 0.1),
                                                    max(BETA * bh / 6 / STRIDE, 0.1)))
    spread = np.where(inside, spread, 0.0)
    spread *= math.log(max(bw * bh, 2.0)) / max(float(spread.sum()), 1e-12)
    box[:, inside] = np.array([x1, y1, x2, y2], dtype=np.float32)[:, None]
    weight[inside] = spread[inside]


def detection_targets(boxes: Sequence[np.ndarray], num_classes: int,
                      image_hw: Sequence[int]) -> dict[str, torch.Tensor]:
    """The heads' targets for a batch of images of `image_hw` (height, width), each image's
    boxes a (k, 5) array [class, x1, y1, x2, y2] in its pixels (k may be 0):
    heatmap (N, K, h, w) in [0, 1], 1 at each object's centre cell; box (N, 4, h, w), the xyxy
    box a cell regresses; weight (N, h, w), each cell's share of the box loss (0: none).
    Where objects overlap, the smaller one's box target wins (drawn last)."""
    h, w = output_size(*image_hw)
    n = len(boxes)
    targets = {"heatmap": np.zeros((n, num_classes, h, w), np.float32),
               "box": np.zeros((n, 4, h, w), np.float32),
               "weight": np.zeros((n, h, w), np.float32)}
    for i, rows in enumerate(boxes):
        rows = np.asarray(rows, dtype=np.float32).reshape(-1, 5)
        areas = (rows[:, 3] - rows[:, 1]) * (rows[:, 4] - rows[:, 2])
        one = {key: value[i] for key, value in targets.items()}
        for row in rows[np.argsort(-areas, kind="stable")]:
            if row[3] > row[1] and row[4] > row[2]:
                _draw_object(one, row)
    return {key: torch.from_numpy(value) for key, value in targets.items()}


# ----------------------------------------------------------------------------- the loss


def focal_heatmap_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss (α 2, β 4), summed and divided by the number of
    objects (target cells equal to 1; at least 1)."""
    positive = target.eq(1).float()
    log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
    p = log_p.exp()
    positives = positive * (1 - p) ** 2 * log_p
    negatives = (1 - positive) * (1 - target) ** 4 * p ** 2 * log_not_p
    return -(positives.sum() + negatives.sum()) / positive.sum().clamp(min=1)


def detection_loss(outputs: Sequence[torch.Tensor], targets: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The network's outputs (heatmap logits, raw distances) against detection_targets':
    focal heatmap loss + GIOU_WEIGHT × the weighted mean GIoU loss of the cells with a box.
    Returns the total and its parts {"heatmap", "giou", "total"} as floats."""
    logits, raw = outputs[0], outputs[1]
    device = logits.device
    heatmap = focal_heatmap_loss(logits, targets["heatmap"].to(device))
    weight = targets["weight"].to(device)
    predicted = cell_boxes(raw)
    target = targets["box"].to(device).permute(0, 2, 3, 1)
    mask = weight > 0
    giou = (giou_loss(predicted[mask], target[mask]) * weight[mask]).sum() / weight.sum().clamp(
        min=1e-6)
    total = heatmap + GIOU_WEIGHT * giou
    return total, {"heatmap": float(heatmap.detach()), "giou": float(giou.detach()),
                   "total": float(total.detach())}


def network_loss(net: nn.Module, images: torch.Tensor, boxes: Sequence[np.ndarray],
                 num_classes: int) -> tuple[torch.Tensor, dict[str, float]]:
    """A batch's training loss: the network's own (`detection_loss`, a torchvision SSD's), or
    the two heads' (detection_targets, detection_loss) of CenterNet and of a --model_def
    module."""
    own = getattr(net, "detection_loss", None)
    if own is not None:
        return own(images, boxes)
    return detection_loss(net(images), detection_targets(boxes, num_classes,
                                                         tuple(images.shape[-2:])))


# ----------------------------------------------------------------------------- the records


def centernet_architecture(preprocessing: dict, num_classes: int) -> dict:
    """The default CenterNet sized for the training images: an encoder level per halving
    while the deepest stays DEEPEST_SIDE pixels or more (WIDTH_LADDER's widths), so that its
    receptive field covers an object of most of the image (at 96 pixels 4 levels, widths 16,
    32, 64, 96; at 32 2 levels)."""
    height, width = preprocessing["image_size"]
    side, levels = min(height, width) // 2, 1
    while side // 2 >= DEEPEST_SIDE and levels < len(WIDTH_LADDER):
        side //= 2
        levels += 1
    return {"name": "CenterNet", "in_channels": int(preprocessing["channels"]),
            "image_size": [height, width], "num_classes": num_classes,
            "widths": list(WIDTH_LADDER[:max(2, levels)]), "head_width": HEAD_WIDTH}


def mobilenet_architecture(preprocessing: dict, num_classes: int) -> dict:
    """MobileNetCenterNet for the data's channels (its size does not depend on the image's:
    the decoder joins whatever the strides give)."""
    return {"name": "MobileNetCenterNet", "in_channels": int(preprocessing["channels"]),
            "image_size": list(preprocessing["image_size"]), "num_classes": num_classes,
            "decoder_width": DECODER_WIDTH, "head_width": HEAD_WIDTH}


# --arch → the function sizing that network for the data (preprocessing, classes) → the
# manifest's architecture record; the default first.
DETECTION_NETWORKS: dict[str, Callable[[dict, int], dict]] = {
    "centernet": centernet_architecture, "mobilenet_v3_large": mobilenet_architecture,
    **{arch: ssd_architecture(arch) for arch in SSD_ARCHS}}
# The record's "name" → the module it builds: cls(**record, mean=..., std=...).
DETECTION_MODULES: dict[str, type[nn.Module]] = {"CenterNet": CenterNet,
                                                  "MobileNetCenterNet": MobileNetCenterNet,
                                                  "TorchvisionSSD": TorchvisionSSD}
