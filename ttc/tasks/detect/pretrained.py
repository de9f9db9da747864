"""`--pretrained true` for a detector: the weights torchvision publishes, read from the torch
hub cache under torchvision's file names (this tool never downloads).
- `--arch mobilenet_v3_large`: the ImageNet MobileNetV3-Large classifier's `features.*` into the
  encoder (as the segmenters' backbones: ttc/tasks/segment/pretrained.py); the decoder and both
  heads start fresh.
- `--arch ssdlite320_mobilenet_v3_large`: torchvision's COCO detector
  (SSDLite320_MobileNet_V3_Large_Weights.COCO_V1), every tensor under `body.` by name; its class
  head, sized for COCO's 91 classes, matches no other class count and starts fresh, while the
  backbone, the extra layers and the box head load.
Importing this module imports torch."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ttc.nets.transfer import Transfer, load_matching, read_state_dict, require_hub_file
from ttc.tasks.detect.ssd import COCO_WEIGHTS
from ttc.tasks.segment.pretrained import init_backbone, require_backbone_file
from utils import sha256_of


def coco_file(arch: str) -> tuple[Path, str]:
    """Where torch hub keeps the COCO weights of a torchvision detector, and their URL."""
    from torchvision.models import detection

    url = getattr(detection, COCO_WEIGHTS[arch]).COCO_V1.url
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name, url


def require_pretrained(arch: str) -> Path:
    """The file --pretrained loads for `arch`, or one DataError line (exit 3) naming it and where
    to put it: checked before training."""
    if arch not in COCO_WEIGHTS:
        return require_backbone_file(arch)
    return require_hub_file(*coco_file(arch), arch, "torchvision's COCO weights are")


def init_pretrained(net: nn.Module, arch: str) -> Transfer:
    """--pretrained into a freshly built detector; the report's train.init_weights says what
    loaded."""
    if arch not in COCO_WEIGHTS:
        return init_backbone(net, arch)
    path = require_pretrained(arch)
    source = read_state_dict(path, f"the torch hub cache's copy is damaged: delete {path} and "
                             f"put the file from {coco_file(arch)[1]} there again")
    transfer = load_matching(net, {f"body.{key}": value for key, value in source.items()},
                             f"torchvision {arch} COCO_V1 ({path})", sha256_of(path))
    transfer.skipped = sorted(key.removeprefix("body.") for key in transfer.skipped)
    if any(".classification_head." in key for key in transfer.missing):
        transfer.notes.append("the class head (body.head.classification_head) starts fresh: "
                              "it is trained for this run's classes")
    return transfer
