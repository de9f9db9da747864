"""What serve.py, the V2 endpoints, the Predictor and the DSPy tool answer for one model type:
its `Parts.served` part, a class built once per opened bundle from `predictor.Opened` (its
ServeOptions, the bundle's paths, manifest, session and graph, the request row reader). This module
holds the shape every type's part has, and the classifiers' (the default): labels and
probabilities, several requests run together by ttc/serving/parts.py's JoinedParts. A segmenter's and a detector's live in their own folders
(ttc/tasks/segment/served.py, ttc/tasks/detect/served.py); ttc/online imports neither.

A part has
- `run` (a batch of model inputs → its raw outputs) and `extra` (the test-time method's extra
  value names, [] for a dense type);
- `predict_parts(parts)`: several requests' rows, each part (its rows, the number of its first
  row), → per part (outputs, extra values), row-aligned arrays the batcher may join with
  np.concatenate (a dense type's outputs: an object array of one answer per row), or the
  exception that request alone gets (a RowError for a bad row);
- `answers(outputs, extra)` → one JSON object per row (what /predict answers);
- `warm_up()`: one row predicted and answered, as a request is (start-up, reloads);
- `output_metadata()` and `v2_outputs(outputs, extra)`: the Open Inference Protocol's output
  tensors, described and filled;
- `tool_description()`: what the DSPy tool says the model does and returns;
- a dense type also `runner(session)` (static): the session's batch run, which inference.py's
  Ray workers run (predictor.worker_runner).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import numpy as np

from ttc.online.predictor import chunk_predictor
from ttc.online.tool import classifier_description
from ttc.online.v2 import classifier_outputs, output_metadata
from ttc.serving.batch import top_classes
from ttc.serving.parts import JoinedParts, Outcome

if TYPE_CHECKING:
    from ttc.online.predictor import Opened


class TypeServing(Protocol):
    """The shape of a `Parts.served` part (the module docstring says what each does)."""

    run: object
    extra: list[str]

    def predict_parts(self, parts: Sequence[tuple[Sequence[Mapping], int]]
                      ) -> list[Outcome | Exception]: ...

    def answers(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]: ...

    def warm_up(self) -> None: ...

    def output_metadata(self) -> list[dict]: ...

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]
                   ) -> list[dict]: ...

    def tool_description(self) -> str: ...


class ClassifierServing(JoinedParts):
    """A classifier's answers: rows encoded by the RecordReader (inference.py --input's rules),
    the chosen graph with the test-time method asked for (chunk_predictor), and per row its
    label, confidence and --top_k classes (rounded as a prediction file), with the method's
    extra values."""

    def __init__(self, opened: Opened) -> None:
        self.options, self.manifest, self.reader = opened.options, opened.manifest, opened.reader
        self.run, self.extra = chunk_predictor(opened.options, opened.paths, opened.manifest,
                                               opened.session, opened.model_path)

    # ------------------------------------------------------------------ answering

    def answers(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        """Probabilities → [{"label", "confidence", "top": [[label, p], ...], extras}], the
        values rounded as in a prediction file."""
        labels = self.manifest.labels
        order, top = top_classes(outputs, min(self.options.top_k, len(labels)))
        rows = []
        for k in range(len(outputs)):
            row = {"label": labels[order[k, 0]], "confidence": float(top[k, 0]),
                   "top": [[labels[c], float(p)] for c, p in zip(order[k], top[k])]}
            for name, values in extra.items():
                row[name] = round(float(values[k]), 6)
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ describing

    def output_metadata(self) -> list[dict]:
        return output_metadata(self.manifest.classes, self.extra)

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        return classifier_outputs(self.manifest.labels, outputs, extra)

    def tool_description(self) -> str:
        return classifier_description(self.manifest, self.reader.role)
