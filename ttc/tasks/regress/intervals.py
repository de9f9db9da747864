"""Prediction intervals of a regressor and how well they hold (numpy only): split conformal
intervals from the absolute residuals of a slice the model was neither trained nor selected on
(Vovk et al. 2005; Lei et al. 2018), Gaussian intervals from a predictive spread (MC-dropout,
an ensemble), and their coverage and width on test targets."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from ttc.tasks.regress import PREDICTION


def check_level(level: float) -> float:
    """`level` as a float strictly between 0 and 1 (ValueError otherwise)."""
    if not isinstance(level, (int, float)) or not 0.0 < float(level) < 1.0:
        raise ValueError(f"an interval's level must lie strictly between 0 and 1, got {level!r}")
    return float(level)


def conformal_rank(n: int, level: float) -> int:
    """The rank k = ceil((n + 1) * level) of the order statistic of n calibration scores that
    split conformal takes; k > n means no finite radius holds the level."""
    # the epsilon keeps a product that is an integer in exact arithmetic but lands just above it
    # in floats (25 * 0.56 = 14.000000000000002) from rounding up to the next rank
    return math.ceil((n + 1) * check_level(level) - 1e-9)


def conformal_radius(residuals: np.ndarray, level: float) -> float:
    """Split conformal radius: the k-th smallest |residual| of n calibration rows, k =
    ceil((n + 1) * level), i.e. the ceil((n + 1) level) / n empirical quantile. Where the
    calibration rows and a test row are exchangeable, prediction ± radius covers the test
    target with probability at least `level` and below level + 1 / (n + 1) (ties aside).

    +inf when n is too small for the level (k > n, i.e. n < level / (1 - level): 9 rows for
    90%, 19 for 95%): no finite radius holds the promise there. ValueError for a level outside
    (0, 1) or a residual that is not finite."""
    scores = np.abs(np.asarray(residuals, dtype=np.float64).ravel())
    rank = conformal_rank(len(scores), level)
    if not np.all(np.isfinite(scores)):
        raise ValueError("conformal residuals must be finite numbers (a NaN or inf prediction "
                         "or target in the calibration slice)")
    if rank > len(scores):
        return math.inf
    return float(np.partition(scores, rank - 1)[rank - 1])


def conformal_interval(prediction: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) = prediction ∓ radius."""
    prediction = np.asarray(prediction, dtype=np.float64)
    return prediction - radius, prediction + radius


def gaussian_interval(mean: np.ndarray, std: np.ndarray, level: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The central `level` interval of N(mean, std²) per row, for a predictive spread (the
    standard deviation over MC-dropout passes or ensemble members): mean ∓ z std with z the
    normal quantile of (1 + level) / 2 (1.645 at 90%). Nominal only: its coverage is whatever
    the spread earns, which coverage() measures. ValueError for a negative or NaN std."""
    z = NormalDist().inv_cdf(0.5 + check_level(level) / 2)
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    if np.any(~(std >= 0)):
        raise ValueError("a predictive standard deviation must be >= 0 (got a negative or NaN)")
    return mean - z * std, mean + z * std


def _same_shape(*arrays: np.ndarray) -> list[np.ndarray]:
    out = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    if len({a.size for a in out}) != 1 or out[0].size == 0:
        raise ValueError(f"interval arrays must be non-empty and of one length, got "
                         f"{[a.size for a in out]}")
    return out


def coverage(y: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> float:
    """The share of targets y with lower <= y <= upper."""
    y, lower, upper = _same_shape(y, lower, upper)
    return float(np.mean((lower <= y) & (y <= upper)))


def mean_width(lower: np.ndarray, upper: np.ndarray) -> float:
    """The mean of upper - lower, in the target's units (+inf for an infinite interval)."""
    lower, upper = _same_shape(lower, upper)
    return float(np.mean(upper - lower))


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@dataclass(frozen=True)
class IntervalReport:
    """One interval method's figures on the test split, as the report's evaluation shows them."""

    method: str  # "conformal", "mc_dropout", "ensemble"
    level: float  # nominal coverage asked for (--interval)
    coverage: float  # share of test targets inside their interval
    mean_width: float  # mean upper - lower, target units (+inf: too few calibration rows)
    calibrated_on: str  # what the radius or spread came from ("calibration slice", ...)
    n_calibration: int  # rows it was calibrated on (0 where nothing is calibrated)

    def to_json(self) -> dict:
        """A JSON-ready dict: the fields, with a non-finite width as None (JSON has no inf)."""
        record = asdict(self)
        record["mean_width"] = _finite_or_none(self.mean_width)
        return record


def prediction_answer(value: float, interval: dict | None) -> dict:
    """One row's answer as serve.py and a prediction file give it: `prediction`, and with a
    conformal interval (the manifest's record) `lower` and `upper`, rounded to 6 places."""
    answer = {PREDICTION: round(value, 6)}
    if interval is not None:
        answer["lower"] = round(value - interval["radius"], 6)
        answer["upper"] = round(value + interval["radius"], 6)
    return answer
