"""The training stage of a regressor, in the segmenter's design (ttc/nets/image_loop.py):
RegressorProgram (a dspy.Module whose model is the network: a feature row or a text in, a number
out), RegressionTrainer (a Teleprompter fitting its weights: AdamW under the run's schedule, MSE
or Huber loss on the standardised target (--loss), BatchNorm re-estimated after each epoch, the
best epoch on validation, early stopping), RegressorSearch (one trainer per learning rate and
seed, the best kept) and train_regressor, which hands export a TrainedModel; with --interval,
the split conformal radius from the calibration slice, which neither training nor any
selection saw.

Every epoch is scored by dspy.Evaluate on the validation examples; the score that picks the
epoch and the candidate is the validation RMSE, as 1 / (1 + RMSE / σ) (σ: the training target's
standard deviation), which is higher for a lower RMSE and lies in (0, 1] as the shared epoch
loop's and search's scores do. The report's figures are RMSEs in the target's units
(rmse_of_score turns the scores back). Importing this module imports torch and dspy."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import dspy
import numpy as np
import torch
import torch.nn.functional as F

from ttc.inputs.data import Dataset, Split
from ttc.inputs.preprocess import PAD_ID, text_tokenizer
from ttc.nets.candidates import BestEpochSearch
from ttc.nets.device import float_outputs, to_device, training_device
from ttc.nets.dspy_program import network_batch
from ttc.nets.finite import check_finite_inputs
from ttc.nets.image_loop import ImagePlan, ImageRunner, ImageTrainer
from ttc.nets.models import count_parameters
from ttc.nets.training import TrainedModel, checkpoint_store, image_trained_model, train_images
from ttc.nets.transfer import Transfer
from ttc.tasks.regress.intervals import conformal_radius, conformal_rank
from ttc.tasks.regress.nets import Regressor, build_regressor, regressor_architecture
from ttc.tasks.registry import task_for
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions

EVAL_BATCH = 256
HUBER_DELTA = 1.0  # in training standard deviations of the target


def score_of_rmse(rmse: float, std: float) -> float:
    """The selection score of an RMSE: 1 / (1 + RMSE / σ), in (0, 1], higher for a lower RMSE."""
    return 1.0 / (1.0 + rmse / std)


def rmse_of_score(score: float, std: float) -> float:
    """The RMSE (target units) a selection score stands for (score_of_rmse's inverse)."""
    return float(std * (1.0 / score - 1.0)) if score > 0 else math.inf


def rmse(predicted: np.ndarray, truth: np.ndarray) -> float:
    errors = np.asarray(predicted, np.float64) - np.asarray(truth, np.float64)
    return float(np.sqrt(np.mean(errors ** 2))) if len(errors) else math.nan


# ----------------------------------------------------------------------------- the DSPy program


@dataclass
class ValidationPass:
    """What RegressorProgram.batched_for computed besides the predictions: the mean loss on the
    standardised targets (None when no example carries one)."""

    loss: float | None = None


class RegressorProgram(dspy.Module):
    """A DSPy program whose model is a regressor network: a feature row or a text in (texts are
    tokenized inside), the predicted number out (`value`, in the target's units)."""

    def __init__(self, net: Regressor, input_field: str, tokenizer=None, pad_id: int = PAD_ID,
                 loss: str = "mse") -> None:
        super().__init__()
        self.net, self.input_field, self.tokenizer = net, input_field, tokenizer
        self.pad_id, self.loss = pad_id, loss
        self._batched: dict[int, float] | None = None

    def encode(self, values: Sequence) -> np.ndarray:
        if self.tokenizer is not None:
            return self.tokenizer.encode_batch(list(values))
        return np.stack(values).astype(np.float32)

    def forward(self, **inputs) -> dspy.Prediction:
        value = inputs[self.input_field]
        found = self._batched.get(id(value)) if self._batched is not None else None
        if found is None:
            found = float(self.predict_values(self.encode([value]))[0])
        return dspy.Prediction(value=found)

    @contextlib.contextmanager
    def batched_for(self, examples: Sequence[dspy.Example]) -> Iterator[ValidationPass]:
        """Within the block, forward() on these examples' inputs returns predictions made here
        in batches (the first still runs alone, as a served single request); yields the mean
        loss on the standardised targets."""
        values = [example[self.input_field] for example in examples]
        predicted = self.predict_values(self.encode(values[1:])) if len(values) > 1 else []
        self._batched = {id(v): float(p) for v, p in zip(values[1:], predicted)}
        passed = ValidationPass()
        if len(values) > 1:
            truth = torch.tensor([float(example.target) for example in examples[1:]])
            std, mean = float(self.net.target_std), float(self.net.target_mean)
            passed.loss = float(regression_loss(
                (torch.as_tensor(predicted, dtype=torch.float32) - mean) / std,
                (truth - mean) / std, self.loss))
        try:
            yield passed
        finally:
            self._batched = None

    def predict_values(self, x: np.ndarray, batch_size: int = EVAL_BATCH) -> np.ndarray:
        """(N, ...) inputs → (N,) float64 predictions in the target's units, in eval mode."""
        self.net.eval()
        device = next(self.net.parameters()).device
        with torch.no_grad():
            chunks = [self.net(network_batch(x[i:i + batch_size], self.pad_id, device))
                      .float().cpu() for i in range(0, len(x), batch_size)]
        return torch.cat(chunks).double().numpy() if chunks else np.zeros(0)


def regression_loss(predicted: torch.Tensor, truth: torch.Tensor, kind: str) -> torch.Tensor:
    """--loss on standardised values: mse, or huber (delta HUBER_DELTA)."""
    if kind == "huber":
        return F.huber_loss(predicted, truth, delta=HUBER_DELTA)
    return F.mse_loss(predicted, truth)


def to_examples(split: Split, field: str) -> list[dspy.Example]:
    values = split.raw if split.raw is not None else split.x
    return [dspy.Example(**{field: v, "target": float(y)}).with_inputs(field)
            for v, y in zip(values, split.y)]


class Closeness:
    """dspy.Evaluate's per-example metric: 1 / (1 + |error| / σ), 1 for an exact prediction."""

    def __init__(self, std: float) -> None:
        self.std = std

    def __call__(self, example: dspy.Example, prediction: dspy.Prediction, trace=None) -> float:
        return 1.0 / (1.0 + abs(prediction.value - example.target) / self.std)


# ----------------------------------------------------------------------------- the trainer


class RegressionTrainer(ImageTrainer):
    """A DSPy optimizer for a regressor's weights (ImageTrainer's loop): --loss on the
    standardised target; each epoch scored by the validation RMSE (as score_of_rmse)."""

    train_metric = "train_score"
    val_metric = "val_score"
    score_name = "RMSE score"

    def __init__(self, *, std: float, mean: float, loss: str, tokenizer, field: str,
                 **kwargs) -> None:
        super().__init__(Closeness(std), **kwargs)
        self.std, self.mean, self.loss, self.tokenizer = std, mean, loss, tokenizer
        self.field = field

    def _stack(self, examples: list[dspy.Example]) -> tuple[torch.Tensor, torch.Tensor]:
        values = [example[self.field] for example in examples]
        x = (self.tokenizer.encode_batch(values) if self.tokenizer is not None
             else np.stack(values).astype(np.float32))
        y = (np.array([float(e.target) for e in examples]) - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.float32))

    def _scored(self, program: RegressorProgram, results: Sequence[tuple],
                validation: ValidationPass) -> tuple[float, float | None]:
        predicted = [prediction.value for _, prediction, _ in results]
        truth = [example.target for example, _, _ in results]
        return score_of_rmse(rmse(predicted, truth), self.std), validation.loss

    def _train_epoch(self, runner: ImageRunner, epoch: int) -> tuple[float, float]:
        """One pass in train mode: (mean loss, the running score of the training RMSE)."""
        net, shard = runner.train_net.train(), runner.shard
        total, squared, seen = 0.0, 0.0, 0
        bar = self._epoch_bar(runner, epoch)
        for number, batch in enumerate(bar, 1):
            self.batches_run = number
            rows = shard.local(batch)
            truth = to_device(runner.y[rows], runner.device)
            with runner.precision.autocast():
                predicted = float_outputs(net.standardised(to_device(runner.x[rows],
                                                                     runner.device)))
            loss = regression_loss(predicted, truth, self.loss)
            errors = float(((predicted.detach() - truth) ** 2).sum())
            value, (errors,) = self._step(runner, loss, len(rows), len(batch), bar, epoch,
                                          number, [errors])
            total += value * len(batch)
            squared += errors
            seen += len(batch)
            bar.set_postfix(loss=f"{total / seen:.4f}")
        if not seen:
            return math.nan, 0.0
        return total / seen, score_of_rmse(math.sqrt(squared / seen), 1.0)


class RegressorSearch(BestEpochSearch):
    """CandidateSearch over regression trainers: the best kept by its best epoch's validation
    RMSE (as the score), ties to the lower validation loss."""

    score_name = "RMSE score"


# ----------------------------------------------------------------------------- the stage


def require_interval_slice(options: TrainingOptions, dataset: Dataset) -> None:
    """--interval needs a calibration slice with enough rows for its level (exit 2 before any
    training)."""
    if getattr(options, "interval", None) is None:
        return
    rows = len(dataset.calibration)
    if conformal_rank(rows, options.interval) > rows:
        raise ConfigError(f"--interval {options.interval:g} needs a calibration slice of at least "
                          f"{math.ceil(options.interval / (1 - options.interval))} rows, and "
                          f"--calibration_fraction {options.calibration_fraction:g} set aside "
                          f"{rows}", "raise --calibration_fraction (e.g. 0.2) or use more data")


def plan_training(options: TrainingOptions, dataset: Dataset, engine: str = "local") -> ImagePlan:
    """The network for this data (checked and announced once) and the factories of its program
    and trainer (per learning rate and seed), with a local run's checkpoints when asked."""
    started = time.perf_counter()
    check_finite_inputs(dataset)
    require_interval_slice(options, dataset)
    task = task_for(options.model_type)
    pre = dataset.preprocessing
    chosen = options.regularisation(options.model_type, options.arch, None)
    architecture = regressor_architecture(pre, options.arch, dataset.labels, chosen.dropout)
    tokenizer = text_tokenizer(pre) if task.input_role == "text" else None
    pad_id = pre.get("pad_id", PAD_ID)

    def wrap(net: Regressor) -> RegressorProgram:
        return RegressorProgram(net, task.input_field, tokenizer, pad_id, options.loss)

    def make_student(seed: int) -> RegressorProgram:
        torch.manual_seed(seed)
        return wrap(build_regressor(architecture, pre, pretrained=True))

    architecture["num_parameters"] = count_parameters(make_student(options.seed).net)
    LOG.info("training %s (%d parameters, %s loss) on %d rows, validating on %d",
             architecture.get("arch"), architecture["num_parameters"], options.loss,
             len(dataset.train), len(dataset.val))
    store = checkpoint_store(options, dataset, architecture, engine)
    device = training_device(options.device)
    target = pre["target"]

    def make_trainer(learning_rate: float, seed: int) -> RegressionTrainer:
        trainer = RegressionTrainer(
            std=target["std"], mean=target["mean"], loss=options.loss, tokenizer=tokenizer,
            field=task.input_field, epochs=options.epochs, batch_size=options.batch_size, learning_rate=learning_rate,
            weight_decay=chosen.weight_decay, seed=seed, lr_schedule=options.lr_schedule,
            patience=options.patience, show_progress=not options.no_progress)
        trainer.checkpoints = store
        trainer.device, trainer.amp = device, options.amp
        return trainer

    return ImagePlan(architecture, make_student, make_trainer, RegressorSearch,
                     Closeness(target["std"]), lambda split: to_examples(split, task.input_field),
                     trained_regressor, build_regressor, wrap, [], started)


def train_regressor(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """Parts.trainer: compile the program with RegressorSearch (one trainer per learning rate
    and seed; one by default); the conformal radius with --interval."""
    return train_images(options, dataset, plan_training(options, dataset))


def trained_regressor(program: RegressorProgram, search: RegressorSearch, dataset: Dataset,
                      architecture: dict, started: float, options: TrainingOptions,
                      transfer: Transfer | None = None) -> TrainedModel:
    """What training hands to export, its scores as RMSEs in the target's units (train: the
    training split in eval mode; val: the best epoch's), and with --interval the preprocessing's
    `interval` (level, radius)."""
    std = dataset.preprocessing["target"]["std"]
    train_rmse = rmse(program.predict_values(dataset.train.x), dataset.train.y)
    trained = image_trained_model(program, search, dataset, architecture, started, options,
                                  transfer, train_rmse)
    trained.val_accuracy = rmse_of_score(trained.val_accuracy, std)
    for record in trained.history:
        record.val_accuracy = rmse_of_score(record.val_accuracy, std)
        record.train_accuracy = rmse_of_score(record.train_accuracy, 1.0) * std
    for candidate in trained.candidates:
        candidate.val_accuracy = rmse_of_score(candidate.val_accuracy, std)
    if getattr(options, "interval", None) is not None:
        trained.preprocessing = {**trained.preprocessing,
                                 "interval": conformal_record(program, dataset, options.interval)}
    return trained


def conformal_record(program: RegressorProgram, dataset: Dataset, level: float) -> dict:
    """Split conformal: the radius from the calibration slice's absolute residuals."""
    calibration = dataset.calibration
    residuals = calibration.y - program.predict_values(calibration.x)
    radius = conformal_radius(residuals, level)
    LOG.info("conformal interval: ± %.4g (level %g) from %d calibration rows", radius, level,
             len(calibration))
    return {"level": float(level), "radius": float(radius), "method": "split conformal",
            "calibration_rows": len(calibration)}
