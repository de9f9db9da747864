"""What serve.py, the V2 endpoints, the Predictor and the DSPy tool answer for one model type:
its `Parts.served` part, a class built once per opened bundle from `predictor.Opened` (its
ServeOptions, the bundle's paths, manifest, session and graph, the request row reader). This module
holds the shape every type's part has, and the classifiers' (the default): labels and
probabilities. A segmenter's and a detector's live in their own folders
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
from ttc.serving.batch import NON_FINITE_OUTPUT, non_finite_rows, top_classes
from ttc.serving.records import RowError

if TYPE_CHECKING:
    from ttc.online.predictor import Opened

Outcome = tuple[np.ndarray, dict]  # a part's outputs (row-aligned) and extra values


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


def join_inputs(parts: list[np.ndarray], pad_id: int) -> np.ndarray:
    """Inputs of several requests as one batch: token ids of different lengths are right-padded
    with the graph's padding id (batches_of trims what no row needs)."""
    if len(parts) == 1:
        return parts[0]
    if parts[0].ndim == 2 and parts[0].dtype == np.int64:
        width = max(p.shape[1] for p in parts)
        parts = [p if p.shape[1] == width else
                 np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=pad_id)
                 for p in parts]
    return np.concatenate(parts)


class ClassifierServing:
    """A classifier's answers: rows encoded by the RecordReader (inference.py --input's rules),
    the chosen graph with the test-time method asked for (chunk_predictor), and per row its
    label, confidence and --top_k classes (rounded as a prediction file), with the method's
    extra values."""

    def __init__(self, opened: Opened) -> None:
        self.options, self.manifest, self.reader = opened.options, opened.manifest, opened.reader
        self.run, self.extra = chunk_predictor(opened.options, opened.paths, opened.manifest,
                                               opened.session, opened.model_path)

    # ------------------------------------------------------------------ predicting

    def predict_parts(self, parts: Sequence[tuple[Sequence[Mapping], int]]
                      ) -> list[Outcome | Exception]:
        """Encoded together where their keys agree, one model run."""
        firsts = [first for _, first in parts]
        encoded = self.reader.encode_parts([rows for rows, _ in parts], firsts)
        good = [k for k, x in enumerate(encoded) if not isinstance(x, Exception)]
        out: list = list(encoded)
        for k, outcome in zip(good, self._run_parts([encoded[k] for k in good],
                                                    [firsts[k] for k in good])):
            out[k] = outcome
        return out

    def _run_parts(self, inputs: list[np.ndarray], firsts: list[int]) -> list:
        """Encoded parts → each one's (probabilities, extra), or its error: a row whose output
        is not finite fails its part (a RowError naming it). A part that failed in the joined
        run (or all, where the run raised) is run again alone, so that one request's rows never
        cost another its answer (test-time training adapts to the whole batch: one overflowing
        row makes every row's statistics NaN)."""
        if not inputs:
            return []
        try:
            outcomes = self._split_run(inputs, firsts)
        except Exception as err:  # noqa: BLE001 - blamed below on the part that raises it
            outcomes = [err] * len(inputs)
        if len(inputs) == 1:
            return outcomes
        for k, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                try:
                    outcomes[k] = self._split_run([inputs[k]], [firsts[k]])[0]
                except Exception as err:  # noqa: BLE001 - this part's own failure
                    outcomes[k] = err
        return outcomes

    def _split_run(self, inputs: list[np.ndarray], firsts: list[int]) -> list:
        """One model run of the parts joined; each part's rows back, or its RowError."""
        probabilities, extra = self.run(join_inputs(inputs, self.manifest.input.pad_id))
        bad = non_finite_rows(probabilities, extra)
        outcomes, offset = [], 0
        for x, first in zip(inputs, firsts):
            rows = slice(offset, offset + len(x))
            offset = rows.stop
            failed = np.flatnonzero(bad[rows])
            if len(failed):
                more = f" (and {len(failed) - 1} more rows)" if len(failed) > 1 else ""
                outcomes.append(RowError(f"row {first + int(failed[0])}: {NON_FINITE_OUTPUT}"
                                         f"{more}", "fix the row"))
                continue
            outcomes.append((probabilities[rows], {name: v[rows] for name, v in extra.items()}))
        return outcomes

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

    def warm_up(self) -> None:
        probabilities, extra = self.run(self.warmup_rows())
        self.answers(probabilities, extra)

    def warmup_rows(self) -> np.ndarray:
        """Model inputs of one row: a text's tokens, else zeros of the sizes the type's
        preprocessing record fixes (an image's channels and sides, a table's features)."""
        if self.reader.role == "text":
            return self.reader.encode([{name: "warm up" for name in self.reader.names}])
        dims = self.reader.task.fixed_input_dims(self.manifest.preprocessing.spec)
        return np.zeros((1, *map(int, dims)), dtype=np.float32)

    # ------------------------------------------------------------------ describing

    def output_metadata(self) -> list[dict]:
        return output_metadata(self.manifest.classes, self.extra)

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        return classifier_outputs(self.manifest.labels, outputs, extra)

    def tool_description(self) -> str:
        return classifier_description(self.manifest, self.reader.role)
