"""The signal type's code: its reader and row encoder reuse the tabular ones (a signal is a row
of numbers) and shape each row as one channel; its network is a small 1-D CNN."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ttc.inputs.data import SPLITS, Dataset, DataOptions, load_table_dataset
from ttc.serving.batch import Chunk, FeatureRows


def as_signals(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(len(x), 1, -1), dtype=np.float32)


def load_signals(options: DataOptions, *, preprocessing: dict | None = None,
                 labels: Sequence[str] | None = None, splits: Sequence[str] = SPLITS) -> Dataset:
    dataset = load_table_dataset(options, preprocessing=preprocessing, labels=labels,
                                 splits=splits)
    dataset.preprocessing = {**dataset.preprocessing, "kind": "signal"}
    for name, split in dataset.splits.items():
        dataset.splits[name] = dataclasses.replace(split, x=as_signals(split.x))
    return dataset


class SignalRows(FeatureRows):
    def encode(self, frame, ids: list[str], labels: list[str | None] | None) -> Chunk:
        chunk = super().encode(frame, ids, labels)
        return dataclasses.replace(chunk, x=None if chunk.x is None else as_signals(chunk.x))


class SignalCNN(nn.Module):
    def __init__(self, length: int, num_classes: int, channels: int = 8, dropout: float = 0.1,
                 median: list[float] | None = None, mean: list[float] | None = None,
                 std: list[float] | None = None, **_: object) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean or [0.0] * length).view(1, 1, -1))
        self.register_buffer("std", torch.tensor(std or [1.0] * length).view(1, 1, -1))
        self.features = nn.Sequential(nn.Conv1d(1, channels, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool1d(4), nn.Flatten(), nn.Dropout(dropout))
        self.head = nn.Linear(channels * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features((x - self.mean) / self.std))


def signal_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "SignalCNN", "length": len(preprocessing["feature_names"]),
            "num_classes": num_classes, "channels": 8}


SIGNAL_NETWORKS = {"conv1d": signal_architecture}
SIGNAL_MODULES = {"SignalCNN": SignalCNN}
