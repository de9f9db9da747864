"""Torch architectures, described by a plain dict stored in the bundle manifest so that any stage
(export.py, later test-time training) can rebuild the network and load `model.pt` into it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from utils import ExportError, atomic_write, sha256_of


def image_architecture(preprocessing: dict, num_classes: int) -> dict:
    """A small CNN sized from the input: one stage per halving until the side is about 4."""
    height, width = preprocessing["image_size"]
    side, pools = min(height, width), 0
    while side >= 8 and pools < 4:
        side //= 2
        pools += 1
    widths = [32, 64, 128, 128, 128][: pools + 1]
    return {"name": "SmallCNN", "in_channels": preprocessing["channels"],
            "image_size": [height, width], "num_classes": num_classes, "widths": widths,
            "convs_per_stage": 2, "dropout": 0.2}


class SmallCNN(nn.Module):
    """Normalise → [Conv-BN-ReLU ×2, MaxPool] per stage → global average pool → Dropout → Linear.

    The training split's mean/std are buffers, so the exported graph takes pixels in [0, 1].
    """

    def __init__(self, in_channels: int, num_classes: int, widths: list[int],
                 convs_per_stage: int = 2, dropout: float = 0.2,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean or [0.0] * in_channels).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std or [1.0] * in_channels).view(1, -1, 1, 1))
        layers: list[nn.Module] = []
        channels = in_channels
        for stage, width in enumerate(widths):
            if stage > 0:
                layers.append(nn.MaxPool2d(2))
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False),
                           nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = (pixels - self.mean) / self.std
        x = self.features(x).mean(dim=(2, 3))
        return self.classifier(self.dropout(x))


class WithProbabilities(nn.Module):
    """What is exported: logits and their softmax, so deployments need no post-processing."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(pixels)
        return logits, torch.softmax(logits, dim=-1)


ARCHITECTURES = {"SmallCNN": SmallCNN}


def build_model(architecture: dict, preprocessing: dict) -> nn.Module:
    """A fresh network for a manifest's architecture (load `model.pt` into it afterwards)."""
    cls = ARCHITECTURES[architecture["name"]]
    return cls(**architecture, mean=preprocessing.get("mean"), std=preprocessing.get("std"))


def count_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def save_weights(net: nn.Module, path: Path) -> str:
    """Write the state_dict (tensors only, no pickled code) atomically; return its sha256."""
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    return sha256_of(path)


def load_weights(manifest: dict, path: Path) -> nn.Module:
    """Rebuild the manifest's network and load `model.pt` into it (weights_only: never unpickle)."""
    expected = (manifest.get("files") or {}).get("sha256", {}).get("weights")
    if not path.is_file():
        raise ExportError(f"weights file {path} not found", "re-run train.py or pipeline.py")
    if expected and sha256_of(path) != expected:
        raise ExportError(f"{path} does not match its manifest (sha256 differs)",
                          "re-run train.py or pipeline.py to write a consistent bundle")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        net = build_model(manifest["architecture"], manifest["preprocessing"])
        net.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - any failure here means an unusable file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(f"cannot load weights {path}: {first}",
                          "re-run train.py or pipeline.py") from None
    return net.eval()
