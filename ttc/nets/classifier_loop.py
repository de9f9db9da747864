"""The classifier's weight training: WeightTrainer (a DSPy Teleprompter fitting a
ClassifierProgram's weights: AdamW under the recipe's schedule, the best epoch on validation,
early stopping) and its epoch loop EpochRunner (an EpochLoop: a local run and every Ray Train
worker run it), with the training-time augmentation (random shifts, the TTA views' random
forms). Imports torch and dspy.
"""
from __future__ import annotations

import copy
import math
import time
from typing import Callable, Sequence

import dspy
import numpy as np
import torch
import torch.nn.functional as F
from dspy.teleprompt import Teleprompter
from torch import nn

from ttc.inputs.preprocess import PAD_ID
from ttc.nets.checkpoints import CheckpointStore
from ttc.nets.device import Precision, backward_step, precision_for, to_device
from ttc.nets.dspy_program import ClassifierProgram, network_batch
from ttc.nets.epoch_loop import (EpochLoop, EpochRecord, Sync, evaluated_loss, pool_batchnorm,
                                 recalibrate_batchnorm)
from ttc.nets.finite import TrainingDiverged, require_finite_weights
from ttc.nets.fitting import BestEpoch, learning_rate_schedule, restrict_row_norms
from ttc.nets.shards import Shard
from ttc.nets.transfer import head_name, head_parameters
from ttc.options.fitting import Recipe
from ttc.testtime.tta import random_augment
from utils import LOG, ConfigError, progress, raise_if_interrupted, stdout_to_stderr


def random_shift(pixels: torch.Tensor, max_shift: int, generator: torch.Generator,
                 drawn_for: torch.Tensor | None = None) -> torch.Tensor:
    """Shift each image by up to `max_shift` whole pixels per axis, replicating the border.
    `drawn_for`: the shifts are drawn for a whole batch, and `pixels` are the rows this mask
    picks (a process's share: every process draws the same numbers)."""
    n, _, height, width = pixels.shape
    drawn = n if drawn_for is None else len(drawn_for)
    shifts = torch.randint(-max_shift, max_shift + 1, (drawn, 2), generator=generator).float()
    if drawn_for is not None:
        shifts = shifts[drawn_for]
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, 0, 2] = -2.0 * shifts[:, 0] / width
    theta[:, 1, 2] = -2.0 * shifts[:, 1] / height
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, mode="nearest", padding_mode="border", align_corners=False)



CLIP_NORM = 1.0  # fine-tuning: gradients clipped to this norm


class WeightTrainer(Teleprompter):
    """A DSPy optimizer for a program's torch weights: AdamW under the `recipe`'s schedule,
    weight decay, label smoothing and max-norm (ttc/nets/fitting.py), or for fine-tuning a
    pretrained transformer (`fine_tune`) the standard recipe: linear warm-up over the first
    tenth of the steps, linear decay to zero, gradients clipped to norm 1. It trains on
    `device` (--device) in the precision `amp` asks for there (--amp: ttc/nets/device.py).

    Each epoch is scored by dspy.Evaluate on the validation set; the best epoch's weights win,
    and training stops early once the validation loss has not improved for recipe.patience
    epochs. A loss that is not finite (checked every batch) or weights that are not (checked
    every epoch and at the end) stop it with TrainingDiverged (exit 4). The epoch loop itself is
    EpochRunner's, which a Ray Train worker runs too (ttc/distributed); `checkpoints` writes
    its state after every epoch and gives the state to resume from (--checkpoint_dir,
    --resume).
    """

    def __init__(self, metric: Callable, *, epochs: int, batch_size: int, learning_rate: float,
                 recipe: Recipe, augment: bool, seed: int, show_progress: bool = True,
                 view_transforms: Sequence = (), freeze_epochs: int = 0,
                 fine_tune: bool = False, pad_id: int = PAD_ID,
                 checkpoints: CheckpointStore | None = None,
                 device: torch.device | None = None, amp: str = "off") -> None:
        super().__init__()
        self.fine_tune, self.pad_id = fine_tune, pad_id
        self.device, self.amp = device or torch.device("cpu"), amp
        self.freeze_epochs = freeze_epochs  # epochs that train the classifier head alone
        # TTA transforms to train on (their random forms), so that test-time views are in
        # distribution.
        self.view_transforms = list(view_transforms)
        self.view_rng = np.random.default_rng(seed)
        self.metric = metric
        self.epochs, self.batch_size = epochs, batch_size
        self.learning_rate, self.recipe = learning_rate, recipe
        self.augment, self.seed, self.show_progress = augment, seed, show_progress
        self.checkpoints = checkpoints
        self.history: list[EpochRecord] = []
        self.best_epoch = 0
        self.initial_loss: float | None = None  # the first batch's, before any update

    def compile(self, student: ClassifierProgram, *, trainset: list[dspy.Example],
                teacher=None, valset: list[dspy.Example] | None = None,
                **kwargs) -> ClassifierProgram:
        program = copy.deepcopy(student)
        x, y = self._stack(program, trainset)
        runner = EpochRunner(self, program, x, y, valset or trainset)
        return runner.run_checkpointed(self.checkpoints)

    def max_norm_layer(self, net: nn.Module) -> nn.Linear | None:
        """The layer --max_norm bounds: the network's output layer (its last nn.Linear)."""
        if not self.recipe.max_norm:
            return None
        name = head_name(net)
        if name is None:
            raise ConfigError("--max_norm bounds the output layer's weights, and this network "
                              "has no nn.Linear layer", "drop --max_norm (or pass --max_norm 0)")
        return net.get_submodule(name)

    def precision(self, device: torch.device) -> Precision:
        """--amp on the device a runner trains on (a Ray worker's GPU or CPU included)."""
        return precision_for(self.amp, device)

    def freeze_body(self, net: nn.Module, frozen: bool) -> None:
        """--freeze_epochs: gradients for the head only (a parameter without a gradient is
        left alone by AdamW, weight decay included), then for everything."""
        if not self.freeze_epochs:
            return
        net.requires_grad_(not frozen)
        for parameter in head_parameters(net):
            parameter.requires_grad_(True)

    @staticmethod
    def _stack(program: ClassifierProgram, examples: list[dspy.Example]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        index = {label: i for i, label in enumerate(program.labels)}
        x = torch.from_numpy(program.encode([ex[program.input_field] for ex in examples]))
        y = torch.tensor([index[ex.label] for ex in examples], dtype=torch.long)
        return x, y



class EpochRunner(EpochLoop):
    """WeightTrainer's epoch loop and everything it carries from one epoch to the next (the
    epoch, the weights, the optimizer and its schedule, the random generators, the history,
    the best epoch and early stopping, the first loss): state_dict() is a checkpoint,
    load_state_dict() resumes one. A local run and every Ray Train worker run this same code;
    `train_net` is what the batches go through (the program's network, or its
    DistributedDataParallel wrapper on a worker), `sync` how the workers agree (Sync)."""

    def __init__(self, trainer: WeightTrainer, program: ClassifierProgram, x: torch.Tensor,
                 y: torch.Tensor, devset: list[dspy.Example], *, sync: Sync | None = None,
                 train_net: nn.Module | None = None, device: torch.device | None = None,
                 shard: Shard | None = None) -> None:
        self._bind(trainer, program, x, y, devset, sync, train_net,
                   device or trainer.device, shard or Shard(len(x)))
        total = self.shard.total
        steps = max(1, total // trainer.batch_size + (total % trainer.batch_size > 1))
        self.optimizer = torch.optim.AdamW(self.train_net.parameters(), lr=trainer.learning_rate,
                                           weight_decay=trainer.recipe.weight_decay)
        self.schedule = learning_rate_schedule(self.optimizer, trainer.epochs * steps,
                                               trainer.recipe.lr_schedule,
                                               trainer.learning_rate, trainer.fine_tune)
        self.net.to(self.device)
        self.precision = trainer.precision(self.device)
        self.scaler = self.precision.scaler()
        self.max_shift = max(1, round(min(x.shape[2:]) / 8)) if trainer.augment else 0
        self.best = BestEpoch(trainer.recipe.patience)
        self.bounded = trainer.max_norm_layer(self.net)
        self.epoch, self.batches_run, self.stopped = 0, 0, False
        trainer.history, trainer.best_epoch, trainer.initial_loss = [], 0, None

    def run_epoch(self, epoch: int) -> bool:
        """Train, re-estimate BatchNorm, check the weights, score validation (rank 0);
        whether to stop, as rank 0 decides."""
        trainer, started = self.trainer, time.perf_counter()
        trainer.freeze_body(self.net, epoch <= trainer.freeze_epochs)
        loss, accuracy = self._train_epoch(epoch)
        recalibrate_batchnorm(self.net, self.x[self.shard.local(
            torch.randperm(self.shard.total, generator=self.generator))], trainer.batch_size,
            device=self.device)
        pool_batchnorm(self.net, self.sync)
        self._check_weights(epoch)
        stop = False
        if self.sync.rank == 0:
            stop = self._score(epoch, loss, accuracy, started)
        return self.sync.agree(stop)

    def _score(self, epoch: int, loss: float, accuracy: float, started: float) -> bool:
        """dspy.Evaluate on the validation set: the epoch's record, the best epoch so far, and
        whether early stopping says stop."""
        trainer, program = self.trainer, self.program
        with stdout_to_stderr(), program.batched_for(self.evaluate.devset):
            evaluated = self.evaluate(program)
        raise_if_interrupted()
        score = evaluated.score / 100.0
        record = EpochRecord(epoch, loss, accuracy, score,
                             round(time.perf_counter() - started, 3),
                             evaluated_loss(evaluated.results, program.labels))
        trainer.history.append(record)
        LOG.info("epoch %d/%d  loss %.4f  train_acc %.4f  val_acc %.4f  (%.1fs)", epoch,
                 trainer.epochs, loss, accuracy, score, record.seconds)
        stop = self.best.keep(self.net, epoch, score, record.val_loss)
        trainer.best_epoch = self.best.epoch
        return stop

    def finish(self) -> ClassifierProgram:
        """The program with the best epoch's weights, on the CPU, in eval mode."""
        self.net.load_state_dict(self.best.state)
        self.net.cpu().eval()
        self._check_weights(self.trainer.best_epoch)
        return self.program

    def _check_weights(self, epoch: int) -> None:
        """Once per epoch (after the BatchNorm statistics are re-estimated) and at the end."""
        require_finite_weights(self.net, epoch, self.batches_run, self.trainer.learning_rate,
                               self.trainer.seed)

    def _train_epoch(self, epoch: int) -> tuple[float, float]:
        """One pass over shuffled batches in train mode: the mean loss and running accuracy,
        over every process's share."""
        trainer, sync = self.trainer, self.sync
        self.train_net.train()
        order = self.shard.order(self.generator)
        batches = [order[i:i + trainer.batch_size]
                   for i in range(0, len(order), trainer.batch_size)]
        # BatchNorm needs 2+ samples in each process's share of a batch: a trailing batch
        # smaller than that is left out (in a local run, a batch of one)
        if len(batches) > 1 and len(batches[-1]) < 2 * sync.world:
            batches.pop()
        total_loss, correct, seen = 0.0, 0.0, 0.0
        bar = progress(batches, desc=f"epoch {epoch}/{trainer.epochs}",
                       enabled=trainer.show_progress and sync.rank == 0)
        for number, batch in enumerate(bar, 1):
            self.batches_run = number
            loss, right, count = self._step(batch, epoch, number, bar)
            total_loss, correct, seen = total_loss + loss, correct + right, seen + count
            bar.set_postfix(loss=f"{total_loss / seen:.4f}")
        return total_loss / seen, correct / seen

    def _inputs(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's share of a batch (the rows of it it holds), augmented: every process
        draws the whole batch's shifts from the shared generator and applies its share's; the
        TTA views' random forms come from each process's own generator."""
        trainer = self.trainer
        inputs = self.x[self.shard.local(batch)]
        if trainer.augment:
            inputs = random_shift(inputs, self.max_shift, self.generator,
                                  drawn_for=self.shard.own(batch))
        if trainer.view_transforms:
            inputs = torch.from_numpy(random_augment(inputs.numpy(), trainer.view_transforms,
                                                     trainer.view_rng))
        return inputs

    def _step(self, batch: torch.Tensor, epoch: int, number: int, bar
              ) -> tuple[float, float, float]:
        """One optimizer step on this process's share of `batch`; the batch's summed loss,
        correct answers and size over all processes. The share's mean loss is weighted by its
        part of the batch, so that the workers' averaged gradients are the whole batch's."""
        trainer, sync = self.trainer, self.sync
        inputs, targets = self._inputs(batch), self.y[self.shard.local(batch)]
        with self.precision.autocast():
            logits = self.train_net(network_batch(inputs, trainer.pad_id, self.device))
            loss = F.cross_entropy(logits.float(), to_device(targets, self.device),
                                   label_smoothing=trainer.recipe.label_smoothing)
        weight = len(targets) * sync.world / len(batch)  # 1.0 in a local run
        right = int((logits.argmax(1).cpu() == targets).sum())
        total, correct, count = sync.sum([loss.detach().item() * len(targets), right,
                                          len(targets)])
        value = total / count
        if trainer.initial_loss is None:
            trainer.initial_loss = value
        if not math.isfinite(value):  # the inputs are finite (check_finite_inputs)
            bar.close()
            raise TrainingDiverged(epoch, number, f"the loss became {value}",
                                   trainer.learning_rate, trainer.seed)
        self.optimizer.zero_grad(set_to_none=True)
        backward_step(loss * weight if weight != 1.0 else loss, self.optimizer, self.scaler,
                      (self.train_net.parameters(), CLIP_NORM) if trainer.fine_tune else None)
        if self.bounded is not None:
            restrict_row_norms(self.bounded, trainer.recipe.max_norm)
        self.schedule.step()
        return total, correct, count

    # ------------------------------------------------------------------ checkpoints

    checkpoint_extras = ("view_rng",)

    def state_dict(self) -> dict:
        """EpochLoop's state and the TTA views' generator."""
        return {**super().state_dict(), "view_rng": self.trainer.view_rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.trainer.view_rng.bit_generator.state = state["view_rng"]
