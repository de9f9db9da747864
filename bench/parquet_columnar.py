"""The columnar Parquet path for all-numeric tabular input (issue 41, item 6) against the row
frames it replaces there, side by side in one run.

    python bench/parquet_columnar.py [--rows 1000000] [--batch_size 4096] [--repeats 3]
                                     [--missing 0.0] [--quick]

Trains a tabular model (builtin:breast_cancer MLP, 30 numeric features), writes --rows generated
rows as Parquet (float64 columns, row groups of 100,000: bench/ray_batch.py's input; --missing:
that share of the cells null), then, in this process, one thread each:

1. raw session.run at --batch_size on the same rows encoded beforehand (one float32 matrix),
   best of --repeats;
2. each path's reading and encoding alone (what the reader thread does), rows/s;
3. inference.py's --input path end to end, in this process (what its predict_new_data runs:
   the bundle's session and predictor, then batch.predict_input: read → encode → session.run →
   write Parquet, chunks of --batch_size rows; the report's predictions.rows_per_s), through the
   row frames (pandas, the path before this issue) and the columnar path, alternating, best of
   --repeats each; the two outputs must be identical. Beside each, the CPU it spent per row (all
   threads) and so the most it could reach with this machine's cores to itself (cores / CPU per
   row, against raw's own CPU per row): a figure that other load on the machine moves less than
   wall-clock rows/s;
4. the CPU each row needs, decoding (on Arrow's threads, bench/ray_batch.py's cpu_per_row, and
   on one thread, as the columnar path decodes), session.run and writing alone, and so the most
   any pipeline can reach on this machine's cores.

Goal: the columnar path end to end ≥ 45% of raw session.run at batch 4096 on 1M rows.
--quick: 20,000 rows, 1 epoch, one repeat.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from common import Config, add_quick_flag, quiet_single_thread, train_bundle
from ray_batch import cpu_per_row, write_tabular_parquet

GOAL = 0.45
PATHS = (("row frames (pandas)", False), ("columnar", True))


def with_missing(path: Path, share: float, seed: int = 1) -> None:
    """Null `share` of the cells of every column of a Parquet file, in place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rng = np.random.default_rng(seed)
    columns = {name: pa.array(column.to_numpy(), mask=rng.random(len(table)) < share)
               for name, column in zip(table.column_names, table.columns)}
    pq.write_table(pa.table(columns), path, row_group_size=100_000)


def read_alone(model: Path, data: Path, batch_size: int, columnar: bool) -> tuple[float, list]:
    """rows/s of reading and encoding alone (TableReader, one path), and the chunks."""
    from ttc.serving.batch import BatchOptions, TableReader
    from ttc.serving.bundle import BundlePaths, read_manifest

    manifest = read_manifest(BundlePaths.from_model_path(model))
    reader = TableReader(data, manifest, BatchOptions(str(data), "unused.parquet", batch_size))
    reader.columnar = columnar
    started = time.perf_counter()
    chunks = list(reader)
    rows = sum(len(c.ids) for c in chunks)
    return rows / (time.perf_counter() - started), chunks


def raw_throughput(model: Path, x: np.ndarray, batch_size: int, repeats: int
                   ) -> tuple[float, float]:
    """session.run rows/s over the encoded rows at batch_size, best of `repeats`, and its
    least CPU seconds per row."""
    from ttc.serving.runtime import batches_of, create_session

    session = create_session(str(model), Config().cpu_runtime())
    name = session.get_inputs()[0].name
    batches = batches_of(x, batch_size)
    session.run(["probabilities"], {name: batches[0]})
    best, cpu = 0.0, float("inf")
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            session.run(["probabilities"], {name: batch})
        best = max(best, len(x) / (time.perf_counter() - started))
        cpu = min(cpu, (time.process_time() - started_cpu) / len(x))
    return best, cpu


def end_to_end(model: Path, data: Path, output: Path, batch_size: int, columnar: bool
               ) -> tuple[float, float]:
    """inference.py's --input path (predict_new_data's steps) in this process through one
    path: its report's predictions.rows_per_s, and the CPU seconds per row it spent."""
    from ttc.online.predictor import chunk_predictor, load_bundle_session
    from ttc.serving.batch import BatchOptions, TableReader, predict_input
    from ttc.serving.bundle import BundlePaths

    config = Config(output_model=str(model), input=str(data), output=str(output),
                    batch_size=batch_size, chunk_rows=batch_size, no_progress=True)
    paths = BundlePaths.from_model_path(model)
    manifest, session, model_path = load_bundle_session(paths, config)
    predict, _ = chunk_predictor(config, paths, manifest, session, model_path)
    report: dict = {}
    TableReader.columnar = columnar
    started = time.process_time()
    try:
        run = predict_input(BatchOptions.from_config(config, batch_size), manifest, predict,
                            report)
    finally:
        TableReader.columnar = True
    return report["predictions"]["rows_per_s"], (time.process_time() - started) / run.predicted


def measure(args: argparse.Namespace, work: Path) -> None:
    config = Config(model_type="tabular_classifier", dataset_path="builtin:breast_cancer",
                    epochs=1 if args.quick else 3, no_progress=True,
                    output_model=str(work / "tab" / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    data = work / "rows.parquet"
    write_tabular_parquet(data, args.rows, dataset.preprocessing["feature_names"])
    if args.missing:
        with_missing(data, args.missing)
    print(f"tabular (30 float64 features, {args.missing:.0%} of cells null), {args.rows:,} rows "
          f"of Parquet, batch {args.batch_size}, 1 thread:")
    alone = {label: read_alone(paths.onnx, data, args.batch_size, columnar)
             for label, columnar in PATHS}
    x = np.concatenate([c.x for c in alone["columnar"][1] if c.x is not None])
    raw, raw_cpu = raw_throughput(paths.onnx, x, args.batch_size, args.repeats)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"  raw session.run: {raw:>12,.0f} rows/s, CPU {raw_cpu * 1e6:.2f} µs/row")
    for label, _ in PATHS:
        rate = alone[label][0]
        print(f"  read + encode alone, {label:<20} {rate:>12,.0f} rows/s = {rate / raw:.0%} of raw")
    best = {label: 0.0 for label, _ in PATHS}
    cpu = {label: float("inf") for label, _ in PATHS}
    for _ in range(args.repeats):  # alternating, so that a change in the machine's load hits both
        for label, columnar in PATHS:
            speed, per_row = end_to_end(paths.onnx, data, work / f"{columnar}.parquet",
                                        args.batch_size, columnar)
            best[label], cpu[label] = max(best[label], speed), min(cpu[label], per_row)
    same = identical(work / "False.parquet", work / "True.parquet")
    for label, _ in PATHS:
        share = best[label] / raw
        goal = f" (goal ≥ {GOAL:.0%}: {'met' if share >= GOAL else 'NOT met'})" \
            if label == "columnar" else ""
        print(f"  end to end, {label:<20} {best[label]:>12,.0f} rows/s = {share:.0%} of raw{goal}")
        print(f"    CPU {cpu[label] * 1e6:.2f} µs/row: on {cores} cores to itself at most "
              f"{cores / cpu[label]:,.0f} rows/s = {cores * raw_cpu / cpu[label]:.0%} of raw at "
              "raw's own CPU per row")
    print(f"  columnar / row frames end to end: {best['columnar'] / best[PATHS[0][0]]:.2f}x; "
          f"predictions identical: {same}")
    costs = cpu_per_row(paths.onnx, data, args.batch_size)
    one = decode_one_thread(data)
    bound = cores / (min(one, costs["decode"]) + costs["model"] + costs["write"])
    print(f"  CPU per row alone: decode Parquet to float64 matrices "
          f"{costs['decode'] * 1e6:.2f} µs on Arrow's threads, {one * 1e6:.2f} µs on one (the "
          f"columnar path's way), session.run "
          f"{costs['model'] * 1e6:.2f} µs, write Parquet {costs['write'] * 1e6:.2f} µs: on "
          f"{cores} cores no pipeline beats {bound:,.0f} rows/s = {bound * costs['model']:.0%} "
          "of raw at session.run's CPU per row")
    if not same:
        raise SystemExit("the two paths' predictions differ")


def decode_one_thread(data: Path) -> float:
    """CPU seconds per row of reading the file as the columnar path does (one thread, each
    part's columns to one float64 matrix), without encoding."""
    import pyarrow.parquet as pq

    from ttc.inputs.tables import parquet_feature_blocks

    names = pq.read_schema(data).names
    started = time.process_time()
    rows = sum(len(block.rows) for block in parquet_feature_blocks(data, names, None, 65536))
    return (time.process_time() - started) / rows


def identical(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    return pq.read_table(a).equals(pq.read_table(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs of each path")
    parser.add_argument("--missing", type=float, default=0.0,
                        help="share of the cells written null (0 to 1)")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 20_000, 1
    quiet_single_thread(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_parquet_columnar_") as tmp:
        measure(args, Path(tmp))


if __name__ == "__main__":
    main()
