"""What a segmenter's and a detector's weight training share (ttc/tasks/*/training.py):
ImageTrainer (a DSPy Teleprompter: AdamW under the run's schedule, BatchNorm re-estimated after
each epoch, the best epoch on validation, early stopping), its epoch loop ImageRunner (an
EpochLoop: a local run and every Ray Train worker run it) and ImagePlan, what a type's
plan_training makes before the first epoch. Imports torch and dspy.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import dspy
import torch
from dspy.teleprompt import Teleprompter
from torch import nn

from ttc.inputs.data import Split
from ttc.nets.checkpoints import CheckpointStore
from ttc.nets.device import backward_step, precision_for
from ttc.nets.epoch_loop import (EpochLoop, EpochRecord, Sync, pool_batchnorm,
                                 recalibrate_batchnorm)
from ttc.nets.finite import TrainingDiverged, require_finite_weights
from ttc.nets.fitting import BestEpoch, learning_rate_schedule
from ttc.nets.shards import Shard
from ttc.nets.transfer import Transfer
from utils import LOG, progress, raise_if_interrupted, stdout_to_stderr


# BatchNorm statistics are re-estimated on at most this many training images after each epoch
# of an ImageTrainer: an image gives every channel H×W values, so a few hundred images estimate
# them as well as the classifier's 4,096 (and the pass costs a tenth of an epoch on 2,000
# canvases).
DENSE_RECALIBRATION_IMAGES = 512


class ImageTrainer(Teleprompter):
    """What the segmenter's and the detector's trainers share (ttc/tasks/*/training.py): AdamW
    with `weight_decay` under the `lr_schedule` (ttc/nets/fitting.py) over shuffled batches,
    BatchNorm statistics re-estimated on DENSE_RECALIBRATION_IMAGES training images after each
    epoch, each epoch scored by dspy.Evaluate on the validation set, the best epoch's weights
    kept and early stopping (BestEpoch); a loss or weights that are not finite stop it with
    TrainingDiverged (exit 4). The epoch loop is ImageRunner's, which a Ray Train worker runs
    too (ttc/distributed); `checkpoints` writes its state after every epoch and gives the state
    to resume from (--checkpoint_dir, --resume). A subclass stacks its examples (_stack),
    trains this process's share of an epoch (_train_epoch, stepping through _step), scores
    validation (_scored) and says what the history's train_accuracy is (_train_accuracy);
    `train_metric`, `val_metric` and `score_name` name them in the log."""

    train_metric = "train_acc"
    val_metric = "val_score"
    score_name = "score"

    def __init__(self, metric: Callable, *, epochs: int, batch_size: int,
                 learning_rate: float, weight_decay: float, seed: int, lr_schedule: str = "auto",
                 patience: int = 0, show_progress: bool = True,
                 checkpoints: CheckpointStore | None = None) -> None:
        super().__init__()
        self.epochs, self.batch_size = epochs, batch_size
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.seed, self.lr_schedule, self.patience = seed, lr_schedule, patience
        self.show_progress = show_progress
        self.metric = metric
        self.checkpoints = checkpoints
        self.device, self.amp = torch.device("cpu"), "off"  # --device, --amp: the plan's
        self.history: list[EpochRecord] = []
        self.best_epoch = 0
        self.batches_run = 0  # in the current epoch
        self.initial_loss: float | None = None  # the first batch's, before any update

    def compile(self, student: dspy.Module, *, trainset: list[dspy.Example], teacher=None,
                valset: list[dspy.Example] | None = None, **kwargs) -> dspy.Module:
        program = copy.deepcopy(student)
        x, y = self._stack(trainset)
        runner = ImageRunner(self, program, x, y, valset or trainset)
        return runner.run_checkpointed(self.checkpoints)

    @property
    def best_record(self) -> EpochRecord:
        return self.history[self.best_epoch - 1]

    def _log_epoch(self, record: EpochRecord) -> None:
        LOG.info("epoch %d/%d  loss %.4f  %s %.4f  %s %.4f  val_loss %.4f  (%.1fs)",
                 record.epoch, self.epochs, record.loss, self.train_metric,
                 record.train_accuracy, self.val_metric, record.val_accuracy,
                 math.nan if record.val_loss is None else record.val_loss, record.seconds)

    def _steps_per_epoch(self, count: int) -> int:
        """The optimizer steps of an epoch over `count` images (the schedule's length)."""
        return max(1, count // self.batch_size + (count % self.batch_size > 1))

    def _batches(self, shard: Shard, generator: torch.Generator) -> list[torch.Tensor]:
        """A shuffled epoch's batches of the split's images (in `shard`'s order, Shard.order); a
        trailing batch of one image is dropped (BatchNorm fails on it: DeepLabV3's ASPP pooling
        branch sees one value per channel)."""
        order = shard.order(generator)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if len(batches) > 1 and len(batches[-1]) == 1:
            batches.pop()
        return batches

    def _epoch_bar(self, runner: "ImageRunner", epoch: int):
        """An epoch's batches (_batches, the same on every process) under rank 0's progress
        bar; with several processes, a trailing batch of fewer images than processes is left
        out (a process without a share would have nothing to run through BatchNorm)."""
        batches = [batch for batch in self._batches(runner.shard, runner.generator)
                   if len(batch) >= runner.sync.world]
        return progress(batches, desc=f"epoch {epoch}/{self.epochs}",
                        enabled=self.show_progress and runner.sync.rank == 0)

    def _step(self, runner: "ImageRunner", loss: torch.Tensor, count: float, whole: float,
              bar, epoch: int, number: int, extra: Sequence[float] = ()
              ) -> tuple[float, list[float]]:
        """One optimizer step on batch `number`, then the schedule's. `loss` is this process's
        share's loss, a mean over its `count` units (pixels, objects) of the batch's `whole`;
        it is weighted by count × world / whole, so that DDP's averaged gradients are those of
        the whole batch's mean. Returns the batch's loss (the share's values summed over the
        processes, the run's first kept as initial_loss) and `extra` summed likewise. A loss
        that is not finite closes the bar and stops training with TrainingDiverged."""
        sync = runner.sync
        if sync.world == 1:  # a local run: the loss as it is (bit for bit as before)
            value, summed = loss.detach().item(), list(extra)
        else:
            total, *summed = sync.sum([loss.detach().item() * count if count else 0.0, *extra])
            value = total / whole if whole else 0.0
        if self.initial_loss is None:
            self.initial_loss = value
        if not math.isfinite(value):
            bar.close()
            raise TrainingDiverged(epoch, number, f"the loss became {value}",
                                   self.learning_rate, self.seed)
        runner.optimizer.zero_grad(set_to_none=True)
        weight = count * sync.world / whole if whole else 1.0  # 1.0 in a local run
        backward_step(loss * weight if weight != 1.0 else loss, runner.optimizer, runner.scaler)
        runner.schedule.step()
        return value, summed

    def _stack(self, examples: list[dspy.Example]) -> tuple[torch.Tensor, object]:
        """The training examples' images (N, C, H, W) float32 and their targets."""
        raise NotImplementedError

    def _units(self, y) -> torch.Tensor | None:
        """Each image's part of a batch's loss (Shard.units: labelled pixels, objects); None:
        one each."""
        return None

    def _train_epoch(self, runner: "ImageRunner", epoch: int) -> tuple[float, float | None]:
        """One pass over the training images in train mode, this process training its share
        of every batch (the rows it holds: runner.shard) through runner.train_net: the mean
        loss, and a running training accuracy (None where _train_accuracy measures it after the
        epoch), both over every process's share."""
        raise NotImplementedError

    def _scored(self, program: dspy.Module, results: Sequence[tuple], validation
                ) -> tuple[float, float | None]:
        """The epoch's validation score and loss, from dspy.Evaluate's results and what
        program.batched_for yielded."""
        raise NotImplementedError

    def _train_accuracy(self, program: dspy.Module, runner: "ImageRunner",
                        running: float | None) -> float:
        """The history's train_accuracy: the epoch's running accuracy."""
        return running


class ImageRunner(EpochLoop):
    """ImageTrainer's epoch loop (EpochLoop: its state is a checkpoint). A local run and every
    Ray Train worker run this same code: each process trains its share of every batch (the
    rows of its `shard`) through `train_net` (the program's network, or its
    DistributedDataParallel wrapper on a worker) on `device`; every process re-estimates
    BatchNorm on its rows among the same drawn images, pooled over the processes; rank 0 scores
    validation with dspy.Evaluate and decides the best epoch and early stopping (`sync`)."""

    def __init__(self, trainer: ImageTrainer, program: dspy.Module, x: torch.Tensor, y,
                 devset: list[dspy.Example], *, sync: Sync | None = None,
                 train_net: nn.Module | None = None, device: torch.device | None = None,
                 shard: Shard | None = None) -> None:
        self._bind(trainer, program, x, y, devset, sync, train_net,
                   device or trainer.device, shard or Shard(len(x), units=trainer._units(y)))
        self.net.to(self.device)
        self.precision = precision_for(trainer.amp, self.device)
        self.scaler = self.precision.scaler()
        self.optimizer = torch.optim.AdamW(self.train_net.parameters(), lr=trainer.learning_rate,
                                           weight_decay=trainer.weight_decay)
        self.schedule = learning_rate_schedule(
            self.optimizer, trainer.epochs * trainer._steps_per_epoch(self.shard.total),
            trainer.lr_schedule, trainer.learning_rate)
        self.best = BestEpoch(trainer.patience)
        self.epoch, self.stopped = 0, False
        trainer.history, trainer.best_epoch, trainer.initial_loss = [], 0, None

    @property
    def score_name(self) -> str:
        return self.trainer.score_name

    @property
    def patience(self) -> int:
        return self.trainer.patience

    def run_epoch(self, epoch: int) -> bool:
        """Train (every process its share), re-estimate BatchNorm, check the weights, score
        validation (rank 0); whether to stop, as rank 0 decides."""
        trainer, started = self.trainer, time.perf_counter()
        loss, running = trainer._train_epoch(self, epoch)
        order = torch.randperm(self.shard.total,
                               generator=self.generator)[:DENSE_RECALIBRATION_IMAGES]
        recalibrate_batchnorm(self.net, self.x[self.shard.local(order)], trainer.batch_size,
                              device=self.device)
        pool_batchnorm(self.net, self.sync)
        require_finite_weights(self.net, epoch, trainer.batches_run, trainer.learning_rate,
                               trainer.seed)
        stop = False
        if self.sync.rank == 0:
            stop = self._score(epoch, loss, running, started)
        return self.sync.agree(stop)

    def _score(self, epoch: int, loss: float, running: float | None, started: float) -> bool:
        """dspy.Evaluate on the validation set: the epoch's record, the best epoch so far, and
        whether early stopping says stop."""
        trainer, program = self.trainer, self.program
        with stdout_to_stderr(), program.batched_for(self.evaluate.devset) as validation:
            evaluated = self.evaluate(program)
        raise_if_interrupted()
        score, val_loss = trainer._scored(program, evaluated.results, validation)
        record = EpochRecord(epoch, loss, trainer._train_accuracy(program, self, running),
                             score, round(time.perf_counter() - started, 3), val_loss)
        trainer.history.append(record)
        trainer._log_epoch(record)
        stop = self.best.keep(self.net, epoch, score, val_loss)
        trainer.best_epoch = self.best.epoch
        return stop

    def finish(self) -> dspy.Module:
        """The program with the best epoch's weights, on the CPU, in eval mode."""
        self.net.load_state_dict(self.best.state)
        self.net.cpu().eval()
        return self.program



@dataclass
class ImagePlan:
    """What training a segmenter or a detector needs before its first epoch, made once from
    the flags and the data by its training module's plan_training (ttc/tasks/*/training.py):
    by the local run (train_images) and by a Ray run's driver (ttc/distributed), which ships
    the student's weights and the trainer to its workers and rebuilds the program there
    (build_net, then wrap: both picklable)."""

    architecture: dict
    make_student: Callable[[int], dspy.Module]
    make_trainer: Callable[[float, int], ImageTrainer]
    search: type  # the CandidateSearch subclass that keeps the best candidate
    metric: Callable  # dspy.Evaluate's per-example metric
    examples: Callable[[Split], list[dspy.Example]]
    trained: Callable  # (program, search, dataset, architecture, started, config, transfer)
    build_net: Callable[[dict, dict], nn.Module]  # (architecture, preprocessing) → network
    wrap: Callable[[nn.Module], dspy.Module]  # network → the DSPy program
    transfers: list[Transfer]
    started: float

    @property
    def transfer(self) -> Transfer | None:
        return self.transfers[0] if self.transfers else None
