"""The report's evaluation section: per-class precision, recall and F1, macro-F1, balanced
accuracy, the confusion matrix and its most frequent confusions, and a verdict against the
majority-class baseline, so that a useless model (one that does not beat always answering the
most frequent class, or never recognises some class) is said to be useless. numpy only.

The figures come from a tally of (true, predicted) counts and per-bin confidence sums, so the
evaluation of a split and of a labelled `inference.py --input` stream of any length is one code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from metrics import (ECE_BINS, class_scores, confusion_matrix, ece_from_bin_sums,
                     reliability_sums)
from utils import LOG

BASELINE_MARGIN = 0.01  # a model must beat the majority class by a point to count as useful
TOP_CONFUSIONS = 5


@dataclass
class Tally:
    """Counts that chunks of predictions add to: the confusion matrix and, per confidence bin,
    samples, Σ confidence and Σ correct (the reliability diagram)."""

    num_classes: int
    confusion: np.ndarray = field(init=False)
    bin_count: np.ndarray = field(init=False)
    bin_confidence: np.ndarray = field(init=False)
    bin_correct: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.confusion = np.zeros((self.num_classes, self.num_classes), np.int64)
        self.bin_count = np.zeros(ECE_BINS, np.int64)
        self.bin_confidence = np.zeros(ECE_BINS)
        self.bin_correct = np.zeros(ECE_BINS)

    def add(self, probabilities: np.ndarray, y: np.ndarray) -> "Tally":
        if len(y):
            self.confusion += confusion_matrix(y, probabilities.argmax(1), self.num_classes)
            count, confidence, correct = reliability_sums(probabilities, y)
            self.bin_count += count
            self.bin_confidence += confidence
            self.bin_correct += correct
        return self

    @property
    def samples(self) -> int:
        return int(self.confusion.sum())


def reliability(probabilities: np.ndarray, y: np.ndarray) -> dict:
    """The reliability diagram's data for one set of predictions."""
    return reliability_of(Tally(probabilities.shape[1]).add(probabilities, y))


def reliability_of(tally: Tally) -> dict:
    """Per equal-width confidence bin: mean confidence, accuracy (null when empty), samples."""
    def per_bin(sums: np.ndarray) -> list[float | None]:
        return [float(s / n) if n else None for s, n in zip(sums, tally.bin_count)]

    return {"bins": ECE_BINS, "confidence": per_bin(tally.bin_confidence),
            "accuracy": per_bin(tally.bin_correct), "count": tally.bin_count.tolist()}


def majority_baseline(labels: Sequence[str], train_counts: Sequence[int] | None,
                      tally: Tally) -> tuple[int, str]:
    """The class a do-nothing model would always answer: the training split's most frequent
    (recorded in the bundle), or the evaluated data's own for a bundle from before that record."""
    if train_counts is not None and len(train_counts) == len(labels) and sum(train_counts):
        return int(np.argmax(train_counts)), "train split"
    return int(np.argmax(tally.confusion.sum(1))), "evaluated data"


def evaluation_section(tally: Tally, labels: Sequence[str],
                       train_counts: Sequence[int] | None, split: str = "test") -> dict:
    """The report's `evaluation`: per-class figures, baseline and verdict with its warnings."""
    confusion = tally.confusion
    scores = class_scores(confusion)
    samples = tally.samples
    support = scores["support"]
    accuracy = float(np.trace(confusion) / samples) if samples else 0.0
    baseline, source = majority_baseline(labels, train_counts, tally)
    baseline_accuracy = float(support[baseline] / samples) if samples else 0.0
    present = support > 0
    section = {
        "split": split, "samples": samples, "labels": list(labels), "accuracy": accuracy,
        "per_class": [{"label": label, "precision": float(scores["precision"][k]),
                       "recall": float(scores["recall"][k]), "f1": float(scores["f1"][k]),
                       "support": int(support[k])} for k, label in enumerate(labels)],
        "macro_f1": float(scores["f1"][present].mean()) if present.any() else 0.0,
        "balanced_accuracy": float(scores["recall"][present].mean()) if present.any() else 0.0,
        "confusion_matrix": confusion.tolist(),
        "top_confusions": top_confusions(confusion, labels),
        "baseline_class": labels[baseline], "baseline_accuracy": baseline_accuracy,
        "baseline_source": source,
        "ece": ece_from_bin_sums(tally.bin_correct, tally.bin_confidence, samples),
        "reliability": reliability_of(tally)}
    section["warnings"] = usefulness_warnings(section)
    section["verdict"] = verdict(section)
    return section


def bundle_evaluation(manifest: dict, tally: Tally, split: str = "test") -> dict:
    """The evaluation of a bundle's predictions against its training split's majority class;
    the warnings are logged (stderr), the verdict too."""
    section = evaluation_section(tally, manifest["labels"],
                                 manifest["dataset"].get("train_class_counts"), split)
    for warning in section["warnings"]:
        LOG.warning("%s", warning)
    LOG.info("evaluation: %s", section["verdict"])
    return section


def top_confusions(confusion: np.ndarray, labels: Sequence[str],
                   count: int = TOP_CONFUSIONS) -> list[dict]:
    """The most frequent (true → predicted) mistakes, most frequent first."""
    off = confusion.copy()
    np.fill_diagonal(off, 0)
    order = np.argsort(-off, axis=None, kind="stable")[:count]
    return [{"true": labels[t], "predicted": labels[p], "count": int(off[t, p])}
            for t, p in zip(*np.unravel_index(order, off.shape)) if off[t, p] > 0]


def usefulness_warnings(section: dict) -> list[str]:
    """What makes the model useless as it is: not beating the majority class by a point, and
    classes present in the data that it never gets right."""
    warnings = []
    gain = section["accuracy"] - section["baseline_accuracy"]
    if section["samples"] and gain < BASELINE_MARGIN:
        warnings.append(
            f"{section['split']} accuracy {section['accuracy']:.4f} does not beat always "
            f"answering the majority class {section['baseline_class']!r} "
            f"({section['baseline_accuracy']:.4f}) by at least {BASELINE_MARGIN * 100:g} point: "
            "the model has not learned the task; try more --epochs or another learning rate "
            "(--lr_candidates)")
    dead = [row for row in section["per_class"] if row["support"] and row["recall"] == 0]
    if dead:
        shown = ", ".join(f"{row['label']!r} ({row['support']} samples)" for row in dead[:5])
        more = f" and {len(dead) - 5} more" if len(dead) > 5 else ""
        warnings.append(f"recall 0 for {len(dead)} class{'es' if len(dead) > 1 else ''}: "
                        f"{shown}{more} never predicted right: the model answers other "
                        "classes for all of them; give those classes more samples (on "
                        "imbalanced data), or train longer")
    return warnings


def verdict(section: dict) -> str:
    gain = section["accuracy"] - section["baseline_accuracy"]
    against = (f"accuracy {section['accuracy']:.4f} against {section['baseline_accuracy']:.4f} "
               f"for always {section['baseline_class']!r} ({gain:+.4f})")
    if section["warnings"]:
        return f"NOT USEFUL as it is: {against}; " + (
            "a class is never recognised" if gain >= BASELINE_MARGIN else
            "it does not beat the majority class")
    return f"useful: {against}; every class recognised (macro-F1 {section['macro_f1']:.4f})"
