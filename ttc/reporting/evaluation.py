"""The report's evaluation section: per-class precision, recall and F1, macro-F1, balanced
accuracy, the confusion matrix and its most frequent confusions, and a verdict against the
majority-class baseline, so that a useless model (one that does not beat always answering the
most frequent class, or never recognises some class) is said to be useless. numpy only.

The figures come from a tally of (true, predicted) counts and per-bin confidence sums, so the
evaluation of a split and of a labelled `inference.py --input` stream of any length is one code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ttc.reporting.metrics import ECE_BINS, class_scores_from_totals, ece_from_bin_sums, reliability_sums
from utils import LOG, quoted

BASELINE_MARGIN = 0.01  # a model must beat the majority class by a point to count as useful
TOP_CONFUSIONS = 5
LABEL_WIDTH = 40  # a class name in a warning: the bundle's, so quoted short
# The report's confusion matrix is classes² numbers (20,000 classes: 400 million). Up to this
# many classes it is there in full; beyond, the report lists the most frequent confusions
# (CONFUSION_PAIRS of them), and the tally, which keeps only the cells that occur, is exact.
DENSE_CONFUSION_CLASSES = 1000
CONFUSION_PAIRS = 1000


@dataclass
class Tally:
    """Counts that chunks of predictions add to: the confusion matrix's cells that occur
    (true × classes + predicted → count: memory grows with the samples, not with classes²) and,
    per confidence bin, samples, Σ confidence and Σ correct (the reliability diagram)."""

    num_classes: int
    cells: dict[int, int] = field(init=False)
    bin_count: np.ndarray = field(init=False)
    bin_confidence: np.ndarray = field(init=False)
    bin_correct: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.cells = {}
        self.bin_count = np.zeros(ECE_BINS, np.int64)
        self.bin_confidence = np.zeros(ECE_BINS)
        self.bin_correct = np.zeros(ECE_BINS)

    def add(self, probabilities: np.ndarray, y: np.ndarray) -> "Tally":
        if len(y):
            keys = np.asarray(y, np.int64) * self.num_classes + probabilities.argmax(1)
            found, counts = np.unique(keys, return_counts=True)
            for key, count in zip(found.tolist(), counts.tolist()):
                self.cells[key] = self.cells.get(key, 0) + count
            count, confidence, correct = reliability_sums(probabilities, y)
            self.bin_count += count
            self.bin_confidence += confidence
            self.bin_correct += correct
        return self

    @property
    def samples(self) -> int:
        return sum(self.cells.values())

    def triples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells that occur as (true classes, predicted classes, counts), by cell index."""
        keys = np.array(sorted(self.cells), dtype=np.int64)
        counts = np.array([self.cells[k] for k in keys.tolist()], dtype=np.int64)
        return keys // self.num_classes, keys % self.num_classes, counts

    def totals(self) -> dict[str, np.ndarray]:
        """Per class: right predictions, predictions, and samples (the support)."""
        true, predicted, counts = self.triples()
        n, right = self.num_classes, true == predicted
        return {name: np.bincount(classes, weights, n).astype(np.int64) for name, classes, weights
                in (("hits", true[right], counts[right]), ("predicted", predicted, counts),
                    ("support", true, counts))}

    def dense(self) -> np.ndarray:
        """The classes × classes confusion matrix (rows true, columns predicted)."""
        matrix = np.zeros((self.num_classes, self.num_classes), np.int64)
        true, predicted, counts = self.triples()
        matrix[true, predicted] = counts
        return matrix


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
    return int(np.argmax(tally.totals()["support"])), "evaluated data"


def evaluation_section(tally: Tally, labels: Sequence[str],
                       train_counts: Sequence[int] | None, split: str = "test") -> dict:
    """The report's `evaluation`: per-class figures, baseline and verdict with its warnings."""
    totals = tally.totals()
    scores = class_scores_from_totals(totals["hits"], totals["predicted"], totals["support"])
    samples = tally.samples
    support = scores["support"]
    accuracy = float(totals["hits"].sum() / samples) if samples else 0.0
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
        **confusion_entries(tally, labels),
        "baseline_class": labels[baseline], "baseline_accuracy": baseline_accuracy,
        "baseline_source": source,
        "ece": ece_from_bin_sums(tally.bin_correct, tally.bin_confidence, samples),
        "reliability": reliability_of(tally)}
    section["warnings"] = usefulness_warnings(section)
    section["verdict"] = verdict(section)
    return section


def bundle_evaluation(section_of: Callable[..., dict], labels: Sequence[str],
                      train_class_counts: Sequence[int] | None, tally: Tally,
                      split: str = "test", dataset: dict | None = None) -> dict:
    """The evaluation of a bundle's predictions by its model type's `section_of` (its entry's
    parts.evaluation, e.g. evaluation_section), against its training split's majority class
    (`train_class_counts`: None in bundles from before that record); the warnings are logged
    (stderr), the verdict too. A useless model of a table whose label column was guessed
    (`dataset`: the report's section) gets one more warning: the guess may be the cause."""
    section = section_of(tally, labels, train_class_counts, split)
    if section["warnings"]:
        section["warnings"] += guessed_label_warning(dataset)
    for warning in section["warnings"]:
        LOG.warning("%s", warning)
    LOG.info("evaluation: %s", section["verdict"])
    return section


def confusion_entries(tally: Tally, labels: Sequence[str]) -> dict:
    """The report's confusion matrix (null beyond DENSE_CONFUSION_CLASSES classes, with the
    CONFUSION_PAIRS most frequent confusions in `confusion_pairs` instead) and top confusions."""
    entries = {"confusion_matrix": None, "top_confusions": top_confusions(tally, labels)}
    if tally.num_classes <= DENSE_CONFUSION_CLASSES:
        entries["confusion_matrix"] = tally.dense().tolist()
    else:
        entries["confusion_pairs"] = top_confusions(tally, labels, CONFUSION_PAIRS)
    return entries


def top_confusions(tally: Tally, labels: Sequence[str],
                   count: int = TOP_CONFUSIONS) -> list[dict]:
    """The most frequent (true → predicted) mistakes, most frequent first (ties: by true class,
    then predicted class)."""
    true, predicted, counts = tally.triples()
    wrong = true != predicted
    true, predicted, counts = true[wrong], predicted[wrong], counts[wrong]
    order = np.argsort(-counts, kind="stable")[:count]
    return [{"true": labels[true[k]], "predicted": labels[predicted[k]],
             "count": int(counts[k])} for k in order]


def usefulness_warnings(section: dict) -> list[str]:
    """What makes the model useless as it is: not beating the majority class by a point, and
    classes present in the data that it never gets right."""
    warnings = []
    gain = section["accuracy"] - section["baseline_accuracy"]
    if section["samples"] and gain < BASELINE_MARGIN:
        warnings.append(not_learned_warning(
            f"{section['split']} accuracy {section['accuracy']:.4f}", "always answering the "
            f"majority class {quoted(section['baseline_class'], LABEL_WIDTH)}",
            section["baseline_accuracy"]))
    dead = [(row["label"], row["support"]) for row in section["per_class"]
            if row["support"] and row["recall"] == 0]
    if dead:
        warnings.append(never_right_warning(
            dead, "recall", "samples", "of them",
            "give those classes more samples (on imbalanced data), or train longer"))
    return warnings


def not_learned_warning(score: str, baseline: str, baseline_value: float) -> str:
    """The warning for a `score` ("test accuracy 0.6123") that does not beat the `baseline`
    ("always answering the majority class 'ham'") by BASELINE_MARGIN."""
    return (f"{score} does not beat {baseline} ({baseline_value:.4f}) by at least "
            f"{BASELINE_MARGIN * 100:g} point: the model has not learned the task; try more "
            "--epochs or another learning rate (--lr_candidates)")


def guessed_label_warning(dataset: dict | None) -> list[str]:
    """The warning that a guessed label column may be the wrong one (none when the label was
    named by --label_column, or the data is no table)."""
    columns = (dataset or {}).get("columns") or {}
    if "label" not in (columns.get("guessed") or []):
        return []
    others = [c for c in columns.get("label_candidates") or [] if c != columns.get("label")]
    also = (f" (other columns that could be it: {', '.join(quoted(c, 40) for c in others)})"
            if others else "")
    return [f"the label column {quoted(columns.get('label'), 40)} was guessed{also}: if it "
            "is not the column to predict, the model cannot learn the task; pass "
            "--label_column to choose it"]


DEAD_SHOWN = 5  # classes named in the warning about classes never predicted right


def never_right_warning(dead: Sequence[tuple[str, int]], measure: str, unit: str, whole: str,
                        remedy: str) -> str:
    """The warning about the classes present in the data (label, count of `unit`) whose
    `measure` is 0: the model answers other classes for all `whole`."""
    shown = ", ".join(f"{quoted(label, LABEL_WIDTH)} ({count} {unit})"
                      for label, count in dead[:DEAD_SHOWN])
    more = f" and {len(dead) - DEAD_SHOWN} more" if len(dead) > DEAD_SHOWN else ""
    return (f"{measure} 0 for {len(dead)} class{'es' if len(dead) > 1 else ''}: {shown}{more} "
            f"never predicted right: the model answers other classes for all {whole}; {remedy}")


def baseline_verdict(measure: str, value: float, baseline: float, baseline_class: str,
                     warnings: Sequence[str], recognised: str) -> str:
    """"useful" or "NOT USEFUL as it is", `measure` against always answering the majority
    class; `recognised` closes a useful verdict (e.g. the macro-F1)."""
    gain = value - baseline
    against = (f"{measure} {value:.4f} against {baseline:.4f} "
               f"for always {quoted(baseline_class, LABEL_WIDTH)} ({gain:+.4f})")
    if warnings:
        return f"NOT USEFUL as it is: {against}; " + (
            "a class is never recognised" if gain >= BASELINE_MARGIN else
            "it does not beat the majority class")
    return f"useful: {against}; every class recognised ({recognised})"


def verdict(section: dict) -> str:
    return baseline_verdict("accuracy", section["accuracy"], section["baseline_accuracy"],
                            section["baseline_class"], section["warnings"],
                            f"macro-F1 {section['macro_f1']:.4f}")
