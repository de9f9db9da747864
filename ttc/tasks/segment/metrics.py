"""Segmentation metrics from a confusion matrix over pixels: pixel accuracy, per-class IoU and
Dice, mean IoU, frequency-weighted IoU, and the majority-class baseline (every pixel answered
as the most frequent class, usually the background) with a verdict in the words of the
classifiers' evaluation (ttc/reporting/evaluation.py). numpy only.

Batches add to one `PixelConfusion` (rows true class, columns predicted class; void pixels
left out), so a split and a stream of any length are scored by one code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ttc.reporting.evaluation import (BASELINE_MARGIN, LABEL_WIDTH, baseline_verdict,
                                      never_right_warning, not_learned_warning)
from utils import quoted

IGNORE_INDEX = 255


@dataclass
class PixelConfusion:
    """The classes × classes confusion matrix over pixels (int64; rows true, columns
    predicted) that batches of masks add to; pixels whose truth is `ignore_index` (void) are
    left out."""

    num_classes: int
    ignore_index: int = IGNORE_INDEX
    matrix: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.matrix = np.zeros((self.num_classes, self.num_classes), np.int64)

    def add(self, predicted: np.ndarray, truth: np.ndarray) -> "PixelConfusion":
        """Count a batch: `predicted` and `truth` class indices of one shape, e.g. (N, H, W)."""
        predicted, truth = np.asarray(predicted), np.asarray(truth)
        if predicted.shape != truth.shape:
            raise ValueError(f"predicted masks {predicted.shape} and true masks {truth.shape} "
                             "differ in shape")
        keep = truth != self.ignore_index
        true = truth[keep].astype(np.int64, copy=False)
        guess = predicted[keep].astype(np.int64, copy=False)
        for name, values in (("true", true), ("predicted", guess)):
            if values.size and (values.min() < 0 or values.max() >= self.num_classes):
                raise ValueError(f"{name} class indices must lie in [0, {self.num_classes}) "
                                 f"(or be {self.ignore_index} in the truth): found "
                                 f"{values.min()}..{values.max()}")
        cells = np.bincount(true * self.num_classes + guess,
                            minlength=self.num_classes * self.num_classes)
        self.matrix += cells.reshape(self.num_classes, self.num_classes)
        return self

    @property
    def pixels(self) -> int:
        """The pixels counted (void ones left out)."""
        return int(self.matrix.sum())


def class_iou(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per class: IoU and Dice (NaN where the union is empty: the class is neither in the
    truth nor predicted), truth pixels and predicted pixels."""
    matrix = np.asarray(matrix, np.int64)
    hits = np.diag(matrix).astype(np.float64)
    truth, predicted = matrix.sum(axis=1), matrix.sum(axis=0)
    union = truth + predicted - hits
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, hits / union, np.nan)
        dice = np.where(union > 0, 2 * hits / (truth + predicted), np.nan)
    return iou, dice, truth, predicted


def summary_scores(matrix: np.ndarray) -> dict[str, float]:
    """Pixel accuracy, mean IoU and Dice over the classes with a non-zero union (in the truth
    or predicted: a class absent from both is left out, not counted as 0 or 1), and
    frequency-weighted IoU (Σ truth share × IoU)."""
    iou, dice, truth, _ = class_iou(matrix)
    total = int(truth.sum())
    seen = ~np.isnan(iou)
    if not total:
        return {"pixel_accuracy": 0.0, "mean_iou": 0.0, "mean_dice": 0.0,
                "frequency_weighted_iou": 0.0}
    return {"pixel_accuracy": float(np.trace(matrix) / total),
            "mean_iou": float(iou[seen].mean()) if seen.any() else 0.0,
            "mean_dice": float(dice[seen].mean()) if seen.any() else 0.0,
            "frequency_weighted_iou": float((truth[seen] / total * iou[seen]).sum())}


def majority_matrix(matrix: np.ndarray, baseline: int) -> np.ndarray:
    """The confusion matrix of answering `baseline` for every pixel of the same truth."""
    always = np.zeros_like(np.asarray(matrix, np.int64))
    always[:, baseline] = np.asarray(matrix).sum(axis=1)
    return always


def segmentation_scores(matrix: np.ndarray, labels: Sequence[str],
                        train_pixels: Sequence[int] | None = None,
                        split: str = "test") -> dict:
    """The evaluation of a pixel confusion `matrix` (rows true, columns predicted): pixel
    accuracy, mean IoU (over the classes with a non-zero union: see summary_scores), mean Dice,
    frequency-weighted IoU, per_class {label: iou, dice, pixels (truth), predicted_pixels} (iou
    and dice None for a class neither in the truth nor predicted), the confusion matrix, and
    the majority-class baseline: every pixel answered as the training split's most frequent
    class (`train_pixels`, per class), else the evaluated truth's, with its pixel accuracy and
    mean IoU. The verdict compares mean IoU with the baseline's (pixel accuracy rewards a
    model that answers background everywhere), as the classifiers compare accuracy."""
    matrix = np.asarray(matrix, np.int64)
    if matrix.shape != (len(labels), len(labels)) or len(set(labels)) != len(labels):
        raise ValueError(f"a {matrix.shape} confusion matrix needs as many distinct labels "
                         f"({len(labels)} given)")
    iou, dice, truth, predicted = class_iou(matrix)
    baseline, source = majority_class(truth, train_pixels)
    always = summary_scores(majority_matrix(matrix, baseline))
    section = {
        "split": split, "pixels": int(truth.sum()), "labels": list(labels),
        **summary_scores(matrix),
        "per_class": {label: {"iou": None if np.isnan(iou[k]) else float(iou[k]),
                              "dice": None if np.isnan(dice[k]) else float(dice[k]),
                              "pixels": int(truth[k]), "predicted_pixels": int(predicted[k])}
                      for k, label in enumerate(labels)},
        "confusion_matrix": matrix.tolist(),
        "baseline_class": labels[baseline], "baseline_source": source,
        "baseline_pixel_accuracy": always["pixel_accuracy"],
        "baseline_mean_iou": always["mean_iou"]}
    section["warnings"] = segmentation_warnings(section)
    section["verdict"] = segmentation_verdict(section)
    return section


def majority_class(truth: np.ndarray, train_pixels: Sequence[int] | None) -> tuple[int, str]:
    """The class a do-nothing model answers everywhere: the training split's most frequent
    (when its per-class pixel counts are given), else the evaluated truth's."""
    if train_pixels is not None and len(train_pixels) == len(truth) and sum(train_pixels):
        return int(np.argmax(train_pixels)), "train split"
    return int(np.argmax(truth)), "evaluated data"


def segmentation_warnings(section: dict) -> list[str]:
    """What makes the model useless as it is: a mean IoU not a point above the majority
    class's, and classes in the truth that no pixel of is predicted right (IoU 0)."""
    warnings = []
    gain = section["mean_iou"] - section["baseline_mean_iou"]
    if section["pixels"] and gain < BASELINE_MARGIN:
        warnings.append(not_learned_warning(
            f"{section['split']} mean IoU {section['mean_iou']:.4f}", "answering the majority "
            f"class {quoted(section['baseline_class'], LABEL_WIDTH)} for every pixel",
            section["baseline_mean_iou"]))
    dead = [(label, row["pixels"]) for label, row in section["per_class"].items()
            if row["pixels"] and row["iou"] == 0]
    if dead:
        warnings.append(never_right_warning(dead, "IoU", "pixels", "their pixels",
                                            "give those classes more images, or train longer"))
    return warnings


def segmentation_verdict(section: dict) -> str:
    return baseline_verdict("mean IoU", section["mean_iou"], section["baseline_mean_iou"],
                            section["baseline_class"], section["warnings"],
                            f"pixel accuracy {section['pixel_accuracy']:.4f}")
