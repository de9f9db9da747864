"""Batch inference at scale: flat memory, lean start, and end-to-end speed against the model.

    python bench/batch_scale.py [--rows 100000,1000000] [--batch_size 4096] [--sms PATH]
                                [--quick]

Trains a tabular model (builtin:breast_cancer, 30 features) and a text model (the SMS Spam
Collection TSV given with --sms PATH; skipped without it), writes generated CSVs of each size
(the texts as a one-column CSV with a `text` header), and runs `inference.py --input CSV
--output preds.csv` as a subprocess on each: peak RSS (GNU time) and end-to-end rows/s. Then
the raw session.run throughput of the same graph at the same batch size on rows encoded
beforehand, the start-up time of `inference.py --help`, and whether a prediction run imports
torch or dspy. --quick: one size, 200 rows (the growth line then compares it with itself), 1
epoch, and a generated stand-in for the SMS texts without --sms.

Goals: peak RSS at the largest size within 10% of the smallest; end-to-end ≥ 80% of raw
session.run throughput; no torch or dspy; --help under 1 s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from common import REPO, Config, add_quick_flag, quiet_single_thread, sms_or_standin, train_bundle

TEXT_HEADER = "text"  # the one column write_texts writes: inference.py --text_column text


@dataclass
class Case:
    name: str
    model: Path
    write: Callable[[Path, int], None]  # (path, rows): the input CSV
    batch_size: int
    text_column: str | None = None  # the input's text column, where it differs from training's

    def column_flags(self) -> list[str]:
        return ["--text_column", self.text_column] if self.text_column else []


def write_tabular(path: Path, rows: int, features: list[str], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    block = rng.normal(10, 5, (10_000, len(features)))
    with open(path, "w") as handle:
        handle.write(",".join(features) + "\n")
        lines = [",".join(f"{v:.4f}" for v in row) for row in block[:rows]]  # no more than written
        for start in range(0, rows, len(lines)):
            handle.write("\n".join(lines[: rows - start]) + "\n")


def write_texts(path: Path, rows: int, texts: list[str]) -> None:
    clean = [t.replace('"', "'").replace("\n", " ") for t in texts]
    with open(path, "w") as handle:
        handle.write(f"{TEXT_HEADER}\n")
        for start in range(0, rows, len(clean)):
            handle.write("".join(f'"{t}"\n' for t in clean[: rows - start]))


def run_inference(case: Case, data: Path) -> tuple[float, float]:
    """(peak RSS in MB, end-to-end rows/s) of one inference.py run."""
    report = data.with_suffix(".report.json")
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M", sys.executable, str(REPO / "inference.py"), "--model",
         str(case.model), "--input", str(data), "--output", str(data.with_suffix(".preds.csv")),
         "--batch_size", str(case.batch_size), "--chunk_rows", str(max(case.batch_size, 4096)),
         "--quiet", "true", "--report_json", str(report), *case.column_flags()],
        capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return peak_kb / 1024, json.loads(report.read_text())["predictions"]["rows_per_s"]


def raw_throughput(case: Case, data: Path, rows: int = 100_000) -> float:
    """session.run rows/s on rows read and encoded beforehand, same graph and batch size."""
    from config import Config as RunConfig
    from ttc.serving.batch import BatchOptions, input_chunks
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import batches_of, create_session

    manifest = read_manifest(BundlePaths.from_model_path(case.model))
    chunks = input_chunks(manifest, BatchOptions(str(data), "unused.csv", rows,
                                                 text_column=case.text_column))
    x = next(iter(chunks)).x
    session = create_session(str(case.model), RunConfig().cpu_runtime())
    name = session.get_inputs()[0].name
    batches = batches_of(x, case.batch_size)
    session.run(["probabilities"], {name: batches[0]})
    started = time.perf_counter()
    for batch in batches:
        session.run(["probabilities"], {name: batch})
    return len(x) / (time.perf_counter() - started)


def lean_start(case: Case, data: Path) -> tuple[float, list[str]]:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "inference.py"), "--help"], capture_output=True,
                   cwd=REPO, check=True)
    help_seconds = time.perf_counter() - started
    code = ("import sys, runpy\n"
            f"sys.argv = ['inference.py', '--model', {str(case.model)!r}, '--input', "
            f"{str(data)!r}, '--output', {str(data.with_suffix('.lean.csv'))!r}, '--quiet', "
            f"'true', *{case.column_flags()!r}]\n"
            "try:\n    runpy.run_path('inference.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(','.join(m for m in ('torch', 'dspy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    return help_seconds, [m for m in out.stdout.strip().split(",") if m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--batch_size", type=int, default=4096, help="tabular batch size")
    parser.add_argument("--text_batch_size", type=int, default=256)
    parser.add_argument("--sms", help="the SMS Spam Collection TSV (label<TAB>text); "
                        "without it the text case is skipped")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rows = "200"
    sizes = [int(r) for r in args.rows.split(",")]
    sms = sms_or_standin(args.sms, args.quick)
    quiet_single_thread()
    with tempfile.TemporaryDirectory(prefix="bench_batch_scale_") as tmp:
        work = Path(tmp)
        cases = train_cases(work, args, sms)
        for case in cases:
            measure(case, work, sizes)


def train_cases(work: Path, args, sms: str | None) -> list[Case]:
    """The tabular model, and the text model when there is an SMS file."""
    tabular_epochs, text_epochs = (1, 1) if args.quick else (5, 3)
    config = Config(model_type="tabular_classifier", dataset_path="builtin:breast_cancer",
                    epochs=tabular_epochs, no_progress=True,
                    output_model=str(work / "tab" / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    features = dataset.preprocessing["feature_names"]
    cases = [Case("tabular (30 features)", paths.onnx,
                  lambda p, n: write_tabular(p, n, features), args.batch_size)]
    if not sms:
        print("text: skipped; pass --sms PATH (the SMS Spam Collection TSV)", file=sys.stderr)
        return cases
    texts = [line.split("\t", 1)[-1]
             for line in Path(sms).read_text(errors="replace").splitlines()]
    config = Config(model_type="text_classifier", dataset_path=sms, epochs=text_epochs,
                    label_column="0", text_column="1", no_progress=True,
                    output_model=str(work / "text" / "model.onnx"))
    _, _, paths, _ = train_bundle(config)
    cases.append(Case("text (SMS)", paths.onnx, lambda p, n: write_texts(p, n, texts),
                      args.text_batch_size, TEXT_HEADER))
    return cases


def measure(case: Case, work: Path, sizes: list[int]) -> None:
    print(f"\n{case.name}, batch {case.batch_size}:")
    results = []
    stem = case.name.split()[0]
    for rows in sizes:
        data = work / f"{stem}_{rows}.csv"
        case.write(data, rows)
        peak, speed = run_inference(case, data)
        results.append((rows, peak, speed))
        print(f"  {rows:>9,} rows: peak RSS {peak:7.1f} MB, end to end {speed:>11,.0f} rows/s")
    first = work / f"{stem}_{sizes[0]}.csv"
    raw = raw_throughput(case, first)
    growth = results[-1][1] / results[0][1] - 1
    share = results[-1][2] / raw
    print(f"  raw session.run: {raw:,.0f} rows/s; end to end / raw = {share:.0%} "
          f"(goal ≥ 80%: {'met' if share >= 0.8 else 'NOT met'})")
    print(f"  peak RSS growth {sizes[0]:,} → {sizes[-1]:,} rows: {growth:+.1%} "
          f"(goal within 10%: {'met' if abs(growth) <= 0.1 else 'NOT met'})")
    help_seconds, heavy = lean_start(case, first)
    print(f"  inference.py --help: {help_seconds:.2f} s; a prediction run imports "
          f"{', '.join(heavy) if heavy else 'neither torch nor dspy'}")


if __name__ == "__main__":
    main()
