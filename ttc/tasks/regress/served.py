"""A regressor served (its `Parts.served` part; ttc/online/served.py says the shape): rows encoded
by the request reader (inference.py --input's rules), several requests in one run of the graph
(ttc/serving/parts.py, as a classifier's), and per row
{"prediction"} in the target's units, with "lower" and "upper" where the bundle has a conformal
interval; V2: `prediction` (FP32, [rows]) and `lower`, `upper` likewise. numpy only."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ttc.serving.parts import JoinedParts
from ttc.serving.runtime import batches_of, graph_padding_id, session_runner
from ttc.tasks.regress import PREDICTION
from ttc.tasks.regress.intervals import prediction_answer


class RegressorServing(JoinedParts):
    """A regressor's answers (see the module docstring)."""

    def __init__(self, opened: Any) -> None:
        self.options, self.manifest, self.reader = opened.options, opened.manifest, opened.reader
        self.session = opened.session
        self.interval = self.manifest.preprocessing.spec.get("interval")
        self.pad_id = graph_padding_id(opened.session)
        self.graph = session_runner(opened.session, PREDICTION)
        self.extra: list[str] = []

    def run(self, x: np.ndarray) -> tuple[np.ndarray, dict]:
        """Encoded rows → (predictions (rows,), {}) in batches of --batch_size."""
        batches = batches_of(x, max(1, int(self.options.batch_size)), self.pad_id)
        return np.concatenate([self.graph(b) for b in batches]).astype(np.float64), {}

    def answers(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        return [prediction_answer(float(value), self.interval)
                for value in np.asarray(outputs, np.float64)]

    def _names(self) -> list[str]:
        return [PREDICTION, *(["lower", "upper"] if self.interval is not None else [])]

    def output_metadata(self) -> list[dict]:
        return [{"name": name, "datatype": "FP32", "shape": [-1]} for name in self._names()]

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        answers = self.answers(outputs, extra)
        return [{"name": name, "datatype": "FP32", "shape": [len(answers)],
                 "data": [answer[name] for answer in answers]} for name in self._names()]

    def tool_description(self) -> str:
        target = self.manifest.preprocessing.spec["target"]["name"]
        what = "a text" if self.reader.role == "text" else "a row of features"
        interval = (f", with a {self.interval['level']:.0%} prediction interval (lower, upper)"
                    if self.interval is not None else "")
        return (f"Predicts the number {target!r} from {what} with a trained "
                f"{self.manifest.architecture.arch or self.manifest.architecture.name} regressor "
                f"run by ONNX Runtime. Returns `prediction` in {target}'s units{interval}.")
