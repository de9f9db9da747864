"""Several requests' rows answered in one model run, for every type whose answer is one row per
input row (the classifiers', a regressor's; ttc/online/served.py says the whole shape of a
type's serving part): the parts encoded together, joined (token ids padded to one width), run
once, and split back; a part that fails in the joined run is run again alone, so that one
request's rows never cost another its answer. numpy only."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ttc.serving.batch import NON_FINITE_OUTPUT, non_finite_rows
from ttc.serving.records import RowError

Outcome = tuple[np.ndarray, dict]  # a part's outputs (row-aligned) and extra values


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


class JoinedParts:
    """predict_parts, warm_up and warmup_rows for a serving part that sets `run` (model inputs →
    (outputs, extra values), row-aligned), `reader` (the request RecordReader), `manifest` and
    `answers`."""

    run: Callable[[np.ndarray], Outcome]
    reader: Any
    manifest: Any

    def answers(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        raise NotImplementedError

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
        """Encoded parts → each one's (outputs, extra), or its error: a row whose output is not
        finite fails its part (a RowError naming it). A part that failed in the joined run (or
        all, where the run raised) is run again alone (test-time training adapts to the whole
        batch: one overflowing row makes every row's statistics NaN)."""
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
        outputs, extra = self.run(join_inputs(inputs, self.manifest.input.pad_id))
        bad = non_finite_rows(outputs, extra)
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
            outcomes.append((outputs[rows], {name: v[rows] for name, v in extra.items()}))
        return outcomes

    def warm_up(self) -> None:
        """One row predicted and answered, as a request is (start-up, reloads)."""
        self.answers(*self.run(self.warmup_rows()))

    def warmup_rows(self) -> np.ndarray:
        """Model inputs of one row: a text's tokens, else zeros of the sizes the type's
        preprocessing record fixes (an image's channels and sides, a table's features)."""
        if self.reader.role == "text":
            return self.reader.encode([{name: "warm up" for name in self.reader.names}])
        dims = self.reader.task.fixed_input_dims(self.manifest.preprocessing.spec)
        return np.zeros((1, *map(int, dims)), dtype=np.float32)
