"""Detection metrics (ttc/tasks/detect/metrics.py): COCO mAP on a case computed by hand, the
edge cases (perfect, empty, a class without instances), pycocotools' printing kept off stdout,
and agreement with pycocotools used the usual way (a JSON file, loadRes, summarize)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from ttc.tasks.detect.metrics import (detection_metrics, detection_verdict,
                                      detection_warnings)

LABELS = ["a", "b", "c"]
F = np.float32


def hand_case() -> tuple[list, list]:
    """Two images, classes a (3 boxes), b (1 box), c (none).

    Image 1: truth a [0,0,10,10], a [20,20,30,30], b [40,40,60,60];
             predicted a [0,0,10,10] 0.9 (exact: a hit at every IoU), a [50,50,60,60] 0.8
             (overlaps nothing: a false positive), b [40,40,60,54.4] 0.7 (IoU 20×14.4/400 =
             0.72: a hit at IoU .50 .. .70, a miss at .75 .. .95); a [20,20,30,30] is missed.
    Image 2: truth a [0,0,20,20]; predicted a [0,0,20,20] 0.6 (exact), c [70,70,80,80] 0.95
             (class c has no instance: not counted against anything).

    Class a, at every IoU threshold, by descending score: hit, false positive, hit of 3 boxes:
    recall 1/3, 1/3, 2/3; precision 1, 1/2, 2/3 → envelope 1, 2/3, 2/3. COCO reads it at the
    101 recall points 0, .01, .., 1 (the first detection whose recall reaches the point):
    0 .. .33 (34 points) → 1, .34 .. .66 (33 points) → 2/3, .67 .. 1 (34 points) → 0 (recall
    never reaches them). AP = (34 × 1 + 33 × 2/3) / 101 = 56/101 = 0.5545 at every IoU.
    Class b: AP 1 at the 5 thresholds .50 .. .70, 0 at the other 5: AP 0.5, AP50 1, AP75 0.
    Class c: no instance, AP None, left out of the means.
    mAP = (56/101 + 0.5) / 2; mAP@.5 = (56/101 + 1) / 2; mAP@.75 = (56/101 + 0) / 2.
    AR@100: class a recalls 2/3 at every threshold, b 1 at half of them: (2/3 + 1/2) / 2 = 7/12.
    """
    truths = [np.array([[0, 0, 0, 10, 10], [0, 20, 20, 30, 30], [1, 40, 40, 60, 60]], F),
              np.array([[0, 0, 0, 20, 20]], F)]
    predictions = [(np.array([[0, 0, 10, 10], [50, 50, 60, 60], [40, 40, 60, 54.4]], F),
                    np.array([0.9, 0.8, 0.7], F), np.array([0, 0, 1])),
                   (np.array([[0, 0, 20, 20], [70, 70, 80, 80]], F),
                    np.array([0.6, 0.95], F), np.array([0, 2]))]
    return predictions, truths


def empty(count: int) -> list:
    return [(np.zeros((0, 4), F), np.zeros(0, F), np.zeros(0, np.int64))] * count


def test_map_of_the_hand_made_case_is_the_hand_computed_one(capsys):
    result = detection_metrics(*hand_case(), LABELS)
    ap_a = 56 / 101
    assert result["map"] == pytest.approx((ap_a + 0.5) / 2, abs=1e-9)
    assert result["map50"] == pytest.approx((ap_a + 1) / 2, abs=1e-9)
    assert result["map75"] == pytest.approx(ap_a / 2, abs=1e-9)
    assert result["recall_100"] == pytest.approx(7 / 12, abs=1e-9)
    a, b, c = result["per_class"]
    assert (a["label"], a["instances"], a["detections"]) == ("a", 3, 3)
    assert a["ap"] == a["ap50"] == pytest.approx(ap_a, abs=1e-9)
    assert (b["ap"], b["ap50"], b["ap75"]) == pytest.approx((0.5, 1.0, 0.0), abs=1e-9)
    assert c == {"label": "c", "ap": None, "ap50": None, "ap75": None, "instances": 0,
                 "detections": 1}
    assert (result["images"], result["instances"], result["detections"]) == (2, 4, 5)
    # every box is under 32² pixels: COCO's "small" range holds them all, the others none
    assert result["map_small"] == pytest.approx(result["map"])
    assert result["map_medium"] is None and result["map_large"] is None
    assert capsys.readouterr().out == ""


def test_the_pr_curve_at_iou_half_is_coco_s_interpolated_precision():
    curve = detection_metrics(*hand_case(), LABELS)["pr_curve"]
    assert curve["iou_threshold"] == 0.5
    assert curve["recall"] == pytest.approx([i / 100 for i in range(101)])
    a, b, c = curve["per_class"]
    assert a == pytest.approx([1.0] * 34 + [2 / 3] * 33 + [0.0] * 34, abs=1e-9)
    assert b == pytest.approx([1.0] * 101, abs=1e-9) and c is None
    assert curve["precision"] == pytest.approx([(x + y) / 2 for x, y in zip(a, b)])
    assert np.mean(curve["precision"]) == pytest.approx(
        detection_metrics(*hand_case(), LABELS)["map50"])


def test_perfect_predictions_score_one_and_are_useful():
    _, truths = hand_case()
    perfect = [(t[:, 1:], np.ones(len(t), F), t[:, 0].astype(np.int64)) for t in truths]
    result = detection_metrics(perfect, truths, LABELS)
    assert [result[k] for k in ("map", "map50", "map75", "recall_100")] == \
        pytest.approx([1.0] * 4, abs=1e-9)
    assert [row["ap"] for row in result["per_class"]][:2] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert detection_warnings(result) == []
    assert detection_verdict(result, []).startswith("useful: mAP@[.5:.95] 1.0000 against 0.0000")


def test_no_predictions_score_zero_not_nan_and_are_not_useful(capsys):
    _, truths = hand_case()
    result = detection_metrics(empty(2), truths, LABELS)
    assert [result[k] for k in ("map", "map50", "map75", "recall_100")] == [0.0] * 4
    assert [row["ap"] for row in result["per_class"]] == [0.0, 0.0, None]
    assert result["detections"] == 0 and result["pr_curve"]["precision"] == [0.0] * 101
    warnings = detection_warnings(result)
    assert len(warnings) == 2 and "'a' (3 boxes)" in warnings[1]
    assert detection_verdict(result, warnings).startswith("NOT USEFUL as it is")
    assert capsys.readouterr().out == ""


def test_no_instance_at_all_gives_zero_and_no_class_ap():
    result = detection_metrics(empty(1), [np.zeros((0, 5), F)], LABELS)
    assert result["map"] == 0.0 and result["instances"] == 0
    assert all(row["ap"] is None for row in result["per_class"])
    assert result["pr_curve"]["per_class"] == [None] * 3


def test_inputs_that_do_not_pair_up_are_refused():
    predictions, truths = hand_case()
    with pytest.raises(ValueError, match="2 images of predictions for 1"):
        detection_metrics(predictions, truths[:1], LABELS)
    with pytest.raises(ValueError, match=r"class indices must lie in \[0, 2\)"):
        detection_metrics(predictions, truths, LABELS[:2])


def random_case(rng: np.random.Generator, images: int) -> tuple[list, list]:
    """Truths of 0..5 boxes of 3 classes per image; predictions: jittered copies of about 80%
    of them (a fifth of those with a random class) and 0..2 random 10×10 false positives, with
    random scores."""
    truths, predictions = [], []
    for _ in range(images):
        k = int(rng.integers(0, 6))
        corner = rng.uniform(0, 70, (k, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(4, 50, (k, 2))], axis=1)
        classes = rng.integers(0, 3, k)
        truths.append(np.concatenate([classes[:, None], boxes], axis=1).astype(F))
        kept = rng.random(k) < 0.8
        found = boxes[kept] + rng.normal(0, 2, (int(kept.sum()), 4))
        found_classes = np.where(rng.random(len(found)) < 0.2, rng.integers(0, 3, len(found)),
                                 classes[kept])
        spurious = rng.uniform(0, 60, (int(rng.integers(0, 3)), 2))
        found = np.concatenate([found, np.concatenate([spurious, spurious + 10], axis=1)])
        found_classes = np.concatenate([found_classes, rng.integers(0, 3, len(spurious))])
        predictions.append((found.astype(F), rng.random(len(found)).astype(F), found_classes))
    return predictions, truths


def usual_pycocotools(predictions: list, truths: list, tmp_path) -> np.ndarray:
    """COCOeval's summary the way its users run it: ground truth from a JSON file, results
    through loadRes as [x, y, width, height] boxes."""
    gt = {"images": [{"id": i + 1} for i in range(len(truths))],
          "categories": [{"id": k + 1, "name": name} for k, name in enumerate(LABELS)],
          "annotations": [{"id": n + 1, "image_id": i + 1, "category_id": int(c) + 1,
                           "bbox": [float(x1), float(y1), float(x2 - x1), float(y2 - y1)],
                           "area": float((x2 - x1) * (y2 - y1)), "iscrowd": 0}
                          for n, (i, (c, x1, y1, x2, y2)) in enumerate(
                              (i, row) for i, t in enumerate(truths) for row in t)]}
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    results = [{"image_id": i + 1, "category_id": int(c) + 1, "score": float(s),
                "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
               for i, (boxes, scores, classes) in enumerate(predictions)
               for b, s, c in zip(boxes, scores, classes)]
    ground = COCO(str(tmp_path / "gt.json"))
    evaluator = COCOeval(ground, ground.loadRes(results), iouType="bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return evaluator.stats


def test_the_figures_equal_pycocotools_used_the_usual_way(tmp_path, capsys):
    predictions, truths = random_case(np.random.default_rng(7), 12)
    result = detection_metrics(predictions, truths, LABELS)
    stats = usual_pycocotools(predictions, truths, tmp_path)
    assert 0.1 < result["map"] < 0.9  # a case with hits and misses, not a degenerate one
    assert [result["map"], result["map50"], result["map75"], result["recall_100"]] == \
        pytest.approx([stats[0], stats[1], stats[2], stats[8]], abs=1e-12)
