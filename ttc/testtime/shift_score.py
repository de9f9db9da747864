"""A label-free shift score: how far a batch's predictions are from what the model gave on data
it was not trained on, for every classifier, from its outputs alone (numpy only).

The statistic is each prediction's entropy scaled by its maximum (ln C), floored at FLOOR: a
confident prediction reads FLOOR whatever its exact confidence, so that a graph that rounds
differently (int8, fp16) or a temperature does not look like a shift, and what moves the score
is the share of uncertain predictions and how uncertain they are. At export the scaled entropies
of the held-out split the exporter gets (the calibration slice, or validation) are recorded in
the manifest (`shift_reference`, at most REFERENCE_SIZE quantiles). A batch's score is the
two-sample Kolmogorov-Smirnov distance between its scaled entropies and that reference, in
[0, 1]; its threshold is calibrated on clean batches resampled from the reference (held-out
predictions), so that a clean batch exchangeable with it is called shifted with probability
ALPHA (1%), ties at the floor counted; measured on long clean streams in bench/shift_score.py.

Why not the BatchNorm statistics: the entropy score separated every --eval_shift corruption of
digits at severity 3 (AUROC 0.997-1.0 per batch of 64, bench/shift_score.py), works for networks
without BatchNorm and for the served graph's outputs, and needs no extra forward pass; the
BatchNorm divergence separated as well but only where BatchNorm exists. The score must be taken
on the unadapted model's outputs: after bn adaptation the same batches separate far worse
(brightness AUROC 0.78), since adaptation is what makes them confident again.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

STATISTIC = "scaled_entropy"
FLOOR = 0.01  # scaled entropies below this are equal: a confident prediction
REFERENCE_SIZE = 256  # quantiles of the held-out entropies kept in the manifest
MIN_REFERENCE = 8  # held-out predictions below which none is recorded (the schema's floor)
ALPHA = 0.01  # the per-batch false alarm rate the threshold is set for
WINDOW = 64  # serve.py: the score is over the last WINDOW rows served
MIN_ROWS = 16  # fewer rows than this: no score (a KS distance of a handful of rows is noise)


def scaled_entropies(probabilities: np.ndarray) -> np.ndarray:
    """Per row, the prediction's entropy over ln C, floored at FLOOR."""
    p = np.clip(np.asarray(probabilities, np.float64), 1e-12, 1.0)
    h = -(p * np.log(p)).sum(1) / math.log(max(p.shape[1], 2))
    return np.maximum(h, FLOOR)


def ks_distance(sample: np.ndarray, reference: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov distance: the largest gap between the two empirical
    distribution functions (ties handled: both are evaluated at every observed value)."""
    a, b = np.sort(sample), np.sort(reference)
    points = np.concatenate([a, b])
    gaps = (np.searchsorted(a, points, side="right") / len(a)
            - np.searchsorted(b, points, side="right") / len(b))
    return float(np.abs(gaps).max())


def critical_distance(m: int, n: int, alpha: float = ALPHA) -> float:
    """The KS distance two samples of sizes m and n from one distribution exceed with
    probability alpha (the asymptotic formula; conservative with ties)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((m + n) / (m * n))


def reference_record(probabilities: np.ndarray) -> dict:
    """The manifest's `shift_reference`: the held-out predictions' scaled entropies (at most
    REFERENCE_SIZE evenly spaced quantiles) and how many predictions they summarise."""
    values = np.sort(scaled_entropies(probabilities))
    if len(values) > REFERENCE_SIZE:
        values = np.quantile(values, (np.arange(REFERENCE_SIZE) + 0.5) / REFERENCE_SIZE)
    return {"statistic": STATISTIC, "floor": FLOOR, "samples": int(len(probabilities)),
            "values": [round(float(v), 6) for v in values]}


@dataclass(frozen=True)
class ShiftReference:
    """What a batch is compared with: the reference entropies and the sample size the
    thresholds assume (the quantiles kept, or the predictions, whichever is fewer)."""

    values: np.ndarray = field(repr=False)
    samples: int

    @classmethod
    def of(cls, record: Mapping | None) -> "ShiftReference | None":
        """The manifest's record read (None: a bundle exported before it, or without held-out
        data)."""
        if not record or record.get("statistic") != STATISTIC:
            return None
        values = np.asarray(record["values"], np.float64)
        return cls(values, int(min(len(values), record.get("samples", len(values)))))

    @classmethod
    def of_manifest(cls, manifest: Any) -> "ShiftReference | None":
        return cls.of(manifest.to_json_dict().get("shift_reference"))

    def score(self, probabilities: np.ndarray) -> float:
        return ks_distance(scaled_entropies(probabilities), self.values)

    def threshold(self, rows: int) -> float:
        """The score a clean batch of `rows` exceeds with probability ALPHA: the 1 - ALPHA
        quantile of the scores of NULL_DRAWS batches resampled from the reference itself
        (which counts its ties: most predictions sit at the floor, where the KS formula,
        made for continuous data, is several times too high), widened by sqrt(1 + rows / n)
        for the reference's own sampling error; never above the formula."""
        key = (rows, self.samples, hash(self.values.tobytes()))
        if key not in _NULL_CACHE:
            rng = np.random.default_rng(rows)
            draws = rng.choice(self.values, (NULL_DRAWS, rows))
            null = np.quantile([ks_distance(d, self.values) for d in draws], 1 - ALPHA)
            _NULL_CACHE[key] = float(min(null * math.sqrt(1 + rows / self.samples),
                                         critical_distance(rows, self.samples)))
        return _NULL_CACHE[key]


_NULL_CACHE: dict[tuple[int, int, int], float] = {}
NULL_DRAWS = 1000  # resampled clean batches per threshold (about 20 ms)


# ----------------------------------------------------------------------------- a report


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(float(v), 4) for v in values]


def case_scores(reference: ShiftReference, batches: Sequence[np.ndarray]) -> dict:
    """One data set's batches (the unadapted model's probabilities, batch by batch): the score
    of each, how many passed their threshold, and the score of them all pooled (`overall`)
    against its own threshold."""
    scores = [reference.score(b) for b in batches]
    flagged = sum(s > reference.threshold(len(b)) for s, b in zip(scores, batches))
    pooled = np.concatenate(batches)
    overall = reference.score(pooled)
    overall_threshold = reference.threshold(len(pooled))
    return {"batches": len(batches), "flagged": int(flagged),
            "score_quantiles": dict(zip(("min", "median", "max"),
                                        _rounded(np.quantile(scores, [0, 0.5, 1])))),
            "overall": round(overall, 4), "overall_threshold": round(overall_threshold, 4),
            "shift_seen": bool(overall > overall_threshold)}


def shift_section(reference: ShiftReference | None, cases: Sequence[tuple[str, int, list]],
                  batch_size: int) -> dict:
    """The report's `ttt.shift`: per case (clean, each corruption: name, severity, the
    unadapted model's probabilities batch by batch) its scores, the per-batch threshold and a
    verdict; without a reference, why there is none."""
    if reference is None:
        return {"available": False, "verdict": "no shift score: this bundle records no "
                "reference predictions (exported before the shift score, or with fewer than "
                f"{MIN_REFERENCE} held-out rows); re-export it with export.py, on more data "
                "(or a larger --calibration_fraction) if the slice was that small"}
    rows = [{"name": name, "severity": severity, **case_scores(reference, batches)}
            for name, severity, batches in cases]
    return {"available": True, "statistic": STATISTIC, "alpha": ALPHA,
            "reference_samples": reference.samples,
            "threshold": round(reference.threshold(batch_size), 4), "batch_size": batch_size,
            "cases": rows, "verdict": shift_verdict(rows)}


def shift_verdict(rows: Sequence[dict]) -> str:
    """One line: whether the unadapted model's predictions on the test split (the first row)
    looked shifted, and how each corruption scored."""
    clean, shifted = rows[0], rows[1:]
    seen = "a shift seen" if clean["shift_seen"] else "no shift seen"
    text = (f"{seen} on the test split (score {clean['overall']:.3f}, threshold "
            f"{clean['overall_threshold']:.3f}; {clean['flagged']} of {clean['batches']} "
            "batches flagged)")
    if shifted:
        text += "; " + ", ".join(f"{r['name']} {r['flagged']}/{r['batches']} batches flagged"
                                 for r in shifted)
    return text


# ----------------------------------------------------------------------------- serving


class ShiftMonitor:
    """serve.py's drift gauge: the score of the last WINDOW rows served (NaN until MIN_ROWS
    have been), updated per batch, and the threshold at that many rows."""

    def __init__(self, reference: ShiftReference, window: int = WINDOW) -> None:
        self.reference = reference
        self.recent: deque = deque(maxlen=window)
        self.score = math.nan

    def observe(self, probabilities: np.ndarray) -> None:
        self.recent.extend(scaled_entropies(probabilities))
        if len(self.recent) >= MIN_ROWS:
            self.score = ks_distance(np.fromiter(self.recent, np.float64), self.reference.values)

    @property
    def threshold(self) -> float:
        return self.reference.threshold(self.recent.maxlen)

    def watching(self, predict_parts: Callable[[Sequence], list]) -> Callable[[Sequence], list]:
        """predict_parts that also feeds every answered part's probabilities to the score."""

        def run(parts: Sequence) -> list:
            outcomes = predict_parts(parts)
            answered = [o[0] for o in outcomes if isinstance(o, tuple)]
            if answered:
                self.observe(np.concatenate(answered))
            return outcomes

        return run


def served_monitor(manifest: Any, test_time: str) -> ShiftMonitor | None:
    """serve.py's monitor of a bundle: where it records a reference and the answers are the
    plain graph's (test_time "none"); a test-time method's outputs are adapted or averaged,
    and their entropies are not what the reference describes (bn-adapted outputs hide a
    shift, TTA's averages look like one)."""
    reference = ShiftReference.of_manifest(manifest)
    return ShiftMonitor(reference) if reference is not None and test_time == "none" else None
