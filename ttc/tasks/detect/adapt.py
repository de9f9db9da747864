"""Test-time training for a detector (issue 44, item 5), episodic: every batch of test images
starts from the bundle's parameters. `bn` re-estimates BatchNorm statistics on the batch,
through the bundle's adaptation graph (model.bn.onnx: the network with its BatchNormalization
nodes kept and the same NMS appended, rewritten by ttc/testtime/ttt.py so that every
BatchNormalization normalises with the batch's statistics blended with the stored ones by
--ttt_bn_prior). With --eval_shift, the same on each photometric corruption of the test images:
COCO mAP before and after, per corruption. ONNX Runtime only: no torch."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ttc.tasks.detect.evaluate import (OUTPUTS, DetectionRunner, predict_detections,
                                       unpadded)
from ttc.tasks.detect.metrics import detection_metrics
from ttc.tasks.segment.adapt import EpisodicScores, episodic_section
from ttc.testtime.ttt import AdaptationGraph

METRIC = "map"  # what the section's accuracy_* cells hold (the classifiers': accuracy)
SCORES = EpisodicScores(METRIC, ("map", "map50"), "map50", "mAP@.5")


def adapted_runner(graph: AdaptationGraph, prior: float) -> DetectionRunner:
    """A batch → its detections after bn: the adaptation graph's, with the batch's own
    (blended) statistics."""
    return lambda batch: unpadded(*graph.run_outputs(batch, prior, {})[0])


def adaptation_graph(model, make_session) -> AdaptationGraph:
    """The bundle's model.bn.onnx as an AdaptationGraph returning the four detection outputs."""
    return AdaptationGraph(model, make_session, primary=OUTPUTS)


def scored_pass(run: DetectionRunner, x: np.ndarray, y: Sequence[np.ndarray],
                labels: Sequence[str], batch_size: int) -> tuple[dict, float]:
    """(COCO's figures over the split, seconds) of one pass, a batch at a time."""
    started = time.perf_counter()
    found = predict_detections(run, x, batch_size)
    seconds = time.perf_counter() - started
    return detection_metrics(found, list(y), list(labels)), seconds


def detection_ttt_section(source: DetectionRunner, adapted: dict[str, DetectionRunner],
                          x: np.ndarray, y: Sequence[np.ndarray], labels: Sequence[str],
                          preprocessing: dict, batch_size: int, shifts: Sequence[str],
                          severity: int, seed: int, settings: dict) -> dict:
    """The report's `ttt` for a detector, in the classifiers' shape (clean, shifts,
    mean_shifted; each row's accuracy_* cells hold mAP@[.5:.95]: `metric` says so), with the
    verdict (the segmenter's episodic_section). `settings`: the section's method and
    bn_prior."""
    return episodic_section(
        lambda run, images: scored_pass(run, images, y, labels, batch_size),
        source, adapted, x, preprocessing, shifts, severity, seed, batch_size, settings, SCORES)

