"""A segmenter's plots (its report part's `plots`, drawn by ttc/reporting/plots.py's
write_plots when the report is a segmenter's): IoU and Dice per class, and the examples' grid of
test images with their true and predicted masks. matplotlib, imported only to draw them."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from ttc.reporting.classifier_report import Plot
from ttc.reporting.plots import (COLORS, PALETTE, new_figure, number, place, plain, section,
                                 text_width)
from ttc.tasks.segment.masks import voc_palette



MAX_IOU_CLASSES = 40  # bars on the per-class IoU chart; more classes: the lowest IoU
EXAMPLE_ROWS = 8  # test images on the examples' grid
MAX_EXAMPLE_SIDE = 1024  # pixels; a bigger "example" in a report is not drawn
PNG_DATA_URL = "data:image/png;base64,"


def segmentation_rows(evaluation: dict) -> list[tuple[str, float | None, float | None]]:
    """(label, IoU, Dice) per class of a segmenter's evaluation, in its order; at most
    MAX_IOU_CLASSES, the lowest IoU first among more (a class without an IoU, neither in the
    truth nor predicted, last, as the summary ranks them)."""
    per_class = evaluation.get("per_class")
    if not isinstance(per_class, dict):
        return []
    rows = [(str(label), number(row.get("iou")), number(row.get("dice")))
            for label, row in per_class.items() if isinstance(row, dict)]
    if len(rows) > MAX_IOU_CLASSES:
        rows = sorted(rows, key=lambda r: 2.0 if r[1] is None else r[1])[:MAX_IOU_CLASSES]
    return rows


def class_iou(report: dict) -> Figure | None:
    """A segmenter's IoU (bar, value written beside it) and Dice (thinner bar) per class, with
    its mean IoU and the majority-class baseline's as vertical lines."""
    evaluation = section(report, "evaluation")
    if not evaluation:
        return None
    rows = segmentation_rows(evaluation)
    if not any(iou is not None or dice is not None for _, iou, dice in rows):
        return None
    names = [plain(label) for label, _, _ in rows]
    label_width = max(text_width(name.replace("\\", ""), 8) for name in names)
    left = 0.35 + label_width
    height = 1.3 + 0.26 * len(rows)
    fig = new_figure(left + 5.2, height)
    place(fig, left=left, right=0.25, bottom=0.85, top=0.35)
    ax = fig.subplots()
    y = np.arange(len(rows))
    ious = [np.nan if iou is None else iou for _, iou, _ in rows]
    dices = [np.nan if dice is None else dice for _, _, dice in rows]
    ax.barh(y - 0.17, ious, height=0.36, color=PALETTE[0], label="IoU")
    ax.barh(y + 0.19, dices, height=0.22, color=PALETTE[0], alpha=0.35, label="Dice")
    for k, (_, iou, dice) in enumerate(rows):
        text = "absent (no pixels)" if iou is None and dice is None else \
            "" if iou is None else f"{iou:.3f}"
        ax.annotate(text, (iou or 0.0, k - 0.17), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=7, color="0.45" if iou is None else "black")
    mean, baseline = number(evaluation.get("mean_iou")), number(evaluation.get("baseline_mean_iou"))
    if mean is not None:
        ax.axvline(mean, color=COLORS["fixed"], linewidth=1.2, label=f"mean IoU {mean:.3f}")
    if baseline is not None:
        always = evaluation.get("baseline_class")
        ax.axvline(baseline, color=COLORS["broken"], linestyle="--", linewidth=1.2,
                   label=f"baseline mean IoU {baseline:.3f}"
                   + (f" (always {plain(always, 18)})" if always is not None else ""))
    ax.set_yticks(y, names)
    ax.set_ylim(len(rows) - 0.5, -0.6)  # the first class on top
    ax.set_xlim(0, 1.08)
    ax.set_xlabel("IoU / Dice")
    ax.grid(axis="y", visible=False)
    split = plain(evaluation.get("split") or "test")
    shown = "" if len(rows) == len(evaluation["per_class"]) else \
        f", the {len(rows)} lowest of {len(evaluation['per_class'])}"
    ax.set_title(f"IoU and Dice per class, {split} split{shown}")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.45 / (height - 1.2)), ncol=2,
              frameon=False, fontsize=7)
    return fig


def data_url_picture(url: Any) -> np.ndarray | None:
    """The RGB pixels of a PNG data URL (an example of the report), or None for anything else:
    not a PNG data URL, undecodable, or bigger than MAX_EXAMPLE_SIDE a side."""
    import base64
    import binascii
    import io

    from PIL import Image

    if not isinstance(url, str) or not url.startswith(PNG_DATA_URL):
        return None
    try:
        data = base64.b64decode(url[len(PNG_DATA_URL):], validate=True)
        with Image.open(io.BytesIO(data), formats=["PNG"]) as picture:
            if max(picture.size) > MAX_EXAMPLE_SIDE:
                return None
            return np.asarray(picture.convert("RGB"))
    except (binascii.Error, OSError, ValueError):  # UnidentifiedImageError is an OSError
        return None


def example_pictures(evaluation: dict) -> list[tuple[dict, list[np.ndarray]]]:
    """The first EXAMPLE_ROWS examples whose three pictures (image, truth, predicted) decode."""
    examples = evaluation.get("examples")
    drawn = []
    for example in examples if isinstance(examples, list) else []:
        if not isinstance(example, dict):
            continue
        pictures = [data_url_picture(example.get(k)) for k in ("image", "truth", "predicted")]
        if all(p is not None for p in pictures):
            drawn.append((example, pictures))
        if len(drawn) == EXAMPLE_ROWS:
            break
    return drawn


def voc_colour(k: int) -> tuple[float, float, float]:
    """Class k's colour in the PASCAL VOC colour map, as masks.py colours the overlays."""
    red, green, blue = (int(v) for v in voc_palette()[k])
    return (red / 255, green / 255, blue / 255)


def mask_colours(labels: Sequence[Any]) -> list[tuple[str, tuple[float, float, float]]]:
    """(label, colour) of the overlays' classes after the first (class 0 is left unshaded),
    at most 20."""
    return [(plain(label, 16), voc_colour(k)) for k, label in enumerate(labels) if 0 < k < 21]


def segmentation_examples(report: dict) -> Figure | None:
    """Test images of a segmenter, one per row: the image, the true mask overlaid and the
    predicted mask overlaid (pixels drawn as squares), each row titled with the example's index
    and pixel accuracy; the class colours underneath."""
    evaluation = section(report, "evaluation")
    drawn = example_pictures(evaluation) if evaluation else []
    if not drawn:
        return None
    labels = evaluation.get("labels") if isinstance(evaluation.get("labels"), list) else []
    colours = mask_colours(labels)
    legend_rows = math.ceil(len(colours) / 5)
    panel, top, bottom = 1.5, 0.75, 0.2 + 0.2 * legend_rows + (0.35 if colours else 0.0)
    width, height = 0.3 + 3 * panel + 2 * 0.25, top + bottom + len(drawn) * (panel + 0.4) - 0.4
    fig = new_figure(width, height)
    place(fig, left=0.15, right=0.15, bottom=bottom, top=top)
    fig.subplots_adjust(wspace=0.25 / panel, hspace=0.4 / panel)
    axes = fig.subplots(len(drawn), 3, squeeze=False)
    for row, (example, pictures) in zip(axes, drawn):
        index = example.get("index")
        accuracy = number(example.get("pixel_accuracy"))
        titles = [f"example {index}" if isinstance(index, int) else "example", "true mask",
                  "predicted" + (f", {accuracy:.1%} right" if accuracy is not None
                                 else "")]
        for ax, picture, title in zip(row, pictures, titles):
            ax.imshow(picture, interpolation="nearest")
            ax.set_title(title, fontsize=8)
            ax.set_axis_off()
    if colours:
        from matplotlib.patches import Patch

        fig.legend(handles=[Patch(color=colour, label=label) for label, colour in colours],
                   loc="lower center", ncol=min(5, len(colours)), frameon=False, fontsize=7,
                   title=f"mask colours ({plain(labels[0], 16)} not shaded)",
                   title_fontsize=7)
    fig.suptitle(f"{len(drawn)} images of the {plain(evaluation.get('split') or 'test')} "
                 "split, true and predicted masks", fontsize=10, y=1 - 0.12 / height,
                 va="top")
    return fig


PLOTS: dict[str, Plot] = {"class_iou": class_iou, "segmentation_examples": segmentation_examples}
