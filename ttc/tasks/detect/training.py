"""The training stage of object detection, in the segmenter's design (ttc/tasks/segment/
training.py): DetectorProgram (a dspy.Module whose model is a detector: an image in, its boxes,
scores and classes out, after the same NMS the exported graph runs), DetectionTrainer (a
Teleprompter fitting its weights: AdamW under the run's schedule, the detector's own loss
(nets.detection_loss), no augmentation, the best epoch on validation, early stopping),
DetectorSearch (one trainer per learning rate and seed, the best kept) and train_detector, which
hands export a TrainedModel.

Every epoch is scored by dspy.Evaluate on the validation examples (per example: the share of
its true boxes found at IoU 0.5 by a box of their class, 1.0 for an image without any), but the
score that picks the epoch and the candidate is COCO's mAP@[.5:.95] over every validation
detection (metrics.detection_metrics, pycocotools): a mean of per-image scores weighs an image of
one digit as much as one of five, and ignores the ranking that AP rewards. Importing this module
imports torch and dspy.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import dspy
import numpy as np
import torch
from torch import nn

from ttc.inputs.data import Dataset, Split
from ttc.nets.device import float_outputs, module_device, to_device, training_device
from ttc.nets.models import count_parameters, network_modules, user_architecture
from ttc.nets.candidates import BestEpochSearch
from ttc.nets.image_loop import ImagePlan, ImageRunner, ImageTrainer
from ttc.nets.training import TrainedModel, checkpoint_store, image_trained_model, train_images
from ttc.nets.shards import Shard
from ttc.tasks.detect.metrics import detection_metrics
from ttc.nets.transfer import Transfer
from ttc.tasks.detect.nets import (detection_loss, detection_targets, network_loss,
                                   output_size)
from ttc.tasks.detect.nms import detect
from ttc.tasks.detect.pretrained import init_pretrained, require_pretrained
from utils import LOG, ConfigError, TrainingError

if TYPE_CHECKING:
    from ttc.options.stages import TrainingOptions

INPUT_FIELD = "image"
DEFAULT_ARCH = "centernet"
EVAL_BATCH = 64  # images per forward pass when scoring
MATCH_IOU = 0.5  # the per-example metric's: a true box is found at this IoU
TRAIN_RECALL_IMAGES = 256  # training images the history's train_accuracy is measured on


@dataclass(frozen=True)
class NmsSettings:
    """The post-processing the exported graph bakes in (--iou_threshold, --score_threshold,
    --max_detections), which validation runs too: the epoch is chosen on what will ship."""

    iou_threshold: float = 0.5
    score_threshold: float = 0.05
    max_detections: int = 100

    @classmethod
    def from_options(cls, options: TrainingOptions) -> "NmsSettings":
        return cls(*(getattr(options, name, getattr(cls, name))
                     for name in ("iou_threshold", "score_threshold", "max_detections")))

    @classmethod
    def from_preprocessing(cls, preprocessing: dict) -> "NmsSettings":
        return cls(**preprocessing["nms"]) if "nms" in preprocessing else cls()

    def record(self) -> dict:
        return {"iou_threshold": self.iou_threshold, "score_threshold": self.score_threshold,
                "max_detections": self.max_detections}


Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)


# ----------------------------------------------------------------------------- the DSPy program


class DetectorProgram(dspy.Module):
    """A DSPy program whose 'model' is a detector: an image (C, H, W) in [0, 1] in, its
    detections (boxes xyxy in its pixels, scores, class indices, and the classes' names) out,
    after the NMS that export puts in the graph."""

    def __init__(self, net: nn.Module, labels: Sequence[str], nms: NmsSettings) -> None:
        super().__init__()
        self.net = net
        self.labels = list(labels)
        self.nms = nms
        self._batched: dict[int, Detections] | None = None  # id(image) → detections

    def forward(self, image: np.ndarray) -> dspy.Prediction:
        found = self._batched.get(id(image)) if self._batched is not None else None
        if found is None:
            found = self.predict(np.asarray(image)[None])[0]
        boxes, scores, labels = found
        # not `labels`: a dspy.Prediction's labels() is a method of its own
        return dspy.Prediction(boxes=boxes, scores=scores, class_ids=labels,
                               classes=[self.labels[k] for k in labels])

    @contextlib.contextmanager
    def batched_for(self, examples: Sequence[dspy.Example]) -> Iterator[list[float]]:
        """Within the block, forward() on one of these examples' images returns the detections
        computed here in batches (the first example still runs alone, as a server's single
        request does). The yielded list receives the mean validation loss, computed in the
        same pass, when every example carries its boxes."""
        images = [ex[INPUT_FIELD] for ex in examples]
        found = self.predict(np.stack(images)) if images else []
        self._batched = {id(image): f for n, (image, f) in enumerate(zip(images, found)) if n}
        loss: list[float] = []
        if examples and all(ex.get("boxes") is not None for ex in examples):
            loss.append(self.mean_loss(np.stack(images), [ex.boxes for ex in examples]))
        try:
            yield loss
        finally:
            self._batched = None

    def predict(self, pixels: np.ndarray, batch_size: int = EVAL_BATCH) -> list[Detections]:
        """(N, C, H, W) pixels → per image (boxes, scores, labels), padding rows removed, in
        eval mode."""
        self.net.eval()
        device = module_device(self.net)
        found: list[Detections] = []
        with torch.no_grad():
            for start in range(0, len(pixels), batch_size):
                batch = to_device(torch.from_numpy(np.ascontiguousarray(
                    pixels[start:start + batch_size], dtype=np.float32)), device)
                boxes, scores, labels, count = (t.cpu().numpy() for t in detect(
                    self.net, batch, self.nms.iou_threshold, self.nms.score_threshold,
                    self.nms.max_detections))
                found.extend((boxes[i, :n], scores[i, :n], labels[i, :n])
                             for i, n in enumerate(count))
        return found

    def mean_loss(self, pixels: np.ndarray, boxes: Sequence[np.ndarray],
                  batch_size: int = EVAL_BATCH) -> float:
        """The detector's loss over these images, in eval mode, weighted by batch size."""
        self.net.eval()
        device, total = module_device(self.net), 0.0
        with torch.no_grad():
            for start in range(0, len(pixels), batch_size):
                batch = to_device(torch.from_numpy(np.ascontiguousarray(
                    pixels[start:start + batch_size], dtype=np.float32)), device)
                loss, _ = network_loss(self.net, batch, boxes[start:start + batch_size],
                                       len(self.labels))
                total += float(loss) * len(batch)
        return total / max(1, len(pixels))


def to_examples(split: Split) -> list[dspy.Example]:
    """One example per image: `image` (C, H, W) the input, `boxes` (k, 5) the truth."""
    return [dspy.Example(**{INPUT_FIELD: x, "boxes": y}).with_inputs(INPUT_FIELD)
            for x, y in zip(split.x, split.y)]


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in `a` (n, 4) with every box in `b` (m, 4), xyxy."""
    low = np.maximum(a[:, None, :2], b[None, :, :2])
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(high - low, 0, None), axis=2)
    area = lambda boxes: np.prod(np.clip(boxes[:, 2:] - boxes[:, :2], 0, None), axis=1)  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


@dataclass(frozen=True)
class BoxRecall:
    """dspy.Evaluate's per-example metric: the share of the image's true boxes that a detected
    box of their class overlaps by IoU ≥ 0.5 (1.0 for an image without any)."""

    iou: float = MATCH_IOU

    def __call__(self, example: dspy.Example, prediction: dspy.Prediction, trace=None) -> float:
        truth = np.asarray(example.boxes, dtype=np.float32).reshape(-1, 5)
        if not len(truth):
            return 1.0
        boxes = np.asarray(prediction.boxes, dtype=np.float32).reshape(-1, 4)
        labels = np.asarray(prediction.class_ids).reshape(-1)
        overlaps = box_iou(truth[:, 1:], boxes) if len(boxes) else np.zeros((len(truth), 0))
        same = truth[:, :1].astype(np.int64) == labels[None, :]
        return float(((overlaps >= self.iou) & same).any(axis=1).mean())


def pooled_map(results: Sequence[tuple], labels: Sequence[str]) -> float:
    """COCO mAP@[.5:.95] over dspy.Evaluate's (example, prediction, score) results."""
    predictions, truths = [], []
    for example, prediction, _ in results:
        if getattr(prediction, "boxes", None) is None:  # Evaluate's stand-in for a failure
            raise TrainingError("scoring the validation split failed: the detector returned "
                                "no boxes for an image", "rerun with --log_level DEBUG")
        predictions.append((prediction.boxes, prediction.scores, prediction.class_ids))
        truths.append(example.boxes)
    return float(detection_metrics(predictions, truths, labels)["map"])


def split_map(program: DetectorProgram, split: Split) -> float:
    """The program's COCO mAP@[.5:.95] over a split, in eval mode."""
    return float(detection_metrics(program.predict(split.x), list(split.y),
                                   program.labels)["map"])


# ----------------------------------------------------------------------------- the optimizer


class DetectionTrainer(ImageTrainer):
    """A DSPy optimizer for a detector's weights (program.ImageTrainer: AdamW with
    `weight_decay` under the `lr_schedule`, BatchNorm statistics re-estimated on training images
    after each epoch; the best epoch, early stopping): the detector's loss, no augmentation (a
    flipped digit is another shape). Each epoch is scored by dspy.Evaluate on the validation
    set, by COCO mAP; the best epoch's weights win, and training stops early once neither the
    validation loss nor the mAP has improved for `patience` epochs. A loss or weights that are
    not finite stop it with TrainingDiverged (exit 4)."""

    train_metric = "train_recall@.5"
    val_metric = "val_map"
    score_name = "mAP"

    def __init__(self, *, epochs: int, batch_size: int, learning_rate: float,
                 weight_decay: float, seed: int, lr_schedule: str = "auto", patience: int = 0,
                 show_progress: bool = True) -> None:
        super().__init__(BoxRecall(), epochs=epochs, batch_size=batch_size,
                         learning_rate=learning_rate, weight_decay=weight_decay, seed=seed,
                         lr_schedule=lr_schedule, patience=patience,
                         show_progress=show_progress)

    def _stack(self, examples: list[dspy.Example]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """The images (N, C, H, W) float32 and each one's (k, 5) boxes."""
        x = torch.from_numpy(np.ascontiguousarray(
            np.stack([ex[INPUT_FIELD] for ex in examples]), dtype=np.float32))
        return x, [ex.boxes for ex in examples]

    def _steps_per_epoch(self, count: int) -> int:
        return len(self._batches(Shard(count), torch.Generator().manual_seed(0)))

    def _units(self, y: list[np.ndarray]) -> torch.Tensor:
        """Each image's objects."""
        return torch.tensor([len(boxes) for boxes in y], dtype=torch.int64)

    def _scored(self, program: DetectorProgram, results: Sequence[tuple],
                validation: list[float]) -> tuple[float, float | None]:
        return pooled_map(results, program.labels), validation[0] if validation else None

    def _train_accuracy(self, program: DetectorProgram, runner: ImageRunner,
                        running: float | None) -> float:
        """The history's train_accuracy: the mean box recall at IoU 0.5 (BoxRecall) of the
        first TRAIN_RECALL_IMAGES training images, in eval mode after the epoch."""
        count = min(len(runner.x), TRAIN_RECALL_IMAGES)
        if not count:
            return 0.0
        found = program.predict(runner.x[:count].numpy())
        return float(np.mean([self.metric(dspy.Example(boxes=runner.y[i]),
                                          dspy.Prediction(boxes=f[0], class_ids=f[2]))
                              for i, f in enumerate(found)]))

    def _train_epoch(self, runner: ImageRunner, epoch: int) -> tuple[float, None]:
        """One pass over the training images: the mean loss per image, in train mode (the
        training recall is measured after the epoch). This process trains its share of every
        batch (the images of its shard, runner.shard), its loss weighted by its part of the batch's objects
        (at least 1 each: ImageTrainer._step). CenterNet's heatmap loss is a sum divided by the
        objects' peak cells (one per object unless two share a cell), so its averaged
        gradients are the whole batch's; its box loss (a mean over the cells with a box) and
        an SSD's (over its matched anchors) are divided by other counts, which objects only
        approximate, and BatchNorm normalises each share by its own statistics: with several
        processes the gradients are close to, not equal to, the whole batch's."""
        shard = runner.shard
        runner.train_net.train()
        total, seen = 0.0, 0
        bar = self._epoch_bar(runner, epoch)
        for number, batch in enumerate(bar, 1):
            self.batches_run = number
            mine = shard.local(batch).tolist()
            objects = max(1, int(shard.units_of(batch)))
            mine_objects = max(1, sum(len(runner.y[i]) for i in mine))
            loss = share_loss(runner, to_device(runner.x[mine], runner.device),
                              [runner.y[i] for i in mine], len(runner.program.labels))
            value, _ = self._step(runner, loss, mine_objects, objects, bar, epoch, number)
            total += value * len(batch)
            seen += len(batch)
            bar.set_postfix(loss=f"{total / seen:.4f}")
        return (total / seen if seen else math.nan), None


def share_loss(runner: ImageRunner, images: torch.Tensor, boxes: list[np.ndarray],
               num_classes: int) -> torch.Tensor:
    """nets.network_loss through runner.train_net: the forward pass goes through the
    DistributedDataParallel wrapper on a Ray worker (so that its gradients are all-reduced),
    then the network's own loss of those outputs (an SSD's) or the two heads' (CenterNet, a
    --model_def module). The forward pass runs in --amp's precision, the loss in float32."""
    with runner.precision.autocast():
        outputs = float_outputs(runner.train_net(images))
    own = getattr(runner.net, "outputs_loss", None)
    if own is not None:
        return own(outputs, images, boxes)[0]
    return detection_loss(outputs, detection_targets(boxes, num_classes,
                                                     tuple(images.shape[-2:])))[0]


# ----------------------------------------------------------------------------- the search


class DetectorSearch(BestEpochSearch):
    """CandidateSearch over detection trainers: one DetectionTrainer per (learning rate, seed),
    the best kept by the validation mAP of its best epoch (ties: the lower validation loss)."""

    score_name = "mAP"


# ----------------------------------------------------------------------------- the stage


def detection_architecture(options: TrainingOptions, dataset: Dataset) -> dict:
    """The manifest's architecture record: --model_def's network (the bundle keeps its file), or
    --arch's (default: our CenterNet) with the run's dropout (--dropout, or the network's
    default); --pretrained needs its weights in the torch hub cache (exit 3 before training),
    and switches MobileNetV3's normalisation to ImageNet's (an SSD normalises as torchvision's
    transform does, always)."""
    from ttc.nets.models import architecture_for

    if getattr(options, "model_def", None):
        path, factory = options.model_def_parts()
        return user_architecture(path.resolve(), factory, dataset.preprocessing,
                                 len(dataset.labels))
    arch = getattr(options, "arch", None) or DEFAULT_ARCH
    dropout = (options.regularisation(options.model_type, options.arch, None).dropout
               if hasattr(options, "regularisation") else getattr(options, "dropout", None))
    record = architecture_for(dataset.preprocessing, len(dataset.labels), arch, dropout=dropout)
    if getattr(options, "pretrained", False):
        require_pretrained(arch)
        if record["name"] == "MobileNetCenterNet":
            record["normalization"] = "imagenet"
    return record


def build_detector(architecture: dict, preprocessing: dict) -> nn.Module:
    """The network of an architecture record, normalising by the training split's statistics
    (a --model_def network: UserNetwork around the module its factory returns)."""
    return network_modules(preprocessing["kind"])[architecture["name"]](
        **architecture, mean=preprocessing.get("mean"), std=preprocessing.get("std"))


def starting_weights(options: TrainingOptions, net: nn.Module) -> Transfer | None:
    """--pretrained: torchvision's weights into the detector (pretrained.py)."""
    if getattr(options, "pretrained", False):
        return init_pretrained(net, options.arch)
    return None


def check_detector_output(net: nn.Module, dataset: Dataset, options: TrainingOptions) -> None:
    """A --model_def network must map a batch of training images (N, C, H, W) to the two heads
    the decoding reads: heatmap logits (N, classes, h, w) and raw box distances (N, 4, h, w),
    h = ceil(H / 4), w = ceil(W / 4) (a forward that fails is the user's error, exit 2)."""
    if not getattr(options, "model_def", None) or len(dataset.train) == 0:
        return
    sample = torch.from_numpy(np.ascontiguousarray(dataset.train.x[:2], dtype=np.float32))
    with torch.no_grad():
        outputs = net.eval()(sample)
    h, w = output_size(*sample.shape[-2:])
    expected = [(len(sample), len(dataset.labels), h, w), (len(sample), 4, h, w)]
    shapes = ([tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in outputs]
              if isinstance(outputs, (tuple, list)) else
              tuple(outputs.shape) if torch.is_tensor(outputs) else type(outputs).__name__)
    if shapes != expected:
        raise ConfigError(f"--model_def {options.model_def}: forward returned {shapes} for a "
                          f"batch of {tuple(sample.shape)}; expected heatmap logits and box "
                          f"distances {expected} (stride 4: ceil(height / 4), ceil(width / 4))",
                          "return (heatmap_logits, box_distances), see docs/detection.md's "
                          "'Your own network'")
    if not all(t.is_floating_point() for t in outputs):
        raise ConfigError(f"--model_def {options.model_def}: forward returned "
                          f"{[str(t.dtype) for t in outputs]}; expected floating point",
                          "return float tensors")


def weight_decay_of(options: TrainingOptions) -> float:
    if hasattr(options, "regularisation"):
        return options.regularisation(options.model_type, options.arch, None).weight_decay
    weight_decay = getattr(options, "weight_decay", None)
    return 1e-4 if weight_decay is None else weight_decay


def plan_training(options: TrainingOptions, dataset: Dataset, engine: str = "local") -> ImagePlan:
    """Build the detector for this data (checked and announced once), and the factories of
    its DetectorProgram (a student per seed) and DetectionTrainer (per learning rate and
    seed), with a local run's checkpoints (--checkpoint_dir, --resume) when asked: what the
    local run (train_detector) and a Ray run's driver (ttc/distributed) train from. The NMS
    settings go into the preprocessing record, which the manifest keeps and export bakes."""
    started = time.perf_counter()
    nms = NmsSettings.from_options(options)
    dataset.preprocessing = {**dataset.preprocessing, "nms": nms.record()}
    architecture = detection_architecture(options, dataset)
    wrap = functools.partial(DetectorProgram, labels=list(dataset.labels), nms=nms)
    transfers: list[Transfer] = []

    def make_student(seed: int) -> DetectorProgram:
        torch.manual_seed(seed)
        net = build_detector(architecture, dataset.preprocessing)
        transfer = starting_weights(options, net)
        if transfer is not None and not transfers:
            transfers.append(transfer)
        return wrap(net)

    first = make_student(options.seed).net
    check_detector_output(first, dataset, options)
    architecture["num_parameters"] = count_parameters(first)
    LOG.info("training %s (%d parameters) on %d images (%d boxes), validating on %d",
             architecture.get("arch") or architecture["name"], architecture["num_parameters"],
             len(dataset.train), sum(len(b) for b in dataset.train.y), len(dataset.val))
    if len(dataset.val) == 0:
        LOG.warning("the validation split is empty: the best epoch is chosen on the training "
                    "split; add data or raise --val_fraction")
    store = checkpoint_store(options, dataset, architecture, engine)
    device = training_device(options.device)

    def make_trainer(learning_rate: float, seed: int) -> DetectionTrainer:
        trainer = DetectionTrainer(epochs=options.epochs, batch_size=options.batch_size,
                                   learning_rate=learning_rate,
                                   weight_decay=weight_decay_of(options), seed=seed,
                                   lr_schedule=options.lr_schedule, patience=options.patience,
                                   show_progress=not getattr(options, "no_progress", False))
        trainer.checkpoints = store
        trainer.device, trainer.amp = device, options.amp
        return trainer

    return ImagePlan(architecture, make_student, make_trainer, DetectorSearch, BoxRecall(),
                     to_examples, trained_detector, build_detector, wrap, transfers, started)


def train_detector(options: TrainingOptions, dataset: Dataset) -> TrainedModel:
    """Build the detector for this data, wrap it in DetectorProgram and compile it with
    DetectorSearch (one DetectionTrainer per learning rate and seed; one by default)."""
    return train_images(options, dataset, plan_training(options, dataset))


def trained_detector(program: DetectorProgram, search: DetectorSearch, dataset: Dataset,
                     architecture: dict, started: float, options: TrainingOptions,
                     transfer: Transfer | None = None) -> TrainedModel:
    """What training hands to export: the chosen candidate's network and its history;
    train_accuracy is the training split's COCO mAP in eval mode, val_accuracy the best
    epoch's validation mAP."""
    return image_trained_model(program, search, dataset, architecture, started, options,
                               transfer, split_map(program, dataset.train))
