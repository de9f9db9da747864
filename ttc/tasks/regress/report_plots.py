"""A regressor's plots (its report part's `plots`, drawn by ttc/reporting/plots.py's write_plots
when the report is a regressor's): predicted against true, the residuals against the
prediction, and the error by decile of the true target, from the evaluation's sampled `points`
and `deciles`. matplotlib, imported only to draw them."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ttc.reporting.classifier_report import Plot
from ttc.reporting.plots import COLORS, PALETTE, new_figure, number, place, plain, section

def _points(report: dict) -> tuple[dict, np.ndarray, np.ndarray] | None:
    evaluation = section(report, "evaluation")
    drawn = (evaluation or {}).get("points")
    if not evaluation or evaluation.get("metric") != "rmse" or not isinstance(drawn, dict):
        return None
    truth = np.asarray(drawn.get("true") or [], dtype=np.float64)
    predicted = np.asarray(drawn.get("predicted") or [], dtype=np.float64)
    if not len(truth) or truth.shape != predicted.shape:
        return None
    return evaluation, truth, predicted


def predicted_vs_true(report: dict) -> Figure | None:
    found = _points(report)
    if found is None:
        return None
    evaluation, truth, predicted = found
    fig = new_figure(5.2, 4.6)
    place(fig, left=0.8, right=0.2, bottom=0.6, top=0.4)
    ax = fig.subplots()
    low, high = float(min(truth.min(), predicted.min())), float(max(truth.max(), predicted.max()))
    radius = number((evaluation.get("interval") or {}).get("radius"))
    if radius is not None:
        ax.fill_between([low, high], [low - radius, high - radius], [low + radius, high + radius],
                        color=PALETTE[0], alpha=0.12, label=f"± {radius:.3g} (conformal)")
    ax.plot([low, high], [low, high], color=COLORS["source"], linewidth=1, label="predicted = true")
    ax.scatter(truth, predicted, s=9, color=PALETTE[0], alpha=0.7)
    ax.set_xlabel(f"true {plain(str(evaluation.get('target') or 'target'))}")
    ax.set_ylabel("predicted")
    ax.set_title(f"{plain(evaluation.get('split') or 'test')} split: R² "
                 f"{number(evaluation.get('r2')) or 0:.3f}, RMSE {number(evaluation.get('rmse')) or 0:.4g}")
    ax.legend(loc="upper left", frameon=False, fontsize=7)
    return fig


def residuals(report: dict) -> Figure | None:
    found = _points(report)
    if found is None:
        return None
    evaluation, truth, predicted = found
    fig = new_figure(5.2, 3.6)
    place(fig, left=0.8, right=0.2, bottom=0.6, top=0.4)
    ax = fig.subplots()
    ax.axhline(0, color=COLORS["source"], linewidth=1)
    ax.scatter(predicted, truth - predicted, s=9, color=PALETTE[1], alpha=0.7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("residual (true − predicted)")
    ax.set_title("residuals against the prediction")
    return fig


def decile_errors(report: dict) -> Figure | None:
    evaluation = section(report, "evaluation")
    rows = (evaluation or {}).get("deciles")
    if not evaluation or evaluation.get("metric") != "rmse" or not isinstance(rows, list) \
            or not rows:
        return None
    mae = [number(r.get("mae")) or 0.0 for r in rows]
    rmse = [number(r.get("rmse")) or 0.0 for r in rows]
    x = np.arange(1, len(rows) + 1)
    fig = new_figure(5.6, 3.6)
    place(fig, left=0.8, right=0.2, bottom=0.6, top=0.4)
    ax = fig.subplots()
    ax.bar(x - 0.2, mae, width=0.4, color=PALETTE[0], label="MAE")
    ax.bar(x + 0.2, rmse, width=0.4, color=PALETTE[1], label="RMSE")
    baseline = number((evaluation.get("baseline") or {}).get("rmse"))
    if baseline is not None:
        ax.axhline(baseline, color=COLORS["broken"], linestyle="--", linewidth=1.2,
                   label=f"baseline RMSE {baseline:.3g}")
    ax.set_ylim(0, 1.3 * max(*rmse, *mae, baseline or 0.0, 1e-12))  # room for the legend
    ax.set_xticks(x)
    ax.set_xlabel("decile of the true target (1: lowest)")
    ax.set_ylabel("error")
    ax.set_title("error by target decile")
    ax.legend(loc="upper center", frameon=False, fontsize=7, ncol=3)
    return fig


PLOTS: dict[str, Plot] = {"predicted_vs_true": predicted_vs_true, "residuals": residuals,
                          "decile_errors": decile_errors}
