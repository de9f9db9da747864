"""int8 and fp16 for a segmenter: its `Parts.quantizing` (QUANTIZING; the shape:
ttc/compress/quantizing.py). A variant is judged by the mean IoU of the masks its pixel
probabilities give (argmax over the class axis, void pixels left out), calibrated 32 images a
batch as a classifier's, no node kept float but what the flags say. No torch."""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from ttc.reporting.metrics import top1_agreement
from ttc.serving.runtime import predict_proba, session_runner
from ttc.tasks.segment.evaluate import probabilities_mean_iou

CALIBRATION_BATCH = 32  # images per calibration batch, a classifier's


class PixelScorer:
    """A segmenter's counterpart of ttc/compress/quantizing.py's ProbabilityScorer (the same
    methods): "mean_iou" of the probabilities (N, K, H, W); agreement: top-1 per pixel;
    difference: the largest of |p - p_fp32|."""

    name = "mean_iou"

    def __init__(self, num_classes: int, ignore_index: int) -> None:
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def runner(self, session) -> Callable[[np.ndarray], np.ndarray]:
        return session_runner(session)

    def predict(self, session, x: np.ndarray, batch_size: int) -> np.ndarray:
        return predict_proba(session, x, batch_size)

    def evaluate(self, probabilities: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return {self.name: probabilities_mean_iou(probabilities, y, self.num_classes,
                                                  self.ignore_index)}

    def compare(self, probabilities: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
        return (top1_agreement(probabilities, reference),
                float(np.abs(probabilities - reference).max()))


class SegmenterQuantizing:
    """A segmenter's part in int8 and fp16 (see the module's docstring)."""

    calibration_batch = CALIBRATION_BATCH

    def scorer(self, manifest) -> PixelScorer:
        return PixelScorer(manifest.classes, manifest.preprocessing.spec["ignore_index"])

    def kept_float(self, graph: onnx.ModelProto) -> None:
        return None


QUANTIZING = SegmenterQuantizing()
