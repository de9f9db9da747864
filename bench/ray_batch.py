"""Parquet and Ray for batch inference (issue 22), measured side by side in one run.

    python bench/ray_batch.py [--rows 1000000] [--texts 100000] [--sms PATH] [--workers 2]
                              [--quick]

1. Tabular from Parquet, local engine: `inference.py --input rows.parquet` end-to-end rows/s
   (its report's predictions.rows_per_s: reading, encoding, predicting and writing) against raw
   session.run on the same rows encoded beforehand, same graph and batch size (goal ≥ 80%); the
   same rows from CSV beside it; each stage alone; and the CPU each row needs to be decoded,
   run and written, which bounds any pipeline on this machine's cores.
2. Ray (--workers workers of 1 thread, a local cluster) against the local engine (1 and 2
   threads) on --rows tabular rows (Parquet) and --texts texts (the SMS Spam Collection with
   --sms PATH, else generated topic texts): wall seconds of the whole command, rows/s, and Ray's
   fixed start-up cost (a 100-row input: Ray's wall time minus the local engine's), from which
   the input size where Ray starts to pay off on this machine follows.

--quick: 2,000 rows and 300 texts, 1 epoch, one timing of each (section 1 without the chunks of
65,536: the same code as 4,096's), the local engine with 1 thread
against Ray on a local cluster of at most 2 CPUs on the tabular input (the texts: the local
engine only), without the 100-row runs: one Ray start.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from batch_scale import TEXT_HEADER, write_texts
from common import REPO, Config, add_quick_flag, quiet_single_thread, train_bundle

QUICK_CPUS = 2  # --quick: the inference.py runs (and so a local Ray cluster) get 2 CPUs at most
CPU_LIMIT: list[int] = []  # the CPUs the inference.py runs may use; empty: all


def limit_cpus() -> None:
    """In the child, before inference.py starts: keep it to CPU_LIMIT (Ray's local cluster gets
    the CPUs of the affinity mask)."""
    if CPU_LIMIT:
        os.sched_setaffinity(0, CPU_LIMIT)


def write_tabular_parquet(path: Path, rows: int, features: list[str], seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    block = rng.normal(10, 5, (100_000, len(features))).round(4)
    schema = pa.schema([(name, pa.float64()) for name in features])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, len(block)):
            part = block[: rows - start]
            writer.write_table(pa.table({name: part[:, j] for j, name in enumerate(features)},
                                        schema=schema), row_group_size=len(block))


def write_csv_from_parquet(source: Path, path: Path) -> None:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    pcsv.write_csv(pq.read_table(source), path,
                   pcsv.WriteOptions(quoting_style="none"))


def run(model: Path, data: Path, output: Path, *args: object) -> tuple[float, dict]:
    """(wall seconds, report) of one inference.py --input run; it must exit 0."""
    report = output.with_suffix(".report.json")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "inference.py"), "--model", str(model),
                           "--input", str(data), "--output", str(output), "--quiet", "true",
                           "--report_json", str(report), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, preexec_fn=limit_cpus)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return wall, json.loads(report.read_text())


def raw_throughput(model: Path, data: Path, batch_size: int, rows: int) -> float:
    """session.run rows/s on `rows` rows read and encoded beforehand (batch.py's reader)."""
    from ttc.serving.batch import BatchOptions, input_chunks
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import batches_of, create_session

    manifest = read_manifest(BundlePaths.from_model_path(model))
    x = np.concatenate([c.x for c in input_chunks(manifest, BatchOptions(
        str(data), "unused.csv", 65536))])[:rows]
    session = create_session(str(model), Config().cpu_runtime())
    name = session.get_inputs()[0].name
    batches = batches_of(x, batch_size)
    session.run(["probabilities"], {name: batches[0]})
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        for batch in batches:
            session.run(["probabilities"], {name: batch})
        best = max(best, len(x) / (time.perf_counter() - started))
    return best


def stage_ceilings(model: Path, data: Path, batch_size: int) -> tuple[float, float]:
    """rows/s of the local engine's stages alone, in this process, one thread each: reading and
    encoding (batch.input_chunks: the reader thread's work) and writing Parquet
    (PredictionWriter: the main thread's, beside session.run)."""
    from ttc.serving.batch import BatchOptions, PredictionWriter, input_chunks
    from ttc.serving.bundle import BundlePaths, read_manifest

    manifest = read_manifest(BundlePaths.from_model_path(model))
    started = time.perf_counter()
    chunks = list(input_chunks(manifest, BatchOptions(str(data), "unused.csv", batch_size)))
    rows = sum(len(c.ids) for c in chunks)
    read_rate = rows / (time.perf_counter() - started)
    rng = np.random.default_rng(0)
    probabilities = rng.dirichlet(np.ones(manifest.classes), batch_size).astype(np.float32)
    with open(data.with_suffix(".ceiling.parquet"), "wb") as handle:
        writer = PredictionWriter(handle, "parquet", manifest.labels, 1, False, [])
        started = time.perf_counter()
        for chunk in chunks:
            writer.write(chunk.ids, probabilities[: len(chunk.ids)], {}, None)
        writer.close()
        write_rate = rows / (time.perf_counter() - started)
    return read_rate, write_rate


def cpu_per_row(model: Path, data: Path, batch_size: int) -> dict[str, float]:
    """CPU seconds per row (this process, all its threads) of the three things every row needs
    whatever the code around them: decoding the Parquet file (pyarrow, its threads on, to a
    float32 matrix), session.run at batch_size (1 thread), and writing the predictions
    (PredictionWriter to Parquet). On C cores no pipeline runs faster than C / their sum."""
    import os

    import pyarrow.parquet as pq

    from ttc.serving.batch import PredictionWriter
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import batches_of, create_session

    def cpu(work) -> float:
        started = time.process_time()
        work()
        return time.process_time() - started

    matrices: list[np.ndarray] = []
    decode = cpu(lambda: matrices.extend(
        np.column_stack([c.to_numpy(zero_copy_only=False) for c in b.columns]).astype(np.float32)
        for b in pq.ParquetFile(data).iter_batches(batch_size=65536, use_threads=True)))
    x = np.concatenate(matrices)
    session = create_session(str(model), Config().cpu_runtime())
    name = session.get_inputs()[0].name
    batches = batches_of(x, batch_size)
    outputs: list[np.ndarray] = []
    run = cpu(lambda: outputs.extend(session.run(["probabilities"], {name: b})[0]
                                     for b in batches))
    manifest = read_manifest(BundlePaths.from_model_path(model))
    ids = [str(i + 1) for i in range(len(x))]
    with open(data.with_suffix(".cpu.parquet"), "wb") as handle:
        writer = PredictionWriter(handle, "parquet", manifest.labels, 1, False, [])

        def write() -> None:
            for start, probabilities in zip(range(0, len(x), batch_size), outputs):
                writer.write(ids[start:start + batch_size], probabilities, {}, None)
            writer.close()

        written = cpu(write)
    rows = len(x)
    return {"decode": decode / rows, "model": run / rows, "write": written / rows,
            "cores": float(os.cpu_count() or 1)}


def parquet_goal(model: Path, work: Path, rows: int, batch_size: int, repeats: int = 2,
                 quick: bool = False) -> None:
    """Section 1; `quick` leaves out the run with chunks of 65,536 (the same code as 4,096's)."""
    print(f"\n1. tabular, {rows:,} rows, batch {batch_size}, local engine, 1 thread:")
    data = work / "tab.parquet"
    csv_data = work / "tab.csv"
    write_csv_from_parquet(data, csv_data)
    raw = raw_throughput(model, data, batch_size, rows)
    print(f"   raw session.run: {raw:>10,.0f} rows/s")
    read_rate, write_rate = stage_ceilings(model, data, batch_size)
    print(f"   stages alone: read + encode Parquet {read_rate:,.0f} rows/s "
          f"({read_rate / raw:.0%} of raw), write Parquet {write_rate:,.0f} rows/s "
          f"({write_rate / raw:.0%} of raw)")
    costs = cpu_per_row(model, data, batch_size)
    bound = costs["cores"] / (costs["decode"] + costs["model"] + costs["write"])
    print(f"   CPU per row: decode Parquet {costs['decode'] * 1e6:.2f} µs, session.run "
          f"{costs['model'] * 1e6:.2f} µs, write Parquet {costs['write'] * 1e6:.2f} µs: on "
          f"{costs['cores']:.0f} cores no pipeline beats {bound:,.0f} rows/s = {bound / raw:.0%} "
          "of raw")
    runs = ((data, "preds.parquet", batch_size), (data, "preds.parquet", 65536),
            (data, "preds.csv", batch_size), (csv_data, "preds.csv", batch_size))
    for source, output, chunk in [r for r in runs if not quick or r[2] != 65536]:
        speeds = [run(model, source, work / output, "--batch_size", batch_size, "--chunk_rows",
                      chunk)[1]["predictions"]["rows_per_s"] for _ in range(repeats)]
        speed = max(speeds)
        share = speed / raw
        goal = f" (goal ≥ 80%: {'met' if share >= 0.8 else 'NOT met'})" \
            if source.suffix == ".parquet" else ""
        print(f"   {source.suffix[1:]:>7} → {output.split('.')[1]:<7} chunks of {chunk:>6,}: "
              f"{speed:>10,.0f} rows/s end to end = {share:.0%} of raw{goal}")


def engines(name: str, model: Path, data: Path, rows: int, work: Path, workers: int,
            batch_args: list, small: Path | None, ray: bool = True) -> None:
    """Each engine on `data` and on the 100-row `small` input (None, under --quick: the local
    engine with 2 threads and the 100-row runs left out, so Ray's start-up cost is not told
    apart); ray=False (--quick's second input) leaves the Ray engine out too."""
    print(f"\n2. {name}, {rows:,} rows:")
    results = {}
    for label, args in (("local, 1 thread", []), ("local, 2 threads", ["--num_threads", 2]),
                        (f"ray, {workers} workers x 1 thread",
                         ["--engine", "ray", "--num_workers", workers])):
        if (small is None and label == "local, 2 threads") or (not ray and "ray" in label):
            continue
        wall, report = run(model, data, work / "out.parquet", *batch_args, *args)
        small_wall = run(model, small, work / "small.parquet", *batch_args, *args)[0] \
            if small else None
        engine = report["engine"]
        results[label] = (wall, small_wall)
        extra = (f"; cluster start {engine['cluster_start_s']:.1f} s, first predictions after "
                 f"{engine['first_batch_s']:.1f} s" if engine["engine"] == "ray" else "")
        small_part = f"; 100 rows: {small_wall:5.1f} s" if small else ""
        print(f"   {label:<26} {wall:7.1f} s wall = {rows / wall:>9,.0f} rows/s{small_part}"
              f"{extra}")
    if not ray:
        print("   ray: not run (--quick: one Ray cluster, on the first input, is its smoke test)")
        return
    local_wall, local_small = results["local, 1 thread"]
    ray_wall, ray_small = results[f"ray, {workers} workers x 1 thread"]
    print(f"   ray / local (1 thread) rows/s, whole command: {local_wall / ray_wall:.2f}x",
          end="")
    if small is None:
        print("; Ray's fixed start-up cost: not measured (--quick)")
        return
    fixed = ray_small - local_small
    local_rate = rows / max(local_wall - local_small, 1e-9)
    ray_rate = rows / max(ray_wall - ray_small, 1e-9)
    print(f"; Ray's fixed start-up cost: {fixed:.1f} s")
    if ray_rate > local_rate:
        breakeven = fixed / (1 / local_rate - 1 / ray_rate)
        print(f"   after start-up: ray {ray_rate:,.0f} vs local {local_rate:,.0f} rows/s; Ray "
              f"pays off from about {breakeven:,.0f} rows on this machine")
    else:
        print(f"   after start-up: ray {ray_rate:,.0f} vs local {local_rate:,.0f} rows/s; Ray "
              "does not pay off at any size on this machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--texts", type=int, default=100_000)
    parser.add_argument("--batch_size", type=int, default=4096, help="tabular batch size")
    parser.add_argument("--text_batch_size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text)")
    parser.add_argument("--sections", default="1,2", help="1: Parquet goal, 2: Ray vs local")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.texts = 2_000, 300
        if hasattr(os, "sched_getaffinity"):
            CPU_LIMIT[:] = sorted(os.sched_getaffinity(0))[:QUICK_CPUS]
        args.workers = min(args.workers, len(CPU_LIMIT) or QUICK_CPUS)  # one CPU each
    quiet_single_thread(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_ray_batch_") as tmp:
        measure(args, Path(tmp))


def measure(args: argparse.Namespace, work: Path) -> None:
    sections = set(args.sections.split(","))
    epochs = 1 if args.quick else 5
    config = Config(model_type="tabular_classifier", dataset_path="builtin:breast_cancer",
                    epochs=epochs, no_progress=True, output_model=str(work / "tab" / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    features = dataset.preprocessing["feature_names"]
    write_tabular_parquet(work / "tab.parquet", args.rows, features)
    write_tabular_parquet(work / "tab_small.parquet", 100, features)
    if "1" in sections:
        parquet_goal(paths.onnx, work, args.rows, args.batch_size, 1 if args.quick else 2,
                     args.quick)
    if "2" not in sections:
        return
    engines("tabular (30 features, Parquet)", paths.onnx, work / "tab.parquet", args.rows, work,
            args.workers, ["--batch_size", args.batch_size, "--chunk_rows", args.batch_size],
            None if args.quick else work / "tab_small.parquet")
    text_epochs = 1 if args.quick else 3
    if args.sms:
        texts = [line.split("\t", 1)[-1]
                 for line in Path(args.sms).read_text(errors="replace").splitlines()]
        text_config = Config(model_type="text_classifier", dataset_path=args.sms,
                             epochs=text_epochs, no_progress=True,
                             output_model=str(work / "text" / "model.onnx"))
        name = "text (SMS, CSV)"
    else:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import topic_texts

        pairs = topic_texts(per_class=30 if args.quick else 400)
        texts = [t for t, _ in pairs]
        (work / "topics.csv").write_text("text,label\n" + "".join(
            f'"{t}",{label}\n' for t, label in pairs))
        text_config = Config(model_type="text_classifier", dataset_path=str(work / "topics.csv"),
                             epochs=text_epochs, no_progress=True,
                             output_model=str(work / "text" / "model.onnx"))
        name = "text (generated topics, CSV)"
    _, _, text_paths, _ = train_bundle(text_config)
    write_texts(work / "texts.csv", args.texts, texts)
    write_texts(work / "texts_small.csv", 100, texts)
    engines(name, text_paths.onnx, work / "texts.csv", args.texts, work, args.workers,
            ["--batch_size", args.text_batch_size, "--text_column", TEXT_HEADER],
            None if args.quick else work / "texts_small.csv", ray=not args.quick)


if __name__ == "__main__":
    main()
