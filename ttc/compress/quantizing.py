"""What the int8 and fp16 variants ask of a model type (its `Parts.quantizing`), and a
classifier's answer, the default. A type's part is any object with:

- `calibration_batch`: samples per batch of static int8's calibration feeds;
- `scorer(manifest)`: what a variant is judged by against fp32 (`Scorer`);
- `kept_float(graph)`: the nodes of the prepared graph always kept float, or None (`KeptFloat`).

A segmenter's is in ttc/tasks/segment/quantize.py (mean IoU of its pixel probabilities), a
detector's in ttc/tasks/detect/quantize.py (COCO mAP; its head and NMS kept float). No torch.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np
import onnx

from ttc.reporting.metrics import accuracy, top1_agreement
from ttc.serving.runtime import predict_proba, session_runner

# Samples per calibration batch. ONNX Runtime's calibration session holds a whole batch's
# activations (its augmented graph outputs every tensor's range); the ranges are those of all the
# batches together, whatever their size. A detector's is smaller (ttc/tasks/detect/quantize.py).
CALIBRATION_BATCH = 32

Metric = Callable[[np.ndarray, np.ndarray], float]  # (probabilities, truth) → a score


class Scorer(Protocol):
    """How a variant's outputs are computed, scored (`name`: the judged figure, e.g. accuracy,
    mean_iou, map) and compared with fp32's."""

    name: str

    def runner(self, session) -> Callable[[np.ndarray], Any]: ...

    def predict(self, session, x: np.ndarray, batch_size: int) -> Any: ...

    def evaluate(self, outputs: Any, y: Any) -> dict[str, float]: ...

    def compare(self, outputs: Any, reference: Any) -> tuple[float, float]: ...


class KeptFloat(Protocol):
    """The nodes of a graph a type keeps float whatever the flags (a detector's head and NMS)."""

    def kept_float(self) -> list[str]: ...

    def section(self, model: onnx.ModelProto, op_types: Sequence[str]) -> dict:
        """The report's quantize.exclusion.kept_float; its `quantizable` nodes join `excluded`."""
        ...

    def problems(self, int8: onnx.ModelProto) -> list[str]:
        """What an int8 graph quantized anyway of the nodes meant to stay float."""
        ...


class Quantizing(Protocol):
    """A model type's Parts.quantizing (see the module's docstring)."""

    calibration_batch: int

    def scorer(self, manifest) -> Scorer: ...

    def kept_float(self, graph: onnx.ModelProto) -> KeptFloat | None: ...


class ProbabilityScorer:
    """What a variant is judged by, for graphs whose output is "probabilities" (classifiers):
    `metric` of the probabilities; agreement: top-1; difference: the largest of |p - p_fp32|.
    A segmenter's is one of these on mean IoU (ttc/tasks/segment/quantize.py); a detector's
    counterpart, with the same methods: ttc/tasks/detect/quantize.py's DetectionScorer."""

    def __init__(self, name: str = "accuracy", metric: Metric = accuracy) -> None:
        self.name, self.metric = name, metric

    def runner(self, session) -> Callable[[np.ndarray], np.ndarray]:
        return session_runner(session)

    def predict(self, session, x: np.ndarray, batch_size: int) -> np.ndarray:
        return predict_proba(session, x, batch_size)

    def evaluate(self, probabilities: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The judged figure first (by `name`), then any other."""
        return {self.name: self.metric(probabilities, y)}

    def compare(self, probabilities: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
        return (top1_agreement(probabilities, reference),
                float(np.abs(probabilities - reference).max()))


class ClassifierQuantizing:
    """A classifier's part: judged by accuracy, calibrated 32 samples a batch, nothing kept
    float but what the flags say."""

    calibration_batch = CALIBRATION_BATCH

    def scorer(self, manifest) -> Scorer:
        return ProbabilityScorer()

    def kept_float(self, graph: onnx.ModelProto) -> KeptFloat | None:
        return None


QUANTIZING = ClassifierQuantizing()
