"""A regressor's figures on a split (numpy only): MAE, RMSE and R² against the mean-of-train
baseline (the training target's mean for every row), the verdict, the error by target decile,
the conformal interval's coverage and mean width, and a sample of (true, predicted) points for
the page's plots."""
from __future__ import annotations

from typing import Any

import numpy as np

from ttc.tasks.regress.intervals import IntervalReport, coverage, mean_width

PLOTTED_POINTS = 500  # (true, predicted) pairs kept in the report for the plots
DECILES = 10


def figures(predicted: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """MAE, RMSE and R² (1 - SSE / SST around the split's own mean; 0 for a constant split)."""
    predicted, truth = np.asarray(predicted, np.float64), np.asarray(truth, np.float64)
    errors = predicted - truth
    sst = float(np.sum((truth - truth.mean()) ** 2))
    sse = float(np.sum(errors ** 2))
    return {"mae": float(np.mean(np.abs(errors))), "rmse": float(np.sqrt(np.mean(errors ** 2))),
            "r2": 1.0 - sse / sst if sst > 0 else 0.0}


def verdict(model: dict, baseline: dict) -> str:
    """"useful" when R² > 0 and the RMSE is below the mean-of-train baseline's, else "not
    useful", with the figures that decide."""
    if model["r2"] > 0 and model["rmse"] < baseline["rmse"]:
        return (f"useful: RMSE {model['rmse']:.4g} vs {baseline['rmse']:.4g} for the mean of the "
                f"training targets, R² {model['r2']:.3f}")
    return (f"not useful: RMSE {model['rmse']:.4g} vs {baseline['rmse']:.4g} for the mean of the "
            f"training targets, R² {model['r2']:.3f} (≤ 0 or no better than the baseline)")


def decile_errors(predicted: np.ndarray, truth: np.ndarray) -> list[dict]:
    """MAE and RMSE per decile of the true target (fewer bins for fewer than 10 rows each)."""
    order = np.argsort(truth, kind="stable")
    bins = np.array_split(order, min(DECILES, max(1, len(truth))))
    rows = []
    for k, rows_of in enumerate(bins):
        if not len(rows_of):
            continue
        part = figures(predicted[rows_of], truth[rows_of])
        rows.append({"decile": k + 1, "rows": int(len(rows_of)),
                     "target_low": float(truth[rows_of].min()),
                     "target_high": float(truth[rows_of].max()),
                     "mae": part["mae"], "rmse": part["rmse"]})
    return rows


def interval_figures(predicted: np.ndarray, truth: np.ndarray, record: dict) -> dict:
    """The conformal interval's coverage and mean width on the split."""
    radius = float(record["radius"])
    lower, upper = predicted - radius, predicted + radius
    report = IntervalReport("conformal", float(record["level"]), coverage(truth, lower, upper),
                            mean_width(lower, upper), "calibration slice",
                            int(record.get("calibration_rows", 0)))
    return {**report.to_json(), "radius": radius}


def regression_section(predicted: np.ndarray, truth: np.ndarray, target: dict,
                       interval: dict | None = None, split: str = "test",
                       seed: int = 0) -> dict:
    """The report's `evaluation` of a regressor: figures, the baseline's, the verdict, errors
    by decile, the interval's coverage and width, and plotted points."""
    predicted, truth = np.asarray(predicted, np.float64), np.asarray(truth, np.float64)
    model = figures(predicted, truth)
    baseline = figures(np.full(len(truth), float(target["mean"])), truth)
    sample = np.random.default_rng(seed).permutation(len(truth))[:PLOTTED_POINTS]
    section: dict[str, Any] = {
        "split": split, "metric": "rmse", "samples": int(len(truth)), "target": target["name"],
        **model, "baseline": {**baseline, "prediction": float(target["mean"])},
        "verdict": verdict(model, baseline), "deciles": decile_errors(predicted, truth),
        "interval": interval_figures(predicted, truth, interval) if interval else None,
        "points": {"true": truth[sample].tolist(), "predicted": predicted[sample].tolist()}}
    return section


def evaluation_section(predicted: Any, truth: Any, target: dict, interval: dict | None = None,
                       split: str = "test") -> dict:
    """Parts.evaluation of a regressor (its own stages call it: no confusion tally)."""
    return regression_section(np.asarray(predicted), np.asarray(truth), target, interval, split)
