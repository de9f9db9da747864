"""Train a classifier: a torch network inside a DSPy program, trained by a DSPy Teleprompter.

    python train.py --dataset_path builtin:digits --output_model runs/digits/model.onnx

writes the weights (model.pt) and manifest (model.json) of the bundle; export.py then writes
model.onnx. pipeline.py runs both in one process.
"""
from __future__ import annotations

import copy
import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import dspy
import numpy as np
import torch
import torch.nn.functional as F
from dspy.teleprompt import Teleprompter
from torch import nn

from config import Config, build_parser, start_cli
from data import Dataset, DataOptions, Split, load_dataset
from models import architecture_for, build_model, count_parameters, input_spec, save_weights
from preprocess import Tokenizer
from tta import build_transforms, random_augment
from utils import (BUNDLE_FORMAT, BUNDLE_FORMAT_VERSION, LOG, BundlePaths, atomic_write_json,
                   progress, quiet_library_loggers, run_cli, run_with_report, stdout_to_stderr)

OUTPUT_NAMES = ("logits", "probabilities")
# The DSPy program's input field per preprocessing kind: text programs take the raw text.
PROGRAM_INPUT = {"image": "image", "text": "text", "tabular": "features"}


# ----------------------------------------------------------------------------- the DSPy program


class ClassifierProgram(dspy.Module):
    """A DSPy program whose 'model' is a torch network: an image, a text or a feature row in,
    label and confidence out. Text programs tokenize inside, so the program is text -> label."""

    def __init__(self, net: nn.Module, labels: Sequence[str], input_field: str,
                 tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.net = net
        self.labels = list(labels)
        self.input_field = input_field
        self.tokenizer = tokenizer

    def encode(self, values: Sequence) -> np.ndarray:
        """Program inputs → the network's input array."""
        if self.tokenizer is not None:
            return self.tokenizer.encode_batch(values)
        return np.stack(values)

    def forward(self, **inputs) -> dspy.Prediction:
        probabilities = self.predict_proba(self.encode([inputs[self.input_field]]))[0]
        best = int(probabilities.argmax())
        return dspy.Prediction(label=self.labels[best], confidence=float(probabilities[best]))

    def predict_proba(self, pixels: np.ndarray, batch_size: int = 256) -> np.ndarray:
        self.net.eval()
        with torch.no_grad():
            chunks = [torch.softmax(self.net(torch.from_numpy(pixels[i:i + batch_size])), -1)
                      for i in range(0, len(pixels), batch_size)]
        return torch.cat(chunks).numpy()


def to_examples(split: Split, labels: Sequence[str], field: str) -> list[dspy.Example]:
    values = split.raw if split.raw is not None else split.x
    return [dspy.Example(**{field: v, "label": labels[y]}).with_inputs(field)
            for v, y in zip(values, split.y)]


def label_match(example: dspy.Example, prediction: dspy.Prediction, trace=None) -> bool:
    return example.label == prediction.label


# ----------------------------------------------------------------------------- the optimizer


def random_shift(pixels: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image by up to `max_shift` whole pixels per axis, replicating the border."""
    n, _, height, width = pixels.shape
    shifts = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=generator).float()
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, 0, 2] = -2.0 * shifts[:, 0] / width
    theta[:, 1, 2] = -2.0 * shifts[:, 1] / height
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, mode="nearest", padding_mode="border", align_corners=False)


def recalibrate_batchnorm(net: nn.Module, x: torch.Tensor, batch_size: int,
                          max_samples: int = 4096) -> None:
    """Re-estimate BatchNorm running statistics for the current weights on clean training data.

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
                net(batch)
    for m, momentum in zip(norms, saved):
        m.momentum = momentum
    net.eval()


@dataclass
class EpochRecord:
    epoch: int
    loss: float
    train_accuracy: float  # running, on augmented batches in train mode
    val_accuracy: float  # dspy.Evaluate on the validation split
    seconds: float


class WeightTrainer(Teleprompter):
    """A DSPy optimizer for a program's torch weights: AdamW with a one-cycle schedule.

    Each epoch is scored by dspy.Evaluate on the validation set; the best epoch's weights win.
    """

    def __init__(self, metric: Callable, *, epochs: int, batch_size: int, learning_rate: float,
                 weight_decay: float, augment: bool, seed: int, show_progress: bool = True,
                 view_transforms: Sequence = ()) -> None:
        super().__init__()
        # TTA transforms to train on (their random forms), so that test-time views are in
        # distribution.
        self.view_transforms = list(view_transforms)
        self.view_rng = np.random.default_rng(seed)
        self.metric = metric
        self.epochs, self.batch_size = epochs, batch_size
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.augment, self.seed, self.show_progress = augment, seed, show_progress
        self.history: list[EpochRecord] = []
        self.best_epoch = 0

    def compile(self, student: ClassifierProgram, *, trainset: list[dspy.Example],
                teacher=None, valset: list[dspy.Example] | None = None,
                **kwargs) -> ClassifierProgram:
        program = copy.deepcopy(student)
        x, y = self._stack(program, trainset)
        evaluate = dspy.Evaluate(devset=valset or trainset, metric=self.metric, num_threads=1,
                                 display_progress=False, max_errors=1)
        generator = torch.Generator().manual_seed(self.seed)
        steps_per_epoch = max(1, len(x) // self.batch_size + (len(x) % self.batch_size > 1))
        optimizer = torch.optim.AdamW(program.net.parameters(), lr=self.learning_rate,
                                      weight_decay=self.weight_decay)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.learning_rate, total_steps=self.epochs * steps_per_epoch)
        max_shift = max(1, round(min(x.shape[2:]) / 8)) if self.augment else 0
        best_score, best_state = -1.0, None
        for epoch in range(1, self.epochs + 1):
            started = time.perf_counter()
            loss, accuracy = self._train_epoch(program.net, x, y, optimizer, schedule, generator,
                                               max_shift, epoch)
            recalibrate_batchnorm(program.net, x[torch.randperm(len(x), generator=generator)],
                                  self.batch_size)
            with stdout_to_stderr():
                score = evaluate(program).score / 100.0
            record = EpochRecord(epoch, loss, accuracy, score, round(time.perf_counter() - started, 3))
            self.history.append(record)
            LOG.info("epoch %d/%d  loss %.4f  train_acc %.4f  val_acc %.4f  (%.1fs)", epoch,
                     self.epochs, loss, accuracy, score, record.seconds)
            if score >= best_score:  # ties: the later epoch, further into the annealing
                best_score, self.best_epoch = score, epoch
                best_state = copy.deepcopy(program.net.state_dict())
        program.net.load_state_dict(best_state)
        program.net.eval()
        return program

    @staticmethod
    def _stack(program: ClassifierProgram, examples: list[dspy.Example]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        index = {label: i for i, label in enumerate(program.labels)}
        x = torch.from_numpy(program.encode([ex[program.input_field] for ex in examples]))
        y = torch.tensor([index[ex.label] for ex in examples], dtype=torch.long)
        return x, y

    def _train_epoch(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer, schedule,
                     generator: torch.Generator, max_shift: int, epoch: int) -> tuple[float, float]:
        net.train()
        order = torch.randperm(len(x), generator=generator)
        batches = [order[i:i + self.batch_size] for i in range(0, len(x), self.batch_size)]
        if len(batches) > 1 and len(batches[-1]) == 1:  # BatchNorm needs 2+ samples
            batches.pop()
        total_loss, correct, seen = 0.0, 0, 0
        bar = progress(batches, desc=f"epoch {epoch}/{self.epochs}", enabled=self.show_progress)
        for batch in bar:
            inputs = x[batch]
            if self.augment:
                inputs = random_shift(inputs, max_shift, generator)
            if self.view_transforms:
                inputs = torch.from_numpy(random_augment(inputs.numpy(), self.view_transforms,
                                                         self.view_rng))
            logits = net(inputs)
            loss = F.cross_entropy(logits, y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += float(loss) * len(batch)
            correct += int((logits.argmax(1) == y[batch]).sum())
            seen += len(batch)
            bar.set_postfix(loss=f"{total_loss / seen:.4f}")
        return total_loss / seen, correct / seen


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

    def report_section(self) -> dict:
        return {"epochs_run": len(self.history), "best_epoch": self.best_epoch,
                "train_accuracy": self.train_accuracy, "val_accuracy": self.val_accuracy,
                "seconds": self.seconds,
                "num_parameters": self.architecture.get("num_parameters")}


def set_torch_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def train_classifier(config: Config, dataset: Dataset) -> TrainedModel:
    """Build the network for this data, wrap it in the DSPy program, compile it with WeightTrainer."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    kind = dataset.preprocessing["kind"]
    architecture = architecture_for(dataset.preprocessing, len(dataset.labels))
    net = build_model(architecture, dataset.preprocessing)
    architecture["num_parameters"] = count_parameters(net)
    LOG.info("training %s (%d parameters) on %d samples, validating on %d",
             architecture["name"], architecture["num_parameters"], len(dataset.train),
             len(dataset.val))
    if len(dataset.val) == 0:
        LOG.warning("the validation split is empty: the best epoch is chosen on the training "
                    "split; add data or raise --val_fraction")
    views = (build_transforms(config.tta_transforms, dataset.preprocessing)
             if config.tta and config.train_augment else [])
    if views:
        LOG.info("training on the TTA transforms too: %s", ", ".join(t.spec for t in views))
    trainer = WeightTrainer(label_match, epochs=config.epochs, batch_size=config.batch_size,
                            learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                            augment=config.train_augment and kind == "image", seed=config.seed,
                            show_progress=not config.no_progress, view_transforms=views)
    field = PROGRAM_INPUT[kind]
    tokenizer = Tokenizer.from_manifest(dataset.preprocessing) if kind == "text" else None
    program = trainer.compile(ClassifierProgram(net, dataset.labels, field, tokenizer),
                              trainset=to_examples(dataset.train, dataset.labels, field),
                              valset=to_examples(dataset.val, dataset.labels, field))
    train_accuracy = float((program.predict_proba(dataset.train.x).argmax(1) == dataset.train.y).mean())
    best = trainer.history[trainer.best_epoch - 1]
    return TrainedModel(net=program.net, labels=dataset.labels, architecture=architecture,
                        preprocessing=dataset.preprocessing, history=trainer.history,
                        best_epoch=trainer.best_epoch, train_accuracy=train_accuracy,
                        val_accuracy=best.val_accuracy,
                        seconds=round(time.perf_counter() - started, 3))


def build_manifest(config: Config, trained: TrainedModel, dataset: Dataset) -> dict:
    """The bundle manifest as training knows it; export fills 'export' and the ONNX file entry."""
    classes = len(trained.labels)
    return {
        "format": BUNDLE_FORMAT, "format_version": BUNDLE_FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_type": config.model_type, "labels": trained.labels,
        "input": input_spec(trained.preprocessing),
        "outputs": [{"name": OUTPUT_NAMES[0], "shape": ["batch", classes], "dtype": "float32"},
                    {"name": OUTPUT_NAMES[1], "shape": ["batch", classes], "dtype": "float32"}],
        "preprocessing": trained.preprocessing, "architecture": trained.architecture,
        "dataset": {**dataset.options.to_manifest(), "given_splits": dataset.given_splits,
                    "counts": dataset.counts, "skipped_images": len(dataset.skipped)},
        "training": {"program": "ClassifierProgram (dspy.Module)",
                     "optimizer": "WeightTrainer (dspy.teleprompt.Teleprompter): AdamW, one-cycle",
                     "epochs": config.epochs, "batch_size": config.batch_size,
                     "learning_rate": config.learning_rate, "weight_decay": config.weight_decay,
                     "train_augment": config.train_augment, "seed": config.seed,
                     "augment_transforms": (config.tta_transforms or "default")
                     if config.tta and config.train_augment else None,
                     **trained.report_section(),
                     "history": [vars(r) for r in trained.history]},
        "export": None, "quantization": None, "extra_graphs": {},
        "files": {"onnx": None, "weights": None, "sha256": {}},
    }


def save_checkpoint(config: Config, trained: TrainedModel, dataset: Dataset,
                    paths: BundlePaths) -> dict:
    """train.py alone: weights and a manifest without an ONNX graph (export.py adds it)."""
    manifest = build_manifest(config, trained, dataset)
    manifest["files"].update(weights=paths.weights.name,
                             sha256={"weights": save_weights(trained.net, paths.weights)})
    atomic_write_json(paths.manifest, manifest)
    return manifest


# ----------------------------------------------------------------------------- CLI

DATA_FLAGS = ["model_type", "dataset_path", "dataset_format", "has_header", "label_column",
              "text_column", "feature_columns", "image_column", "val_path", "test_path",
              "image_size", "channels", "max_vocab", "max_length", "val_fraction",
              "test_fraction", "seed"]
TRAIN_FLAGS = DATA_FLAGS + ["epochs", "batch_size", "learning_rate", "weight_decay",
                            "train_augment", "tta", "tta_transforms", "num_threads", "output_model", "report_json",
                            "log_level", "no_progress"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "train.py", "Train a classifier and write its weights (PATH.pt) and manifest "
        "(PATH.json); export.py turns them into PATH.onnx.", TRAIN_FLAGS,
        required=["dataset_path", "output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits "
               "--output_model runs/digits/model.onnx --epochs 20")
    config = start_cli(parser, argv, TRAIN_FLAGS)
    config.validate_tta(config.model_type)
    quiet_library_loggers()
    set_torch_threads(config.num_threads)

    def stages(report: dict) -> None:
        dataset = load_dataset(DataOptions.from_config(config), splits=("train", "val"))
        report["dataset"] = dataset.report_section()
        trained = train_classifier(config, dataset)
        report["train"] = trained.report_section()
        save_checkpoint(config, trained, dataset, BundlePaths.from_model_path(config.output_model))

    return run_with_report(config, stages)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
