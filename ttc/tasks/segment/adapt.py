"""Test-time training for a segmenter (issue 43, item 4), episodic: every batch of test images
starts from the bundle's parameters.
- `bn` re-estimates BatchNorm statistics on the batch, through the bundle's adaptation graph
  (model.bn.onnx, rewritten by ttc/testtime/ttt.py so that every BatchNormalization normalises
  with the batch's statistics blended with the stored ones by --ttt_bn_prior). A batch of
  images holds thousands of pixels per channel, so even one image gives usable statistics.
- `tent` minimises the mean entropy over the batch's pixels (ttt.py's Tent, whose softmax and
  entropy run over axis 1, a segmenter's class axis) in --ttt_iterations steps on a PyTorch copy
  of the network, then predicts through the adaptation graph with the adapted affine
  parameters (--ttt_predict after) or returns the last step's own forward (before). With
  --ttt_guard filter, pixels whose entropy is above EATA's limit stay out of the loss.
With --eval_shift, the same on each corruption of the test images (the photometric ones: a
geometric shift would move the pixels away from their masks): mean IoU before and after, per
corruption. bn runs in ONNX Runtime only; tent imports torch."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ttc.inputs.shifts import corrupt
from ttc.tasks.segment.evaluate import MaskRunner, batches, confusion_of
from ttc.tasks.segment.metrics import summary_scores
from ttc.testtime.ttt import AdaptationGraph, Tent

METRIC = "mean_iou"  # what the section's accuracy_* cells hold (the classifiers': accuracy)


def adapted_runner(graph: AdaptationGraph, prior: float) -> MaskRunner:
    """A batch → its masks after bn: the argmax of the probabilities the adaptation graph gives
    with the batch's own (blended) statistics."""
    return lambda batch: graph.run(batch, prior, {})[0].argmax(axis=1)


def tent_runner(graph: AdaptationGraph, tent: Tent, predict_before: bool) -> MaskRunner:
    """A batch → its masks after tent's steps on it, from the bundle's parameters."""
    def run(batch: np.ndarray) -> np.ndarray:
        tent.reset()
        observed = tent.step(batch)
        if predict_before and observed is not None:
            return observed.argmax(axis=1)
        return graph.run(batch, 0.0, tent.parameters())[0].argmax(axis=1)
    return run


def scored_pass(run: MaskRunner, x: np.ndarray, y: np.ndarray, num_classes: int,
                ignore_index: int, batch_size: int) -> tuple[dict, float]:
    """(mean IoU and pixel accuracy over the split, seconds) of one pass, a batch at a time."""
    started = time.perf_counter()
    masks = np.concatenate([run(batch) for batch in batches(x, batch_size)])
    seconds = time.perf_counter() - started
    return summary_scores(confusion_of(masks, y, num_classes, ignore_index).matrix), seconds


def data_row(source: MaskRunner, adapted: dict[str, MaskRunner], x: np.ndarray, y: np.ndarray,
             num_classes: int, ignore_index: int, batch_size: int) -> dict:
    """Mean IoU and pixel accuracy of the source graph and of each method's (`adapted`), with
    each method's cost against the source pass."""
    before, plain_seconds = scored_pass(source, x, y, num_classes, ignore_index, batch_size)
    row = {"accuracy_source": before[METRIC], "mean_iou_source": before["mean_iou"],
           "pixel_accuracy_source": before["pixel_accuracy"]}
    for method, run in adapted.items():
        after, seconds = scored_pass(run, x, y, num_classes, ignore_index, batch_size)
        row.update({f"accuracy_{method}": after[METRIC], f"mean_iou_{method}": after["mean_iou"],
                    f"pixel_accuracy_{method}": after["pixel_accuracy"],
                    f"cost_ratio_{method}": round(seconds / max(plain_seconds, 1e-9), 3)})
    return row


def mean_row(rows: Sequence[dict]) -> dict | None:
    if not rows:
        return None
    keys = [k for k in rows[0] if k not in ("name", "severity")]
    return {k: float(np.mean([row[k] for row in rows])) for k in keys}


def dense_ttt_section(source: MaskRunner, adapted: dict[str, MaskRunner], x: np.ndarray,
                      y: np.ndarray, labels: Sequence[str], preprocessing: dict,
                      batch_size: int, shifts: Sequence[str], severity: int, seed: int,
                      settings: dict) -> dict:
    """The report's `ttt` for a segmenter, in the classifiers' shape (clean, shifts,
    mean_shifted; each row's accuracy_* cells hold mean IoU: `metric` says so), with the
    verdict. `adapted`: each method's runner (bn: adapted_runner, tent: tent_runner);
    `settings`: the section's method, bn_prior, iterations, learning_rate, guard, predict."""
    ignore_index, classes = preprocessing["ignore_index"], len(labels)
    clean = data_row(source, adapted, x, y, classes, ignore_index, batch_size)
    rows = [{"name": name, "severity": severity,
             **data_row(source, adapted, corrupt(x, name, severity, preprocessing, seed), y,
                        classes, ignore_index, batch_size)} for name in shifts]
    section = {**settings, "mode": "episodic", "batch_size": batch_size, "metric": METRIC,
               "clean": clean, "shifts": rows, "mean_shifted": mean_row(rows)}
    section["verdict"] = verdict(clean, section["mean_shifted"], list(adapted))
    return section


def verdict(clean: dict, shifted: dict | None, methods: Sequence[str]) -> str:
    parts = []
    for method in methods:
        for name, row in (("the corruptions (mean)", shifted), ("clean images", clean)):
            if row is None:
                continue
            before, after = row["mean_iou_source"], row[f"mean_iou_{method}"]
            parts.append(f"{method} {'raised' if after > before else 'did not raise'} mean IoU "
                         f"on {name} ({before:.4f} → {after:.4f}, {after - before:+.4f})")
    return "; ".join(parts)
