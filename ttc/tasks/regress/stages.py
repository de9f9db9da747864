"""A regressor's inference stage (its Parts.test_split and Parts.new_input, which
ttc/online/evaluate.py and ttc/online/predict.py hand the opened bundle to): the test split's
predictions scored (MAE, RMSE, R² against the mean-of-train baseline, the verdict, the conformal
interval's coverage and width) with the graph's latency; and --input's rows, each row's
prediction (and lower and upper where the bundle has an interval) written to --output.
numpy and ONNX Runtime only."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ttc.inputs.tables import numeric_cells
from ttc.serving.batch import (NON_FINITE_OUTPUT, BatchOptions, RecordWriter,
                               fail_without_predictions, input_chunks, raise_for_error_rows,
                               write_errors)
from ttc.serving.runtime import (batches_of, graph_padding_id, session_device, session_runner,
                                 time_runners, whole_batches)
from ttc.tasks.regress import PREDICTION
from ttc.tasks.regress.intervals import prediction_answer
from ttc.tasks.regress.metrics import regression_section
from ttc.tasks.regress.testtime import run_test_time
from utils import LOG, ConfigError, RuntimeFailure, atomic_write_stream, progress

if TYPE_CHECKING:
    from ttc.serving.stages import InputRun, SplitRun


def predict_split(session, x: np.ndarray, batch_size: int) -> np.ndarray:
    """The graph's predictions (target units, float64) over `x` in batches."""
    run = session_runner(session, PREDICTION)
    batches = batches_of(x, batch_size, graph_padding_id(session))
    return np.concatenate([run(b) for b in batches]).astype(np.float64) if batches else \
        np.zeros(0)


def evaluate_regressor(run: SplitRun) -> None:
    """The test split: figures and verdict (`evaluation`), latency and throughput
    (`inference`); with --benchmark (or a quantized bundle) each graph's RMSE and latency."""
    options, manifest, session, (x, y) = run.options, run.manifest, run.session, run.test
    if len(x) == 0:
        raise RuntimeFailure("no test samples to run", "check the dataset's test split")
    spec = manifest.preprocessing.spec
    predicted = predict_split(session, x, options.batch_size)
    evaluation = regression_section(predicted, y, spec["target"], spec.get("interval"),
                                    seed=options.seed)
    batches = whole_batches(batches_of(x, options.batch_size, graph_padding_id(session)),
                            options.batch_size)
    timings = time_runners([session_runner(session, PREDICTION)], batches,
                           max(30, len(batches)), min_seconds=0)
    run.report["inference"] = {
        "providers_requested": options.providers(), "providers_active": session.get_providers(),
        "provider_options": options.runtime().provider_options,
        "io_binding": session_device(session) is not None, "model_path": str(run.model_path),
        "rmse": evaluation["rmse"], "mae": evaluation["mae"], "r2": evaluation["r2"],
        "latency_ms_p50": timings.percentile_ms(0, 50),
        "latency_ms_p95": timings.percentile_ms(0, 95), "throughput_per_s": timings.throughput(0),
        "batch_size": options.batch_size, "samples": len(x), "timed_batches": len(batches)}
    run.report["evaluation"] = evaluation
    run_test_time(run, x, y, predicted, evaluation)
    LOG.info("inference on %s: RMSE %.4g, MAE %.4g, R² %.4f (baseline RMSE %.4g); p50 %.3f "
             "ms/batch of %d", ", ".join(session.get_providers()), evaluation["rmse"],
             evaluation["mae"], evaluation["r2"], evaluation["baseline"]["rmse"],
             run.report["inference"]["latency_ms_p50"], options.batch_size)


# ----------------------------------------------------------------------------- --input


class ValueWriter(RecordWriter):
    """--input's rows: id, the input's id column, prediction, lower and upper (with an
    interval), and true_target where the input has the target column."""

    def schema(self):
        import pyarrow as pa

        texts = {"id", "row", self.key} if self.key else {"id", "row"}
        return pa.schema([(name, pa.string() if name in texts else pa.float64())
                          for name in self.columns])

    def __init__(self, handle, fmt: str, interval: bool, truth: bool, key: str | None) -> None:
        self.key = key
        row = "row" if key is not None and key.lower() == "id" else "id"
        self.columns = [row, *([key] if key else []), PREDICTION,
                        *(["lower", "upper"] if interval else []),
                        *(["true_target"] if truth else [])]
        super().__init__(handle, fmt, self.columns)


def target_numbers(labels: Sequence[str | None] | None) -> np.ndarray | None:
    """The input's target cells as numbers (NaN where missing or not a number), or None."""
    if labels is None:
        return None
    return numeric_cells(np.array([np.nan if t is None else t for t in labels],
                                  dtype=object))[0]


def predict_values(run: InputRun) -> None:
    """--input: each row's prediction (and interval) to --output (CSV, JSONL or Parquet), the
    rows that cannot be encoded or whose prediction is not finite to --errors; the report's
    `predictions`, and `evaluation` where the input has the target column."""
    options = run.options
    if options.engine == "ray":
        raise ConfigError("--engine ray predicts a classifier's, a segmenter's or a detector's "
                          "input; a regressor's runs in this process", "drop --engine ray")
    batch = BatchOptions.from_config(options, options.chunk_rows)
    manifest, session, _ = run.open()
    spec = manifest.preprocessing.spec
    interval = spec.get("interval")
    fmt = Path(options.output).suffix.lower().lstrip(".")
    errors: list[tuple[str, str]] = []
    truth: list[np.ndarray] = []
    found: list[np.ndarray] = []
    total = predicted = 0
    with atomic_write_stream(options.output, binary=fmt == "parquet") as handle:
        writer = None
        for chunk in progress(input_chunks(manifest, batch), desc="predict",
                              enabled=not options.no_progress):
            total += len(chunk.ids) + len(chunk.errors)
            errors += chunk.errors
            if chunk.x is None or not len(chunk.ids):
                continue
            values = predict_split(session, chunk.x, options.batch_size)
            ids = [str(i) for i in chunk.ids]
            good = np.isfinite(values)
            errors += [(ids[k], NON_FINITE_OUTPUT) for k in np.flatnonzero(~good)]
            targets = target_numbers(chunk.labels)
            if writer is None:
                key = chunk.keys.name if chunk.keys else None
                writer = ValueWriter(handle, fmt, interval is not None, targets is not None, key)
            keys = chunk.keys.of(chunk.ids) if chunk.keys else None
            writer.write_records([_record(writer, ids[k], keys[k] if keys else None,
                                          float(values[k]), interval,
                                          None if targets is None else targets[k])
                                  for k in np.flatnonzero(good)])
            predicted += int(good.sum())
            if targets is not None:
                known = good & np.isfinite(targets)
                truth.append(targets[known])
                found.append(values[known])
        if predicted == 0:
            if total == 0:
                raise RuntimeFailure(f"{options.input} has no rows to predict",
                                     "check the input (a header alone is no rows)")
            fail_without_predictions(batch, total, "rows", "predicted", errors, "fix those rows")
        writer.close()
    if options.errors:
        write_errors(options.errors, errors)
    run.report["predictions"] = {"input": options.input, "output": options.output, "rows": total,
                                 "predicted": predicted, "failed": len(errors),
                                 "errors_path": options.errors}
    truth_all = np.concatenate(truth) if truth else np.zeros(0)
    if len(truth_all):
        run.report["evaluation"] = regression_section(np.concatenate(found), truth_all,
                                                      spec["target"], interval, "input")
    LOG.info("predicted %d of %d rows into %s", predicted, total, options.output)
    raise_for_error_rows(batch, len(errors), total, "rows", "predicted",
                         f"the other predictions are in {options.output}")


def _record(writer: ValueWriter, ident: str, key: str | None, value: float,
            interval: dict | None, truth: float | None) -> dict:
    record: dict = {writer.columns[0]: ident}
    if writer.key:
        record[writer.key] = key
    record.update(prediction_answer(value, interval))
    if "true_target" in writer.columns:
        record["true_target"] = None if truth is None or not np.isfinite(truth) else float(truth)
    return record
