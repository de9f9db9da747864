"""`--pretrained true` for a segmenter (issue 43, item 2): torchvision's LR-ASPP and DeepLabV3
are built on MobileNetV3-Large, so their backbone starts from the ImageNet classifier's weights
(`MobileNet_V3_Large_Weights.IMAGENET1K_V1`, read from the torch hub cache under torchvision's
file name; this tool never downloads). The classifier's `features.N.*` tensors are the
backbone's `body.backbone.N.*`; its 1000-class head is not used, and the segmentation head
starts fresh (its classes are this run's). Loading goes through ttc/nets/transfer.py, as the
classifiers' --pretrained does: tensors load where name and shape match, and a grayscale
network takes the first conv's RGB filters summed. Importing this module imports torch."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ttc.nets.transfer import Transfer, learned_state, load_matching, pretrained_file, \
    read_state_dict, require_hub_file
from utils import sha256_of

BACKBONE = "mobilenet_v3_large"  # every --pretrained segmenter's ImageNet classifier
FILE_PREFIX = "features."  # the classifier's backbone, in its state dict
NET_PREFIX = "body.backbone."  # the same layers in TorchvisionSegmenter
HEAD_PREFIX = "body.classifier."


def backbone_file(arch: str) -> tuple[Path, str]:
    """Where torch hub keeps the ImageNet weights of `arch`'s backbone, and their URL."""
    del arch  # both segmenters share MobileNetV3-Large
    return pretrained_file(BACKBONE)


def require_backbone_file(arch: str) -> Path:
    """The backbone's weights in the torch hub cache, or one DataError line (exit 3) naming the
    file and where to put it."""
    return require_hub_file(*backbone_file(arch), arch,
                            f"the ImageNet {BACKBONE} backbone weights are")


def backbone_tensors(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """The file's backbone tensors under the network's names (features.N.* → body.backbone.N.*;
    the RGB filters summed where the network's first conv takes one channel), the renamed
    key → the file's key, and notes."""
    renamed: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    notes: list[str] = []
    for key, tensor in source.items():
        if not key.startswith(FILE_PREFIX):
            renamed[key] = tensor  # the ImageNet head: matches nothing, listed as skipped
            continue
        name = NET_PREFIX + key[len(FILE_PREFIX):]
        want = target.get(name)
        if want is not None and tensor.dim() == 4 and tensor.shape[1] == 3 and \
                want.shape[1] == 1 and want.shape[2:] == tensor.shape[2:]:
            tensor = tensor.sum(dim=1, keepdim=True)
            notes.append(f"{key}: the RGB filters summed for one input channel")
        renamed[name], origin[name] = tensor, key
    return renamed, origin, notes


def init_backbone(net: nn.Module, arch: str) -> Transfer:
    """--pretrained for a TorchvisionSegmenter: the ImageNet MobileNetV3-Large weights into its
    backbone; the report's train.init_weights says what loaded."""
    path = require_backbone_file(arch)
    source = read_state_dict(path, f"the torch hub cache's copy is damaged: delete {path} and "
                             f"put the file from {backbone_file(arch)[1]} there again")
    renamed, origin, notes = backbone_tensors(source, learned_state(net))
    transfer = load_matching(net, renamed, f"torchvision {BACKBONE} IMAGENET1K_V1 backbone "
                             f"({path})", sha256_of(path))
    transfer.skipped = sorted(origin.get(key, key) for key in transfer.skipped)
    transfer.notes += notes
    if any(key.startswith(HEAD_PREFIX) for key in transfer.missing):
        transfer.notes.append("the segmentation head (body.classifier) starts fresh: it is "
                              "trained for this run's classes")
    return transfer
