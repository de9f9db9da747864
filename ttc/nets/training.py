"""Training a network as the stage runs it: a classifier's plan (TrainingPlan: the data
checked, the network built, the factories of its students and trainers) and train_classifier,
a segmenter's or a detector's local run (train_images, over its type's ImagePlan), and what
either hands to export (TrainedModel, with the report's train.engine). A type's Parts.trainer
names its function here or in its own folder; importing this module imports torch and dspy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import dspy
import numpy as np
import torch
from torch import nn

from ttc.inputs.data import Dataset
from ttc.inputs.preprocess import PAD_ID, text_tokenizer
from ttc.nets.candidates import Candidate, CandidateSearch
from ttc.nets.checkpoints import CheckpointStore, new_run_id
from ttc.nets.classifier_loop import WeightTrainer
from ttc.nets.device import device_name, precision_for, training_device
from ttc.nets.dspy_program import ClassifierProgram, label_match, to_examples
from ttc.nets.epoch_loop import EpochRecord
from ttc.nets.finite import TrainingDiverged, check_finite_inputs, example_rate
from ttc.nets.image_loop import ImagePlan, ImageTrainer
from ttc.nets.models import architecture_for, build_model, count_parameters, user_architecture
from ttc.nets.transfer import (Transfer, head_parameters, init_from_file, init_from_pretrained,
                               require_pretrained_file)
from ttc.reporting.metrics import accuracy
from ttc.tasks.registry import task_of_kind
from ttc.testtime.tta import build_transforms
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions


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
    calibration: dict | None = None  # the temperature fit (stage.calibrate_network)
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


def plan_training(options: TrainingOptions, dataset: Dataset,
                  engine: str = "local") -> TrainingPlan:
    """Check the data, build the network for it (checked and announced once), and the
    factories of the DSPy program (a student per seed) and of its WeightTrainer (per learning
    rate and seed), with a local run's checkpoints (--checkpoint_dir, --resume) when asked."""
    started = time.perf_counter()
    check_finite_inputs(dataset)
    task = task_of_kind(dataset.preprocessing["kind"])
    architecture = network_architecture(options, dataset)
    tokenizer = text_tokenizer(dataset.preprocessing) if task.input_role == "text" else None
    pad_id = dataset.preprocessing.get("pad_id", PAD_ID)
    fine_tune = architecture["name"] == "HFTextNet"
    device = training_device(options.device)
    transfers: list[Transfer] = []

    def make_student(seed: int) -> ClassifierProgram:
        torch.manual_seed(seed)
        net = build_model(architecture, dataset.preprocessing, pretrained=True)
        transfer = starting_weights(options, net)
        if transfer is not None and not transfers:
            transfers.append(transfer)
        return ClassifierProgram(net, dataset.labels, task.input_field, tokenizer, pad_id)

    first = make_student(options.seed).net
    check_output_shape(first, dataset, options)
    architecture["num_parameters"] = count_parameters(first)
    announce_training(options, dataset, architecture, first)
    views = (build_transforms(options.tta_transforms, dataset.preprocessing)
             if options.tta and options.train_augment else [])
    if views:
        LOG.info("training on the TTA transforms too: %s", ", ".join(t.spec for t in views))
    recipe = options.recipe(options.model_type, options.arch, options.model_def)
    folder = options.checkpoint_folder()
    store = (CheckpointStore(folder, new_run_id(), run_fingerprint(options, dataset, architecture),
                             options.resume) if folder is not None and engine == "local" else None)

    def make_trainer(learning_rate: float, seed: int) -> WeightTrainer:
        return WeightTrainer(label_match, epochs=options.epochs, batch_size=options.batch_size,
                             learning_rate=learning_rate, recipe=recipe,
                             augment=options.train_augment and task.augments, seed=seed,
                             show_progress=not options.no_progress, view_transforms=views,
                             freeze_epochs=options.freeze_epochs, fine_tune=fine_tune,
                             pad_id=pad_id, checkpoints=store, device=device, amp=options.amp)

    return TrainingPlan(architecture, make_student, make_trainer, transfers, started,
                        task.input_field)


def run_fingerprint(options: TrainingOptions, dataset: Dataset, architecture: dict) -> dict:
    """What a checkpoint must share with a run that resumes it (checkpoints.FINGERPRINT_KEYS)."""
    return {"model_type": options.model_type, "labels": list(dataset.labels),
            "network": architecture.get("arch") or architecture["name"],
            "num_parameters": architecture.get("num_parameters"), "samples": len(dataset.train),
            "batch_size": options.batch_size, "learning_rate": options.learning_rates()[0],
            "seed": options.seed}


def train_classifier(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """Build the network for this data, wrap it in the DSPy program, compile it with
    CandidateSearch (one WeightTrainer per learning rate and seed; one candidate by default)."""
    plan = plan_training(options, dataset)
    search = CandidateSearch(label_match, plan.make_student, plan.make_trainer,
                             options.learning_rates(),
                             [options.seed + k for k in range(options.num_candidates)])
    try:
        program = search.compile(
            trainset=to_examples(dataset.train, dataset.labels, plan.field),
            valset=to_examples(dataset.val, dataset.labels, plan.field))
    except TrainingDiverged as err:  # one candidate only: say which flag set its rate
        if options.lr_candidates:
            err.hint = f"lower --lr_candidates (e.g. {example_rate(err.learning_rate)})"
        raise
    trained = trained_model(program, search, dataset, plan.architecture, plan.started,
                            plan.transfer, options)
    store = search.chosen_trainer.checkpoints
    trained.engine = engine_section(
        "local", None, 1, options.num_threads,
        [record.seconds for record in trained.history],
        checkpoint_dir=str(store.root) if store else None,
        resumed_from_epoch=store.resumed_from if store else None,
        **resumed_candidates(search, store))
    return trained



def image_trained_model(program: dspy.Module, search: CandidateSearch, dataset: Dataset,
                        architecture: dict, started: float, options: TrainingOptions,
                        transfer: Transfer | None, train_score: float) -> TrainedModel:
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
                        epochs_planned=options.epochs, initial_loss=trainer.initial_loss,
                        transfer=transfer, **trained_on(trainer))


def trained_on(trainer: WeightTrainer | ImageTrainer) -> dict:
    """TrainedModel's device and amp: where a local run's kept candidate trained, and how."""
    return {"device": device_name(trainer.device),
            "amp": precision_for(trainer.amp, trainer.device).mode}


def checkpoint_store(options: TrainingOptions, dataset: Dataset, architecture: dict,
                     engine: str) -> CheckpointStore | None:
    """A local run's checkpoints (--checkpoint_dir, --resume); None for a Ray run (its workers
    report theirs) or a run that keeps none."""
    folder = options.checkpoint_folder() if hasattr(options, "checkpoint_folder") else None
    if folder is None or engine != "local":
        return None
    return CheckpointStore(folder, new_run_id(), run_fingerprint(options, dataset, architecture),
                           options.resume)


def train_images(options: TrainingOptions, dataset: Dataset, plan: ImagePlan) -> TrainedModel:
    """A segmenter's or a detector's local training stage: the plan's search (one trainer per
    learning rate and seed; one by default) compiled on the training examples, the kept
    candidate's TrainedModel with train.engine."""
    search = plan.search(plan.metric, plan.make_student, plan.make_trainer,
                         options.learning_rates(),
                         [options.seed + k for k in range(options.num_candidates)])
    try:
        program = search.compile(trainset=plan.examples(dataset.train),
                                 valset=plan.examples(dataset.val))
    except TrainingDiverged as err:  # one candidate only: say which flag set its rate
        if getattr(options, "lr_candidates", None):
            err.hint = f"lower --lr_candidates (e.g. {example_rate(err.learning_rate)})"
        raise
    trained = plan.trained(program, search, dataset, plan.architecture, plan.started, options,
                           plan.transfer)
    store = search.chosen_trainer.checkpoints
    trained.engine = engine_section(
        "local", None, 1, getattr(options, "num_threads", 0),
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


def announce_training(options: TrainingOptions, dataset: Dataset, architecture: dict,
                      net: torch.nn.Module) -> None:
    """Log what is trained on what, and warn about a setting that trains less than it seems; a
    --freeze_epochs network without a head to train alone fails here, before any epoch."""
    LOG.info("training %s (%d parameters) on %d samples, validating on %d",
             architecture.get("arch") or architecture["name"], architecture["num_parameters"],
             len(dataset.train), len(dataset.val))
    if options.freeze_epochs:
        head_parameters(net)
        if not (options.init_weights or options.pretrained):
            LOG.warning("--freeze_epochs %d without --init_weights or --pretrained trains the "
                        "head on randomly initialised features", options.freeze_epochs)
    if len(dataset.val) == 0:
        LOG.warning("the validation split is empty: the best epoch is chosen on the training "
                    "split; add data or raise --val_fraction")


def trained_model(program: ClassifierProgram, search: CandidateSearch, dataset: Dataset,
                  architecture: dict, started: float, transfer: Transfer | None,
                  options: TrainingOptions) -> TrainedModel:
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
                        transfer=transfer, freeze_epochs=options.freeze_epochs,
                        epochs_planned=options.epochs, initial_loss=trainer.initial_loss,
                        **trained_on(trainer))


def network_architecture(options: TrainingOptions, dataset: Dataset) -> dict:
    """The manifest's architecture: --model_def's network, or --arch's (default per type);
    --pretrained switches a torchvision network to ImageNet's normalisation."""
    if options.model_def:
        path, factory = options.model_def_parts()
        return user_architecture(path.resolve(), factory, dataset.preprocessing,
                                 len(dataset.labels))
    dropout = options.regularisation(options.model_type, options.arch, None).dropout
    architecture = architecture_for(dataset.preprocessing, len(dataset.labels), options.arch,
                                    dataset.labels, dropout)
    if options.pretrained:
        require_pretrained_file(options.arch)  # before any training: exit 3 with the path
        architecture["normalization"] = "imagenet"
    return architecture


def starting_weights(options: TrainingOptions, net: nn.Module) -> Transfer | None:
    """--init_weights or --pretrained into a freshly built network."""
    if options.init_weights:
        return init_from_file(net, Path(options.init_weights))
    if options.pretrained:
        return init_from_pretrained(net, options.arch)
    return None


def check_output_shape(net: nn.Module, dataset: Dataset, options: TrainingOptions) -> None:
    """A --model_def network must map a batch to one logit per class (a forward that fails is
    the user's error, exit 2, as anywhere: models.user_code)."""
    if not options.model_def or len(dataset.train) == 0:
        return
    sample = torch.from_numpy(np.ascontiguousarray(dataset.train.x[:2]))
    with torch.no_grad():
        logits = net.eval()(sample)
    expected = (len(sample), len(dataset.labels))
    if not torch.is_tensor(logits) or tuple(logits.shape) != expected:
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ConfigError(f"--model_def {options.model_def}: forward returned {shape} for a "
                          f"batch of {len(sample)}; expected {expected} (one logit per class)",
                          "return logits of shape (batch, num_classes)")
