"""Test-time training for a segmenter (issue 43, item 4): BatchNorm re-estimation (`bn`) on each
batch of test images, through the bundle's adaptation graph (model.bn.onnx, rewritten by
ttc/testtime/ttt.py so that every BatchNormalization normalises with the batch's statistics
blended with the stored ones by --ttt_bn_prior), episodic: every batch starts from the bundle's
statistics. A batch of images holds thousands of pixels per channel, so even one image gives
usable statistics. With --eval_shift, the same on each corruption of the test images (the
photometric ones: a geometric shift would move the pixels away from their masks): mean IoU
before and after, per corruption. ONNX Runtime only; no torch."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ttc.inputs.shifts import corrupt
from ttc.tasks.segment.evaluate import MaskRunner, batches, confusion_of
from ttc.tasks.segment.metrics import summary_scores
from ttc.testtime.ttt import AdaptationGraph

METRIC = "mean_iou"  # what the section's accuracy_* cells hold (the classifiers': accuracy)


def adapted_runner(graph: AdaptationGraph, prior: float) -> MaskRunner:
    """A batch → its masks after bn: the argmax of the probabilities the adaptation graph gives
    with the batch's own (blended) statistics."""
    return lambda batch: graph.run(batch, prior, {})[0].argmax(axis=1)


def scored_pass(run: MaskRunner, x: np.ndarray, y: np.ndarray, num_classes: int,
                ignore_index: int, batch_size: int) -> tuple[dict, float]:
    """(mean IoU and pixel accuracy over the split, seconds) of one pass, a batch at a time."""
    started = time.perf_counter()
    masks = np.concatenate([run(batch) for batch in batches(x, batch_size)])
    seconds = time.perf_counter() - started
    return summary_scores(confusion_of(masks, y, num_classes, ignore_index).matrix), seconds


def data_row(source: MaskRunner, adapted: MaskRunner, x: np.ndarray, y: np.ndarray,
             num_classes: int, ignore_index: int, batch_size: int) -> dict:
    before, plain_seconds = scored_pass(source, x, y, num_classes, ignore_index, batch_size)
    after, bn_seconds = scored_pass(adapted, x, y, num_classes, ignore_index, batch_size)
    return {"accuracy_source": before[METRIC], "accuracy_bn": after[METRIC],
            "mean_iou_source": before["mean_iou"], "mean_iou_bn": after["mean_iou"],
            "pixel_accuracy_source": before["pixel_accuracy"],
            "pixel_accuracy_bn": after["pixel_accuracy"],
            "cost_ratio_bn": round(bn_seconds / max(plain_seconds, 1e-9), 3)}


def mean_row(rows: Sequence[dict]) -> dict | None:
    if not rows:
        return None
    keys = [k for k in rows[0] if k not in ("name", "severity")]
    return {k: float(np.mean([row[k] for row in rows])) for k in keys}


def dense_ttt_section(graph: AdaptationGraph, source: MaskRunner, x: np.ndarray,
                      y: np.ndarray, labels: Sequence[str], preprocessing: dict,
                      batch_size: int, prior: float, shifts: Sequence[str], severity: int,
                      seed: int) -> dict:
    """The report's `ttt` for a segmenter, in the classifiers' shape (clean, shifts,
    mean_shifted; each row's accuracy_* cells hold mean IoU: `metric` says so), with the
    verdict."""
    adapted = adapted_runner(graph, prior)
    ignore_index, classes = preprocessing["ignore_index"], len(labels)
    clean = data_row(source, adapted, x, y, classes, ignore_index, batch_size)
    rows = [{"name": name, "severity": severity,
             **data_row(source, adapted, corrupt(x, name, severity, preprocessing, seed), y,
                        classes, ignore_index, batch_size)} for name in shifts]
    section = {"method": "bn", "mode": "episodic", "batch_size": batch_size,
               "bn_prior": prior, "iterations": 1, "metric": METRIC, "clean": clean,
               "shifts": rows, "mean_shifted": mean_row(rows)}
    section["verdict"] = verdict(clean, section["mean_shifted"])
    return section


def verdict(clean: dict, shifted: dict | None) -> str:
    parts = []
    for name, row in (("the corruptions (mean)", shifted), ("clean images", clean)):
        if row is None:
            continue
        gain = row["mean_iou_bn"] - row["mean_iou_source"]
        parts.append(f"bn {'raised' if gain > 0 else 'did not raise'} mean IoU on {name} "
                     f"({row['mean_iou_source']:.4f} → {row['mean_iou_bn']:.4f}, {gain:+.4f})")
    return "; ".join(parts)
