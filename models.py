"""Torch architectures, described by a plain dict stored in the bundle manifest so that any stage
(export.py, test-time training) can rebuild the network and load `model.pt` into it.

Each network takes what the deployed graph takes (pixels in [0, 1], token ids, raw features with
NaN for missing) and does its own normalisation, so the .onnx is self-contained.
"""
from __future__ import annotations

import io
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


def text_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TextClassifier", "vocab_size": preprocessing["vocab_size"],
            "num_classes": num_classes, "embedding_dim": 64, "hidden": 128, "dropout": 0.3}


class TextClassifier(nn.Module):
    """Embedding → masked mean and max pooling → BatchNorm → MLP.

    Pooling ignores padding (id 0), so padding a text never changes its prediction.
    """

    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int = 64,
                 hidden: int = 128, dropout: float = 0.3, **_: object) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.norm = nn.BatchNorm1d(2 * embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.hidden = nn.Linear(2 * embedding_dim, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mask = (token_ids != 0).unsqueeze(-1)
        vectors = self.embedding(token_ids)
        count = mask.sum(dim=1).clamp(min=1).to(vectors.dtype)
        mean = (vectors * mask).sum(dim=1) / count
        peak = vectors.masked_fill(~mask, -1e4).max(dim=1).values
        x = self.norm(torch.cat([mean, peak], dim=1))
        x = torch.relu(self.hidden(self.dropout(x)))
        return self.classifier(self.dropout(x))


def tabular_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TabularMLP", "num_features": len(preprocessing["feature_names"]),
            "num_classes": num_classes, "hidden": [128, 64], "dropout": 0.2}


class TabularMLP(nn.Module):
    """Impute NaN with training medians → standardise → [Linear-BN-ReLU-Dropout] ×2 → Linear."""

    def __init__(self, num_features: int, num_classes: int, hidden: list[int],
                 dropout: float = 0.2, median: list[float] | None = None,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        self.register_buffer("median", torch.tensor(median or [0.0] * num_features).view(1, -1))
        self.register_buffer("mean", torch.tensor(mean or [0.0] * num_features).view(1, -1))
        self.register_buffer("std", torch.tensor(std or [1.0] * num_features).view(1, -1))
        layers: list[nn.Module] = []
        width = num_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.BatchNorm1d(size), nn.ReLU(inplace=True),
                       nn.Dropout(dropout)]
            width = size
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = torch.where(torch.isnan(features), self.median, features)
        return self.classifier(self.body((x - self.mean) / self.std))


ARCHITECTURE_FOR_KIND = {"image": image_architecture, "text": text_architecture,
                         "tabular": tabular_architecture}


def architecture_for(preprocessing: dict, num_classes: int) -> dict:
    return ARCHITECTURE_FOR_KIND[preprocessing["kind"]](preprocessing, num_classes)


def input_spec(preprocessing: dict) -> dict:
    """The graph input the manifest promises, with the axes that are dynamic."""
    kind = preprocessing["kind"]
    if kind == "image":
        height, width = preprocessing["image_size"]
        return {"name": "image", "dtype": "float32", "layout": "NCHW", "range": [0.0, 1.0],
                "shape": ["batch", preprocessing["channels"], height, width]}
    if kind == "text":
        return {"name": "token_ids", "dtype": "int64", "shape": ["batch", "length"],
                "padding_id": 0}
    return {"name": "features", "dtype": "float32",
            "shape": ["batch", len(preprocessing["feature_names"])], "missing": "NaN"}


class WithProbabilities(nn.Module):
    """What is exported: logits and their softmax, so deployments need no post-processing."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(pixels)
        return logits, torch.softmax(logits, dim=-1)


ARCHITECTURES = {"SmallCNN": SmallCNN, "TextClassifier": TextClassifier,
                 "TabularMLP": TabularMLP}


def build_model(architecture: dict, preprocessing: dict) -> nn.Module:
    """A fresh network for a manifest's architecture (load `model.pt` into it afterwards)."""
    cls = ARCHITECTURES[architecture["name"]]
    stats = {k: preprocessing.get(k) for k in ("mean", "std", "median")}
    return cls(**architecture, **stats)


def count_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def save_weights(net: nn.Module, path: Path) -> str:
    """Write the state_dict (tensors only, no pickled code) atomically; return its sha256."""
    buffer = io.BytesIO()  # serialised first: torch's own file writer hides a full disk's OSError
    torch.save({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, buffer)
    atomic_write(path, lambda tmp: tmp.write_bytes(buffer.getvalue()))
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
