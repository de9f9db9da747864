"""A regressor's networks: the tables' and the texts' own networks (ttc/nets/models.py: MLP,
ResMLP; bag, CNN, transformer) with a one-output head, wrapped so that the graph answers in the
target's units: `standardised(x)` is the head's output (what the loss sees, the target
standardised by the training split's mean and standard deviation), `forward(x)` undoes the
standardisation, (batch,) float32. The mean and standard deviation are buffers (in model.pt and
folded into the graph), set from the preprocessing's `target` record when the network is built
for training. Imports torch."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ttc.nets.models import (TABULAR_MODULES, TABULAR_NETWORKS, TEXT_MODULES, TEXT_NETWORKS)


class Regressor(nn.Module):
    """A body network of one output, its output mapped back to the target's units."""

    body_class: type[nn.Module] = nn.Module

    def __init__(self, target_mean: float = 0.0, target_std: float = 1.0, **body: object) -> None:
        super().__init__()
        body.pop("num_classes", None)
        self.body = self.body_class(num_classes=1, **body)
        self.register_buffer("target_mean", torch.tensor(float(target_mean)))
        self.register_buffer("target_std", torch.tensor(float(target_std)))

    def set_target(self, record: dict) -> None:
        """The preprocessing's `target` record (its training mean and standard deviation)."""
        self.target_mean.fill_(float(record["mean"]))
        self.target_std.fill_(float(record["std"]))

    def standardised(self, x: torch.Tensor) -> torch.Tensor:
        """(batch,): the prediction in training standard deviations from the training mean."""
        return self.body(x)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.standardised(x) * self.target_std + self.target_mean


def _regressor(name: str, body: type[nn.Module]) -> type[Regressor]:
    return type(name, (Regressor,), {"body_class": body, "__doc__": f"{body.__name__}, one "
                                     "output, in the target's units"})


MODULE_NAMES = {"TabularMLP": "TabularMLPRegressor", "TabularResMLP": "TabularResMLPRegressor",
                "TextClassifier": "TextBagRegressor", "TextCNN": "TextCNNRegressor",
                "TextTransformer": "TextTransformerRegressor"}


def _architecture(build: Callable[[dict, int], dict]) -> Callable[[dict, int], dict]:
    """The body's architecture record under its regressor's name, with one output."""

    def record(preprocessing: dict, num_classes: int) -> dict:
        body = build(preprocessing, 1)
        return {**body, "name": MODULE_NAMES[body["name"]], "num_classes": 1}

    return record


TABULAR_NETWORKS = {arch: _architecture(build) for arch, build in TABULAR_NETWORKS.items()}
TEXT_NETWORKS = {arch: _architecture(build) for arch, build in TEXT_NETWORKS.items()}
TABULAR_MODULES = {MODULE_NAMES[name]: _regressor(MODULE_NAMES[name], cls)
                   for name, cls in TABULAR_MODULES.items()}
TEXT_MODULES = {MODULE_NAMES[name]: _regressor(MODULE_NAMES[name], cls)
                for name, cls in TEXT_MODULES.items() if name in MODULE_NAMES}
