"""Regression (issue 67) measured side by side in one run: `pipeline.py --model_type
tabular_regressor` against scikit-learn on the same test rows, conformal coverage over seeds,
and ONNX Runtime against PyTorch eager.

    python bench/regression.py [--data diabetes,friedman1] [--seeds 5] [--level 0.9]
                               [--epochs 60] [--friedman_rows 2500]
                               [--threads 1] [--runs 200] [--pipeline_flags "--arch resmlp"]
                               [--quick]

The data: builtin:diabetes (scikit-learn's bundled set, read by ttc/tasks/regress/builtin.py)
and Friedman #1 (--friedman_rows rows, noise 1.0: the rows of make_friedman1 with random_state
0). For each seed s (0 .. --seeds - 1) the table is split 70/30 by scikit-learn's
train_test_split(test_size=0.3, random_state=s) and written to train.csv and test.csv, so that
pipeline.py (`--dataset_path train.csv --test_path test.csv --label_column target --interval
LEVEL --seed s`, 1 thread) is tested on exactly scikit-learn's test rows; its validation split
and calibration slice come out of train.csv, scikit-learn's models see all of train.csv. Per
data set and seed it prints:

  R²          scikit-learn's LinearRegression and MLPRegressor(hidden_layer_sizes=(64, 64),
              max_iter=2000, random_state=0; seed 0 only) on the 30% test rows, the pipeline's
              test R² (its report's evaluation.r2) and the gap pipeline - linear, with the
              report's mean-of-train baseline and verdict
  coverage    the test coverage and mean width of the pipeline's conformal LEVEL intervals
              (evaluation.interval) and the calibration rows they came from, and the figures
              of any other interval method the report holds
  ORT/eager   seed 0's model.onnx (ONNX Runtime) against its rebuilt PyTorch network (model.pt)
              at batch 1, timed in turns on the same rows (runtime.time_runners)

Goals (issue 67): diabetes R² within 0.03 of LinearRegression or above it; Friedman #1 R² ≥
0.85; conformal coverage LEVEL ± 4 points in the mean over seeds; ORT ≥ 2x eager at batch 1.
A pipeline.py run that fails is reported in its rows and the script exits 1 after the others.
--quick: 300 Friedman rows, 2 epochs, 1 seed, a few hundred MLPRegressor steps and timed turns,
everything in a temporary folder; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import REPO, Config, add_quick_flag, scratch_dir
from ttc.tasks.regress.builtin import friedman1_table, load_diabetes_table

TEST_SHARE = 0.3
DIABETES_GAP = 0.03  # pipeline R² may fall this far below LinearRegression's
FRIEDMAN_R2 = 0.85
COVERAGE_POINTS = 0.04
ORT_OVER_EAGER = 2.0


@dataclass
class Run:
    """One pipeline.py run on one data set and seed, with scikit-learn's figures beside it."""

    data: str
    seed: int
    test_rows: int
    linear_r2: float
    mlp_r2: float | None  # seed 0 only
    pipeline_test_rows: int | None = None
    r2: float | None = None
    rmse: float | None = None
    baseline_r2: float | None = None
    baseline_rmse: float | None = None
    verdict: str = ""
    intervals: list[dict] = field(default_factory=list)  # {method, level, coverage, mean_width}
    seconds: float = 0.0
    error: str = ""
    eager_ms: float | None = None
    ort_ms: float | None = None


# ----------------------------------------------------------------------------- data, scikit-learn


def split_files(frame, seed: int, folder: Path) -> tuple[Path, Path, object, object]:
    """(train.csv, test.csv, train frame, test frame): scikit-learn's 70/30 split of `frame`."""
    from sklearn.model_selection import train_test_split

    train, test = train_test_split(frame, test_size=TEST_SHARE, random_state=seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.csv", folder / "test.csv"
    train.to_csv(paths[0], index=False)  # pandas writes floats that read back exactly
    test.to_csv(paths[1], index=False)
    return paths[0], paths[1], train, test


def sklearn_r2(train, test, mlp_iterations: int | None) -> tuple[float, float | None]:
    """(LinearRegression's test R², MLPRegressor(64, 64)'s or None when not asked)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LinearRegression
    from sklearn.metrics import r2_score
    from sklearn.neural_network import MLPRegressor

    x, y = train.drop(columns="target").to_numpy(), train["target"].to_numpy()
    tx, ty = test.drop(columns="target").to_numpy(), test["target"].to_numpy()
    linear = r2_score(ty, LinearRegression().fit(x, y).predict(tx))
    if mlp_iterations is None:
        return float(linear), None
    with warnings.catch_warnings():  # --quick stops it early on purpose
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp = MLPRegressor(hidden_layer_sizes=(64, 64), max_iter=mlp_iterations,
                           random_state=0).fit(x, y)
    return float(linear), float(r2_score(ty, mlp.predict(tx)))


# ----------------------------------------------------------------------------- pipeline runs


def pipeline_command(train: Path, test: Path, folder: Path, seed: int,
                     args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(REPO / "pipeline.py"), "--model_type", "tabular_regressor",
            "--dataset_path", str(train), "--test_path", str(test), "--label_column", "target",
            "--interval", str(args.level), "--seed", str(seed), "--epochs", str(args.epochs),
            "--num_threads", str(args.threads), "--plots", "none", "--no_progress", "true",
            "--output_model", str(folder / "model.onnx"),
            "--report_json", str(folder / "report.json"), *shlex.split(args.pipeline_flags)]


def run_pipeline(train: Path, test: Path, folder: Path, seed: int, args: argparse.Namespace
                 ) -> tuple[dict | None, float, str]:
    """(the report JSON or None, wall seconds, the error line or "") of one pipeline.py run."""
    started = time.perf_counter()
    done = subprocess.run(pipeline_command(train, test, folder, seed, args), cwd=REPO,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return None, seconds, f"pipeline.py failed (exit {done.returncode}): {lines[-1]}"
    return json.loads((folder / "report.json").read_text()), seconds, ""


def read_report(report: dict, run: Run) -> None:
    """The figures this bench takes from pipeline.py's report JSON: the one place that knows
    its keys (evaluation: r2, rmse, baseline {r2, rmse}, verdict, interval; dataset: test; and
    every other {method, level, coverage, mean_width} record, after evaluation.interval)."""
    evaluation = report["evaluation"]
    run.r2, run.rmse = evaluation["r2"], evaluation["rmse"]
    run.baseline_r2 = evaluation["baseline"]["r2"]
    run.baseline_rmse = evaluation["baseline"]["rmse"]
    verdict = evaluation.get("verdict", "")
    run.verdict = verdict if isinstance(verdict, str) else json.dumps(verdict)
    run.pipeline_test_rows = report.get("dataset", {}).get("test")
    conformal = evaluation.get("interval")
    run.intervals = [conformal] if conformal else []
    run.intervals += [r for r in interval_records(report) if r is not conformal]


def interval_records(node, found: list[dict] | None = None) -> list[dict]:
    """Every dict in the report that reads as an interval's figures (method, coverage), in the
    JSON's order: the conformal one and whatever MC-dropout or an ensemble adds."""
    found = [] if found is None else found
    if isinstance(node, dict):
        if {"method", "coverage"} <= node.keys():
            found.append(node)
        for value in node.values():
            interval_records(value, found)
    elif isinstance(node, list):
        for value in node:
            interval_records(value, found)
    return found


def time_bundle(folder: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(PyTorch eager p50 ms, ONNX Runtime p50 ms) at batch 1: model.pt rebuilt by the
    manifest's network and model.onnx, taking turns on the same rows (values drawn N(0, 1): an
    MLP's time does not depend on them)."""
    import torch

    from ttc.nets.models import load_weights
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import create_session, time_runners

    torch.set_num_threads(args.threads)
    paths = BundlePaths.from_model_path(folder / "model.onnx")
    net = load_weights(read_manifest(paths), paths.weights).eval()
    session = create_session(str(paths.onnx), Config(num_threads=args.threads).cpu_runtime())
    graph_input = session.get_inputs()[0]
    width = graph_input.shape[1]
    rows = np.random.default_rng(0).standard_normal((64, width)).astype(np.float32)
    ones = [rows[i:i + 1] for i in range(len(rows))]

    def eager(batch: np.ndarray) -> object:
        with torch.inference_mode():
            return net(torch.from_numpy(batch))

    def ort(batch: np.ndarray) -> object:
        return session.run(None, {graph_input.name: batch})

    speed = time_runners([eager, ort], ones, runs=args.runs,
                         min_seconds=0.0 if args.quick else 1.0)
    return speed.percentile_ms(0, 50), speed.percentile_ms(1, 50)


def measure(name: str, frame, seed: int, args: argparse.Namespace, work: Path) -> Run:
    folder = work / f"{name}_seed{seed}"
    train_csv, test_csv, train, test = split_files(frame, seed, folder)
    linear, mlp = sklearn_r2(train, test, args.mlp_iterations if seed == 0 else None)
    run = Run(name, seed, len(test), linear, mlp)
    report, run.seconds, run.error = run_pipeline(train_csv, test_csv, folder, seed, args)
    if report is None:
        return run
    try:
        read_report(report, run)
    except (KeyError, TypeError) as err:
        run.error = f"report JSON lacks {err} (bench/regression.py read_report)"
        return run
    if seed == 0:
        run.eager_ms, run.ort_ms = time_bundle(folder, args)
    return run


# ----------------------------------------------------------------------------- printing


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_runs(runs: list[Run]) -> None:
    print(f"{'data':<10} {'seed':>4} {'test rows':>9} {'linear R²':>9} {'MLP(64,64) R²':>13} "
          f"{'pipeline R²':>11} {'gap':>7} {'mean R²':>8} {'RMSE':>8} {'coverage':>8} "
          f"{'width':>8} {'calib':>5} {'seconds':>7}  verdict")
    for r in runs:
        conformal = r.intervals[0] if r.intervals else {}
        gap = None if r.r2 is None else r.r2 - r.linear_r2
        print(f"{r.data:<10} {r.seed:>4} {r.test_rows:>9} {r.linear_r2:>9.3f} "
              f"{fmt(r.mlp_r2):>13} {fmt(r.r2):>11} {fmt(gap):>7} {fmt(r.baseline_r2):>8} "
              f"{fmt(r.rmse, 2):>8} {fmt(conformal.get('coverage')):>8} "
              f"{fmt(conformal.get('mean_width'), 1):>8} "
              f"{conformal.get('n_calibration', '-'):>5} {r.seconds:>7.1f}  "
              f"{r.error or r.verdict}")
        if r.pipeline_test_rows is not None and r.pipeline_test_rows != r.test_rows:
            print(f"  WARNING: pipeline.py tested {r.pipeline_test_rows} rows, scikit-learn "
                  f"{r.test_rows}: not the same test split")
        for other in r.intervals[1:]:
            print(f"  {other['method']} nominal {other.get('level')}: coverage "
                  f"{fmt(other.get('coverage'))}, mean width {fmt(other.get('mean_width'), 1)}")


def coverage_goal(runs: list[Run], level: float) -> tuple[str, str, bool | None]:
    """(label, figure, met) of the conformal coverage over seeds on one data set."""
    values = [r.intervals[0]["coverage"] for r in runs if r.intervals]
    label = f"conformal {level:.0%} coverage, {runs[0].data}, {len(values)} seed(s)"
    if not values:
        return label, "not measured", None
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    figure = (f"{mean:.3f} ± {spread:.3f} (min {min(values):.3f}, max {max(values):.3f}; "
              f"goal {level:.2f} ± {COVERAGE_POINTS:.2f})")
    return label, figure, abs(mean - level) <= COVERAGE_POINTS


def r2_rows(name: str, runs: list[Run]) -> list[tuple[str, str, bool | None]]:
    """The R² goal on seed 0's split (the issue's), and the gap to the linear model over seeds."""
    first = runs[0]
    if first.r2 is None:
        return [(f"{name} test R²", "not measured", None)]
    if name == "diabetes":
        gap = first.r2 - first.linear_r2
        rows = [(f"{name} test R² vs LinearRegression", f"{first.r2:.3f} vs "
                 f"{first.linear_r2:.3f} (gap {gap:+.3f}, goal ≥ -{DIABETES_GAP})",
                 gap >= -DIABETES_GAP)]
    else:
        rows = [(f"{name} test R²", f"{first.r2:.3f} (goal ≥ {FRIEDMAN_R2}; MLPRegressor "
                 f"{fmt(first.mlp_r2)}, linear {first.linear_r2:.3f})", first.r2 >= FRIEDMAN_R2)]
    gaps = [r.r2 - r.linear_r2 for r in runs if r.r2 is not None]
    if len(gaps) > 1:
        rows.append((f"{name} R² - LinearRegression R² over {len(gaps)} seeds",
                     f"mean {statistics.fmean(gaps):+.3f} (min {min(gaps):+.3f}, "
                     f"max {max(gaps):+.3f})", None))
    return rows


def speed_row(name: str, first: Run) -> tuple[str, str, bool | None]:
    label = f"{name} ORT fp32 / PyTorch eager at batch 1"
    if not first.ort_ms:
        return label, "not measured", None
    ratio = first.eager_ms / first.ort_ms
    return label, (f"{ratio:.2f}x ({first.eager_ms:.3f} → {first.ort_ms:.3f} ms; goal ≥ "
                   f"{ORT_OVER_EAGER:.0f}x)"), ratio >= ORT_OVER_EAGER


def goal_rows(by_data: dict[str, list[Run]], level: float) -> list[tuple[str, str, bool | None]]:
    rows = []
    for name, runs in by_data.items():
        rows += [*r2_rows(name, runs), coverage_goal(runs, level), speed_row(name, runs[0])]
    return rows


def print_goals(rows: list[tuple[str, str, bool | None]]) -> None:
    print("\ngoals:")
    for label, figure, met in rows:
        mark = "" if met is None else ("  met" if met else "  NOT met")
        print(f"  {label}: {figure}{mark}")


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="diabetes,friedman1",
                        help="the tables, of: diabetes, friedman1")
    parser.add_argument("--seeds", type=int, default=5, help="splits and pipeline seeds 0..N-1")
    parser.add_argument("--level", type=float, default=0.9, help="--interval's coverage")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--friedman_rows", type=int, default=2500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=200, help="timed turns at batch 1")
    parser.add_argument("--mlp_iterations", type=int, default=2000,
                        help="MLPRegressor's max_iter")
    parser.add_argument("--pipeline_flags", default="",
                        help="more pipeline.py flags, e.g. \"--arch resmlp --loss huber\"")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs, args.friedman_rows = 1, 2, 300
        args.runs, args.mlp_iterations = 20, 50
    tables = {"diabetes": load_diabetes_table,
              "friedman1": lambda: friedman1_table(n_rows=args.friedman_rows, noise=1.0, seed=0)}
    names = [name for name in args.data.split(",") if name]
    if not names or set(names) - set(tables):
        parser.error(f"--data takes a comma-separated list of {', '.join(tables)}")
    data = {name: tables[name]() for name in names}
    work = scratch_dir()
    by_data = {name: [measure(name, frame, seed, args, work) for seed in range(args.seeds)]
               for name, frame in data.items()}
    print_runs([r for runs in by_data.values() for r in runs])
    print_goals(goal_rows(by_data, args.level))
    if any(r.error for runs in by_data.values() for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
