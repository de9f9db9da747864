"""int8 and fp16 for a regressor: its `Parts.quantizing` (QUANTIZING; the shape:
ttc/compress/quantizing.py). A variant is judged by its RMSE, as the skill 1 - RMSE / σ (σ: the
training target's standard deviation), which is higher for a lower RMSE and has no unit, so the
shared gate reads it as it reads accuracy: --max_accuracy_drop 0.01 lets int8 add at most 1% of
σ to the RMSE. The test RMSEs themselves are reported beside it. No torch."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ttc.compress.quantizing import ClassifierQuantizing
from ttc.serving.runtime import session_runner
from ttc.tasks.regress import PREDICTION
from ttc.tasks.regress.stages import predict_split

AGREEMENT_SHARE = 0.01  # a row agrees with fp32 within this share of σ


class RmseScorer:
    """A variant's predictions, scored by `rmse_skill` (and `rmse`), compared with fp32's."""

    name = "rmse_skill"

    def __init__(self, std: float) -> None:
        self.std = std

    def runner(self, session) -> Callable[[np.ndarray], np.ndarray]:
        return session_runner(session, PREDICTION)

    def predict(self, session, x: np.ndarray, batch_size: int) -> np.ndarray:
        return predict_split(session, x, batch_size)

    def evaluate(self, predicted: np.ndarray, y: np.ndarray) -> dict[str, float]:
        error = float(np.sqrt(np.mean((predicted - np.asarray(y, np.float64)) ** 2)))
        return {self.name: 1.0 - error / self.std, "rmse": error}

    def compare(self, predicted: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
        difference = np.abs(predicted - reference)
        return (float(np.mean(difference <= AGREEMENT_SHARE * self.std)),
                float(difference.max()))


class RegressorQuantizing(ClassifierQuantizing):
    """A classifier's part but for the scorer (RMSE); calibrated 32 rows a batch."""

    def scorer(self, manifest) -> RmseScorer:
        return RmseScorer(float(manifest.preprocessing.spec["target"]["std"]))


QUANTIZING = RegressorQuantizing()
