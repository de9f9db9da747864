"""The figures every stage reports, computed one way: accuracy, agreement, entropy, negative
log-likelihood, expected calibration error, accuracy when abstaining, and paired bootstrap
intervals. numpy only.
"""
from __future__ import annotations

import numpy as np

ECE_BINS = 15
COVERAGE = 0.9


def accuracy(probabilities: np.ndarray, y: np.ndarray) -> float:
    """Share of rows whose most probable class is the label."""
    return float((np.asarray(probabilities).argmax(1) == y).mean())


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows on which two models' most probable classes agree."""
    return float((a.argmax(1) == b.argmax(1)).mean())


def nll(probabilities: np.ndarray, y: np.ndarray) -> float:
    return float(-np.log(np.clip(probabilities[np.arange(len(y)), y], 1e-12, 1)).mean())


def expected_calibration_error(probabilities: np.ndarray, y: np.ndarray,
                               bins: int = ECE_BINS) -> float:
    """Σ over equal-width confidence bins of |accuracy − mean confidence| × share of samples
    (Guo et al. 2017); a bin holds confidences in (lower, upper]."""
    confidence = probabilities.max(1)
    return _binned_ece(_ece_bin(confidence, bins), confidence,
                       probabilities.argmax(1) == y, bins)


def _ece_bin(confidence: np.ndarray, bins: int) -> np.ndarray:
    """Each confidence's bin: k for (k/bins, (k+1)/bins]; −1 for a confidence of 0."""
    return np.searchsorted(np.linspace(0, 1, bins + 1), confidence, side="left") - 1


def _binned_ece(bin_of: np.ndarray, confidence: np.ndarray, correct: np.ndarray,
                bins: int) -> float:
    """ECE from each sample's bin: Σ over bins of |Σ correct − Σ confidence| / all samples."""
    inside = bin_of >= 0
    if not inside.any():
        return 0.0
    rights = np.bincount(bin_of[inside], correct[inside].astype(np.float64), bins)
    confidences = np.bincount(bin_of[inside], confidence[inside].astype(np.float64), bins)
    return ece_from_bin_sums(rights, confidences, len(bin_of))


def ece_from_bin_sums(correct: np.ndarray, confidence: np.ndarray, samples: int) -> float:
    """ECE from per-bin sums of correct predictions and of confidences over all samples."""
    return float(np.abs(correct - confidence).sum() / max(1, samples))


def ece_change_interval(single: np.ndarray, other: np.ndarray, y: np.ndarray,
                        resamples: int = 500, seed: int = 0, level: float = 0.9
                        ) -> tuple[float, float]:
    """A paired bootstrap interval for ECE(other) − ECE(single): both scored on the same
    resampled test samples. On a few hundred samples with a handful of errors, ECE moves by
    its own size from one resample to the next; an interval that spans 0 says the test split
    cannot tell the two apart."""
    rng = np.random.default_rng(seed)
    scored = []
    for probabilities in (single, other):
        confidence = probabilities.max(1)
        scored.append((_ece_bin(confidence, ECE_BINS), confidence, probabilities.argmax(1) == y))
    changes = np.empty(resamples)
    for r in range(resamples):
        pick = rng.integers(0, len(y), len(y))
        first, second = (_binned_ece(b[pick], c[pick], k[pick], ECE_BINS) for b, c, k in scored)
        changes[r] = second - first
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(changes, [tail, 100 - tail])
    return float(low), float(high)


def nll_change_interval(before: np.ndarray, after: np.ndarray, y: np.ndarray,
                        resamples: int = 500, seed: int = 0, level: float = 0.9
                        ) -> tuple[float, float]:
    """A paired bootstrap interval for NLL(after) − NLL(before) on the same resampled samples
    (the mean of per-sample differences)."""
    rows = np.arange(len(y))
    losses = [-np.log(np.clip(p[rows, y], 1e-12, 1)) for p in (before, after)]
    change = losses[1] - losses[0]
    rng = np.random.default_rng(seed)
    means = np.array([change[rng.integers(0, len(y), len(y))].mean() for _ in range(resamples)])
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def entropy(probabilities: np.ndarray) -> np.ndarray:
    p = np.clip(probabilities, 1e-12, 1)
    return -(p * np.log(p)).sum(-1)


def accuracy_at_coverage(probabilities: np.ndarray, y: np.ndarray, uncertainty: np.ndarray,
                         coverage: float = COVERAGE) -> float:
    """Accuracy on the `coverage` share of samples with the lowest uncertainty (abstaining on
    the rest)."""
    keep = max(1, int(np.ceil(coverage * len(y))))
    chosen = np.argsort(uncertainty, kind="stable")[:keep]
    return accuracy(probabilities[chosen], y[chosen])




def class_scores_from_totals(hits: np.ndarray, predicted: np.ndarray, support: np.ndarray
                             ) -> dict[str, np.ndarray]:
    """Per-class precision, recall, F1 and support from each class's right predictions,
    predictions and samples. A class never predicted has precision 0, a class absent from the
    data recall 0 (scikit-learn's zero_division=0)."""
    hits = np.asarray(hits).astype(np.float64)
    precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
    recall = np.divide(hits, support, out=np.zeros_like(hits), where=support > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(hits), where=both > 0)
    return {"precision": precision, "recall": recall, "f1": f1, "support": support}


def reliability_sums(probabilities: np.ndarray, y: np.ndarray, bins: int = ECE_BINS
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width confidence bin (the ECE's bins): samples, Σ confidence, Σ correct; sums,
    so that chunks of a stream add up."""
    confidence = np.asarray(probabilities).max(1)
    bin_of = np.clip(_ece_bin(confidence, bins), 0, bins - 1)
    correct = (np.asarray(probabilities).argmax(1) == y).astype(np.float64)
    return (np.bincount(bin_of, minlength=bins), np.bincount(bin_of, confidence, bins),
            np.bincount(bin_of, correct, bins))
