"""Weighted box fusion (ttc/tasks/detect/wbf.py) against cases computed by hand."""
from __future__ import annotations

import numpy as np
import pytest

from ttc.tasks.detect.wbf import weighted_box_fusion

F = np.float32


def two_views() -> tuple[list, list, list]:
    """View 1: class 0 [10,10,50,50] 0.9 and class 1 [10,10,50,50] 0.8.
    View 2: class 0 [12,10,52,50] 0.6 (IoU with view 1's class-0 box 38×40 / (1600 + 1600 -
    1520) = 0.905 > 0.55: fused) and class 0 [100,100,120,120] 0.5 (overlaps nothing)."""
    boxes = [np.array([[10, 10, 50, 50], [10, 10, 50, 50]], F),
             np.array([[12, 10, 52, 50], [100, 100, 120, 120]], F)]
    scores = [np.array([0.9, 0.8], F), np.array([0.6, 0.5], F)]
    labels = [np.array([0, 1]), np.array([0, 0])]
    return boxes, scores, labels


def test_overlapping_boxes_of_one_class_fuse_to_their_score_weighted_mean():
    boxes, scores, labels = weighted_box_fusion(*two_views())
    # class 0 cluster: x1 = (0.9×10 + 0.6×12) / 1.5 = 10.8, x2 = (0.9×50 + 0.6×52) / 1.5 = 50.8;
    # score = mean(0.9, 0.6) × min(2 boxes, 2 views) / 2 views = 0.75.
    # Class 1's box overlaps it exactly but is another class: not fused; alone, found by one
    # view of 2: 0.8 × 1/2 = 0.4. The lone class-0 box: 0.5 × 1/2 = 0.25. Sorted by score.
    assert boxes == pytest.approx(np.array([[10.8, 10, 50.8, 50], [10, 10, 50, 50],
                                            [100, 100, 120, 120]]), abs=1e-5)
    assert scores == pytest.approx([0.75, 0.4, 0.25], abs=1e-6)
    assert labels.tolist() == [0, 1, 0]
    assert (boxes.dtype, scores.dtype, labels.dtype) == (F, F, np.int64)


def test_view_weights_scale_the_scores_and_the_mean():
    boxes, scores, labels = weighted_box_fusion(*two_views(), weights=[2, 1])
    # weighted scores 1.8 (view 1) and 0.6: x1 = (1.8×10 + 0.6×12) / 2.4 = 10.5,
    # x2 = (1.8×50 + 0.6×52) / 2.4 = 50.5; score = mean(1.8, 0.6) × min(2, 2) / (2 + 1) = 0.8;
    # class 1: 1.6 × 1 / 3; the lone class-0 box of view 2: 0.5 × 1 / 3.
    assert boxes[0] == pytest.approx([10.5, 10, 50.5, 50], abs=1e-5)
    assert scores == pytest.approx([0.8, 1.6 / 3, 0.5 / 3], abs=1e-6)
    assert labels.tolist() == [0, 1, 0]


def test_more_boxes_than_views_in_a_cluster_keep_their_mean_score():
    # two boxes from view 1 and one from view 2 in one cluster: mean(0.9, 0.3, 0.6) ×
    # min(3, 2) / 2 = 0.6; x1 = (0.9×10 + 0.3×11 + 0.6×12) / 1.8 = 10.8333
    boxes, scores, _ = weighted_box_fusion(
        [np.array([[10, 10, 50, 50], [11, 10, 51, 50]], F), np.array([[12, 10, 52, 50]], F)],
        [np.array([0.9, 0.3], F), np.array([0.6], F)], [np.array([0, 0]), np.array([0])])
    assert scores == pytest.approx([0.6], abs=1e-6)
    assert boxes[0] == pytest.approx([19.5 / 1.8, 10, 91.5 / 1.8, 50], abs=1e-5)


def test_boxes_overlapping_at_most_the_threshold_stay_apart():
    # IoU of [10,10,50,50] and [30,10,70,50]: 800 / 2400 = 1/3, below 0.55
    boxes, scores, _ = weighted_box_fusion(
        [np.array([[10, 10, 50, 50]], F), np.array([[30, 10, 70, 50]], F)],
        [np.array([0.9], F), np.array([0.6], F)], [np.array([3]), np.array([3])])
    assert boxes.tolist() == [[10, 10, 50, 50], [30, 10, 70, 50]]
    assert scores == pytest.approx([0.45, 0.3], abs=1e-6)


def test_low_scores_and_zero_area_boxes_are_skipped_and_nothing_gives_empty_arrays():
    boxes, scores, labels = weighted_box_fusion(
        [np.array([[0, 0, 10, 10], [5, 5, 5, 20]], F)], [np.array([0.05, 0.9], F)],
        [np.array([0, 0])], skip_box_threshold=0.1)
    assert boxes.shape == (0, 4) and scores.shape == (0,) and labels.shape == (0,)
    with pytest.raises(ValueError, match="one boxes, scores and labels array per view"):
        weighted_box_fusion([], [], [])
