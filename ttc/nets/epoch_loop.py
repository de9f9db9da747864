"""What every weight-training loop shares: the epoch loop (EpochLoop, whose state is a
checkpoint; a classifier's EpochRunner and a segmenter's or detector's ImageRunner are one),
an epoch's record, how the processes that train one network agree (Sync: one process in a local
run, a Ray Train worker's peers), BatchNorm re-estimated after each epoch and pooled over the
processes, and the validation loss read off dspy.Evaluate's results. Imports torch and dspy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import dspy
import numpy as np
import torch
from dspy.teleprompt import Teleprompter
from torch import nn

from ttc.nets.checkpoints import CheckpointStore, state_problem
from ttc.nets.device import to_device
from ttc.nets.fitting import BestEpoch
from ttc.nets.shards import Shard
from ttc.reporting.metrics import nll
from utils import LOG


def recalibrate_batchnorm(net: nn.Module, x: torch.Tensor, batch_size: int,
                          max_samples: int = 4096, device: torch.device | None = None) -> None:
    """Re-estimate BatchNorm running statistics for the current weights on clean training data
    (`x` on the host, each batch copied to `device`, the network's).

    The running averages lag the weights (momentum 0.1): on small datasets with few steps they
    are far off, and eval-mode accuracy collapses although training accuracy is perfect.
    """
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    net.train()
    with torch.no_grad():
        for start in range(0, min(len(x), max_samples), batch_size):
            batch = x[start:start + batch_size]
            if len(batch) > 1:
                net(batch if device is None else to_device(batch, device))
    for m, momentum in zip(norms, saved):
        m.momentum = momentum
    net.eval()


def pool_batchnorm(net: nn.Module, sync: "Sync") -> None:
    """After each process re-estimated BatchNorm on its own rows (recalibrate_batchnorm), pool
    the running statistics over the processes: the re-estimate is an average of its batches'
    means and variances, so the average over every process's batches is what one process
    would have estimated from all of them. One small all-reduce; nothing in a local run."""
    if sync.world == 1:
        return
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.running_mean is not None]
    if not norms:  # the same network on every process: all return here alike
        return
    values = []
    for m in norms:
        batches = float(m.num_batches_tracked)
        values += [batches, *(m.running_mean * batches).tolist(),
                   *(m.running_var * batches).tolist()]
    totals = iter(sync.sum(values))
    for m in norms:
        channels = m.running_mean.numel()
        batches = next(totals)
        mean = torch.tensor([next(totals) for _ in range(channels)], dtype=torch.float64)
        variance = torch.tensor([next(totals) for _ in range(channels)], dtype=torch.float64)
        if batches > 0:
            m.running_mean.copy_(mean / batches)
            m.running_var.copy_(variance / batches)



@dataclass
class EpochRecord:
    epoch: int
    loss: float
    train_accuracy: float  # running, on augmented batches in train mode
    val_accuracy: float  # dspy.Evaluate on the validation split
    seconds: float
    val_loss: float | None = None  # mean cross-entropy of the same dspy.Evaluate predictions


class Sync:
    """How the processes that train one network together agree: here, one process alone (a
    local run). A Ray Train worker's (ttc/distributed/worker.py) sums over its peers with
    torch.distributed and takes rank 0's word; each process holds its shard of the training
    rows and trains the rows of every batch it holds (ttc/nets/shards.py), and every process
    draws the same random numbers (batch order, shifts), so that --batch_size stays the
    global batch and one worker equals a local run."""

    rank, world = 0, 1

    def sum(self, values: list[float]) -> list[float]:
        """`values` summed over the processes."""
        return values

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag`, on every process."""
        return flag



class EpochLoop:
    """The epochs of one training run and what they carry from one epoch to the next, as
    EpochRunner (a classifier's) and ImageRunner (a segmenter's or a detector's) keep it: the
    epoch, the weights, the optimizer and its schedule, the batch order's generator, torch's
    random state (dropout), the history, the best epoch and early stopping, the first loss.
    state_dict() is a checkpoint (ttc/nets/checkpoints.py), load_state_dict() resumes one,
    whichever engine wrote it. A subclass sets these in its __init__ and runs an epoch
    (run_epoch); `score_name` and `patience` word the early stop's log line."""

    trainer: Teleprompter
    net: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    best: BestEpoch
    epoch: int
    stopped: bool
    score_name = "accuracy"
    checkpoint_extras: tuple[str, ...] = ()  # the keys a subclass adds to state_dict()

    @property
    def patience(self) -> int:
        return self.trainer.recipe.patience

    def run(self, after_epoch: Callable[["EpochLoop"], None] | None = None) -> None:
        """The epochs after self.epoch, up to --epochs or an early stop; `after_epoch` sees the
        runner after each (a checkpoint)."""
        trainer = self.trainer
        while not self.stopped and self.epoch < trainer.epochs:
            self.stopped = self.run_epoch(self.epoch + 1)
            self.epoch += 1
            if after_epoch is not None:
                after_epoch(self)
            if self.stopped and self.epoch < trainer.epochs:
                LOG.info("early stop after epoch %d of %d: neither the validation loss nor its "
                         "%s has improved for %d epochs (--patience); keeping epoch %d",
                         self.epoch, trainer.epochs, self.score_name, self.patience,
                         trainer.best_epoch)

    def _bind(self, trainer: Teleprompter, program: dspy.Module, x: torch.Tensor, y,
              devset: list[dspy.Example], sync: Sync | None, train_net: nn.Module | None,
              device: torch.device, shard: Shard) -> None:
        """What every epoch loop holds: the trainer and its program, the training data (this
        process's `shard` of it: every row in a local run), how the processes agree, the
        network the batches go through, the device, the validation (dspy.Evaluate with the
        trainer's metric) and the batch order's generator."""
        self.trainer, self.program, self.x, self.y = trainer, program, x, y
        self.shard = shard
        self.sync = sync or Sync()
        self.net = program.net
        self.train_net = train_net or program.net
        self.device = device
        self.evaluate = dspy.Evaluate(devset=devset, metric=trainer.metric, num_threads=1,
                                      display_progress=False, max_errors=1)
        self.generator = torch.Generator().manual_seed(trainer.seed)

    def run_checkpointed(self, store: CheckpointStore | None) -> dspy.Module:
        """A local run: from the store's checkpoint with --resume, a checkpoint after each
        epoch with --checkpoint_dir (store None: neither); the program with the best epoch's
        weights (finish)."""
        if store is not None and (state := store.start_state(self.checkpoint_check(self.net))
                                  ) is not None:
            self.load_state_dict(state)
        self.run(None if store is None else
                 lambda done: store.save(done.state_dict(), done.epoch))
        return self.finish()

    def finish(self) -> dspy.Module:
        """The program with the best epoch's weights, on the CPU, in eval mode."""
        raise NotImplementedError

    def run_epoch(self, epoch: int) -> bool:
        """Train one epoch and score it; whether to stop, as rank 0 decides."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything the next epoch depends on, as plain containers and tensors (a checkpoint
        loads with torch.load(weights_only=True))."""
        trainer, best = self.trainer, self.best
        return {"epoch": self.epoch, "stopped": self.stopped,
                "net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": {key: self.schedule.state_dict()[key]
                             for key in ("last_epoch", "_step_count", "_last_lr")},
                "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "history": [vars(record) for record in trainer.history],
                "best": {"score": best.score, "epoch": best.epoch, "state": best.state,
                         "stopping": vars(best.stopping)},
                "initial_loss": trainer.initial_loss}

    @classmethod
    def checkpoint_check(cls, net: nn.Module) -> Callable[[object], str | None]:
        """What makes a checkpoint's state unusable for this loop training `net`
        (checkpoints.state_problem), checked before load_state_dict uses any of it."""
        fields = tuple(f.name for f in dataclasses.fields(EpochRecord))
        return lambda state: state_problem(state, net, fields, cls.checkpoint_extras)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint (checked by checkpoint_check). The schedule keeps its
        step; its length is this run's (--epochs may have grown since)."""
        trainer, best = self.trainer, self.best
        self.epoch, self.stopped = int(state["epoch"]), bool(state["stopped"])
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        for key, value in state["schedule"].items():
            setattr(self.schedule, key, value)
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        trainer.history[:] = [EpochRecord(**record) for record in state["history"]]
        best.score, best.epoch = state["best"]["score"], state["best"]["epoch"]
        best.state = state["best"]["state"]
        vars(best.stopping).update(state["best"]["stopping"])
        trainer.best_epoch, trainer.initial_loss = best.epoch, state["initial_loss"]



def evaluated_loss(results: Sequence[tuple], labels: Sequence[str]) -> float | None:
    """Mean cross-entropy of dspy.Evaluate's (example, prediction, score) results: the
    validation loss at no extra forward pass."""
    index = {label: i for i, label in enumerate(labels)}
    scored = [(prediction.probabilities, index[example.label]) for example, prediction, _ in results
              if getattr(prediction, "probabilities", None) is not None]
    if not scored:
        return None
    probabilities = np.stack([p for p, _ in scored]).astype(np.float64)
    return nll(probabilities, np.array([k for _, k in scored]))
