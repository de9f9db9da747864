"""The training stage of semantic segmentation, in the classifier's design (ttc/nets/)
and much smaller: SegmenterProgram (a dspy.Module whose model is a segmentation network: an
image in, a mask of class indices out), SegmentationTrainer (a Teleprompter fitting its
weights: AdamW under the run's schedule, pixel cross-entropy that skips void pixels, no
augmentation, the best epoch on validation, early stopping), SegmenterSearch (one trainer per
learning rate and seed, the best kept) and train_segmenter, which hands export a TrainedModel.

Every epoch is scored by dspy.Evaluate on the validation examples (per example: pixel
accuracy), but the score that picks the epoch and the candidate is the mean IoU of the pixel
confusion pooled over every validation mask (ttc/tasks/segment/metrics.py): a mean of
per-image scores weighs a nearly empty image as much as a full one, and pixel accuracy rewards
answering background everywhere. Importing this module imports torch and dspy.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import dspy
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ttc.inputs.data import Dataset, Split
from ttc.nets.device import float_outputs, module_device, to_device, training_device
from ttc.nets.models import UserNetwork, count_parameters, user_architecture
from ttc.nets.candidates import BestEpochSearch
from ttc.nets.image_loop import ImagePlan, ImageRunner, ImageTrainer
from ttc.nets.training import TrainedModel, checkpoint_store, image_trained_model, train_images
from ttc.nets.transfer import Transfer
from ttc.tasks.segment.metrics import IGNORE_INDEX, PixelConfusion, summary_scores
from ttc.tasks.segment.nets import SEGMENTATION_MODULES, SEGMENTATION_NETWORKS
from ttc.tasks.segment.pretrained import init_backbone, require_backbone_file
from utils import LOG, ConfigError, TrainingError

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions

INPUT_FIELD = "image"
DEFAULT_ARCH = "unet"
EVAL_BATCH = 64  # images per forward pass when scoring


# ----------------------------------------------------------------------------- the DSPy program


@dataclass
class ValidationPass:
    """What SegmenterProgram.batched_for computed besides the masks: the mean pixel
    cross-entropy over the examples' non-void pixels (None when no example carries a mask)."""

    loss: float | None = None
    pixels: int = 0


class SegmenterProgram(dspy.Module):
    """A DSPy program whose 'model' is a segmentation network: an image (C, H, W) in [0, 1] in,
    its mask (H, W) of class indices out, with the names of the classes it holds."""

    def __init__(self, net: nn.Module, labels: Sequence[str],
                 ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.net = net
        self.labels = list(labels)
        self.ignore_index = ignore_index
        self._batched: dict[int, np.ndarray] | None = None  # id(image) → mask

    def forward(self, image: np.ndarray) -> dspy.Prediction:
        mask = self._batched.get(id(image)) if self._batched is not None else None
        if mask is None:
            mask = self.predict_masks(np.asarray(image)[None])[0]
        return dspy.Prediction(mask=mask,
                               classes=[self.labels[k] for k in np.unique(mask)])

    @contextlib.contextmanager
    def batched_for(self, examples: Sequence[dspy.Example]) -> Iterator[ValidationPass]:
        """Within the block, forward() on one of these examples' images (the same object, as
        dspy.Evaluate passes it) returns the mask computed here in batches, as
        ClassifierProgram.batched_for does; the first example still runs alone, as a server's
        single request does. The pass also gives the mean pixel cross-entropy against the
        examples' true masks (the validation loss at no extra forward pass: a prediction
        holding every pixel's class probabilities would take classes × 4 bytes a pixel)."""
        scored = ValidationPass()
        masks: dict[int, np.ndarray] = {}
        total = 0.0
        for start, logits in self._logit_chunks([ex[INPUT_FIELD] for ex in examples]):
            chunk = examples[start:start + len(logits)]
            for offset, (example, mask) in enumerate(zip(chunk, logits.argmax(1).numpy())):
                if start + offset:
                    masks[id(example[INPUT_FIELD])] = mask
            truth = [ex.get("mask") for ex in chunk]
            if all(t is not None for t in truth):
                target = torch.from_numpy(np.stack(truth).astype(np.int64, copy=False))
                total += float(F.cross_entropy(logits, target, ignore_index=self.ignore_index,
                                               reduction="sum"))
                scored.pixels += int((target != self.ignore_index).sum())
        scored.loss = total / scored.pixels if scored.pixels else None
        self._batched = masks
        try:
            yield scored
        finally:
            self._batched = None

    def predict_masks(self, pixels: np.ndarray, batch_size: int = EVAL_BATCH) -> np.ndarray:
        """(N, C, H, W) pixels → (N, H, W) int64 class indices, in eval mode."""
        masks = [logits.argmax(1) for _, logits in self._logit_chunks(pixels, batch_size)]
        height, width = np.shape(pixels)[-2:]
        return torch.cat(masks).numpy() if masks else np.zeros((0, height, width), np.int64)

    def _logit_chunks(self, images: Sequence[np.ndarray] | np.ndarray,
                      batch_size: int = EVAL_BATCH) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, float32 logits of images[start:start + batch_size]) over the images."""
        self.net.eval()
        device = module_device(self.net)
        with torch.no_grad():
            for start in range(0, len(images), batch_size):
                batch = np.ascontiguousarray(np.stack(images[start:start + batch_size]),
                                             dtype=np.float32)
                yield start, self.net(to_device(torch.from_numpy(batch), device)).float().cpu()


def to_examples(split: Split) -> list[dspy.Example]:
    """One example per image: `image` (C, H, W) the input, `mask` (H, W) the truth."""
    return [dspy.Example(**{INPUT_FIELD: x, "mask": y}).with_inputs(INPUT_FIELD)
            for x, y in zip(split.x, split.y)]


@dataclass(frozen=True)
class PixelAccuracy:
    """dspy.Evaluate's per-example metric: the share of the mask's non-void pixels predicted
    right (1.0 for a mask without any)."""

    ignore_index: int = IGNORE_INDEX

    def __call__(self, example: dspy.Example, prediction: dspy.Prediction, trace=None) -> float:
        truth = np.asarray(example.mask)
        keep = truth != self.ignore_index
        if not keep.any():
            return 1.0
        return float((np.asarray(prediction.mask)[keep] == truth[keep]).mean())


def pooled_confusion(results: Sequence[tuple], num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> PixelConfusion:
    """The pixel confusion of dspy.Evaluate's (example, prediction, score) results, pooled."""
    confusion = PixelConfusion(num_classes, ignore_index)
    for example, prediction, _ in results:
        mask = getattr(prediction, "mask", None)
        if mask is None:  # Evaluate's stand-in for a forward that failed
            raise TrainingError("scoring the validation split failed: the segmenter returned "
                                "no mask for an image", "rerun with --log_level DEBUG")
        confusion.add(mask, example.mask)
    return confusion


def pooled_miou(results: Sequence[tuple], num_classes: int,
                ignore_index: int = IGNORE_INDEX) -> float:
    """Mean IoU over the pooled pixel confusion of dspy.Evaluate's results."""
    return summary_scores(pooled_confusion(results, num_classes, ignore_index).matrix)[
        "mean_iou"]


def split_miou(net: nn.Module, split: Split, num_classes: int,
               ignore_index: int = IGNORE_INDEX) -> float:
    """The network's mean IoU over a split's pooled pixel confusion, in eval mode."""
    masks = SegmenterProgram(net, [str(k) for k in range(num_classes)],
                             ignore_index).predict_masks(split.x)
    matrix = PixelConfusion(num_classes, ignore_index).add(masks, split.y).matrix
    return summary_scores(matrix)["mean_iou"]


# ----------------------------------------------------------------------------- the optimizer


class SegmentationTrainer(ImageTrainer):
    """A DSPy optimizer for a segmenter's weights (program.ImageTrainer: AdamW with
    `weight_decay` under the `lr_schedule`, BatchNorm statistics re-estimated on clean training
    images after each epoch, as the classifier's; the best epoch, early stopping): mean pixel
    cross-entropy over the non-void pixels, no augmentation. Each epoch is scored by
    dspy.Evaluate on the validation set, by the pooled mean IoU; the best epoch's weights win
    (ties: the later), and training stops early once neither the validation loss nor the mean
    IoU has improved for `patience` epochs. A loss or weights that are not finite stop it with
    TrainingDiverged (exit 4)."""

    train_metric = "train_pixel_acc"
    val_metric = "val_miou"
    score_name = "mean IoU"

    def __init__(self, *, epochs: int, batch_size: int, learning_rate: float,
                 weight_decay: float, seed: int, lr_schedule: str = "auto", patience: int = 0,
                 ignore_index: int = IGNORE_INDEX, show_progress: bool = True) -> None:
        super().__init__(PixelAccuracy(ignore_index), epochs=epochs, batch_size=batch_size,
                         learning_rate=learning_rate, weight_decay=weight_decay, seed=seed,
                         lr_schedule=lr_schedule, patience=patience,
                         show_progress=show_progress)
        self.ignore_index = ignore_index

    def _stack(self, examples: list[dspy.Example]) -> tuple[torch.Tensor, torch.Tensor]:
        return stack_examples(examples)

    def _units(self, y: torch.Tensor) -> torch.Tensor:
        """Each mask's labelled (non-void) pixels."""
        return (y != self.ignore_index).sum(dim=(1, 2))

    def _scored(self, program: SegmenterProgram, results: Sequence[tuple],
                validation: ValidationPass) -> tuple[float, float | None]:
        return pooled_miou(results, len(program.labels), self.ignore_index), validation.loss

    def _train_epoch(self, runner: ImageRunner, epoch: int) -> tuple[float, float]:
        """One pass over the training images: (mean pixel loss, pixel accuracy), running,
        over the non-void pixels, in train mode. This process trains its share of every batch
        (the images of its shard, runner.shard); the share's mean pixel loss is weighted by its
        part of the batch's non-void pixels (ImageTrainer._step), so the averaged gradients are exactly
        the whole batch's mean (BatchNorm aside: each process normalises with its own share's
        statistics, as DistributedDataParallel does without SyncBatchNorm)."""
        net, shard = runner.train_net.train(), runner.shard
        total_loss, correct, seen = 0.0, 0.0, 0
        bar = self._epoch_bar(runner, epoch)
        for number, batch in enumerate(bar, 1):
            self.batches_run = number
            pixels = int(shard.units_of(batch))
            if not pixels:  # only void pixels: nothing to learn (and a loss of 0/0)
                runner.schedule.step()
                continue
            rows = shard.local(batch)
            mine = to_device(runner.y[rows], runner.device)
            keep = mine != self.ignore_index
            with runner.precision.autocast():
                logits = float_outputs(net(to_device(runner.x[rows], runner.device)))
            mine_pixels = int(keep.sum())
            loss = (F.cross_entropy(logits, mine, ignore_index=self.ignore_index) if mine_pixels
                    else logits.sum() * 0.0)  # a share of void pixels only: no gradient
            right = int((logits.detach().argmax(1) == mine)[keep].sum())
            value, (right,) = self._step(runner, loss, mine_pixels, pixels, bar, epoch, number,
                                         [right])
            total_loss += value * pixels
            correct += right
            seen += pixels
            bar.set_postfix(loss=f"{total_loss / seen:.4f}")
        return (total_loss / seen, correct / seen) if seen else (math.nan, 0.0)


def stack_examples(examples: Sequence[dspy.Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples' images (N, C, H, W) float32 and masks (N, H, W) int64 as tensors."""
    x = np.ascontiguousarray(np.stack([ex[INPUT_FIELD] for ex in examples]), dtype=np.float32)
    y = np.ascontiguousarray(np.stack([ex.mask for ex in examples]), dtype=np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


# ----------------------------------------------------------------------------- the search


class SegmenterSearch(BestEpochSearch):
    """CandidateSearch over segmentation trainers: one SegmentationTrainer per (learning rate,
    seed), the best kept by the validation mean IoU of its best epoch (ties: the lower
    validation loss). A diverged candidate is skipped with a WARNING unless it is the only
    one; the search fails only when all do."""

    score_name = "mean IoU"


# ----------------------------------------------------------------------------- the stage


def segmentation_architecture(options: TrainingOptions, dataset: Dataset) -> dict:
    """The manifest's architecture record: --model_def's network (the bundle keeps its file), or
    --arch's (default: the U-Net) with the run's dropout where the network takes one
    (--dropout, or the network's default); --pretrained switches a torchvision network to
    ImageNet's normalisation, once its backbone weights are found (exit 3 before training)."""
    if getattr(options, "model_def", None):
        path, factory = options.model_def_parts()
        return user_architecture(path.resolve(), factory, dataset.preprocessing,
                                 len(dataset.labels))
    arch = getattr(options, "arch", None) or DEFAULT_ARCH
    record = SEGMENTATION_NETWORKS[arch](dataset.preprocessing, len(dataset.labels))
    dropout = fitting_settings(options)[1]
    module = SEGMENTATION_MODULES[record["name"]]
    if dropout is not None and "dropout" in inspect.signature(module).parameters:
        record["dropout"] = float(dropout)
    if getattr(options, "pretrained", False):
        require_backbone_file(arch)
        record["normalization"] = "imagenet"
    return record


def starting_weights(options: TrainingOptions, net: nn.Module) -> Transfer | None:
    """--pretrained: the ImageNet backbone into a freshly built torchvision segmenter."""
    if getattr(options, "pretrained", False):
        return init_backbone(net, options.arch)
    return None


def check_segmenter_output(net: nn.Module, dataset: Dataset, options: TrainingOptions) -> None:
    """A --model_def network must map a batch of training images (N, C, H, W) to logits
    (N, classes, H, W): one per class and pixel, at the input's height and width (a forward
    that fails is the user's error, exit 2, as anywhere: models.user_code)."""
    if not getattr(options, "model_def", None) or len(dataset.train) == 0:
        return
    sample = torch.from_numpy(np.ascontiguousarray(dataset.train.x[:2], dtype=np.float32))
    with torch.no_grad():
        logits = net.eval()(sample)
    expected = (len(sample), len(dataset.labels), *sample.shape[-2:])
    if not torch.is_tensor(logits) or tuple(logits.shape) != expected:
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ConfigError(f"--model_def {options.model_def}: forward returned {shape} for a "
                          f"batch of {tuple(sample.shape)}; expected {expected} (one logit per "
                          "class and pixel, at the input's height and width)",
                          "return logits of shape (batch, num_classes, height, width): resize "
                          "them to the input's size, e.g. F.interpolate(logits, "
                          "size=images.shape[-2:], mode=\"bilinear\")")
    if not logits.is_floating_point():
        raise ConfigError(f"--model_def {options.model_def}: forward returned {logits.dtype} "
                          "logits; expected floating point", "return float logits")


def fitting_settings(options: TrainingOptions) -> tuple[float, float | None]:
    """(weight decay, dropout): the network's regularisation with the flags over it, or the
    options' own fields (weight decay 1e-4 when unset) for options without that method."""
    if hasattr(options, "regularisation"):
        chosen = options.regularisation(options.model_type, options.arch, options.model_def)
        return chosen.weight_decay, chosen.dropout
    weight_decay = getattr(options, "weight_decay", None)
    return (1e-4 if weight_decay is None else weight_decay), getattr(options, "dropout", None)


def build_segmenter(architecture: dict, preprocessing: dict) -> nn.Module:
    """The network of an architecture record, normalising by the training split's statistics
    (a --model_def network: UserNetwork around the module its factory returns)."""
    modules = {**SEGMENTATION_MODULES, "UserNetwork": UserNetwork}
    return modules[architecture["name"]](
        **architecture, mean=preprocessing.get("mean"), std=preprocessing.get("std"))


def plan_training(options: TrainingOptions, dataset: Dataset, engine: str = "local") -> ImagePlan:
    """Build the network for this data (checked and announced once), and the factories of its
    SegmenterProgram (a student per seed) and SegmentationTrainer (per learning rate and
    seed), with a local run's checkpoints (--checkpoint_dir, --resume) when asked: what the
    local run (train_segmenter) and a Ray run's driver (ttc/distributed) train from."""
    started = time.perf_counter()
    architecture = segmentation_architecture(options, dataset)
    ignore_index = int(dataset.preprocessing.get("ignore_index", IGNORE_INDEX))
    weight_decay = fitting_settings(options)[0]
    wrap = functools.partial(SegmenterProgram, labels=list(dataset.labels),
                             ignore_index=ignore_index)
    transfers: list[Transfer] = []

    def make_student(seed: int) -> SegmenterProgram:
        torch.manual_seed(seed)
        net = build_segmenter(architecture, dataset.preprocessing)
        transfer = starting_weights(options, net)
        if transfer is not None and not transfers:
            transfers.append(transfer)
        return wrap(net)

    first = make_student(options.seed).net
    check_segmenter_output(first, dataset, options)
    architecture["num_parameters"] = count_parameters(first)
    LOG.info("training %s (%d parameters) on %d images, validating on %d",
             architecture.get("arch") or architecture["name"], architecture["num_parameters"],
             len(dataset.train), len(dataset.val))
    if len(dataset.val) == 0:
        LOG.warning("the validation split is empty: the best epoch is chosen on the training "
                    "split; add data or raise --val_fraction")
    store = checkpoint_store(options, dataset, architecture, engine)
    device = training_device(options.device)

    def make_trainer(learning_rate: float, seed: int) -> SegmentationTrainer:
        trainer = SegmentationTrainer(epochs=options.epochs, batch_size=options.batch_size,
                                      learning_rate=learning_rate, weight_decay=weight_decay,
                                      seed=seed, lr_schedule=options.lr_schedule,
                                      patience=options.patience, ignore_index=ignore_index,
                                      show_progress=not getattr(options, "no_progress", False))
        trainer.checkpoints = store
        trainer.device, trainer.amp = device, options.amp
        return trainer

    return ImagePlan(architecture, make_student, make_trainer, SegmenterSearch,
                     PixelAccuracy(ignore_index), to_examples, trained_segmenter,
                     build_segmenter, wrap, transfers, started)


def train_segmenter(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """Build the network for this data, wrap it in SegmenterProgram and compile it with
    SegmenterSearch (one SegmentationTrainer per learning rate and seed; one by default)."""
    return train_images(options, dataset, plan_training(options, dataset))


def trained_segmenter(program: SegmenterProgram, search: SegmenterSearch, dataset: Dataset,
                      architecture: dict, started: float, options: TrainingOptions,
                      transfer: Transfer | None = None) -> TrainedModel:
    """What training hands to export: the chosen candidate's network and its history;
    train_accuracy is the training split's mean IoU in eval mode, val_accuracy the best
    epoch's validation mean IoU (both pooled over the split's pixels)."""
    train_miou = split_miou(program.net, dataset.train, len(dataset.labels),
                            program.ignore_index)
    return image_trained_model(program, search, dataset, architecture, started, options,
                               transfer, train_miou)


def validation_scores(net: nn.Module, split: Split, preprocessing: dict, batch_size: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Parts.validation_scores: a seeded sample of the validation split's non-void pixels, the
    logits and classes --calibrate temperature fits T on (evaluate.pixel_logits)."""
    from ttc.tasks.segment.evaluate import pixel_logits

    return pixel_logits(net, split.x, split.y, preprocessing["ignore_index"], batch_size, seed)
