"""A segmenter's inference stage on held-out images (issue 43, item 5): the graph's masks over
the test split in ONNX Runtime, pooled into one pixel confusion (metrics.py: pixel accuracy, IoU
and Dice per class, mean and frequency-weighted IoU, the all-majority baseline and the verdict),
latency and throughput at --batch_size; and the validation pixels a temperature is fitted on.
No torch here but in `pixel_logits` (training's calibration, which has the network)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ttc.serving.runtime import outputs_runner, time_runners, whole_batches
from ttc.tasks.segment.metrics import PixelConfusion, segmentation_scores, summary_scores
from utils import RuntimeFailure

MaskRunner = Callable[[np.ndarray], np.ndarray]  # a batch (N, C, H, W) → masks (N, H, W)
# Validation pixels a temperature is fitted on (a seeded sample): the fit's bootstrap costs about
# 0.3 ms a pixel here (153,600 pixels took 3 minutes), and neighbouring pixels are no
# independent evidence anyway.
CALIBRATION_PIXELS = 10_000


def batches(x: np.ndarray, size: int) -> list[np.ndarray]:
    return [x[i:i + size] for i in range(0, len(x), size)]


def predict_masks(run: MaskRunner, x: np.ndarray, batch_size: int) -> np.ndarray:
    """The masks of every image, a batch at a time."""
    return np.concatenate([run(batch) for batch in batches(x, batch_size)]).astype(np.int64)


def mask_runner(session) -> MaskRunner:
    """An ONNX Runtime session's `mask` output for a batch."""
    name, run = session.get_inputs()[0].name, outputs_runner(session, ["mask"])
    return lambda batch: run({name: batch})[0]


def probabilities_mean_iou(probabilities: np.ndarray, truth: np.ndarray, num_classes: int,
                           ignore_index: int) -> float:
    """The mean IoU of the masks of (N, K, H, W) probabilities (argmax over the class axis)."""
    masks = probabilities.argmax(axis=1)
    return summary_scores(confusion_of(masks, truth, num_classes, ignore_index).matrix)[
        "mean_iou"]


def confusion_of(masks: np.ndarray, truth: np.ndarray, num_classes: int,
                 ignore_index: int) -> PixelConfusion:
    return PixelConfusion(num_classes, ignore_index).add(masks, truth)


def evaluation_section(masks: np.ndarray, truth: np.ndarray, labels: Sequence[str],
                       ignore_index: int, train_pixels: Sequence[int] | None,
                       split: str = "test") -> dict:
    """The report's `evaluation` for a segmenter (metrics.segmentation_scores)."""
    confusion = confusion_of(masks, truth, len(labels), ignore_index)
    return segmentation_scores(confusion.matrix, labels, train_pixels, split)


@dataclass
class SegmentationRun:
    """The inference stage's figures (the report's `inference`)."""

    providers_active: list[str]
    model_path: str
    pixel_accuracy: float
    mean_iou: float
    latency_ms_p50: float
    latency_ms_p95: float
    throughput_per_s: float  # images per second at batch_size
    batch_size: int
    samples: int
    timed_batches: int
    image_size: list[int]

    def report_section(self) -> dict:
        return dict(vars(self))


def run_test_split(session, model_path: str, x: np.ndarray, y: np.ndarray,
                   labels: Sequence[str], ignore_index: int,
                   train_pixels: Sequence[int] | None, batch_size: int
                   ) -> tuple[SegmentationRun, dict, np.ndarray]:
    """The test split's masks, their evaluation section and the timing of the session at
    `batch_size` (30 batches at least, one whole pass)."""
    if len(x) == 0:
        raise RuntimeFailure("no test images to run", "check the dataset's test split")
    run = mask_runner(session)
    masks = predict_masks(run, x, batch_size)
    evaluation = evaluation_section(masks, y, labels, ignore_index, train_pixels)
    evaluation["examples"] = example_overlays(x, y, masks, ignore_index)
    timed = whole_batches(batches(x, batch_size), batch_size)
    timings = time_runners([run], timed, max(30, len(timed)), min_seconds=0)
    result = SegmentationRun(
        providers_active=session.get_providers(), model_path=str(model_path),
        pixel_accuracy=evaluation["pixel_accuracy"], mean_iou=evaluation["mean_iou"],
        latency_ms_p50=timings.percentile_ms(0, 50), latency_ms_p95=timings.percentile_ms(0, 95),
        throughput_per_s=timings.throughput(0), batch_size=batch_size, samples=len(x),
        timed_batches=len(timings.samples), image_size=list(x.shape[-2:]))
    return result, evaluation, masks


EXAMPLES = 8  # test images the report shows with their true and predicted masks
EXAMPLE_MAX_SIDE = 128  # larger ones are shown downscaled (the report stays small)


def png_data_url(rgb: np.ndarray) -> str:
    """An (H, W, 3) uint8 picture as a data: URL of a PNG, at most EXAMPLE_MAX_SIDE a side."""
    import base64
    import io

    from PIL import Image

    picture = Image.fromarray(rgb, mode="RGB")
    if max(picture.size) > EXAMPLE_MAX_SIDE:
        picture.thumbnail((EXAMPLE_MAX_SIDE, EXAMPLE_MAX_SIDE), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def example_overlays(x: np.ndarray, truth: np.ndarray, masks: np.ndarray,
                     ignore_index: int, count: int = EXAMPLES) -> list[dict]:
    """The first `count` test images (the split is shuffled by the seed) as the report's
    examples: the image, and it with the true and with the predicted mask overlaid (class
    colours of the VOC palette, background and void left as they are), as PNG data URLs, with
    the image's pixel accuracy."""
    from ttc.tasks.segment.masks import overlay

    examples = []
    for k in range(min(count, len(x))):
        shown_truth = np.where(truth[k] == ignore_index, 0, truth[k])
        known = truth[k] != ignore_index
        examples.append({
            "index": k, "size": list(x[k].shape[-2:]),
            "image": png_data_url(overlay(x[k], np.zeros_like(masks[k]))),
            "truth": png_data_url(overlay(x[k], shown_truth)),
            "predicted": png_data_url(overlay(x[k], masks[k])),
            "pixel_accuracy": float((masks[k][known] == truth[k][known]).mean())
            if known.any() else None})
    return examples


def tta_section(plain: MaskRunner, merged: MaskRunner, views: str, x: np.ndarray,
                truth: np.ndarray, plain_masks: np.ndarray, labels: Sequence[str],
                ignore_index: int, batch_size: int) -> dict:
    """The TTA graph against the plain one on the test split: mean IoU and pixel accuracy of
    each, the pixels it fixed (wrong → right) and broke, and what it costs (both timed in turns
    at `batch_size`); the verdict says plainly when it does not help."""
    masks = predict_masks(merged, x, batch_size)
    known = truth != ignore_index
    before = confusion_of(plain_masks, truth, len(labels), ignore_index)
    after = confusion_of(masks, truth, len(labels), ignore_index)
    plain_scores = segmentation_scores(before.matrix, labels)
    scores = segmentation_scores(after.matrix, labels)
    right_before, right_after = (plain_masks == truth) & known, (masks == truth) & known
    timed = whole_batches(batches(x, batch_size), batch_size)
    timings = time_runners([plain, merged], timed, max(10, len(timed)), min_seconds=0)
    cost = timings.percentile_ms(1, 50) / max(timings.percentile_ms(0, 50), 1e-9)
    gain = scores["mean_iou"] - plain_scores["mean_iou"]
    section = {"transforms": views, "views": 1 + len(views.split(",")), "backend": "graph",
               "plan": "graph", "mean_iou_plain": plain_scores["mean_iou"],
               "mean_iou": scores["mean_iou"],
               "pixel_accuracy_plain": plain_scores["pixel_accuracy"],
               "pixel_accuracy": scores["pixel_accuracy"],
               "fixed": int((right_after & ~right_before).sum()),
               "broken": int((right_before & ~right_after).sum()),
               "latency_ms_p50_plain": timings.percentile_ms(0, 50),
               "latency_ms_p50": timings.percentile_ms(1, 50), "cost_ratio": round(cost, 3)}
    section["verdict"] = (f"TTA ({views}) raised test mean IoU by {gain:+.4f} at {cost:.1f}x "
                          "the plain graph's latency" if gain > 0 else
                          f"TTA ({views}) did not help: test mean IoU {gain:+.4f} at {cost:.1f}x "
                          "the plain graph's latency; serve the plain graph")
    return section


def train_pixel_counts(y: np.ndarray, num_classes: int) -> list[int]:
    """Pixels per class in the training masks (void and out-of-range indices left out)."""
    flat = np.asarray(y, np.int64).ravel()
    return np.bincount(flat[(flat >= 0) & (flat < num_classes)],
                       minlength=num_classes).tolist()


def pixel_logits(net, x: np.ndarray, y: np.ndarray, ignore_index: int, batch_size: int,
                 seed: int, limit: int = CALIBRATION_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """(logits (P, K), classes (P,)) of up to `limit` non-void validation pixels, a seeded
    sample: what a temperature is fitted on (one network forward per image)."""
    import torch

    rows, truth = [], []
    net.eval()
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = net(torch.from_numpy(x[start:start + batch_size])).numpy()
            labels = y[start:start + batch_size]
            keep = labels != ignore_index
            rows.append(np.moveaxis(logits, 1, -1)[keep])
            truth.append(labels[keep])
    logits, classes = np.concatenate(rows), np.concatenate(truth)
    if len(classes) > limit:
        chosen = np.sort(np.random.default_rng(seed).choice(len(classes), limit, replace=False))
        logits, classes = logits[chosen], classes[chosen]
    return logits.astype(np.float64), classes.astype(np.int64)
