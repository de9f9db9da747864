"""A detector's plots (its report part's `plots`, drawn by ttc/reporting/plots.py's
write_plots when the report is a detector's): AP per class, and precision against recall at IoU
0.5. matplotlib, imported only to draw them."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from matplotlib.figure import Figure

from ttc.reporting.classifier_report import Plot
from ttc.reporting.plots import (COLORS, PALETTE, new_figure, number, place, plain, section,
                                 text_width)



MAX_AP_CLASSES = 40  # bars on the per-class AP chart; more classes: the lowest AP
MAX_PR_CLASSES = 10  # per-class curves on the PR plot; more classes: the lowest AP@.5


def detection_rows(evaluation: dict) -> list[tuple[str, float | None, float | None]]:
    """(label, AP@[.5:.95], AP@.5) per class of a detector's evaluation, in its order; at
    most MAX_AP_CLASSES, the lowest AP first among more (a class without a true box last)."""
    per_class = evaluation.get("per_class")
    rows = [(str(row.get("label")), number(row.get("ap")), number(row.get("ap50")))
            for row in per_class if isinstance(row, dict)] if isinstance(per_class, list) else []
    if len(rows) > MAX_AP_CLASSES:
        rows = sorted(rows, key=lambda r: 2.0 if r[1] is None else r[1])[:MAX_AP_CLASSES]
    return rows


def class_ap(report: dict) -> Figure | None:
    """A detector's AP@[.5:.95] (bar, value written beside it) and AP@.5 (thinner, lighter
    bar) per class, with its mAP and the empty detector's (0) as vertical lines."""
    evaluation = section(report, "evaluation")
    if not evaluation:
        return None
    rows = detection_rows(evaluation)
    if not any(ap is not None or ap50 is not None for _, ap, ap50 in rows):
        return None
    names = [plain(label) for label, _, _ in rows]
    left = 0.35 + max(text_width(name.replace("\\", ""), 8) for name in names)
    height = 1.3 + 0.26 * len(rows)
    fig = new_figure(left + 5.2, height)
    place(fig, left=left, right=0.25, bottom=0.85, top=0.35)
    ax = fig.subplots()
    y = np.arange(len(rows))
    ax.barh(y - 0.17, [np.nan if ap is None else ap for _, ap, _ in rows], height=0.36,
            color=PALETTE[0], label="AP@[.5:.95]")
    ax.barh(y + 0.19, [np.nan if ap50 is None else ap50 for _, _, ap50 in rows], height=0.22,
            color=PALETTE[0], alpha=0.35, label="AP@.5")
    for k, (_, ap, _) in enumerate(rows):
        ax.annotate("no true box" if ap is None else f"{ap:.3f}", (ap or 0.0, k - 0.17),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
                    color="0.45" if ap is None else "black")
    mean, baseline = number(evaluation.get("map")), number(evaluation.get("baseline_map"))
    if mean is not None:
        ax.axvline(mean, color=COLORS["fixed"], linewidth=1.2, label=f"mAP {mean:.3f}")
    if baseline is not None:
        ax.axvline(baseline, color=COLORS["broken"], linestyle="--", linewidth=1.2,
                   label=f"empty detector's mAP {baseline:.3f}")
    ax.set_yticks(y, names)
    ax.set_ylim(len(rows) - 0.5, -0.6)  # the first class on top
    ax.set_xlim(0, 1.08)
    ax.set_xlabel("average precision")
    ax.grid(axis="y", visible=False)
    total = len(evaluation["per_class"])
    shown = "" if len(rows) == total else f", the {len(rows)} lowest of {total}"
    ax.set_title(f"AP per class, {plain(evaluation.get('split') or 'test')} split{shown}")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.45 / (height - 1.2)), ncol=2,
              frameon=False, fontsize=7)
    return fig


def curve(values: Any, length: int) -> list[float] | None:
    """A list of `length` finite numbers (a PR curve's precisions), None for anything else."""
    if not isinstance(values, list) or len(values) != length:
        return None
    numbers = [number(v) for v in values]
    return None if any(v is None for v in numbers) else numbers


class PrCurves(NamedTuple):
    """A detector's PR curves at IoU .5 ready to draw: the recall points, the mean precision
    over the classes (None where missing), (label, precision) of the classes drawn, and how
    many classes have a curve."""
    recall: list[float]
    overall: list[float] | None
    classes: list[tuple[str, list[float]]]
    with_curve: int


def pr_curves(evaluation: dict) -> PrCurves:
    """evaluation.pr_curve as PrCurves: at most MAX_PR_CLASSES classes, the lowest mean
    precision (AP@.5) among more; a class without a true box has no curve."""
    pr = evaluation.get("pr_curve") if isinstance(evaluation.get("pr_curve"), dict) else {}
    recall = pr.get("recall")
    recall = curve(recall, len(recall)) if isinstance(recall, list) and recall else None
    if recall is None:
        return PrCurves([], None, [], 0)
    labels = evaluation.get("labels") if isinstance(evaluation.get("labels"), list) else []
    per_class = pr.get("per_class") if isinstance(pr.get("per_class"), list) else []
    classes = [(str(labels[k]) if k < len(labels) else str(k), values)
               for k, values in enumerate(curve(v, len(recall)) for v in per_class)
               if values is not None]
    drawn = classes if len(classes) <= MAX_PR_CLASSES else \
        sorted(classes, key=lambda c: float(np.mean(c[1])))[:MAX_PR_CLASSES]
    return PrCurves(recall, curve(pr.get("precision"), len(recall)), drawn, len(classes))


def pr_curve(report: dict) -> Figure | None:
    """A detector's precision against recall at IoU 0.5 (COCO's interpolated precision at
    its 101 recall points, 100 detections per image): the mean over the classes, bold, and
    one thin line per class."""
    evaluation = section(report, "evaluation")
    if not evaluation:
        return None
    recall, overall, classes, with_curve = pr_curves(evaluation)
    if overall is None and not classes:
        return None
    fig = new_figure(6.4, 4.2)
    place(fig, left=0.6, right=1.9, bottom=0.5, top=0.35)
    ax = fig.subplots()
    for k, (label, precision) in enumerate(classes):
        ax.plot(recall, precision, color=PALETTE[k % len(PALETTE)], linewidth=0.9, alpha=0.75,
                label=plain(label, 18))
    if overall is not None:
        map50 = number(evaluation.get("map50"))
        ax.plot(recall, overall, color="black", linewidth=2.2,
                label="all classes" + (f" (mAP@.5 {map50:.3f})" if map50 is not None else ""))
    ax.set_xlim(0, 1.0)
    ax.set_ylim(0, 1.03)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    shown = f", the {len(classes)} lowest of {with_curve} classes" \
        if with_curve > len(classes) else ""
    ax.set_title(f"Precision/recall at IoU 0.5, {plain(evaluation.get('split') or 'test')} "
                 f"split{shown}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=7)
    return fig


PLOTS: dict[str, Plot] = {"class_ap": class_ap, "pr_curve": pr_curve}
