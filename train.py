"""Train a classifier: a torch network inside a DSPy program, trained by a DSPy Teleprompter.

    python train.py --dataset_path builtin:digits --output_model runs/digits/model.onnx

writes the weights (model.pt) and manifest (model.json) of the bundle; export.py then writes
model.onnx. pipeline.py runs both in one process.
"""
from __future__ import annotations

import copy
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
from bundle import BundlePaths, manifest_text, new_manifest, record_weights
from metrics import accuracy
from report import run_with_report
from utils import (LOG, atomic_write_text, exit_cli, progress, quiet_library_loggers, run_cli,
                   stdout_to_stderr)

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
            total_loss += loss.detach().item() * len(batch)
            correct += int((logits.argmax(1) == y[batch]).sum())
            seen += len(batch)
            bar.set_postfix(loss=f"{total_loss / seen:.4f}")
        return total_loss / seen, correct / seen


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


class CandidateSearch(Teleprompter):
    """Like DSPy's random-search optimizers, over weight training: compile one WeightTrainer per
    (learning rate, seed) candidate, score each compiled program with dspy.Evaluate on the
    validation set and keep the best. Ties go to the lower validation loss: small validation
    sets tie often, and the loss still tells the candidates apart."""

    def __init__(self, metric: Callable, make_student: Callable[[int], ClassifierProgram],
                 make_trainer: Callable[[float, int], WeightTrainer],
                 learning_rates: Sequence[float], seeds: Sequence[int]) -> None:
        super().__init__()
        self.metric, self.make_student, self.make_trainer = metric, make_student, make_trainer
        self.grid = [(lr, seed) for lr in learning_rates for seed in seeds]
        self.candidates: list[Candidate] = []
        self.chosen = 0
        self.chosen_trainer: WeightTrainer | None = None

    def compile(self, student: ClassifierProgram | None = None, *, trainset: list[dspy.Example],
                teacher=None, valset: list[dspy.Example] | None = None,
                **kwargs) -> ClassifierProgram:
        devset = valset or trainset
        evaluate = dspy.Evaluate(devset=devset, metric=self.metric, num_threads=1,
                                 display_progress=False, max_errors=1)
        best: tuple[float, float] | None = None
        best_program = None
        for index, (learning_rate, seed) in enumerate(self.grid):
            started = time.perf_counter()
            if len(self.grid) > 1:
                LOG.info("candidate %d of %d: learning rate %g, seed %d", index + 1,
                         len(self.grid), learning_rate, seed)
            trainer = self.make_trainer(learning_rate, seed)
            program = trainer.compile(self.make_student(seed), trainset=trainset, valset=devset)
            with stdout_to_stderr():
                score = evaluate(program).score / 100.0
            loss = validation_loss(program, devset)
            self.candidates.append(Candidate(index, learning_rate, seed, score, loss,
                                             trainer.best_epoch,
                                             round(time.perf_counter() - started, 3)))
            if best is None or (score, -loss) > best:
                best, best_program = (score, -loss), program
                self.chosen, self.chosen_trainer = index, trainer
        if len(self.grid) > 1:
            chosen = self.candidates[self.chosen]
            LOG.info("candidate search: kept %d of %d (learning rate %g, seed %d, val accuracy "
                     "%.4f)", chosen.index + 1, len(self.grid), chosen.learning_rate, chosen.seed,
                     chosen.val_accuracy)
        return best_program


def validation_loss(program: ClassifierProgram, devset: list[dspy.Example]) -> float:
    x, y = WeightTrainer._stack(program, devset)
    probabilities = program.predict_proba(x.numpy())
    picked = probabilities[np.arange(len(y)), y.numpy()]
    return float(-np.log(np.clip(picked, 1e-12, None)).mean())


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

    def report_section(self) -> dict:
        return {"epochs_run": len(self.history), "best_epoch": self.best_epoch,
                "train_accuracy": self.train_accuracy, "val_accuracy": self.val_accuracy,
                "seconds": self.seconds, "samples": self.samples,
                "learning_rate": self.learning_rate, "seed": self.seed,
                "num_parameters": self.architecture.get("num_parameters"),
                "candidates": [vars(c) for c in self.candidates]
                if len(self.candidates) > 1 else None,
                "chosen_candidate": self.chosen_candidate if len(self.candidates) > 1 else None}


def set_torch_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def train_classifier(config: Config, dataset: Dataset) -> TrainedModel:
    """Build the network for this data, wrap it in the DSPy program, compile it with
    CandidateSearch (one WeightTrainer per learning rate and seed; one candidate by default)."""
    started = time.perf_counter()
    kind = dataset.preprocessing["kind"]
    architecture = architecture_for(dataset.preprocessing, len(dataset.labels))
    field = PROGRAM_INPUT[kind]
    tokenizer = Tokenizer.from_manifest(dataset.preprocessing) if kind == "text" else None

    def make_student(seed: int) -> ClassifierProgram:
        torch.manual_seed(seed)
        net = build_model(architecture, dataset.preprocessing)
        return ClassifierProgram(net, dataset.labels, field, tokenizer)

    architecture["num_parameters"] = count_parameters(make_student(config.seed).net)
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

    def make_trainer(learning_rate: float, seed: int) -> WeightTrainer:
        return WeightTrainer(label_match, epochs=config.epochs, batch_size=config.batch_size,
                             learning_rate=learning_rate, weight_decay=config.weight_decay,
                             augment=config.train_augment and kind == "image", seed=seed,
                             show_progress=not config.no_progress, view_transforms=views)

    search = CandidateSearch(label_match, make_student, make_trainer, config.learning_rates(),
                             [config.seed + k for k in range(config.num_candidates)])
    program = search.compile(trainset=to_examples(dataset.train, dataset.labels, field),
                             valset=to_examples(dataset.val, dataset.labels, field))
    trainer, chosen = search.chosen_trainer, search.candidates[search.chosen]
    train_accuracy = accuracy(program.predict_proba(dataset.train.x), dataset.train.y)
    return TrainedModel(net=program.net, labels=dataset.labels, architecture=architecture,
                        preprocessing=dataset.preprocessing, history=trainer.history,
                        best_epoch=trainer.best_epoch, train_accuracy=train_accuracy,
                        val_accuracy=trainer.history[trainer.best_epoch - 1].val_accuracy,
                        seconds=round(time.perf_counter() - started, 3),
                        samples=len(dataset.train), learning_rate=chosen.learning_rate,
                        seed=chosen.seed, candidates=search.candidates,
                        chosen_candidate=search.chosen)


def split_accuracy(net: nn.Module, split: Split) -> float | None:
    if len(split) == 0:
        return None
    program = ClassifierProgram(net, [], "")
    return accuracy(program.predict_proba(split.x), split.y)


def train_stage(config: Config, dataset: Dataset, report: dict,
                teacher_lm: dspy.BaseLM | None = None) -> tuple[TrainedModel, Dataset]:
    """Training as pipeline.py and train.py run it: with --teacher_lm, the teacher labels the
    unlabeled texts and the student is trained twice, without and with them, so the report can
    say what the teacher's labels bought. Returns the model to export and the data it saw.
    `teacher_lm` replaces the LM --teacher_lm names (tests pass dspy.utils.DummyLM)."""
    if not config.teacher_lm:
        trained = train_classifier(config, dataset)
        report["train"] = trained.report_section()
        return trained, dataset
    from teacher import distill

    distilled = distill(config, dataset, teacher_lm)
    report["teacher"] = distilled.section
    LOG.info("student without the teacher's labels (%d training texts)", len(dataset.train))
    baseline = train_classifier(config, dataset)
    LOG.info("student with the teacher's labels (%d training texts)", len(distilled.dataset.train))
    trained = train_classifier(config, distilled.dataset)
    report["train"] = trained.report_section()
    report["teacher"].update(teacher_comparison(baseline, dataset, trained, distilled.dataset))
    return trained, distilled.dataset


def teacher_comparison(baseline: TrainedModel, dataset: Dataset, student: TrainedModel,
                       enlarged: Dataset) -> dict:
    """Student accuracy without and with the teacher's data, and a plain verdict."""
    test = "test" in dataset.splits
    row = {"student_val_accuracy_without_teacher": baseline.val_accuracy,
           "student_val_accuracy_with_teacher": student.val_accuracy,
           "student_accuracy_without_teacher": split_accuracy(baseline.net, dataset.test)
           if test else None,
           "student_accuracy_with_teacher": split_accuracy(student.net, enlarged.test)
           if test else None}
    before, after = (("student_accuracy_without_teacher", "student_accuracy_with_teacher")
                     if test else ("student_val_accuracy_without_teacher",
                                   "student_val_accuracy_with_teacher"))
    delta = row[after] - row[before]
    where = "test" if test else "validation"
    row["verdict"] = (f"the teacher's labels raised {where} accuracy by {delta:+.4f}" if delta > 0
                      else f"the teacher's labels did not help: {where} accuracy {delta:+.4f}; "
                      "check the teacher's validation accuracy, or give it more demos "
                      "(--teacher_demos) or a stronger model")
    if delta <= 0:
        LOG.warning("%s", row["verdict"])
    return row


def build_manifest(config: Config, trained: TrainedModel, dataset: Dataset,
                   teacher: dict | None = None) -> dict:
    """The bundle manifest as training knows it (bundle.new_manifest); export fills the rest."""
    return new_manifest(
        model_type=config.model_type, labels=trained.labels,
        input_spec=input_spec(trained.preprocessing), preprocessing=trained.preprocessing,
        architecture=trained.architecture,
        dataset={**dataset.options.to_manifest(), "given_splits": dataset.given_splits,
                 "counts": dataset.counts, "skipped_images": len(dataset.skipped),
                 "columns": dataset.columns.to_manifest() if dataset.columns else None},
        training={"program": "ClassifierProgram (dspy.Module)",
                  "optimizer": "WeightTrainer (dspy.teleprompt.Teleprompter): AdamW, one-cycle",
                  "epochs": config.epochs, "batch_size": config.batch_size,
                  "learning_rate": config.learning_rate, "weight_decay": config.weight_decay,
                  "train_augment": config.train_augment, "seed": config.seed,
                  "augment_transforms": (config.tta_transforms or "default")
                  if config.tta and config.train_augment else None,
                  **trained.report_section(),
                  "history": [vars(r) for r in trained.history], "teacher": teacher})


def save_checkpoint(config: Config, trained: TrainedModel, dataset: Dataset,
                    paths: BundlePaths, teacher: dict | None = None) -> dict:
    """train.py alone: weights and a manifest without an ONNX graph (export.py adds it)."""
    manifest = build_manifest(config, trained, dataset, teacher)
    record_weights(manifest, paths, save_weights(trained.net, paths.weights))
    atomic_write_text(paths.manifest, manifest_text(manifest))
    return manifest


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "train", "Train a classifier and write its weights (PATH.pt) and manifest "
        "(PATH.json); export.py turns them into PATH.onnx.",
        required=["dataset_path", "output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits "
               "--output_model runs/digits/model.onnx --epochs 20")
    config = start_cli(parser, argv)
    config.validate_tta(config.model_type)
    quiet_library_loggers()
    set_torch_threads(config.num_threads)

    def stages(report: dict) -> None:
        # With a teacher, the test split measures what its labels bought.
        splits = ("train", "val", "test") if config.teacher_lm else ("train", "val")
        dataset = load_dataset(DataOptions.from_config(config), splits=splits)
        report["dataset"] = dataset.report_section()
        trained, dataset = train_stage(config, dataset, report)
        save_checkpoint(config, trained, dataset, BundlePaths.from_model_path(config.output_model),
                        report.get("teacher"))

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
