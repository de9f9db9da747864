"""Charts of a run's report as PNG files: training curves, confusion matrix, reliability diagram
(without and with the temperature), test-time training and calibration under shift, benchmark,
and what TTA fixed and broke.

`write_plots(report, folder)` draws each chart whose data the report holds (a section that did not
run, or a report from an older run, simply has fewer charts) and writes it atomically as
`<name>.png`. Each chart is one function `name(report) -> Figure | None`, None when its data is
missing. Figures are built with matplotlib's object API on the Agg canvas, never through pyplot,
so nothing is registered globally and each figure is freed once written.

Every string that comes from the user (class names, variant and corruption names) is shown as
plain text: a `$` never starts mathtext, and long names are shortened.

The model type that made the report (its report part, ttc/reporting/kinds.py) names its scores
and draws its own plots (`PLOTS` asks it for those); the helpers here are what its plots build on.
"""
from __future__ import annotations

import contextlib
import gc
import math
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ttc.reporting.classifier_report import Plot
from ttc.reporting.kinds import report_part
from ttc.reporting.sections import PLOT_NAMES
from utils import LOG, atomic_write

matplotlib.use("Agg")  # headless; the charts never go through pyplot, whose backend this sets

DPI = 100
# Our own look, whatever the user's matplotlibrc says; usetex off and mathtext on only for our
# own strings (user strings are escaped by `plain`).
STYLE = {"text.usetex": False, "text.parse_math": True, "font.size": 9, "axes.titlesize": 10,
         "axes.labelsize": 9, "legend.fontsize": 8, "xtick.labelsize": 8, "ytick.labelsize": 8,
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.6, "figure.dpi": DPI, "savefig.dpi": DPI,
         # a fixed title height: no search for ticks the title might overlap on every draw
         "axes.titley": 1.0}
COLORS = {"train": "#1f77b4", "val": "#ff7f0e", "source": "#7f7f7f", "bn": "#1f77b4",
          "tent": "#ff7f0e", "fixed": "#2ca02c", "broken": "#d62728"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
MAX_ANNOTATED_CLASSES = 20  # above this the confusion matrix shows colours only
MAX_LABEL_CHARS = 24
MAX_CURVES = 6  # on the reliability diagram; more would be unreadable

Reliability = dict  # {"bins", "confidence", "accuracy", "count"}, as in the report


# ----------------------------------------------------------------------------- small helpers


def plain(text: Any, limit: int = MAX_LABEL_CHARS) -> str:
    """A user string as matplotlib shows it literally: one line, at most `limit` characters, and
    every `$` escaped so it never starts mathtext."""
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("$", r"\$")


def number(value: Any) -> float | None:
    """A finite number, or None for null, NaN, infinities, booleans and anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def section(report: dict, key: str) -> dict | None:
    value = report.get(key) if isinstance(report, dict) else None
    return value if isinstance(value, dict) and value else None


def points(rows: Sequence[Any], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """The (x, y) pairs of `rows` where both are numbers; rows with a null are skipped."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        if isinstance(row, dict):
            x, y = number(row.get(x_key)), number(row.get(y_key))
            if x is not None and y is not None:
                xs.append(x)
                ys.append(y)
    return xs, ys


def new_figure(width: float, height: float) -> Figure:
    """A figure of `width` x `height` inches. Margins are set by hand in inches (see `place`):
    a layout engine would draw every figure twice, which doubles the cost of writing it."""
    return Figure(figsize=(width, height), dpi=DPI)


def place(fig: Figure, left: float, right: float, bottom: float, top: float,
          gap: float = 0.0) -> None:
    """Subplot margins in inches (gap: between side-by-side panels)."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height,
                        top=1 - top / height,
                        wspace=gap / max((width - left - right - gap) / 2, 0.1))


def text_width(text: str, points: float) -> float:
    """About how wide `text` is in inches at `points` in DejaVu Sans, from rough per-character
    widths (measuring with a renderer costs milliseconds per label)."""
    ems = sum(1.0 if c in "MWmw@%" or unicodedata.east_asian_width(c) in "WF"
              else 0.34 if c in "iljtfr.,;:'!|()[]{} " else 0.72 if c.isupper() else 0.62
              for c in text)
    return ems * points / 72


def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", color="0.5",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


# ----------------------------------------------------------------------------- training curves


def training_curves(report: dict) -> Figure | None:
    """Loss and accuracy per epoch, train and validation, the kept epoch marked."""
    train = section(report, "train")
    history = train.get("history") if train else None
    if not isinstance(history, list) or not history:
        return None
    panels = [("loss", [("train", "loss"), ("val", "val_loss")]),
              ("accuracy", [("train", "train_accuracy"), ("val", "val_accuracy")])]
    # the model type's names of the scores its history holds under the accuracy keys
    names = report_part(report).names
    legend, scores = dict(zip(("train", "val"), names.curves)), names.curves_title
    series = {(title, name): points(history, "epoch", key)
              for title, lines in panels for name, key in lines}
    if not any(xs for xs, _ in series.values()):
        return None
    best = number(train.get("best_epoch"))
    fig = new_figure(7.2, 2.9)
    place(fig, left=0.55, right=0.15, bottom=0.45, top=0.3, gap=0.55)
    for ax, (title, lines) in zip(fig.subplots(1, 2), panels):
        drawn = False
        for name, _ in lines:
            xs, ys = series[(title, name)]
            if xs:
                ax.plot(xs, ys, color=COLORS[name],
                        label=legend[name] if title != "loss" else name, linewidth=1.5,
                        marker="o" if len(xs) <= 30 else None, markersize=3)
                drawn = True
        if not drawn:
            no_data(ax, title)
            continue
        if best is not None:
            ax.axvline(best, color="0.4", linestyle=":", linewidth=1,
                       label=f"kept (epoch {best:g})")
        ax.set_title(f"{scores if title != 'loss' else title} per epoch")
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="upper right" if title == "loss" else "lower right", frameon=False)
    return fig


# ----------------------------------------------------------------------------- confusion matrix


def square_matrix(value: Any) -> np.ndarray | None:
    """A square matrix of non-negative counts, or None when the value is anything else."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(row, list) and len(row) == len(value) for row in value):
        return None
    cells = [number(c) for row in value for c in row]
    if any(c is None or c < 0 for c in cells):
        return None
    return np.array(cells, dtype=float).reshape(len(value), len(value))


def confusion_matrix(report: dict) -> Figure | None:
    """Test-split confusion matrix: colour = share of the true class (rows sum to 1), numbers =
    counts (zeros left blank; no numbers above MAX_ANNOTATED_CLASSES classes)."""
    evaluation = section(report, "evaluation")
    matrix = square_matrix(evaluation.get("confusion_matrix")) if evaluation else None
    if matrix is None or matrix.sum() <= 0:
        return None
    n = len(matrix)
    labels = evaluation.get("labels")
    if not isinstance(labels, list) or len(labels) != n:
        labels = [str(i) for i in range(n)]
    totals = matrix.sum(axis=1, keepdims=True)
    share = np.divide(matrix, totals, out=np.zeros_like(matrix), where=totals > 0)

    font = float(np.clip(260 / n, 4, 8))
    step = max(1, math.ceil(n / 100))
    ticks = list(range(0, n, step))
    names = [plain(labels[i], 18 if n > MAX_ANNOTATED_CLASSES else MAX_LABEL_CHARS) for i in ticks]
    side = min(3.6 + 0.07 * n, 9.0)  # of the matrix, inches
    label_width = max(text_width(name.replace("\\", ""), font) for name in names)
    rotate = label_width > 0.9 * side / n * step
    left = 0.45 + label_width
    bottom = 0.4 + (label_width if rotate else font / 72)
    width, height = left + side + 1.0, bottom + side + 0.35
    fig = new_figure(width, height)
    ax = fig.add_axes((left / width, bottom / height, side / width, side / height))
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest",
                      aspect="auto")
    ax.grid(False)
    if n <= MAX_ANNOTATED_CLASSES:
        size = 8 if n <= 12 else 6
        for (i, j), count in np.ndenumerate(matrix):
            if count:
                ax.text(j, i, f"{count:g}", ha="center", va="center", fontsize=size,
                        color="white" if share[i, j] > 0.5 else "black")
    ax.set_xticks(ticks, names, fontsize=font, rotation=90 if rotate else 0)
    ax.set_yticks(ticks, names, fontsize=font)
    ax.tick_params(length=0 if n > MAX_ANNOTATED_CLASSES else 3)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    split = plain(evaluation.get("split") or "test")
    kind = report_part(report)  # what the matrix counts (a segmenter's: pixels)
    unit, score = kind.confusion_unit, kind.confusion_score
    samples = number(evaluation.get(unit))
    accuracy = number(evaluation.get(score))
    detail = ", ".join(([f"{samples:,.0f} {unit}"] if samples is not None else [])
                       + ([f"{score.replace('_', ' ')} {accuracy:.3f}"]
                          if accuracy is not None else []))
    ax.set_title(f"Confusion matrix, {split} split" + (f" ({detail})" if detail else ""),
                 fontsize=9)
    bar = fig.add_axes(((left + side + 0.15) / width, bottom / height, 0.15 / width,
                        side / height))
    fig.colorbar(image, cax=bar, label="share of the true class"
                 + ("" if unit == "samples" else f"'s {unit}"))
    return fig


# ----------------------------------------------------------------------------- reliability


class Bins(NamedTuple):
    """A reliability section ready to draw: the bin edges and samples per bin, and for each bin
    with samples and an accuracy, its mean confidence (the bin's centre where null), accuracy
    and samples."""
    edges: np.ndarray
    counts: list[float]
    confidence: list[float]
    accuracy: list[float]
    samples: list[float]


def reliability_bins(value: Any) -> Bins | None:
    """The drawable bins of a reliability section; None when it has none or is malformed."""
    if not isinstance(value, dict):
        return None
    accuracy, count = value.get("accuracy"), value.get("count")
    if not isinstance(accuracy, list) or not accuracy or not isinstance(count, list) \
            or len(count) != len(accuracy):
        return None
    confidence = value.get("confidence")
    if not isinstance(confidence, list) or len(confidence) != len(accuracy):
        confidence = [None] * len(accuracy)
    edges = np.linspace(0.0, 1.0, len(accuracy) + 1)
    bins = Bins(edges, [number(c) or 0.0 for c in count], [], [], [])
    for k, n in enumerate(bins.counts):
        acc, conf = number(accuracy[k]), number(confidence[k])
        if acc is not None and n > 0:
            bins.confidence.append(conf if conf is not None else (edges[k] + edges[k + 1]) / 2)
            bins.accuracy.append(acc)
            bins.samples.append(n)
    return bins if bins.accuracy else None


class Curve(NamedTuple):
    """One curve of the reliability diagram: its name, reliability section, ECE (None: the
    legend shows none) and the temperature its probabilities were scaled by (None: none)."""
    name: str
    bins: Reliability
    ece: float | None
    temperature: float | None = None


def calibrated(report: dict) -> dict | None:
    """The calibration section of a run that applies a temperature (None for `--calibrate
    none`, a failed fit or an older report)."""
    calibration = section(report, "calibration")
    if calibration is None or calibration.get("method") in (None, "none") or \
            calibration.get("applied") is False:  # T kept at 1: nothing to draw beside
        return None
    return calibration


def first_curve(name: str, options: Sequence[tuple[Any, Any]],
                temperature: float | None = None) -> Curve | None:
    """A curve from the first (reliability section, ECE) of `options` that has bins to draw."""
    for bins, ece in options:
        if reliability_bins(bins) is not None:
            return Curve(name, bins, number(ece), temperature)
    return None


def single_pass_curves(report: dict) -> list[Curve]:
    """The single pass from the evaluation and calibration sections: "single" without the
    temperature, and for a calibrated run "single+T", the evaluation's (the served graph bakes
    the temperature in)."""
    evaluation = section(report, "evaluation") or {}
    served = (evaluation.get("reliability"), evaluation.get("ece"))
    calibration = calibrated(report)
    if calibration is None:
        curves = [first_curve("single", [served])]
    else:
        curves = [first_curve("single", [(calibration.get("reliability_before"),
                                           calibration.get("ece_before"))]),
                  first_curve("single+T", [(calibration.get("reliability_after"),
                                            calibration.get("ece_after")), served],
                              number(calibration.get("temperature")))]
    return [curve for curve in curves if curve is not None]


def reliability_curves(report: dict) -> list[Curve]:
    """One curve per variant, at most MAX_CURVES: the single pass without and with the
    temperature from the evaluation and calibration sections, then each iterative variant (its
    "single" and "single+T" rows only where those sections have no curve: the same numbers)."""
    curves = single_pass_curves(report)
    iterative = section(report, "iterative")
    rows = iterative.get("rows") if iterative else None
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        variant = str(row.get("variant") or f"variant {len(curves) + 1}")
        curve = first_curve(variant, [(row.get("reliability"), row.get("ece"))],
                            number(row.get("temperature")))
        if curve is not None and variant not in {c.name for c in curves}:
            curves.append(curve)
    return curves


def base_variant(name: str) -> str:
    """A variant without its "+T" (temperature scaled) suffix."""
    return name[:-2] if name.endswith("+T") else name


def curve_label(curve: Curve) -> str:
    """The legend's line: the variant ("single pass" for "single"), its temperature and ECE."""
    name = curve.name
    if base_variant(name) == "single":
        name = "single pass" + name[len("single"):]
    details = ([] if curve.temperature is None else [f"T {curve.temperature:.3f}"]) \
        + ([] if curve.ece is None else [f"ECE {curve.ece:.3f}"])
    return plain(name, 32) + (f" ({', '.join(details)})" if details else "")


def curve_styles(names: Sequence[str]) -> list[dict]:
    """Plot keywords per curve: one colour per variant, shared by its "+T" curve; a variant
    that has a "+T" curve is drawn dashed with open markers, the scaled one solid."""
    styles = []
    for name, color in zip(names, variant_colors(names)):
        paired = f"{name}+T" in names
        styles.append({"color": color, "linestyle": "--" if paired else "-",
                       "markerfacecolor": "white" if paired else color})
    return styles


def reliability_figure(curves: Sequence[tuple], title: str = "Reliability diagram"
                       ) -> Figure | None:
    """Accuracy against confidence per bin for each curve (at most MAX_CURVES), the diagonal
    of perfect calibration, and the samples per bin underneath. `curves` holds Curve or
    (name, bins, ECE or None: then the legend has no ECE[, temperature])."""
    parsed = [(Curve(*curve), reliability_bins(curve[1])) for curve in curves]
    parsed = [(curve, bins) for curve, bins in parsed if bins is not None]
    if not parsed:
        return None
    left_out = len(parsed) - MAX_CURVES
    parsed = parsed[:MAX_CURVES]
    width, height = 5.0, 5.4
    fig = new_figure(width, height)
    top = fig.add_axes((0.6 / width, 1.75 / height, 4.2 / width, 3.35 / height))
    bottom = fig.add_axes((0.6 / width, 0.5 / height, 4.2 / width, 1.0 / height), sharex=top)
    top.plot([0, 1], [0, 1], color="0.55", linestyle=":", linewidth=1,
             label="perfectly calibrated")
    styles = curve_styles([curve.name for curve, _ in parsed])
    for (curve, bins), style in zip(parsed, styles):
        top.plot(bins.confidence, bins.accuracy, marker="o", markersize=4, linewidth=1.5,
                 label=curve_label(curve), **style)
        bottom.stairs(bins.counts, bins.edges, color=style["color"], linewidth=1.2, alpha=0.8,
                      linestyle=style["linestyle"], fill=len(parsed) == 1)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.02)
    top.set_ylabel("accuracy")
    if left_out > 0:
        top.plot([], [], " ", label=f"{left_out} more in the report")
    if any(curve.temperature is not None for curve, _ in parsed):
        title += " (+T: temperature scaled)"
    top.set_title(title)
    # curves may run above or below the diagonal
    top.legend(loc="best", frameon=False, fontsize=8 if len(parsed) <= 4 else 7)
    top.tick_params(labelbottom=False)
    bottom.set_xlabel("confidence (top-class probability)")
    bottom.set_ylabel("samples")
    bottom.grid(axis="x", visible=False)
    return fig


def reliability(report: dict) -> Figure | None:
    """Reliability diagram of the single pass, without and with the temperature, and every
    iterative variant."""
    return reliability_figure(reliability_curves(report))


# ----------------------------------------------------------------------------- grouped bars


Series = tuple[str, Sequence[float | None], dict]  # (legend label, value per group, bar style)


def shift_label(row: dict, severities: set) -> str:
    """A corruption's name on the x axis, with its severity when the shifts' severities differ."""
    severity = number(row.get("severity"))
    return plain(row.get("name", "?"), 18) + (
        f" ({severity:g})" if len(severities) > 1 and severity is not None else "")


def grouped_bars(names: Sequence[str], series: Sequence[Series], per_group: float = 0.8,
                 legend_width: float = 1.0) -> tuple[Figure, Axes]:
    """One group of bars per name along x (labels turned 45° when they do not fit), one bar per
    series in each group where its value is not None, the legend on the right."""
    fig_width = max(5.0, 0.6 + legend_width + per_group * len(names))
    widest = max(text_width(name, 8) for name in names)
    rotate = widest > 0.9 * (fig_width - 0.35 - legend_width) / len(names)
    label_height = widest * 0.71 + 0.1 if rotate else 0.15
    fig = new_figure(fig_width, 2.8 + label_height)
    place(fig, left=0.6, right=legend_width, bottom=0.3 + label_height, top=0.3)
    ax = fig.subplots()
    width = 0.8 / len(series)
    for s, (label, values, style) in enumerate(series):
        xs = [g - 0.4 + width * (s + 0.5) for g, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width * 0.95, label=label,
               **style)
    ax.set_xticks(range(len(names)), names, rotation=45 if rotate else 0,
                  ha="right" if rotate else "center", rotation_mode="anchor" if rotate else None)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig, ax


# ----------------------------------------------------------------------------- test-time training


def ttt_shifts(report: dict) -> Figure | None:
    """Accuracy of the source model, BN adaptation and TENT on clean data and each corruption."""
    ttt = section(report, "ttt")
    if not ttt:
        return None
    shifts = [row for row in ttt.get("shifts") or [] if isinstance(row, dict)]
    severities = {number(row.get("severity")) for row in shifts} - {None}
    groups: list[tuple[str, dict]] = []
    if isinstance(ttt.get("clean"), dict):
        groups.append(("clean", ttt["clean"]))
    groups += [(shift_label(row, severities), row) for row in shifts]
    if isinstance(ttt.get("mean_shifted"), dict) and len(shifts) > 1:
        groups.append(("mean of shifts", ttt["mean_shifted"]))
    series = [(method, [number(row.get(f"accuracy_{method}")) for _, row in groups],
               {"color": COLORS[method]}) for method in ("source", "bn", "tent")]
    series = [s for s in series if any(v is not None for v in s[1])]
    if not series:
        return None
    fig, ax = grouped_bars([name for name, _ in groups], series)
    ax.set_ylim(0, 1.0)
    ax.set_ylabel(report_part(report).names.metric)
    details = [plain(ttt["mode"])] if isinstance(ttt.get("mode"), str) else []
    if len(severities) == 1:  # none at all without --eval_shift: the clean split alone
        details.append(f"severity {next(iter(severities)):g}")
    detail = ", ".join(details)
    title = "Test-time adaptation " + ("under shift" if shifts else "on the clean test split")
    ax.set_title(title + (f" ({detail})" if detail else ""))
    return fig


# ----------------------------------------------------------------------------- calibration


def clean_ece(report: dict, calibration: dict) -> dict[str, float]:
    """ECE per variant on the clean test split: the single pass without (and, for a calibrated
    run, with) the temperature from the calibration section, the others from the iterative
    rows."""
    values = {"single": number(calibration.get("ece_before"))}
    if calibrated(report):
        values["single+T"] = number(calibration.get("ece_after"))
    iterative = section(report, "iterative")
    rows = iterative.get("rows") if iterative else None
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and values.get(str(row.get("variant"))) is None:
            values[str(row.get("variant"))] = number(row.get("ece"))
    return {name: value for name, value in values.items() if value is not None}


def shift_groups(report: dict, calibration: dict, shifts: Sequence[dict]
                 ) -> list[tuple[str, dict[str, float]]]:
    """(x label, ECE per variant): clean data, each corruption, and the mean over the
    corruptions when there are several."""
    severities = {number(row.get("severity")) for row in shifts} - {None}
    groups = [("clean", clean_ece(report, calibration))]
    for shift in shifts:
        rows = [r for r in shift["rows"] if isinstance(r, dict)]
        groups.append((shift_label(shift, severities),
                       {str(r.get("variant")): number(r.get("ece")) for r in rows}))
    under_shift = calibration.get("under_shift")
    means = under_shift.get("mean_ece") if isinstance(under_shift, dict) else None
    if isinstance(means, dict) and len(shifts) > 1:
        groups.append(("mean of shifts", {str(k): number(v) for k, v in means.items()}))
    return groups


def variant_colors(names: Sequence[str]) -> list[str]:
    """One colour per variant, shared by its "+T" (temperature scaled) twin."""
    bases = list(dict.fromkeys(base_variant(name) for name in names))
    return [PALETTE[bases.index(base_variant(name)) % len(PALETTE)] for name in names]


def calibration_shift(report: dict) -> Figure | None:
    """ECE of each variant on clean test data and under each corruption; the variant best
    calibrated under shift (lowest mean ECE) named in the title."""
    calibration = section(report, "calibration")
    shifts = calibration.get("shifts") if calibration else None
    shifts = [s for s in shifts if isinstance(s, dict) and isinstance(s.get("rows"), list)] \
        if isinstance(shifts, list) else []
    variants = list(dict.fromkeys(str(r.get("variant")) for s in shifts for r in s["rows"]
                                  if isinstance(r, dict)))
    if not variants:
        return None
    groups = shift_groups(report, calibration, shifts)
    series = [(plain(variant), [values.get(variant) for _, values in groups],
               {"color": color, "alpha": 0.45 if f"{variant}+T" in variants else 1.0})
              for variant, color in zip(variants, variant_colors(variants))]
    series = [s for s in series if any(v is not None for v in s[1])]
    if not series:
        return None
    fig, ax = grouped_bars([name for name, _ in groups], series,
                           per_group=max(0.8, 0.3 + 0.22 * len(series)), legend_width=1.4)
    top = max(v for _, values, _ in series for v in values if v is not None)
    ax.set_ylim(0, max(top * 1.15, 0.01))
    ax.set_ylabel("ECE (lower is better)")
    severities = {number(s.get("severity")) for s in shifts} - {None}
    title = "Calibration under shift" + (f" (severity {next(iter(severities)):g})"
                                         if len(severities) == 1 else "")
    under_shift = calibration.get("under_shift")
    best = under_shift.get("best") if isinstance(under_shift, dict) else None
    ax.set_title(title + (f"; best calibrated: {plain(best, 32)}" if best else ""))
    return fig


# ----------------------------------------------------------------------------- benchmark


def benchmark(report: dict) -> Figure | None:
    """p50 latency at batch 1 against model size for each variant (whisker up to p95), with its
    accuracy written beside the point."""
    rows = report.get("benchmark") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        return None
    usable = [r for r in rows if isinstance(r, dict) and number(r.get("size_mb")) is not None
              and number(r.get("latency_ms_p50_batch1")) is not None]
    if not usable:
        return None
    legend_rows = len(usable)
    fig = new_figure(6.0, 3.4 + 0.17 * legend_rows)
    place(fig, left=0.65, right=0.2, bottom=0.75 + 0.17 * legend_rows, top=0.3)
    ax = fig.subplots()
    for index, row in enumerate(usable):
        color = PALETTE[index % len(PALETTE)]
        size, p50 = number(row["size_mb"]), number(row["latency_ms_p50_batch1"])
        p95 = number(row.get("latency_ms_p95_batch1"))
        if p95 is not None and p95 > p50:
            ax.plot([size, size], [p50, p95], color=color, linewidth=1, alpha=0.6)
        accuracy = number(row.get("accuracy"))
        name = plain(row.get("variant") or f"variant {index + 1}", 40)
        ax.plot([size], [p50], marker="os^DvP*X"[index % 8], color=color, linestyle="none",
                markersize=7, label=name + (f", accuracy {accuracy:.4f}"
                                            if accuracy is not None else ""))
        if accuracy is not None:
            ax.annotate(f"{accuracy:.3f}", (size, p50), xytext=(6, 4 - 11 * (index % 3)),
                        textcoords="offset points", fontsize=7, color=color)
    ax.set_xlabel("model size (MB)")
    ax.set_ylabel("p50 latency, batch 1 (ms)")
    # both axes from zero, so that sizes and latencies compare as ratios
    ax.set_xlim(0, max(number(r["size_mb"]) for r in usable) * 1.2 or 1.0)
    ax.set_ylim(0, max(max(number(r["latency_ms_p50_batch1"]),
                           number(r.get("latency_ms_p95_batch1")) or 0.0) for r in usable) * 1.1
                or 1.0)
    ax.set_title("Latency against size (line up to p95, accuracy beside each point)",
                 fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(-0.1, -0.17), frameon=False)
    return fig


def compression(report: dict) -> Figure | None:
    """Validation accuracy against latency at the judged batch size, one point per variant
    (fp32 a black star, the served one ringed), so a variant up and to the left is better."""
    data = section(report, "compression")
    rows = [r for r in (data or {}).get("variants") or [] if isinstance(r, dict)
            and number(r.get("latency_ms")) is not None
            and number(r.get("val_accuracy") if r.get("val_accuracy") is not None
                       else r.get("test_accuracy")) is not None]
    if not rows:
        return None
    fig = new_figure(6.0, 3.4 + 0.17 * len(rows))
    place(fig, left=0.75, right=0.2, bottom=0.75 + 0.17 * len(rows), top=0.3)
    ax = fig.subplots()
    for index, row in enumerate(rows):
        latency = number(row["latency_ms"])
        score = number(row.get("val_accuracy") if row.get("val_accuracy") is not None
                       else row.get("test_accuracy"))
        fp32 = row.get("name") == "fp32"
        color = "black" if fp32 else PALETTE[index % len(PALETTE)]
        label = plain(row.get("name"), 40) + (" (served)" if row.get("served") else "")
        ax.plot([latency], [score], marker="*" if fp32 else "os^DvPX"[index % 7], color=color,
                linestyle="none", markersize=11 if fp32 else 7, label=label)
        if row.get("served"):
            ax.plot([latency], [score], marker="o", markersize=16, markerfacecolor="none",
                    markeredgecolor=color, linestyle="none")
    batch = (data or {}).get("batch_size")
    ax.set_xlabel(f"p50 latency per batch of {batch} (ms)" if batch else "p50 latency (ms)")
    ax.set_ylabel("validation accuracy")
    ax.set_xlim(0, max(number(r["latency_ms"]) for r in rows) * 1.15 or 1.0)
    ax.set_title("Accuracy against latency per variant (fp32: the star)", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(-0.1, -0.17), frameon=False)
    return fig


# ----------------------------------------------------------------------------- TTA


def tta(report: dict) -> Figure | None:
    """Test samples TTA fixed (wrong to right) and broke (right to wrong), and accuracy with and
    without TTA on the test and validation splits."""
    section_tta = section(report, "tta")
    if not section_tta:
        return None
    fixed, broken = number(section_tta.get("fixed")), number(section_tta.get("broken"))
    if fixed is None and broken is None:
        return None
    figures = report_part(report).tta  # the model type's: a segmenter's pixels and mean IoU
    pairs = [(split, number(section_tta.get(f"{key}_plain")), number(section_tta.get(key)))
             for split, key in figures.scores]
    pairs = [(split, a, b) for split, a, b in pairs if a is not None and b is not None]
    fig = new_figure(7.0 if pairs else 3.6, 3.0)
    place(fig, left=0.6, right=0.2, bottom=0.6, top=0.3, gap=0.9)
    axes = fig.subplots(1, 2 if pairs else 1, squeeze=False)[0]
    ax = axes[0]
    bars = [(name, value, COLORS[key]) for name, value, key in
            (("fixed\n(wrong → right)", fixed, "fixed"), ("broken\n(right → wrong)", broken,
                                                           "broken")) if value is not None]
    ax.bar(range(len(bars)), [v for _, v, _ in bars], color=[c for _, _, c in bars], width=0.6)
    for x, (_, value, _) in enumerate(bars):
        ax.annotate(f"{value:g}", (x, value), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=9)
    ax.set_xticks(range(len(bars)), [name for name, _, _ in bars])
    ax.set_xlim(-0.7, len(bars) - 0.3)
    ax.set_ylim(0, max([v for _, v, _ in bars] + [1]) * 1.2)
    ax.set_ylabel(figures.unit)
    ax.grid(axis="x", visible=False)
    net = (fixed or 0) - (broken or 0)
    ax.set_title(f"TTA changes (net {net:+g})")
    if pairs:
        ax = axes[1]
        for y, (split, before, after) in enumerate(pairs):
            color = COLORS["fixed"] if after >= before else COLORS["broken"]
            ax.plot([before, after], [y, y], color=color, linewidth=2, alpha=0.7)
            ax.plot([before], [y], "o", color=COLORS["source"], markersize=7,
                    label="without TTA" if y == 0 else None)
            ax.plot([after], [y], "D", color=color, markersize=7,
                    label="with TTA" if y == 0 else None)
            ax.annotate(f"{before:.4f} → {after:.4f}", ((before + after) / 2, y), xytext=(0, 8),
                        textcoords="offset points", ha="center", fontsize=8)
        ax.set_yticks(range(len(pairs)), [split for split, _, _ in pairs])
        ax.set_ylim(-0.6, len(pairs) - 0.4)
        ax.margins(x=0.3)
        metric = figures.metric
        ax.set_xlabel(metric)
        ax.set_title(f"{metric[0].upper()}{metric[1:]} without and with TTA")
        ax.legend(loc="lower right", frameon=False, fontsize=7)
    return fig


# ----------------------------------------------------------------------------- writing


def drawn_by_type(name: str) -> Plot:
    """The plot `name` as the report's model type draws it (None where it draws none)."""

    def draw(report: dict) -> Figure | None:
        own = report_part(report if isinstance(report, dict) else {}).plots().get(name)
        return None if own is None else own(report)

    draw.__name__ = name
    return draw


# each plot of the sections' table, in the table's order: the function of its name here, else
# the one the report's model type draws (its report part's `plots`)
PLOTS: dict[str, Callable[[dict], Figure | None]] = {
    name: globals().get(name) or drawn_by_type(name) for name in PLOT_NAMES}


def save_figure(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG atomically. (zlib level 1: charts are flat colours, which compress
    nearly as well at a fraction of the default level's time.)"""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI,
                                                      pil_kwargs={"compress_level": 1}))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Drawing makes many short-lived objects: pausing the cycle collector meanwhile saves
    about a tenth of the time. Figures are never registered with pyplot, so each is garbage
    once written, and the collector frees them when it runs again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def write_plot(name: str, report: dict, path: Path) -> str | None:
    """Draw PLOTS[name] and write it to `path`; None when its data is missing, or malformed
    (then with a warning: a chart never fails the run). Errors writing the file propagate."""
    try:
        fig = PLOTS[name](report)
        return None if fig is None else str(save_figure(fig, path))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        LOG.warning("plot %s skipped: its data is malformed (%s: %s)", name,
                    type(err).__name__, err)
        return None


def write_plots(report: dict, folder: Path) -> dict[str, str]:
    """Draw every chart the report has data for into `folder` (created if missing) as
    `<name>.png`; return name -> path of the PNGs written, in PLOTS order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with collector_paused(), matplotlib.rc_context(STYLE):
        written = {name: write_plot(name, report, folder / f"{name}.png") for name in PLOTS}
    return {name: path for name, path in written.items() if path is not None}
