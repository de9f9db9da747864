"""Temperature scaling (Guo et al. 2017): one temperature T, fitted on the validation split by
minimising the negative log-likelihood, divides a model's scores before the softmax. T changes
confidence, never the predicted class. numpy only.

A single network's scores are its logits; an average of several passes or members (MC-dropout,
an ensemble) is rescaled through the log of its mean probabilities: softmax(log(mean p) / T),
with its own T fitted on that averaged output.

NLL(β = 1/T) = mean(logsumexp(β·z) − β·z_y) is convex in β, and its derivative
mean(E_p[z] − z_y) is monotone, so bisection on the derivative finds the one minimum within
[T_MIN, T_MAX]. A validation split with no errors has no minimum: NLL keeps falling as T → 0,
since every answer is right. Such a fit falls back to the temperature whose mean validation
confidence equals Laplace's estimate of the accuracy, (n + 1) / (n + 2): a split of n right
answers says the error rate is small, not zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ttc.reporting.metrics import ece_change_interval, expected_calibration_error, nll, nll_change_interval

T_MIN, T_MAX = 0.05, 20.0
BISECTIONS = 60  # β's bracket shrinks 2**60-fold: far below float precision
RESAMPLES = 100  # bootstrap refits for the temperature's interval
MAX_RESAMPLED_SCORES = 2_000_000  # samples x classes beyond which the interval is skipped
LOG_FLOOR = 1e-12  # log of an averaged probability: the floor metrics.nll clips at


def softmax(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(scores, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def log_scores(probabilities: np.ndarray) -> np.ndarray:
    """Scores whose softmax is `probabilities` (an average of passes or members)."""
    return np.log(np.clip(np.asarray(probabilities, np.float64), LOG_FLOOR, 1.0))


def rescale(probabilities: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(log p / T): what a graph that bakes T after an average computes."""
    return softmax(log_scores(probabilities), temperature)


@dataclass
class TemperatureFit:
    """One fitted temperature and how it was found, on the split it was fitted on."""

    temperature: float
    method: str  # "nll", "laplace" (no validation errors: no NLL minimum) or "none"
    samples: int
    errors: int
    nll_before: float | None
    nll_after: float | None
    note: str | None = None
    interval: list[float] | None = None  # 90% bootstrap interval (temperature_interval)

    def manifest_entry(self) -> dict:
        return {"temperature": self.temperature, "method": self.method,
                "fitted_on": "validation", "samples": self.samples, "errors": self.errors,
                "nll_before": self.nll_before, "nll_after": self.nll_after,
                "temperature_interval_90": self.interval, "note": self.note}


def no_fit(reason: str, samples: int = 0) -> TemperatureFit:
    return TemperatureFit(1.0, "none", samples, 0, None, None, reason)


def _nll_slope(scores: np.ndarray, y: np.ndarray, beta: float) -> float:
    """d NLL / d β at β: mean over samples of E_softmax(β z)[z] − z_y."""
    return _nll_derivatives(scores, y, beta)[0]


def _nll_derivatives(scores: np.ndarray, y: np.ndarray, beta: float) -> tuple[float, float]:
    """d NLL / d β and d² NLL / d β² (the mean variance of z under softmax(β z): ≥ 0)."""
    p = softmax(scores * beta)
    mean = (p * scores).sum(1)
    variance = (p * scores ** 2).sum(1) - mean ** 2
    return float((mean - scores[np.arange(len(y)), y]).mean()), float(variance.mean())


def _minimum_beta(scores: np.ndarray, y: np.ndarray, low: float, high: float) -> float:
    """The β where the NLL's slope crosses 0 in [low, high]: Newton steps, a bisection step
    whenever Newton would leave the bracket (the slope is increasing, so its sign keeps the
    bracket)."""
    beta = 1.0 if low < 1.0 < high else (low + high) / 2
    for _ in range(BISECTIONS):
        slope, curvature = _nll_derivatives(scores, y, beta)
        if slope > 0:
            high = beta
        else:
            low = beta
        step = beta - slope / curvature if curvature > 0 else None
        following = step if step is not None and low < step < high else (low + high) / 2
        if abs(following - beta) <= 1e-12 * beta:
            return following
        beta = following
    return beta


def _bisect(increasing: Callable[[float], float], low: float, high: float) -> float:
    """The root of a function increasing on [low, high] (an end when it has none there)."""
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        if increasing(middle) > 0:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def fit_temperature(scores: np.ndarray, y: np.ndarray) -> TemperatureFit:
    """T in [T_MIN, T_MAX] minimising NLL of softmax(scores / T) on (scores, y); the Laplace
    fallback when every answer is right (module docstring)."""
    scores, y = np.asarray(scores, np.float64), np.asarray(y, np.int64)
    if len(y) == 0:
        return no_fit("no validation samples to fit a temperature on")
    errors = int((scores.argmax(1) != y).sum())
    before = nll(softmax(scores), y)
    low_beta, high_beta = 1 / T_MAX, 1 / T_MIN
    if errors == 0:  # NLL falls without end as T → 0: no minimum to find
        target = (len(y) + 1) / (len(y) + 2)
        beta = _bisect(lambda b: softmax(scores * b).max(1).mean() - target, low_beta, high_beta)
        temperature, method = 1 / beta, "laplace"
        note = (f"the validation split has no errors in {len(y)}, so NLL keeps falling as T → 0; "
                f"T set so that the mean validation confidence is {target:.4f}, Laplace's "
                f"estimate of the accuracy ({len(y)} + 1) / ({len(y)} + 2)")
    else:
        temperature, method, note = 1 / _minimum_beta(scores, y, low_beta, high_beta), "nll", None
        for bound, slope_sign, why in ((T_MIN, -1, "the network is far too unsure"),
                                       (T_MAX, 1, "the scores barely tell the classes apart")):
            beta = 1 / bound
            if np.sign(_nll_slope(scores, y, beta)) == slope_sign and \
                    abs(temperature - bound) < 1e-9 * bound:
                note = f"NLL is lowest at the bound T = {bound:g}: {why}"
    return TemperatureFit(float(temperature), method, len(y), errors, before,
                          nll(softmax(scores, temperature), y), note)


def fit_with_interval(scores: np.ndarray, y: np.ndarray, seed: int = 0) -> TemperatureFit:
    """fit_temperature, with the 90% bootstrap interval of T: the fit repeated on RESAMPLES
    resamples of the split. A split with a handful of errors gives a wide one, and then a T
    that helps on one test split may hurt on another (docs/calibration.md)."""
    fit = fit_temperature(scores, y)
    scores, y = np.asarray(scores, np.float64), np.asarray(y, np.int64)
    if fit.method == "none" or scores.size > MAX_RESAMPLED_SCORES:
        return fit
    rng = np.random.default_rng(seed)
    refits = [fit_temperature(scores[pick], y[pick]).temperature
              for pick in (rng.integers(0, len(y), len(y)) for _ in range(RESAMPLES))]
    fit.interval = [float(t) for t in np.percentile(refits, [5, 95])]
    return fit


# ----------------------------------------------------------------------------- judging


def before_after(before: np.ndarray, after: np.ndarray, y: np.ndarray, seed: int) -> dict:
    """Accuracy, mean confidence, ECE and NLL without and with the temperature on one split,
    with the 90% paired bootstrap interval of each change."""
    row = {"samples": int(len(y))}
    for name, probabilities in (("before", before), ("after", after)):
        row[f"accuracy_{name}"] = float((probabilities.argmax(1) == y).mean())
        row[f"mean_confidence_{name}"] = float(probabilities.max(1).mean())
        row[f"ece_{name}"] = expected_calibration_error(probabilities, y)
        row[f"nll_{name}"] = nll(probabilities, y)
    row["ece_change_interval_90"] = list(ece_change_interval(before, after, y, seed=seed))
    row["nll_change_interval_90"] = list(nll_change_interval(before, after, y, seed=seed))
    return row


def verdict(fit: dict, row: dict) -> str:
    """One line: what the temperature did to ECE and NLL on the test split, judged by the
    bootstrap intervals."""
    low, high = row["ece_change_interval_90"]
    nll_low, nll_high = row["nll_change_interval_90"]
    ece = (f"ECE {row['ece_before']:.4f} → {row['ece_after']:.4f} (90% interval of the change "
           f"[{low:+.4f}, {high:+.4f}])")
    loss = (f"NLL {row['nll_before']:.4f} → {row['nll_after']:.4f} "
            f"([{nll_low:+.4f}, {nll_high:+.4f}])")
    where = f"on {row['samples']} test samples"
    t = f"T = {fit['temperature']:.3f}"
    if fit["method"] == "none":
        return f"not calibrated ({fit.get('note') or '--calibrate none'})"
    if high < 0:
        return f"temperature scaling ({t}) lowers {ece} and {loss} {where}"
    if low > 0:
        return (f"temperature scaling ({t}) raises {ece} {where}: the model was better "
                f"calibrated without it ({loss})")
    return f"temperature scaling ({t}): no ECE change this test split can detect, {ece}; {loss}"


def calibration_section(fit: dict, raw: np.ndarray, calibrated: np.ndarray, y: np.ndarray,
                        seed: int) -> dict:
    """The report's `calibration`: the bundle's fit (manifest) and what it does on the test
    split: `raw` is softmax(logits), `calibrated` the graph's probabilities."""
    from ttc.reporting.evaluation import reliability

    row = before_after(raw, calibrated, y, seed)
    return {"temperature": fit["temperature"], "method": fit["method"],
            "fitted_on": fit.get("fitted_on", "validation"), "fit_samples": fit.get("samples"),
            "fit_errors": fit.get("errors"), "fit_note": fit.get("note"),
            "temperature_interval_90": fit.get("temperature_interval_90"), "split": "test",
            **row, "verdict": verdict(fit, row),
            "reliability_before": reliability(raw, y),
            "reliability_after": reliability(calibrated, y), "shifts": None}


def shift_rows(variants: dict[str, np.ndarray], y: np.ndarray) -> list[dict]:
    """Accuracy, ECE and NLL of each variant's probabilities on one (shifted) split."""
    return [{"variant": name, "accuracy": float((p.argmax(1) == y).mean()),
             "ece": expected_calibration_error(p, y), "nll": nll(p, y)}
            for name, p in variants.items()]


def best_calibrated(shifts: list[dict]) -> dict:
    """Per variant, the mean ECE over the corruptions, and which variant is lowest."""
    names = [row["variant"] for row in shifts[0]["rows"]] if shifts else []
    means = {name: float(np.mean([r["ece"] for s in shifts for r in s["rows"]
                                  if r["variant"] == name])) for name in names}
    best = min(means, key=means.get) if means else None
    return {"mean_ece": means, "best": best}
