"""Weighted box fusion (Solovyev, Wang and Gabruseva 2019, "Weighted boxes fusion: ensembling
boxes from different object detection models"), the reference in numpy for one image: what
the `ensemble_boxes` package's weighted_boxes_fusion computes with conf_type "avg", without
its clipping to [0, 1] (our boxes are in pixels).

The views (e.g. the original image and its horizontal flip, boxes mapped back) each give
their detections of the image. Per class, boxes are taken by descending (weighted) score; a
box joins the cluster whose fused box it overlaps most when that IoU is above
`iou_threshold` (strictly), else it starts a cluster. A cluster's fused box is the
score-weighted mean of its boxes' coordinates; its score is the mean of its boxes' (weighted)
scores × min(boxes, views) / views (with view weights: × min(Σ..., views) / Σ weights, as
ensemble_boxes), so a box that only one of n views found keeps 1/n of its score.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

Boxes = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (K, 4) xyxy, scores (K,), labels (K,)


def weighted_box_fusion(boxes_list: Sequence[np.ndarray], scores_list: Sequence[np.ndarray],
                        labels_list: Sequence[np.ndarray], iou_threshold: float = 0.55,
                        skip_box_threshold: float = 0.0,
                        weights: Sequence[float] | None = None) -> Boxes:
    """The fused detections of one image from its views' (one (M_i, 4) xyxy boxes, (M_i,)
    scores, (M_i,) class indices per view): boxes float32 (K, 4), scores float32 (K,),
    labels int64 (K,), sorted by descending score. Boxes scored below `skip_box_threshold`
    and boxes of zero area are left out; `weights` (one per view, default 1) scale each
    view's scores."""
    views = len(boxes_list)
    if not views or len(scores_list) != views or len(labels_list) != views:
        raise ValueError(f"one boxes, scores and labels array per view: got {len(boxes_list)}, "
                         f"{len(scores_list)}, {len(labels_list)}")
    weights = np.ones(views) if weights is None else np.asarray(weights, np.float64)
    if weights.shape != (views,):
        raise ValueError(f"{weights.size} weights for {views} views")
    boxes, scores, labels = gathered(boxes_list, scores_list, labels_list, weights,
                                     skip_box_threshold)
    parts = [(*fuse_class(boxes[labels == label], scores[labels == label], iou_threshold,
                          weights), label) for label in np.unique(labels)]
    out_boxes = np.concatenate([np.zeros((0, 4))] + [p[0] for p in parts])
    out_scores = np.concatenate([np.zeros(0)] + [p[1] for p in parts])
    out_labels = np.concatenate([np.zeros(0, np.int64)]
                                + [np.full(len(p[1]), p[2], np.int64) for p in parts])
    order = np.argsort(-out_scores, kind="stable")
    return (out_boxes[order].astype(np.float32), out_scores[order].astype(np.float32),
            out_labels[order])


def gathered(boxes_list: Sequence[np.ndarray], scores_list: Sequence[np.ndarray],
             labels_list: Sequence[np.ndarray], weights: np.ndarray,
             skip_box_threshold: float) -> tuple[np.ndarray, ...]:
    """All views' boxes (float64, corners ordered), weighted scores and labels, less the
    boxes scored below the threshold (before weighting, as ensemble_boxes) or of zero area."""
    parts = []
    for view, (boxes, scores, labels) in enumerate(zip(boxes_list, scores_list, labels_list)):
        boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
        scores = np.asarray(scores, np.float64).ravel()
        labels = np.asarray(labels).astype(np.int64).ravel()
        if not len(boxes) == len(scores) == len(labels):
            raise ValueError(f"view {view}: {len(boxes)} boxes, {len(scores)} scores and "
                             f"{len(labels)} labels")
        boxes = np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]),
                                np.maximum(boxes[:, :2], boxes[:, 2:])], axis=1)
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        keep = (scores >= skip_box_threshold) & (area > 0)
        parts.append((boxes[keep], scores[keep] * weights[view], labels[keep]))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def fuse_class(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float,
               weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One class's boxes clustered and fused (see the module's docstring): the fused boxes
    (C, 4) and their scores (C,)."""
    order = np.argsort(-scores, kind="stable")
    members: list[list[int]] = []
    fused = np.zeros((0, 4))
    for index in order:
        match = best_match(fused, boxes[index], iou_threshold)
        if match < 0:
            members.append([index])
            fused = np.concatenate([fused, boxes[index][None]])
        else:
            members[match].append(index)
            fused[match] = weighted_mean_box(boxes[members[match]], scores[members[match]])
    fused_scores = np.array([scores[m].mean() * min(len(weights), len(m)) / weights.sum()
                             for m in members])
    return fused, fused_scores


def best_match(fused: np.ndarray, box: np.ndarray, iou_threshold: float) -> int:
    """The index of the fused box `box` overlaps most when that IoU is above the threshold,
    else -1."""
    if not len(fused):
        return -1
    ious = iou_with(fused, box)
    best = int(np.argmax(ious))
    return best if ious[best] > iou_threshold else -1


def iou_with(boxes: np.ndarray, box: np.ndarray) -> np.ndarray:
    """IoU of each of `boxes` (n, 4) with `box` (4,), xyxy in continuous coordinates."""
    width = np.clip(np.minimum(boxes[:, 2], box[2]) - np.maximum(boxes[:, 0], box[0]), 0, None)
    height = np.clip(np.minimum(boxes[:, 3], box[3]) - np.maximum(boxes[:, 1], box[1]), 0, None)
    inter = width * height
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = areas + (box[2] - box[0]) * (box[3] - box[1]) - inter
    return inter / np.maximum(union, np.finfo(np.float64).tiny)


def weighted_mean_box(boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The score-weighted mean of the boxes' coordinates (the plain mean when all scores are
    0, which a skip_box_threshold of 0 lets through)."""
    total = scores.sum()
    if total <= 0:
        return boxes.mean(axis=0)
    return (boxes * scores[:, None]).sum(axis=0) / total
