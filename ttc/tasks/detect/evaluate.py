"""A detector's inference stage on held-out images (issue 44, item 4): the graph's detections
over the test split in ONNX Runtime, scored with COCO's metrics (metrics.py: mAP@[.5:.95],
mAP@.5, mAP@.75, recall at 100 detections, AP per class), the empty detector as the baseline,
the verdict, example pictures with the true and predicted boxes drawn, latency and throughput
at --batch_size. No torch here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ttc.serving.runtime import outputs_runner, time_runners, whole_batches
from ttc.tasks.detect.metrics import (detection_metrics, detection_verdict,
                                      detection_warnings)
from utils import RuntimeFailure

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)
DetectionRunner = Callable[[np.ndarray], list[Detections]]
OUTPUTS = ["boxes", "scores", "labels", "num_detections"]
EXAMPLES = 8  # test images the report shows with their true and predicted boxes
EXAMPLE_MAX_SIDE = 160
EXAMPLE_MIN_SCORE = 0.3  # predicted boxes drawn on the examples score at least this
TRUE_COLOUR, PREDICTED_COLOUR = (40, 200, 80), (240, 70, 40)


def batches(x: np.ndarray, size: int) -> list[np.ndarray]:
    return [x[i:i + size] for i in range(0, len(x), size)]


def unpadded(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray,
             counts: np.ndarray) -> list[Detections]:
    """The graph's padded outputs → per image its num_detections rows."""
    return [(boxes[i, :n], scores[i, :n], labels[i, :n]) for i, n in enumerate(counts)]


def detection_runner(session) -> DetectionRunner:
    """An ONNX Runtime session's detections for a batch, per image, padding removed."""
    name, run = session.get_inputs()[0].name, outputs_runner(session, OUTPUTS)
    return lambda batch: unpadded(*run({name: batch}))


def predict_detections(run: DetectionRunner, x: np.ndarray, batch_size: int
                       ) -> list[Detections]:
    """The detections of every image, a batch at a time."""
    return [found for batch in batches(x, batch_size) for found in run(batch)]


def evaluation_section(found: Sequence[Detections], truth: Sequence[np.ndarray],
                       labels: Sequence[str], train_boxes: Sequence[int] | None = None,
                       split: str = "test") -> dict:
    """The report's `evaluation` for a detector: COCO's metrics (metrics.detection_metrics),
    the empty detector's mAP (0) as the baseline, the warnings and the verdict."""
    section = {"split": split, "metric": "map",
               **detection_metrics(list(found), list(truth), list(labels)),
               "labels": list(labels), "train_boxes_per_class": list(train_boxes or []) or None}
    section["warnings"] = detection_warnings(section, split)
    section["verdict"] = detection_verdict(section, section["warnings"])
    return section


@dataclass
class DetectionRun:
    """The inference stage's figures (the report's `inference`)."""

    providers_active: list[str]
    model_path: str
    map: float
    map50: float
    latency_ms_p50: float
    latency_ms_p95: float
    throughput_per_s: float  # images per second at batch_size
    batch_size: int
    samples: int
    timed_batches: int
    image_size: list[int]

    def report_section(self) -> dict:
        return dict(vars(self))


def run_test_split(session, model_path: str, x: np.ndarray, y: Sequence[np.ndarray],
                   labels: Sequence[str], train_boxes: Sequence[int] | None, batch_size: int
                   ) -> tuple[DetectionRun, dict, list[Detections]]:
    """The test split's detections, their evaluation section and the timing of the session at
    `batch_size` (30 batches at least, one whole pass)."""
    if len(x) == 0:
        raise RuntimeFailure("no test images to run", "check the dataset's test split")
    run = detection_runner(session)
    found = predict_detections(run, x, batch_size)
    evaluation = evaluation_section(found, y, labels, train_boxes)
    evaluation["examples"] = example_pictures(x, y, found, labels)
    timed = whole_batches(batches(x, batch_size), batch_size)
    timings = time_runners([run], timed, max(30, len(timed)), min_seconds=0)
    result = DetectionRun(
        providers_active=session.get_providers(), model_path=str(model_path),
        map=evaluation["map"], map50=evaluation["map50"],
        latency_ms_p50=timings.percentile_ms(0, 50), latency_ms_p95=timings.percentile_ms(0, 95),
        throughput_per_s=timings.throughput(0), batch_size=batch_size, samples=len(x),
        timed_batches=len(timings.samples), image_size=list(x.shape[-2:]))
    return result, evaluation, found


def tta_section(plain: DetectionRunner, merged: DetectionRunner,
                fused_and_exact: Callable[[np.ndarray], tuple[list[Detections],
                                                              list[Detections]]],
                views: str, x: np.ndarray, y: Sequence[np.ndarray], labels: Sequence[str],
                batch_size: int, fusion: dict, plain_found: Sequence[Detections] | None = None
                ) -> dict:
    """The TTA graph (`merged`) against the plain one on the test split: mAP@[.5:.95] and
    mAP@.5 of each, and of exact weighted box fusion (wbf.py) of the same views' detections
    (`fused_and_exact`: a batch → the graph's fused detections and exact WBF's, from the TTA
    graph's inner tensors: fusion.inner_runner), and the cost (both graphs timed in turns at
    `batch_size`); the verdict says plainly when TTA does not help."""
    if plain_found is None:
        plain_found = predict_detections(plain, x, batch_size)
    fused: list[Detections] = []
    exact: list[Detections] = []
    for batch in batches(x, batch_size):
        got, wbf = fused_and_exact(batch)
        fused += got
        exact += wbf
    scores = {name: detection_metrics(list(found), list(y), list(labels))
              for name, found in (("plain", plain_found), ("tta", fused), ("wbf", exact))}
    timed = whole_batches(batches(x, batch_size), batch_size)
    timings = time_runners([plain, merged], timed, max(10, len(timed)), min_seconds=0)
    cost = timings.percentile_ms(1, 50) / max(timings.percentile_ms(0, 50), 1e-9)
    section = {"transforms": views, "views": 1 + len(views.split(",")), "backend": "graph",
               "plan": "graph", "fusion": fusion.get("rule"),
               "fusion_iou": fusion.get("fusion_iou"),
               **{f"{key}{suffix}": scores[name][key] for key in ("map", "map50")
                  for name, suffix in (("plain", "_plain"), ("tta", ""), ("wbf", "_wbf"))},
               "latency_ms_p50_plain": timings.percentile_ms(0, 50),
               "latency_ms_p50": timings.percentile_ms(1, 50), "cost_ratio": round(cost, 3)}
    section["verdict"] = tta_verdict(section)
    return section


def tta_verdict(section: dict) -> str:
    """Whether TTA helped, in mAP@[.5:.95] (and mAP@.5), at what cost; how far exact WBF is."""
    views, cost = section["transforms"], section["cost_ratio"]
    gain = section["map"] - section["map_plain"]
    gain50 = section["map50"] - section["map50_plain"]
    exact = (f"; exact WBF of the same views' detections: mAP@[.5:.95] "
             f"{section['map_wbf']:.4f}, mAP@.5 {section['map50_wbf']:.4f}")
    if gain > 0:
        return (f"TTA ({views}) raised test mAP@[.5:.95] by {gain:+.4f} (mAP@.5 {gain50:+.4f}) "
                f"at {cost:.1f}x the plain graph's latency{exact}")
    mirror = (" (hflip mirrors objects whose side matters, e.g. digits)"
              if "hflip" in views.split(",") else "")
    return (f"TTA ({views}) did not help{mirror}: test mAP@[.5:.95] {gain:+.4f} (mAP@.5 "
            f"{gain50:+.4f}) at {cost:.1f}x the plain graph's latency; serve the plain "
            f"graph{exact}")


def draw_boxes(image: np.ndarray, boxes: np.ndarray, classes: Sequence[int],
               labels: Sequence[str], colour: tuple[int, int, int],
               scores: np.ndarray | None = None):
    """A (C, H, W) image in [0, 1] as an RGB Pillow picture with its boxes drawn, each named by
    its class (and score)."""
    from PIL import Image

    picture = rgb_picture(image)
    scale = max(1, EXAMPLE_MAX_SIDE // max(picture.size))
    if scale > 1:  # small canvases: drawn larger, so that names are legible
        picture = picture.resize((picture.width * scale, picture.height * scale),
                                 Image.Resampling.NEAREST)
    return draw_on(picture, boxes, classes, labels, colour, scores, scale)


def rgb_picture(image: np.ndarray):
    """A (C, H, W) image in [0, 1] (C = 1 or 3) as an RGB Pillow picture of its size."""
    from PIL import Image

    pixels = np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)
    rgb = np.repeat(pixels, 3, axis=0) if pixels.shape[0] == 1 else pixels[:3]
    return Image.fromarray(np.ascontiguousarray(np.moveaxis(rgb, 0, -1)), mode="RGB")


def draw_on(picture, boxes: np.ndarray, classes: Sequence[int], labels: Sequence[str],
            colour: tuple[int, int, int], scores: np.ndarray | None = None, scale: float = 1,
            width: int = 1):
    """`picture` (an RGB Pillow image) with the boxes (xyxy, times `scale` in its pixels) drawn
    in place with lines `width` pixels wide, each named by its class (and score); returned."""
    from PIL import ImageDraw

    pen = ImageDraw.Draw(picture)
    for k, box in enumerate(np.asarray(boxes, np.float32).reshape(-1, 4)):
        x1, y1, x2, y2 = (float(v) * scale for v in box)
        pen.rectangle([x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)], outline=colour, width=width)
        name = str(labels[int(classes[k])]) if 0 <= int(classes[k]) < len(labels) else "?"
        if scores is not None:
            name += f" {float(scores[k]):.2f}"
        pen.text((x1 + 1, y1), name, fill=colour)
    return picture


def example_pictures(x: np.ndarray, truth: Sequence[np.ndarray], found: Sequence[Detections],
                     labels: Sequence[str], count: int = EXAMPLES) -> list[dict]:
    """The first `count` test images (the split is shuffled by the seed) as the report's
    examples: the image with its true boxes, and with the predicted boxes scored at least
    EXAMPLE_MIN_SCORE, as PNG data URLs."""
    from ttc.tasks.segment.evaluate import png_data_url

    examples = []
    for k in range(min(count, len(x))):
        true_boxes = np.asarray(truth[k], np.float32).reshape(-1, 5)
        boxes, scores, classes = found[k]
        shown = scores >= EXAMPLE_MIN_SCORE
        examples.append({
            "index": k, "size": list(x[k].shape[-2:]), "true_boxes": len(true_boxes),
            "predicted_boxes": int(shown.sum()),
            "truth": png_data_url(np.asarray(draw_boxes(
                x[k], true_boxes[:, 1:], true_boxes[:, 0].astype(int), labels, TRUE_COLOUR))),
            "predicted": png_data_url(np.asarray(draw_boxes(
                x[k], boxes[shown], classes[shown], labels, PREDICTED_COLOUR, scores[shown])))})
    return examples
