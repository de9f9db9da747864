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

from ttc.nets.hf import HFTextNet
from ttc.nets.models import (TABULAR_MODULES, TABULAR_NETWORKS, TEXT_MODULES, TEXT_NETWORKS,
                             architecture_for)


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


class HFTextRegressor(Regressor):
    """A Hugging Face encoder (`--arch hf:NAME_OR_PATH`: ttc/nets/hf.py's HFTextNet, its
    sequence-classification head of one output), in the target's units. `pretrained` (training)
    starts from the checkpoint's weights, as the text classifier's does."""

    body_class = HFTextNet

    def graph_prediction(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The exported graph's forward: the hf inputs in, the prediction out."""
        standardised = self.body.graph_forward(input_ids, attention_mask, token_type_ids)[:, 0]
        return standardised * self.target_std + self.target_mean


def _regressor(name: str, body: type[nn.Module]) -> type[Regressor]:
    return type(name, (Regressor,), {"body_class": body, "__doc__": f"{body.__name__}, one "
                                     "output, in the target's units"})


MODULE_NAMES = {"TabularMLP": "TabularMLPRegressor", "TabularResMLP": "TabularResMLPRegressor",
                "TextClassifier": "TextBagRegressor", "TextCNN": "TextCNNRegressor",
                "TextTransformer": "TextTransformerRegressor", "HFTextNet": "HFTextRegressor"}


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
TEXT_MODULES = {**{MODULE_NAMES[name]: _regressor(MODULE_NAMES[name], cls)
                   for name, cls in TEXT_MODULES.items()
                   if name in MODULE_NAMES and cls is not HFTextNet},
                "HFTextRegressor": HFTextRegressor}


def regressor_architecture(preprocessing: dict, arch: str | None, labels,
                           dropout: float | None) -> dict:
    """The manifest's architecture of a regressor's network: ours through the entry's
    networks, an hf one (architecture_for builds its transformers config, one output) under
    its regressor's name."""
    record = architecture_for(preprocessing, 1, arch, labels, dropout)
    if record["name"] == "HFTextNet":
        return {**record, "name": MODULE_NAMES["HFTextNet"]}
    return record


def build_regressor(architecture: dict, preprocessing: dict,
                    pretrained: bool = False) -> Regressor:
    """A regressor for a manifest's architecture, its target record set; `pretrained`: an hf
    network starts from its checkpoint's weights (training does)."""
    from ttc.nets.models import build_model

    if architecture["name"] == "HFTextRegressor":
        net: Regressor = HFTextRegressor(**architecture, pretrained=pretrained)
    else:
        net = build_model(architecture, preprocessing)
    net.set_target(preprocessing["target"])
    return net
