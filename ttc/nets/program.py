"""The PyTorch model inside a DSPy program, and the DSPy teleprompters that train it.

ClassifierProgram (a dspy.Module whose model is a torch network), WeightTrainer (a Teleprompter
that fits its weights: AdamW under a schedule that follows the run's length, the best epoch on
validation, early stopping), ImageTrainer (the segmenter's and the detector's trainers' common
part), their epoch loops (EpochRunner, ImageRunner: EpochLoop, whose state is a checkpoint; a
local run and every Ray Train worker run them), CandidateSearch (one WeightTrainer per learning
rate and seed, the best kept by dspy.Evaluate), and the checks that stop a training run whose
data or weights are not finite. train.py and pipeline.py call train_classifier (a segmenter's
and a detector's training modules: train_images); importing this module imports torch and
dspy.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import dspy
import numpy as np
import torch
import torch.nn.functional as F
from dspy.teleprompt import Teleprompter
from torch import nn

from config import Config
from ttc.inputs.data import Dataset, Split
from ttc.nets.checkpoints import CheckpointStore, new_run_id, state_problem
from ttc.nets.device import (Precision, backward_step, device_name, precision_for, to_device,
                             training_device)
from ttc.nets.shards import Shard
from ttc.nets.models import architecture_for, build_model, count_parameters, user_architecture
from ttc.inputs.preprocess import PAD_ID, HFTokenizer, Tokenizer, text_tokenizer, trim_padding
from ttc.nets.fitting import BestEpoch, learning_rate_schedule, restrict_row_norms
from ttc.options.fitting import Recipe
from ttc.nets.transfer import (Transfer, head_name, head_parameters, init_from_file,
                               init_from_pretrained, require_pretrained_file)
from ttc.testtime.tta import build_transforms, random_augment
from ttc.reporting.metrics import accuracy, nll
from ttc.tasks.registry import task_of_kind
from utils import (LOG, ConfigError, DataError, TrainingError, progress, raise_if_interrupted,
                   stdout_to_stderr)


# ----------------------------------------------------------------------------- the DSPy program


class ClassifierProgram(dspy.Module):
    """A DSPy program whose 'model' is a torch network: an image, a text or a feature row in,
    label and confidence out. Text programs tokenize inside, so the program is text -> label."""

    def __init__(self, net: nn.Module, labels: Sequence[str], input_field: str,
                 tokenizer: Tokenizer | HFTokenizer | None = None, pad_id: int = PAD_ID) -> None:
        super().__init__()
        self.net = net
        self.labels = list(labels)
        self.input_field = input_field
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self._batched: dict[int, np.ndarray] | None = None  # id(input) → probabilities

    def encode(self, values: Sequence) -> np.ndarray:
        """Program inputs → the network's input array."""
        if self.tokenizer is not None:
            return self.tokenizer.encode_batch(values)
        return np.stack(values)

    def forward(self, **inputs) -> dspy.Prediction:
        value = inputs[self.input_field]
        probabilities = self._batched.get(id(value)) if self._batched is not None else None
        if probabilities is None:
            probabilities = self.predict_proba(self.encode([value]))[0]
        best = int(probabilities.argmax())
        return dspy.Prediction(label=self.labels[best], confidence=float(probabilities[best]),
                               probabilities=probabilities)

    @contextlib.contextmanager
    def batched_for(self, examples: Sequence[dspy.Example]):
        """Within the block, forward() on one of these examples' inputs (the same object, as
        dspy.Evaluate passes it) returns probabilities computed here for them in batches:
        Evaluate calls the program one example at a time, and the network run on one input
        costs nearly as much as on 256 (builtin:digits, 269 validation images, 6 epochs: the
        training stage 4.6 → 4.0 s, the same accuracy at every epoch). The first example
        still runs alone, as a server's single request does: a network that fails on a batch
        of one fails in training, not in serving."""
        values = [example[self.input_field] for example in examples][1:]
        probabilities = self.predict_proba(self.encode(values)) if values else []
        self._batched = {id(v): p for v, p in zip(values, probabilities)}
        try:
            yield self
        finally:
            self._batched = None

    def predict_proba(self, pixels: np.ndarray, batch_size: int = 256) -> np.ndarray:
        return torch.softmax(torch.from_numpy(self.predict_logits(pixels, batch_size)), -1).numpy()

    def predict_logits(self, pixels: np.ndarray, batch_size: int = 256) -> np.ndarray:
        self.net.eval()
        device = next(self.net.parameters()).device
        with torch.no_grad():
            chunks = [self.net(network_batch(pixels[i:i + batch_size], self.pad_id,
                                             device)).float().cpu()
                      for i in range(0, len(pixels), batch_size)]
        return torch.cat(chunks).numpy()


def network_batch(x: np.ndarray | torch.Tensor, pad_id: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """A batch as the network takes it: token ids without the padding columns no text in the
    batch needs (texts are padded to the longest of a whole split, and a transformer's cost
    grows with the length), on `device`."""
    if x.ndim == 2 and x.dtype in (np.int64, torch.int64) and len(x):
        x = trim_padding(np.asarray(x), pad_id)
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return to_device(x, device)


def to_examples(split: Split, labels: Sequence[str], field: str) -> list[dspy.Example]:
    values = split.raw if split.raw is not None else split.x
    return [dspy.Example(**{field: v, "label": labels[y]}).with_inputs(field)
            for v, y in zip(values, split.y)]


def label_match(example: dspy.Example, prediction: dspy.Prediction, trace=None) -> bool:
    return example.label == prediction.label


# ----------------------------------------------------------------------------- the optimizer


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


def example_rate(learning_rate: float) -> str:
    """A learning rate to suggest after `learning_rate` diverged: 1e-3, or a tenth of it when it
    was already that low, written short ("1e-3")."""
    mantissa, exponent = f"{min(1e-3, learning_rate / 10):.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


class TrainingDiverged(TrainingError):
    """A candidate's training stopped because its loss or weights stopped being finite."""

    def __init__(self, epoch: int, batch: int, what: str, learning_rate: float,
                 seed: int) -> None:
        self.epoch, self.batch, self.what = epoch, batch, what
        self.learning_rate, self.seed = learning_rate, seed
        super().__init__(f"training diverged at epoch {epoch}, batch {batch}: {what} (learning "
                         f"rate {learning_rate:g}, seed {seed})",
                         f"lower --learning_rate (e.g. {example_rate(learning_rate)})")


def nonfinite_tensors(net: nn.Module) -> list[str]:
    """The parameters and buffers (BatchNorm statistics) of `net` holding a NaN or an inf."""
    return [name for name, tensor in net.state_dict().items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


def require_finite_weights(net: nn.Module, epoch: int, batch: int, learning_rate: float,
                           seed: int) -> None:
    """TrainingDiverged (exit 4) when a weight of `net` is NaN or infinite."""
    broken = nonfinite_tensors(net)
    if broken:
        shown = ", ".join(broken[:3]) + (" ..." if len(broken) > 3 else "")
        raise TrainingDiverged(epoch, batch, f"the weights became non-finite (in {shown})",
                               learning_rate, seed)


def _sample_name(ident: str) -> str:
    """A split's sample id as a user finds it: a table row `PATH:INDEX` (0-based) becomes
    `NAME row N`, numbered like inference.py's row ids (1 = the first data row, header
    excluded); an image keeps its file name."""
    source, _, index = str(ident).rpartition(":")
    if source and index.isdigit():
        return f"{Path(source).name} row {int(index) + 1}"
    return Path(str(ident)).name


def check_finite_inputs(dataset: Dataset) -> None:
    """Refuse data the network cannot learn from before training starts: an infinite feature
    (a cell such as `inf` or `1e400`, or a number beyond float32's ±3.4e38) or a non-finite
    pixel would make the loss NaN, which would then read as divergence. NaN is a missing feature
    in a table (imputed inside the graph), so only ±inf counts there."""
    task = task_of_kind(dataset.preprocessing["kind"])
    if task.input_role == "text":  # token ids
        return
    tabular = task.missing_values  # NaN is a missing feature there
    counts: list[str] = []
    columns: set[int] = set()
    examples: list[str] = []
    total = 0
    for name, split in dataset.splits.items():
        x = split.x
        if len(x) == 0 or not np.issubdtype(x.dtype, np.floating):
            continue
        if not tabular and np.isfinite(x.sum(dtype=np.float64)):
            continue  # the usual case, without a mask as large as the images
        bad = np.isinf(x) if tabular else ~np.isfinite(x)
        rows = np.flatnonzero(bad.reshape(len(x), -1).any(axis=1))
        if not len(rows):
            continue
        total += len(rows)
        counts.append(f"{len(rows)} in the {name} split")
        examples += [_sample_name(split.ids[i]) for i in rows[:3 - len(examples)]]
        if tabular:
            columns.update(np.flatnonzero(bad.any(axis=0)).tolist())
    if not total:
        return
    where = f"e.g. {', '.join(examples)}" if examples else ""
    if tabular:
        names = [dataset.preprocessing["feature_names"][c] for c in sorted(columns)]
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        rows_hold = "1 row holds" if total == 1 else f"{total} rows hold"
        raise DataError(f"{rows_hold} an infinite value (inf, 1e400, or a number beyond "
                        f"float32's ±3.4e38) in the numeric column(s) {shown}: "
                        f"{', '.join(counts)} ({where})",
                        "remove those rows, or empty those cells so that they count as missing")
    images_hold = "1 image holds" if total == 1 else f"{total} images hold"
    raise DataError(f"{images_hold} non-finite pixel values (nan or inf): {', '.join(counts)} "
                    f"({where})", "remove or re-save those images")


CLIP_NORM = 1.0  # fine-tuning: gradients clipped to this norm


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


@dataclass
class Candidate:
    """One trained candidate of the search and its validation figures."""

    index: int
    learning_rate: float
    seed: int
    val_accuracy: float  # dspy.Evaluate score on the validation split, as a fraction
    val_loss: float  # mean cross-entropy on the validation split (breaks accuracy ties)
    best_epoch: int
    seconds: float


@dataclass
class TrialCandidate(Candidate):
    """A candidate trained as a Ray Tune trial (ttc/distributed/search.py): what the engine
    adds to the report's row (a local search's rows keep Candidate's keys)."""

    trial_seconds: float | None = None  # the trial's own wall time, on its worker
    epochs_run: int | None = None
    stopped_early: bool | None = None  # the trial's early stopping ended it before --epochs
    restarts: int | None = None  # after a lost process, from the trial's last checkpoint


@dataclass
class TrainedCandidate:
    """One candidate's training as CandidateSearch.choose scores it: the compiled program and
    its trainer (history, best epoch), trained in this process or by a Ray Tune trial, or the
    TrainingDiverged that stopped it. `extra` is what a TrialCandidate adds to its row."""

    index: int
    trainer: WeightTrainer
    program: ClassifierProgram | None
    seconds: float  # its training's, before the search scores it
    diverged: TrainingDiverged | None = None
    extra: dict = field(default_factory=dict)


class CandidateSearch(Teleprompter):
    """Like DSPy's random-search optimizers, over weight training: compile one WeightTrainer per
    (learning rate, seed) candidate, score each compiled program with dspy.Evaluate on the
    validation set and keep the best. Ties go to the lower validation loss: small validation
    sets tie often, and the loss still tells the candidates apart. A candidate whose training
    diverges is skipped with a WARNING (`diverged`); the search fails only when all do.
    compile trains the candidates here, one after the other; choose scores candidates trained
    elsewhere too (--engine ray's parallel trials), by the same rules."""

    def __init__(self, metric: Callable, make_student: Callable[[int], ClassifierProgram],
                 make_trainer: Callable[[float, int], WeightTrainer],
                 learning_rates: Sequence[float], seeds: Sequence[int]) -> None:
        super().__init__()
        self.metric, self.make_student, self.make_trainer = metric, make_student, make_trainer
        self.grid = [(lr, seed) for lr in learning_rates for seed in seeds]
        self.candidates: list[Candidate] = []
        self.diverged: list[dict] = []  # candidates whose training diverged (skipped)
        self.chosen = 0
        self.chosen_trainer: WeightTrainer | None = None
        self.resumed_from: dict[int, int | None] = {}  # per candidate, with --resume

    score_name = "accuracy"  # what `score` measures, for the log

    def compile(self, student: ClassifierProgram | None = None, *, trainset: list[dspy.Example],
                teacher=None, valset: list[dspy.Example] | None = None,
                **kwargs) -> ClassifierProgram:
        devset = valset or trainset
        return self.choose(self._train_each(trainset, devset), devset)

    def _train_each(self, trainset: list[dspy.Example], devset: list[dspy.Example]
                    ) -> Iterator[TrainedCandidate]:
        """The candidates trained in turn (lazily: only the best program so far is kept)."""
        for index, (learning_rate, seed) in enumerate(self.grid):
            started = time.perf_counter()
            if len(self.grid) > 1:
                LOG.info("candidate %d of %d: learning rate %g, seed %d", index + 1,
                         len(self.grid), learning_rate, seed)
            trainer = self.make_trainer(learning_rate, seed)
            self.own_checkpoints(trainer, index)
            try:
                program = trainer.compile(self.make_student(seed), trainset=trainset,
                                          valset=devset)
            except TrainingDiverged as err:
                if len(self.grid) == 1:
                    raise
                yield TrainedCandidate(index, trainer, None, 0.0, diverged=err)
                continue
            finally:
                if trainer.checkpoints is not None:
                    self.resumed_from[index] = trainer.checkpoints.resumed_from
            yield TrainedCandidate(index, trainer, program, time.perf_counter() - started)

    def own_checkpoints(self, trainer, index: int) -> None:
        """A search's candidate keeps its own checkpoints (--checkpoint_dir: its run, its
        learning rate and seed in the fingerprint) and resumes its own (--resume)."""
        if trainer.checkpoints is not None and len(self.grid) > 1:
            learning_rate, seed = self.grid[index]
            trainer.checkpoints = trainer.checkpoints.for_candidate(index, learning_rate, seed,
                                                                    self.grid)

    def resumed_epochs(self) -> list[int | None] | None:
        """--resume with a search: the epoch each candidate continued from (None: it started
        afresh), in the grid's order; None without a search resumed."""
        if len(self.grid) == 1 or not self.resumed_from:
            return None
        return [self.resumed_from.get(index) for index in range(len(self.grid))]

    def choose(self, trained: Iterable[TrainedCandidate], devset: list[dspy.Example]
               ) -> ClassifierProgram:
        """Score each trained candidate (`score`), skip the diverged, keep the best: its
        program; TrainingError when every candidate diverged."""
        best: tuple[float, float] | None = None
        best_program = None
        for done in trained:
            if done.diverged is not None:
                self._skip(done.index, done.diverged)
                continue
            started = time.perf_counter()
            score, loss = self.score(done.program, done.trainer, devset)
            learning_rate, seed = self.grid[done.index]
            record = TrialCandidate if done.extra else Candidate
            self.candidates.append(record(
                done.index, learning_rate, seed, score, loss, done.trainer.best_epoch,
                round(done.seconds + time.perf_counter() - started, 3), **done.extra))
            if best is None or (score, -loss) > best:
                best, best_program = (score, -loss), done.program
                self.chosen, self.chosen_trainer = done.index, done.trainer
        if best_program is None:  # every candidate diverged
            self._all_diverged()
        if len(self.grid) > 1:
            chosen = self.chosen_candidate
            LOG.info("candidate search: kept %d of %d (learning rate %g, seed %d, val %s "
                     "%.4f)", chosen.index + 1, len(self.grid), chosen.learning_rate, chosen.seed,
                     self.score_name, chosen.val_accuracy)
        return best_program

    def _all_diverged(self) -> None:
        first = self.diverged[0]
        rates = ", ".join(f"{r:g}" for r in dict.fromkeys(d["learning_rate"]
                                                          for d in self.diverged))
        raise TrainingError(f"training diverged for all {len(self.grid)} candidates "
                            f"(learning rates {rates}); the first {first['reason']}",
                            "lower --lr_candidates (e.g. "
                            f"{example_rate(min(lr for lr, _ in self.grid))})")

    def score(self, program: ClassifierProgram, trainer: WeightTrainer,
              devset: list[dspy.Example]) -> tuple[float, float]:
        """(the compiled program's dspy.Evaluate score on the validation set, its validation
        loss)."""
        evaluate = dspy.Evaluate(devset=devset, metric=self.metric, num_threads=1,
                                 display_progress=False, max_errors=1)
        with stdout_to_stderr(), program.batched_for(devset):
            score = evaluate(program).score / 100.0
        raise_if_interrupted()
        return score, validation_loss(program, devset)

    @property
    def chosen_candidate(self) -> Candidate:
        return next(c for c in self.candidates if c.index == self.chosen)

    def _skip(self, index: int, err: TrainingDiverged) -> None:
        reason = (f"diverged at epoch {err.epoch}, batch {err.batch}: {err.what}")
        LOG.warning("candidate %d of %d (learning rate %g, seed %d) %s; skipped, the search "
                    "goes on", index + 1, len(self.grid), err.learning_rate, err.seed, reason)
        self.diverged.append({"index": index, "learning_rate": err.learning_rate,
                              "seed": err.seed, "reason": reason})


def validation_loss(program: ClassifierProgram, devset: list[dspy.Example]) -> float:
    x, y = WeightTrainer._stack(program, devset)
    return nll(program.predict_proba(x.numpy()), y.numpy())


# ----------------------------------------------------------------------------- the stage


@dataclass
class TrainedModel:
    """What training hands to export: the best network and everything the manifest needs."""

    net: nn.Module
    labels: list[str]
    architecture: dict
    preprocessing: dict
    history: list[EpochRecord] = field(default_factory=list)
    best_epoch: int = 0
    train_accuracy: float = 0.0
    val_accuracy: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    learning_rate: float = 0.0
    seed: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    chosen_candidate: int = 0
    diverged_candidates: list[dict] = field(default_factory=list)  # skipped by the search
    transfer: Transfer | None = None  # --init_weights / --pretrained
    freeze_epochs: int = 0
    epochs_planned: int = 0  # --epochs; early stopping may run fewer
    initial_loss: float | None = None  # the kept candidate's first batch, before any update
    calibration: dict | None = None  # the temperature fit (train.calibrate_network)
    compressed: list = field(default_factory=list)  # --prune / --qat (compress.CompressedNet)
    fp32_record: dict | None = None  # the trained network's parameters and MACs, when compressed
    engine: dict | None = None  # where it trained: --engine ray's workers and timings
    device: str = "cpu"  # what it trained on (--device): "cpu", "cuda:0 (NAME)"
    amp: str = "off"  # its precision there (--amp): off, bf16, fp16

    def report_section(self) -> dict:
        searched = len(self.candidates) + len(self.diverged_candidates) > 1
        return {"epochs_run": len(self.history),
                "epochs_not_run": max(0, self.epochs_planned - len(self.history)),
                "stopped_early": len(self.history) < self.epochs_planned,
                "best_epoch": self.best_epoch,
                "train_accuracy": self.train_accuracy, "val_accuracy": self.val_accuracy,
                "seconds": self.seconds, "samples": self.samples,
                "learning_rate": self.learning_rate, "seed": self.seed,
                "arch": self.architecture.get("arch"), "network": self.architecture["name"],
                "num_parameters": self.architecture.get("num_parameters"),
                "candidates": [vars(c) for c in self.candidates] if searched else None,
                "chosen_candidate": self.chosen_candidate if searched else None,
                "diverged_candidates": self.diverged_candidates if searched else None,
                "init_weights": self.transfer.report_section() if self.transfer else None,
                "freeze_epochs": self.freeze_epochs,
                "engine": self.engine, "device": self.device, "amp": self.amp,
                "history": [vars(record) for record in self.history]}


def set_torch_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


@dataclass
class TrainingPlan:
    """What training a classifier needs before its first epoch, made once from the flags and
    the data: by train_classifier, and by a Ray run's driver (ttc/distributed), which ships the
    student and the trainer to its workers."""

    architecture: dict
    make_student: Callable[[int], ClassifierProgram]
    make_trainer: Callable[[float, int], WeightTrainer]
    transfers: list[Transfer]
    started: float
    field: str

    @property
    def transfer(self) -> Transfer | None:
        return self.transfers[0] if self.transfers else None


def plan_training(config: Config, dataset: Dataset, engine: str = "local") -> TrainingPlan:
    """Check the data, build the network for it (checked and announced once), and the
    factories of the DSPy program (a student per seed) and of its WeightTrainer (per learning
    rate and seed), with a local run's checkpoints (--checkpoint_dir, --resume) when asked."""
    started = time.perf_counter()
    check_finite_inputs(dataset)
    task = task_of_kind(dataset.preprocessing["kind"])
    architecture = network_architecture(config, dataset)
    tokenizer = text_tokenizer(dataset.preprocessing) if task.input_role == "text" else None
    pad_id = dataset.preprocessing.get("pad_id", PAD_ID)
    fine_tune = architecture["name"] == "HFTextNet"
    device = training_device(config.device)
    transfers: list[Transfer] = []

    def make_student(seed: int) -> ClassifierProgram:
        torch.manual_seed(seed)
        net = build_model(architecture, dataset.preprocessing, pretrained=True)
        transfer = starting_weights(config, net)
        if transfer is not None and not transfers:
            transfers.append(transfer)
        return ClassifierProgram(net, dataset.labels, task.input_field, tokenizer, pad_id)

    first = make_student(config.seed).net
    check_output_shape(first, dataset, config)
    architecture["num_parameters"] = count_parameters(first)
    announce_training(config, dataset, architecture, first)
    views = (build_transforms(config.tta_transforms, dataset.preprocessing)
             if config.tta and config.train_augment else [])
    if views:
        LOG.info("training on the TTA transforms too: %s", ", ".join(t.spec for t in views))
    recipe = config.recipe(config.model_type, config.arch, config.model_def)
    folder = config.checkpoint_folder()
    store = (CheckpointStore(folder, new_run_id(), run_fingerprint(config, dataset, architecture),
                             config.resume) if folder is not None and engine == "local" else None)

    def make_trainer(learning_rate: float, seed: int) -> WeightTrainer:
        return WeightTrainer(label_match, epochs=config.epochs, batch_size=config.batch_size,
                             learning_rate=learning_rate, recipe=recipe,
                             augment=config.train_augment and task.augments, seed=seed,
                             show_progress=not config.no_progress, view_transforms=views,
                             freeze_epochs=config.freeze_epochs, fine_tune=fine_tune,
                             pad_id=pad_id, checkpoints=store, device=device, amp=config.amp)

    return TrainingPlan(architecture, make_student, make_trainer, transfers, started,
                        task.input_field)


def run_fingerprint(config: Config, dataset: Dataset, architecture: dict) -> dict:
    """What a checkpoint must share with a run that resumes it (checkpoints.FINGERPRINT_KEYS)."""
    return {"model_type": config.model_type, "labels": list(dataset.labels),
            "network": architecture.get("arch") or architecture["name"],
            "num_parameters": architecture.get("num_parameters"), "samples": len(dataset.train),
            "batch_size": config.batch_size, "learning_rate": config.learning_rates()[0],
            "seed": config.seed}


def train_classifier(config: Config, dataset: Dataset) -> TrainedModel:
    """Build the network for this data, wrap it in the DSPy program, compile it with
    CandidateSearch (one WeightTrainer per learning rate and seed; one candidate by default)."""
    plan = plan_training(config, dataset)
    search = CandidateSearch(label_match, plan.make_student, plan.make_trainer,
                             config.learning_rates(),
                             [config.seed + k for k in range(config.num_candidates)])
    try:
        program = search.compile(
            trainset=to_examples(dataset.train, dataset.labels, plan.field),
            valset=to_examples(dataset.val, dataset.labels, plan.field))
    except TrainingDiverged as err:  # one candidate only: say which flag set its rate
        if config.lr_candidates:
            err.hint = f"lower --lr_candidates (e.g. {example_rate(err.learning_rate)})"
        raise
    trained = trained_model(program, search, dataset, plan.architecture, plan.started,
                            plan.transfer, config)
    store = search.chosen_trainer.checkpoints
    trained.engine = engine_section(
        "local", None, 1, config.num_threads,
        [record.seconds for record in trained.history],
        checkpoint_dir=str(store.root) if store else None,
        resumed_from_epoch=store.resumed_from if store else None,
        **resumed_candidates(search, store))
    return trained


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


def image_trained_model(program: dspy.Module, search: CandidateSearch, dataset: Dataset,
                        architecture: dict, started: float, config, transfer: Transfer | None,
                        train_score: float) -> TrainedModel:
    """What a segmenter's or a detector's training hands to export (their `trained`): the
    chosen candidate's network and its history; train_accuracy is `train_score` (the training
    split's mean IoU or mAP, in eval mode), val_accuracy the best epoch's validation score."""
    trainer, chosen = search.chosen_trainer, search.chosen_candidate
    return TrainedModel(net=program.net, labels=list(dataset.labels), architecture=architecture,
                        preprocessing=dataset.preprocessing, history=trainer.history,
                        best_epoch=trainer.best_epoch, train_accuracy=train_score,
                        val_accuracy=trainer.best_record.val_accuracy,
                        seconds=round(time.perf_counter() - started, 3),
                        samples=len(dataset.train), learning_rate=chosen.learning_rate,
                        seed=chosen.seed, candidates=search.candidates,
                        chosen_candidate=search.chosen, diverged_candidates=search.diverged,
                        epochs_planned=config.epochs, initial_loss=trainer.initial_loss,
                        transfer=transfer, **trained_on(trainer))


def trained_on(trainer: WeightTrainer | ImageTrainer) -> dict:
    """TrainedModel's device and amp: where a local run's kept candidate trained, and how."""
    return {"device": device_name(trainer.device),
            "amp": precision_for(trainer.amp, trainer.device).mode}


def checkpoint_store(config, dataset: Dataset, architecture: dict,
                     engine: str) -> CheckpointStore | None:
    """A local run's checkpoints (--checkpoint_dir, --resume); None for a Ray run (its workers
    report theirs) or a run that keeps none."""
    folder = config.checkpoint_folder() if hasattr(config, "checkpoint_folder") else None
    if folder is None or engine != "local":
        return None
    return CheckpointStore(folder, new_run_id(), run_fingerprint(config, dataset, architecture),
                           config.resume)


def train_images(config, dataset: Dataset, plan: ImagePlan) -> TrainedModel:
    """A segmenter's or a detector's local training stage: the plan's search (one trainer per
    learning rate and seed; one by default) compiled on the training examples, the kept
    candidate's TrainedModel with train.engine."""
    search = plan.search(plan.metric, plan.make_student, plan.make_trainer,
                         config.learning_rates(),
                         [config.seed + k for k in range(config.num_candidates)])
    try:
        program = search.compile(trainset=plan.examples(dataset.train),
                                 valset=plan.examples(dataset.val))
    except TrainingDiverged as err:  # one candidate only: say which flag set its rate
        if getattr(config, "lr_candidates", None):
            err.hint = f"lower --lr_candidates (e.g. {example_rate(err.learning_rate)})"
        raise
    trained = plan.trained(program, search, dataset, plan.architecture, plan.started, config,
                           plan.transfer)
    store = search.chosen_trainer.checkpoints
    trained.engine = engine_section(
        "local", None, 1, getattr(config, "num_threads", 0),
        [record.seconds for record in trained.history],
        checkpoint_dir=str(store.root) if store else None,
        resumed_from_epoch=store.resumed_from if store else None,
        **resumed_candidates(search, store))
    return trained


def resumed_candidates(search: CandidateSearch, store: CheckpointStore | None) -> dict:
    """train.engine's `candidates_resumed_from_epoch` for a search with --resume (each
    candidate's resumed epoch, None: started afresh); nothing otherwise."""
    epochs = search.resumed_epochs() if store is not None and store.resume else None
    return {} if epochs is None else {"candidates_resumed_from_epoch": epochs}


def engine_section(engine: str, address: str | None, workers: int, threads: int,
                   epoch_seconds: list[float], **more) -> dict:
    """The report's train.engine: where the network trained and how long its epochs took
    (for --engine ray also the cluster's start, and the share of the training time spent in
    the gradients' all-reduce: ttc/distributed)."""
    return {"engine": engine, "address": address, "workers": workers,
            "threads_per_worker": threads, "epoch_seconds": epoch_seconds,
            "allreduce_seconds": None, "allreduce_share": None, **more}


def announce_training(config: Config, dataset: Dataset, architecture: dict,
                      net: torch.nn.Module) -> None:
    """Log what is trained on what, and warn about a setting that trains less than it seems; a
    --freeze_epochs network without a head to train alone fails here, before any epoch."""
    LOG.info("training %s (%d parameters) on %d samples, validating on %d",
             architecture.get("arch") or architecture["name"], architecture["num_parameters"],
             len(dataset.train), len(dataset.val))
    if config.freeze_epochs:
        head_parameters(net)
        if not (config.init_weights or config.pretrained):
            LOG.warning("--freeze_epochs %d without --init_weights or --pretrained trains the "
                        "head on randomly initialised features", config.freeze_epochs)
    if len(dataset.val) == 0:
        LOG.warning("the validation split is empty: the best epoch is chosen on the training "
                    "split; add data or raise --val_fraction")


def trained_model(program: ClassifierProgram, search: CandidateSearch, dataset: Dataset,
                  architecture: dict, started: float, transfer: Transfer | None,
                  config: Config) -> TrainedModel:
    """What training hands to export: the chosen candidate's network and its history."""
    trainer, chosen = search.chosen_trainer, search.chosen_candidate
    train_accuracy = accuracy(program.predict_proba(dataset.train.x), dataset.train.y)
    return TrainedModel(net=program.net, labels=dataset.labels, architecture=architecture,
                        preprocessing=dataset.preprocessing, history=trainer.history,
                        best_epoch=trainer.best_epoch, train_accuracy=train_accuracy,
                        val_accuracy=trainer.history[trainer.best_epoch - 1].val_accuracy,
                        seconds=round(time.perf_counter() - started, 3),
                        samples=len(dataset.train), learning_rate=chosen.learning_rate,
                        seed=chosen.seed, candidates=search.candidates,
                        chosen_candidate=search.chosen, diverged_candidates=search.diverged,
                        transfer=transfer, freeze_epochs=config.freeze_epochs,
                        epochs_planned=config.epochs, initial_loss=trainer.initial_loss,
                        **trained_on(trainer))


def network_architecture(config: Config, dataset: Dataset) -> dict:
    """The manifest's architecture: --model_def's network, or --arch's (default per type);
    --pretrained switches a torchvision network to ImageNet's normalisation."""
    if config.model_def:
        path, factory = config.model_def_parts()
        return user_architecture(path.resolve(), factory, dataset.preprocessing,
                                 len(dataset.labels))
    dropout = config.regularisation(config.model_type, config.arch, None).dropout
    architecture = architecture_for(dataset.preprocessing, len(dataset.labels), config.arch,
                                    dataset.labels, dropout)
    if config.pretrained:
        require_pretrained_file(config.arch)  # before any training: exit 3 with the path
        architecture["normalization"] = "imagenet"
    return architecture


def starting_weights(config: Config, net: nn.Module) -> Transfer | None:
    """--init_weights or --pretrained into a freshly built network."""
    if config.init_weights:
        return init_from_file(net, Path(config.init_weights))
    if config.pretrained:
        return init_from_pretrained(net, config.arch)
    return None


def check_output_shape(net: nn.Module, dataset: Dataset, config: Config) -> None:
    """A --model_def network must map a batch to one logit per class (a forward that fails is
    the user's error, exit 2, as anywhere: models.user_code)."""
    if not config.model_def or len(dataset.train) == 0:
        return
    sample = torch.from_numpy(np.ascontiguousarray(dataset.train.x[:2]))
    with torch.no_grad():
        logits = net.eval()(sample)
    expected = (len(sample), len(dataset.labels))
    if not torch.is_tensor(logits) or tuple(logits.shape) != expected:
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ConfigError(f"--model_def {config.model_def}: forward returned {shape} for a "
                          f"batch of {len(sample)}; expected {expected} (one logit per class)",
                          "return logits of shape (batch, num_classes)")


def split_logits(net: nn.Module, x: np.ndarray) -> np.ndarray:
    """The network's logits on a split's inputs, in eval mode."""
    return ClassifierProgram(net, [], "", pad_id=getattr(net, "pad_id", PAD_ID)).predict_logits(x)


def split_accuracy(net: nn.Module, split: Split) -> float | None:
    if len(split) == 0:
        return None
    program = ClassifierProgram(net, [], "", pad_id=getattr(net, "pad_id", PAD_ID))
    return accuracy(program.predict_proba(split.x), split.y)
