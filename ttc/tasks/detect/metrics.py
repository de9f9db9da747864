"""Detection metrics, COCO's own: mAP@[.5:.95], mAP@.5, mAP@.75, recall at 100 detections,
per-class AP and the precision/recall curve at IoU 0.5, computed by pycocotools' COCOeval
(iouType "bbox") on COCO objects built in memory (no file), with its printing kept off our
stdout; and the verdict against the trivial baseline, an empty detector (mAP 0).

COCOeval's standard parameters, unchanged: IoU thresholds .50:.05:.95, 101 recall points
0:.01:1 (precision interpolated to its monotone envelope and read at each point), maxDets
[1, 10, 100] (the figures here use 100: at most 100 detections per image and class, the best
scored), area ranges all / small (< 32²) / medium (< 96²) / large; the headline figures use
"all". Boxes go in as xyxy (continuous pixel coordinates, ttc/tasks/detect's contract) and
are handed to pycocotools as [x, y, width, height] with width = x2 - x1: pycocotools ≥ 2.0
computes IoU in continuous coordinates (no +1, unlike the old Matlab API), so a box's area is
width × height. A truth's `area` (for the area ranges) is its box's; none is a crowd.

Conventions kept from COCO: a class with no true instance has no AP (COCO's -1; None here) and
is left out of the means; detections of such a class are not counted against anything. The
means are 0.0, never NaN, when nothing is detected, and 0.0 when no class has an instance.
"""
from __future__ import annotations

import contextlib
import io
from typing import Sequence

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from ttc.reporting.evaluation import (BASELINE_MARGIN, never_right_warning,
                                      not_learned_warning)

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4) xyxy, scores, labels

MAX_DETECTIONS = 100  # COCO's maxDets[-1]: the detections per image and class scored
BASELINE_MAP = 0.0  # the trivial baseline: an empty detector finds nothing, mAP 0
BASELINE_NAME = "an empty detector"
AREAS = ("all", "small", "medium", "large")  # COCOeval's areaRngLbl, in its order


def detection_metrics(predictions: Sequence[Detections], truths: Sequence[np.ndarray],
                      labels: Sequence[str]) -> dict:
    """COCO's bbox evaluation of `predictions` (one (boxes (M, 4) xyxy, scores (M,), labels
    (M,) class index) tuple per image, padding rows removed) against `truths` (one (k, 5)
    [class, x1, y1, x2, y2] array per image) for the classes `labels`.

    Returns map (AP@[.5:.95]), map50, map75, recall_100 (AR@100), map_small / map_medium /
    map_large (None where no instance has that size), per_class [{label, ap, ap50, ap75,
    instances, detections}] (ap None for a class without an instance), pr_curve (see
    pr_curve_section), images, instances, detections, baseline_map (0.0)."""
    check_inputs(predictions, truths, len(labels))
    evaluator = evaluate(predictions, truths, len(labels))
    precision = evaluator.eval["precision"][..., -1]  # (T, R, K, A) at 100 detections
    recall = evaluator.eval["recall"][..., -1]  # (T, K, A)
    instances = class_counts([t[:, 0] for t in truths], len(labels))
    detected = class_counts([p[2] for p in predictions], len(labels))
    area_maps = {f"map_{area}": mean_or_none(precision[:, :, :, a])
                 for a, area in enumerate(AREAS) if area != "all"}
    return {
        "map": mean_or_zero(precision[:, :, :, 0]),
        "map50": mean_or_zero(precision[0, :, :, 0]),
        "map75": mean_or_zero(precision[5, :, :, 0]),
        "recall_100": mean_or_zero(recall[:, :, 0]),
        **area_maps,
        "per_class": [{"label": label, "ap": mean_or_none(precision[:, :, k, 0]),
                       "ap50": mean_or_none(precision[0, :, k, 0]),
                       "ap75": mean_or_none(precision[5, :, k, 0]),
                       "instances": int(instances[k]), "detections": int(detected[k])}
                      for k, label in enumerate(labels)],
        "pr_curve": pr_curve_section(precision[0, :, :, 0], evaluator.params.recThrs),
        "images": len(truths), "instances": int(instances.sum()),
        "detections": int(detected.sum()), "baseline_map": BASELINE_MAP}


def check_inputs(predictions: Sequence[Detections], truths: Sequence[np.ndarray],
                 num_classes: int) -> None:
    """ValueError for predictions and truths that do not pair up or hold another shape or
    class index than the module's contract."""
    if len(predictions) != len(truths):
        raise ValueError(f"{len(predictions)} images of predictions for {len(truths)} of truth")
    for i, (prediction, truth) in enumerate(zip(predictions, truths)):
        boxes, scores, classes = (np.asarray(a) for a in prediction)
        if (scores.shape != (len(scores),) or classes.shape != scores.shape
                or boxes.shape != (len(scores), 4)):
            raise ValueError(f"image {i}: predictions need boxes (M, 4), scores (M,) and "
                             f"labels (M,): got {boxes.shape}, {scores.shape}, {classes.shape}")
        truth = np.asarray(truth)
        if truth.ndim != 2 or truth.shape[1] != 5:
            raise ValueError(f"image {i}: a truth must be a (k, 5) array, got {truth.shape}")
        for name, values in (("predicted", classes), ("true", truth[:, 0])):
            if values.size and (values.min() < 0 or values.max() >= num_classes):
                raise ValueError(f"image {i}: {name} class indices must lie in "
                                 f"[0, {num_classes}): found {values.min()}..{values.max()}")


def evaluate(predictions: Sequence[Detections], truths: Sequence[np.ndarray],
             num_classes: int) -> COCOeval:
    """COCOeval, evaluated and accumulated on in-memory COCO objects (image ids 1..N,
    category ids 1..K, annotation ids from 1: COCOeval reads a match to id 0 as no match),
    everything pycocotools prints sent to a sink."""
    images = [{"id": i + 1} for i in range(len(truths))]
    categories = [{"id": k + 1, "name": str(k)} for k in range(num_classes)]
    with contextlib.redirect_stdout(io.StringIO()):
        ground = coco_object(images, categories, truth_annotations(truths))
        found = coco_object(images, categories, detection_annotations(predictions))
        evaluator = COCOeval(ground, found, iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
    return evaluator


def coco_object(images: list[dict], categories: list[dict], annotations: list[dict]) -> COCO:
    """A COCO dataset in memory (COCO.loadRes is not used: it fails on an empty list)."""
    coco = COCO()
    coco.dataset = {"images": images, "categories": categories, "annotations": annotations}
    coco.createIndex()
    return coco


def coco_box(box: Sequence[float]) -> tuple[list[float], float]:
    """xyxy → COCO's [x, y, width, height] and the area width × height."""
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1, y1, x2 - x1, y2 - y1], (x2 - x1) * (y2 - y1)


def truth_annotations(truths: Sequence[np.ndarray]) -> list[dict]:
    annotations = []
    for i, truth in enumerate(truths):
        for row in np.asarray(truth, np.float64).reshape(-1, 5):
            bbox, area = coco_box(row[1:])
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": int(row[0]) + 1, "bbox": bbox, "area": area,
                                "iscrowd": 0})
    return annotations


def detection_annotations(predictions: Sequence[Detections]) -> list[dict]:
    annotations = []
    for i, (boxes, scores, classes) in enumerate(predictions):
        for box, score, label in zip(np.asarray(boxes, np.float64).reshape(-1, 4),
                                     np.asarray(scores, np.float64), np.asarray(classes)):
            bbox, area = coco_box(box)
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1,
                                "category_id": int(label) + 1, "bbox": bbox, "area": area,
                                "score": float(score), "iscrowd": 0})
    return annotations


def class_counts(class_lists: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    indices = [np.asarray(c).astype(np.int64).ravel() for c in class_lists]
    flat = np.concatenate(indices) if indices else np.zeros(0, np.int64)
    return np.bincount(flat, minlength=num_classes)[:num_classes]


def mean_or_none(values: np.ndarray) -> float | None:
    """The mean of COCO's values that are defined (> -1: COCO's -1 marks a class without an
    instance), None when none is."""
    defined = values[values > -1]
    return float(defined.mean()) if defined.size else None


def mean_or_zero(values: np.ndarray) -> float:
    mean = mean_or_none(values)
    return 0.0 if mean is None else mean


def pr_curve_section(precision: np.ndarray, recall_points: np.ndarray) -> dict:
    """The precision/recall curves at IoU 0.5 from COCOeval's (R, K) interpolated precision
    at 100 detections: recall (the 101 points), precision (the mean over the classes with an
    instance at each point, 0 where none has; its mean is map50) and per_class (one list per
    label, in the labels' order; None for a class without an instance)."""
    defined = (precision > -1).all(axis=0)
    overall = (precision[:, defined].mean(axis=1) if defined.any()
               else np.zeros(len(recall_points)))
    return {"iou_threshold": 0.5, "recall": [float(r) for r in recall_points],
            "precision": [float(p) for p in overall],
            "per_class": [[float(p) for p in precision[:, k]] if defined[k] else None
                          for k in range(precision.shape[1])]}


def detection_warnings(section: dict, split: str = "test") -> list[str]:
    """What makes the detector useless as it is: an mAP not a point above the empty
    detector's 0, and classes with instances that are never detected right (AP 0)."""
    warnings = []
    if section["instances"] and section["map"] - section["baseline_map"] < BASELINE_MARGIN:
        warnings.append(not_learned_warning(f"{split} mAP@[.5:.95] {section['map']:.4f}",
                                            BASELINE_NAME, section["baseline_map"]))
    dead = [(row["label"], row["instances"]) for row in section["per_class"]
            if row["instances"] and row["ap"] == 0]
    if dead:
        warnings.append(never_right_warning(dead, "AP", "boxes", "their boxes",
                                            "give those classes more images, or train longer"))
    return warnings


def detection_verdict(section: dict, warnings: Sequence[str]) -> str:
    """"useful" or "NOT USEFUL as it is": mAP@[.5:.95] against the empty detector's."""
    gain = section["map"] - section["baseline_map"]
    against = (f"mAP@[.5:.95] {section['map']:.4f} against {section['baseline_map']:.4f} "
               f"for {BASELINE_NAME} ({gain:+.4f})")
    if warnings:
        return f"NOT USEFUL as it is: {against}; " + (
            "a class is never detected" if gain >= BASELINE_MARGIN else
            "it does not beat an empty detector")
    return f"useful: {against}; every class detected (mAP@.5 {section['map50']:.4f})"
