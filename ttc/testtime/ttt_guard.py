"""The guard of test-time training: a label-free test that tells a batch adaptation would hurt on
(a correlated batch, one that holds a few classes only, as a label-sorted stream or one customer's
or one camera's rows give) from one it helps on (a batch of the shifted test distribution), and
the counts of what it did.

BatchNorm adaptation normalises each batch with its own statistics, so it assumes a batch is a
sample of the test distribution. In a correlated batch the statistics carry the class itself and
normalising removes it: on digits sorted by label, bn falls from 0.978 to 0.755 (shuffled: 0.981).
The signal is the class histogram of the source model's predictions, which is stable from batch
to batch of an exchangeable stream, shifted or not (on contrast-shifted digits the source model
calls every image one class, batch after batch), and moves in a correlated one. Two tests, each a
Monte Carlo p-value of the total-variation distance between two histograms, so that they hold for
any class count and batch size (a chi-square approximation fails on sparse cells):

- within the batch: its first half against its second half (in stream order), under random
  splits of the same predictions;
- across the stream: the batch against the histogram of the last WINDOW batches, under random
  re-splits of their pooled predictions.

A batch either test rejects at ALPHA is correlated. The test sees predictions only, never labels.
Its blind spot: a stream that holds one class from its first batch on looks stable (docs/
test-time-compute.md).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

GUARDS = ("none", "reset", "filter")
ALPHA = 1e-3  # a shuffled stream's batch is called correlated once in a thousand
WINDOW = 8  # batches of history: a lasting change of the class mix is the new normal after it
DRAWS = 2000  # Monte Carlo draws per test: p-values down to 1/2000 resolve ALPHA
SCREEN_P = 0.05  # a chi-square p-value above this clears a batch without the Monte Carlo test
FIRST_DRAWS = 200  # ... of which these first: enough to accept a batch far from ALPHA
MIN_SAMPLES = 8  # a batch smaller than this is not tested


def total_variation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Half the L1 distance between count vectors (last axis) as distributions."""
    return 0.5 * np.abs(a / a.sum(-1, keepdims=True) - b / b.sum(-1, keepdims=True)).sum(-1)


def class_counts(rows: np.ndarray, classes_count: int) -> np.ndarray:
    """Per row of class indices (shape (draws, samples)), the count of each class."""
    offsets = rows + classes_count * np.arange(len(rows))[:, None]
    return np.bincount(offsets.ravel(), minlength=len(rows) * classes_count).reshape(
        len(rows), classes_count)


def clearly_alike(first: np.ndarray, second: np.ndarray) -> bool:
    """A cheap screen before the Monte Carlo test: the chi-square test of homogeneity of two
    count vectors gives p > SCREEN_P (Wilson-Hilferty's normal approximation of the chi-square
    tail). With sparse cells the approximation errs towards small p-values, so a batch it
    clears would be cleared by the exact test too; the rest go to the exact test."""
    table = np.vstack([first, second]).astype(float)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return True
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2)) > SCREEN_P


def monte_carlo_p_value(observed: float, simulated: Callable[[int], np.ndarray]) -> float:
    """P-value of `observed` against distances `simulated(n)` draws under the null: FIRST_DRAWS
    first, all DRAWS only when those leave it small (a shuffled stream's batch costs little)."""
    exceed = int((simulated(FIRST_DRAWS) >= observed - 1e-12).sum())
    if exceed >= 5:
        return (1 + exceed) / (FIRST_DRAWS + 1)
    exceed += int((simulated(DRAWS - FIRST_DRAWS) >= observed - 1e-12).sum())
    return (1 + exceed) / (DRAWS + 1)


def halves_p_value(classes: np.ndarray, classes_count: int, rng: np.random.Generator) -> float:
    """P-value of 'the batch's two halves hold the same class mix', by random re-splits."""
    half = len(classes) // 2

    def distances(splits: np.ndarray) -> np.ndarray:
        return total_variation(class_counts(splits[:, :half], classes_count).astype(float),
                               class_counts(splits[:, half:], classes_count).astype(float))

    if clearly_alike(np.bincount(classes[:half], minlength=classes_count),
                     np.bincount(classes[half:], minlength=classes_count)):
        return 1.0
    observed = float(distances(classes[None])[0])
    return monte_carlo_p_value(observed, lambda n: distances(
        rng.permuted(np.tile(classes, (n, 1)), axis=1)))


def window_p_value(counts: np.ndarray, history: np.ndarray, rng: np.random.Generator) -> float:
    """P-value of 'the batch holds the class mix of the recent stream': a two-sample test of
    the batch against the history, by random re-splits of their pooled predictions (the
    history is a sample too, so it is not taken as the truth)."""
    if clearly_alike(counts, history):
        return 1.0
    pooled = (counts + history).astype(np.int64)
    size = int(counts.sum())

    def distance(batch: np.ndarray) -> np.ndarray:
        return total_variation(batch.astype(float), (pooled - batch).astype(float))

    observed = float(distance(counts.astype(np.int64)))
    return monte_carlo_p_value(observed, lambda n: distance(
        rng.multivariate_hypergeometric(pooled, size, size=n)))


@dataclass
class StreamGuard:
    """What the guard remembers of a stream (the source model's class counts of its last WINDOW
    batches) and what it did. `mode`: none (never tests), reset (a correlated batch is
    predicted by the source model and online adaptation restarts from the bundle's
    parameters, as RDumb resets) or filter (a correlated batch is not adapted to, and online
    adaptation keeps what it had; tent also leaves out of its loss the samples whose entropy is
    above 0.4 ln C, as EATA does)."""

    mode: str = "filter"
    seed: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    resets: int = 0
    skipped: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def correlated(self, source: np.ndarray) -> str | None:
        """Why the batch whose source-model probabilities are `source` looks correlated, or
        None; the batch joins the history either way."""
        classes = source.argmax(1)
        counts = np.bincount(classes, minlength=source.shape[1]).astype(float)
        reason = None
        if len(classes) >= MIN_SAMPLES:
            if self.history:
                p = window_p_value(counts, np.sum(self.history, axis=0), self.rng)
                if p < ALPHA:
                    reason = (f"its class mix differs from the last {len(self.history)} "
                              f"batches' (p = {p:.1e})")
            if reason is None:
                p = halves_p_value(classes, source.shape[1], self.rng)
                if p < ALPHA:
                    reason = f"its two halves hold different classes (p = {p:.1e})"
        self.history.append(counts)
        return reason

    def counted(self) -> dict:
        return {"resets": self.resets, "skipped": self.skipped}
