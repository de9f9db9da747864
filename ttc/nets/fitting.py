"""The parts of weight training that follow a run's length and its validation split: the
learning-rate schedule, early stopping and the max-norm constraint. Each is small and sees only
its own numbers (ttc/options/fitting.py holds the flags and the networks' defaults)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

# auto: the share of the optimizer steps spent warming up and decaying (warm-up, stable, decay)
WARMUP_SHARE = 0.05
DECAY_SHARE = 0.2
# fine-tuning a pretrained transformer: linear warm-up over this share, then linear decay to 0
FINE_TUNE_WARMUP_SHARE = 0.1


def learning_rate_schedule(optimizer: torch.optim.Optimizer, total_steps: int, kind: str,
                           peak: float, fine_tune: bool = False):
    """The schedule stepped after every optimizer step, over `total_steps` steps."""
    if kind == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak,
                                                   total_steps=total_steps)
    if fine_tune:
        warmup = max(1, round(FINE_TUNE_WARMUP_SHARE * total_steps))
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min((step + 1) / warmup,
                                        max(0.0, (total_steps - step) / max(1, total_steps - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_stable_decay(total_steps))


def warmup_stable_decay(total_steps: int):
    """The rate's factor at each step: linear warm-up over WARMUP_SHARE of the steps (the first
    step at 1/warm-up of the peak, so a short run starts near the peak and a long one gently),
    the peak, then linear decay over the last DECAY_SHARE to 1/decay-steps of it."""
    warmup = max(1, round(WARMUP_SHARE * total_steps))
    decay = max(1, round(DECAY_SHARE * total_steps))
    stable_until = max(warmup, total_steps - decay)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < stable_until:
            return 1.0
        return max(0.0, (total_steps - step) / decay)

    return factor


@dataclass
class EarlyStopping:
    """Stop once neither the validation loss nor the validation accuracy has improved for
    `patience` epochs (0: never). The loss alone stops too soon: a network that grows
    overconfident raises its validation loss while its accuracy still climbs (SST-2's text CNN:
    lowest loss at epoch 2, best accuracy at epoch 15 of 20; docs/networks.md)."""

    patience: int
    best_loss: float = float("inf")
    best_accuracy: float = -1.0
    epochs_without_improvement: int = 0

    def should_stop(self, val_loss: float | None, val_accuracy: float) -> bool:
        if not self.patience or val_loss is None:
            return False
        improved = val_loss < self.best_loss or val_accuracy > self.best_accuracy
        self.best_loss = min(self.best_loss, val_loss)
        self.best_accuracy = max(self.best_accuracy, val_accuracy)
        self.epochs_without_improvement = 0 if improved else self.epochs_without_improvement + 1
        return self.epochs_without_improvement >= self.patience


class BestEpoch:
    """The best epoch's weights so far by the validation score (ties go to the later epoch,
    further into the annealing), and early stopping on it and the validation loss
    (EarlyStopping): what every trainer's epoch loop keeps."""

    def __init__(self, patience: int) -> None:
        self.score, self.epoch = -1.0, 0
        self.state: dict | None = None
        self.stopping = EarlyStopping(patience)

    def keep(self, net: nn.Module, epoch: int, score: float, val_loss: float | None) -> bool:
        """Keep `net`'s weights if `score` is the best so far; whether training should stop."""
        if score >= self.score:
            self.score, self.epoch = score, epoch
            self.state = copy.deepcopy(net.state_dict())
        return self.stopping.should_stop(val_loss, score)


@torch.no_grad()
def restrict_row_norms(layer: nn.Linear, max_norm: float) -> None:
    """Scale down each output unit's weight row whose L2 norm exceeds max_norm (Kim 2014)."""
    layer.weight.copy_(torch.renorm(layer.weight, p=2, dim=0, maxnorm=max_norm))
