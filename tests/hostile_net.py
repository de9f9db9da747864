"""A --model_def network built to lose everything under full int8: used by
tests/test_quantize_diagnosis.py and bench/quantize_layers.py."""
import torch
from torch import nn


class Hostile(nn.Module):
    """The last hidden tensor also carries a channel 1000x wider than the rest, which a fixed
    selection matrix drops: exact in fp32, while int8's one scale for the whole tensor rounds
    the informative channels to zero."""

    def __init__(self, channels, num_classes):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(),
                                      nn.Flatten(), nn.LazyLinear(16), nn.ReLU())
        self.head = nn.Linear(16, num_classes)
        self.register_buffer("select", torch.cat([torch.eye(16), torch.zeros(1, 16)]))

    def forward(self, x):
        hidden = self.features(x)
        wide = 1000.0 * x.abs().flatten(1).sum(dim=1, keepdim=True)
        return self.head(torch.cat([hidden, wide], dim=1) @ self.select)


def build(num_classes, input_spec):
    return Hostile(input_spec["channels"], num_classes)
