"""The temperature fitted on the calibration slice against today's fit on the validation split
(issue 65, item 1), over several seeds, through the real commands.

    python bench/calibration_slice.py [--seeds 5] [--sms_seeds 3] [--first_seed 0]
                                      [--sms sms_spam.tsv] [--quick]

Per seed, the same data set and flags twice:
- today: `pipeline.py --calibration_fraction 0`, which trains on the whole training split as the
  tool did before the slice (same rows, same network); the bench then fits T on the validation
  split's logits by the rule of before (T's interval excludes 1 and the NLL gain's lies above
  0, then the fitted T itself applied; calibrate.py, fitted_on "validation") and applies it to
  the test logits;
- slice: `pipeline.py` with its defaults (--calibration_fraction 0.1): T fitted on the slice
  and decided by the tool (its NLL and Brier gains), as the report's `calibration` says.
It prints test accuracy, T, whether it was applied, and test NLL, Brier and ECE before → after
T, each run's wall time, and the goals: where T is applied, test NLL never up by more than 0.002
and ECE by more than 0.005; no accuracy lost on the README main job (digits, seed 0) and its time
not up by more than 10%. Then a deliberately overconfident network, on which T must still lower
test NLL: the SMS text model (or --quick's stand-in) trained without any regularisation
(--weight_decay 0 --dropout 0, 30 epochs, --patience 1000) with a calibration slice of 0.2.
Option (b), cross-fitting (K networks trained on K − 1 folds, their out-of-fold logits the
calibration data), costs K further trainings: the bench prints that estimate from the measured
training time; it does not run it.

--quick: one digits seed of one epoch, the SMS stand-in; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import REPO, add_quick_flag, scratch_dir, sms_or_standin

NLL_SLACK, ECE_SLACK = 0.002, 0.005  # the goal: what T may add to test NLL and ECE
TIME_SLACK = 0.10
OVERCONFIDENT = ("--weight_decay", "0", "--dropout", "0", "--epochs", "30", "--patience", "1000",
                 "--calibration_fraction", "0.2")
CROSS_FOLDS = 5


@dataclass
class Run:
    """One run's test figures: accuracy, T, and NLL/Brier/ECE before → after T."""

    accuracy: float
    temperature: float
    applied: bool
    fitted_on: str
    samples: int
    before: tuple[float, float, float]  # nll, brier, ece
    after: tuple[float, float, float]
    seconds: float
    train_seconds: float
    reason: str


def pipeline(args: list, out: Path) -> tuple[dict, float]:
    """pipeline.py with --report_json; its report and wall time."""
    cmd = [sys.executable, str(REPO / "pipeline.py"), *map(str, args), "--report_json", str(out),
           "--no_progress", "true", "--plots", "none", "--num_threads", "1"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text()), time.perf_counter() - started


def slice_run(data: list, seed: int, extra: tuple = ()) -> Run:
    """The tool as it is: T fitted on the calibration slice, decided by the tool."""
    folder = scratch_dir()
    report, seconds = pipeline([*data, "--seed", seed, "--output_model", folder / "model.onnx",
                                *extra], folder / "report.json")
    c = report["calibration"]
    return Run(report["evaluation"]["accuracy"], c["temperature"], bool(c["applied"]),
               c["fitted_on"], c["fit_samples"] or 0,
               (c["nll_before"], c["brier_before"], c["ece_before"]),
               (c["nll_after"], c["brier_after"], c["ece_after"]), seconds,
               report["train"]["seconds"], c.get("reason") or "")


def today_run(data: list, seed: int, extra: tuple = ()) -> Run:
    """Before the slice: the whole training split trained on, T fitted on the validation split
    by the rule of then (NLL gain only), applied to the test split here."""
    from ttc.testtime.calibrate import decide, fit_with_interval

    folder = scratch_dir()
    model = folder / "model.onnx"
    report, seconds = pipeline([*data, "--seed", seed, "--output_model", model,
                                "--calibration_fraction", "0", *extra], folder / "report.json")
    (val_logits, val_y), (test_logits, test_y) = bundle_logits(model, data)
    fit = fit_with_interval(val_logits, val_y, seed, fitted_on="validation")
    fit.brier_gain_interval = None  # the rule of before judged the NLL gain alone
    fit = decide(fit, "evidence")
    if fit.applied:  # ... and applied the fitted T itself (not calibrate.cautious's)
        fit.temperature = fit.fitted
    return Run(report["evaluation"]["accuracy"], fit.temperature, bool(fit.applied),
               "validation", fit.samples, scores(test_logits, test_y, 1.0),
               scores(test_logits, test_y, fit.temperature), seconds,
               report["train"]["seconds"], fit.reason or "")


def bundle_logits(model: Path, data: list) -> tuple[tuple, tuple]:
    """The validation and test splits' logits from the bundle's graph, and their classes."""
    from ttc.inputs.data import load_bundle_dataset
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import RuntimeOptions, create_session, session_feeder

    manifest = read_manifest(BundlePaths.from_model_path(model))
    path = data[data.index("--dataset_path") + 1]
    dataset = load_bundle_dataset(manifest, str(path), ("val", "test"), show_progress=False)
    session = create_session(str(model), RuntimeOptions(intra_op_threads=1))
    feed = session_feeder(session)

    def logits(x: np.ndarray) -> np.ndarray:
        return np.concatenate([session.run(["logits"], feed(x[i:i + 1]))[0]
                               for i in range(len(x))])

    return ((logits(dataset.val.x), dataset.val.y), (logits(dataset.test.x), dataset.test.y))


def scores(logits: np.ndarray, y: np.ndarray, temperature: float) -> tuple[float, float, float]:
    from ttc.reporting.metrics import expected_calibration_error, nll
    from ttc.testtime.calibrate import brier, softmax

    p = softmax(logits, temperature)
    return nll(p, y), brier(p, y), expected_calibration_error(p, y)


def row(name: str, seed: int, run: Run) -> str:
    (n0, b0, e0), (n1, b1, e1) = run.before, run.after
    return (f"  {name:<7} {seed:>4} {run.accuracy:>8.4f} {run.fitted_on[:5]:>6} {run.samples:>5} "
            f"{run.temperature:>7.3f} {'yes' if run.applied else 'no':>7}  {n0:.4f} → {n1:.4f}  "
            f"{b0:.4f} → {b1:.4f}  {e0:.4f} → {e1:.4f} {run.seconds:>7.1f}")


HEADER = (f"  {'option':<7} {'seed':>4} {'test acc':>8} {'on':>6} {'rows':>5} {'T':>7} "
          f"{'applied':>7}  {'NLL before → after':<18}  {'Brier':<17}  {'ECE':<17} {'wall s':>7}")


def goal_lines(name: str, runs: list[Run]) -> list[str]:
    """Where T is applied: test NLL up by at most NLL_SLACK and ECE by at most ECE_SLACK."""
    applied = [r for r in runs if r.applied]
    nll_bad = [r for r in applied if r.after[0] - r.before[0] > NLL_SLACK]
    ece_bad = [r for r in applied if r.after[2] - r.before[2] > ECE_SLACK]
    met = not nll_bad and not ece_bad
    return [f"  {name}: T applied in {len(applied)} of {len(runs)}; test NLL up > {NLL_SLACK} in "
            f"{len(nll_bad)}, ECE up > {ECE_SLACK} in {len(ece_bad)}: "
            f"{'met' if met else 'NOT met'}"]


def compare(name: str, data: list, seeds: range) -> tuple[list[Run], list[Run]]:
    print(f"\n{name}: today (T on the validation split) against the slice (T on the "
          f"calibration slice), test split")
    print(HEADER)
    today, sliced = [], []
    for seed in seeds:
        today.append(today_run(data, seed))
        sliced.append(slice_run(data, seed))
        print(row("today", seed, today[-1]))
        print(row("slice", seed, sliced[-1]))
    accuracy = [np.mean([r.accuracy for r in runs]) for runs in (today, sliced)]
    seconds = [np.mean([r.seconds for r in runs]) for runs in (today, sliced)]
    print(f"  mean test accuracy today {accuracy[0]:.4f}, slice {accuracy[1]:.4f} "
          f"({accuracy[1] - accuracy[0]:+.4f}: the cost of training on 10% fewer rows); "
          f"wall s {seconds[0]:.1f} → {seconds[1]:.1f} (×{seconds[1] / seconds[0]:.2f})")
    for line in (*goal_lines("today", today), *goal_lines("slice", sliced)):
        print(line)
    train = np.mean([r.train_seconds for r in today])
    print(f"  option (b), cross-fitting with {CROSS_FOLDS} folds, not run: {CROSS_FOLDS} more "
          f"trainings on {CROSS_FOLDS - 1}/{CROSS_FOLDS} of the rows, about "
          f"{CROSS_FOLDS * train * (CROSS_FOLDS - 1) / CROSS_FOLDS:.0f} s more than today's "
          f"{train:.1f} s of training (×{1 + CROSS_FOLDS * (CROSS_FOLDS - 1) / CROSS_FOLDS:.1f}), "
          f"no rows lost")
    return today, sliced


def main_job_goal(today: Run, sliced: Run) -> None:
    """README's main job (digits, seed 0, defaults): accuracy kept, wall time within 10%."""
    kept = sliced.accuracy >= today.accuracy
    ratio = sliced.seconds / today.seconds
    print(f"\nREADME main job (builtin:digits, seed 0): test accuracy {today.accuracy:.4f} → "
          f"{sliced.accuracy:.4f}: {'met' if kept else 'NOT met'}; wall time "
          f"{today.seconds:.1f} s → {sliced.seconds:.1f} s (×{ratio:.2f}, goal ≤ "
          f"×{1 + TIME_SLACK:.2f}): {'met' if ratio <= 1 + TIME_SLACK else 'NOT met'}")


def overconfident(data: list, seed: int) -> None:
    """A network trained without regularisation: T must still lower its test NLL."""
    run = slice_run(data, seed, OVERCONFIDENT)
    print(f"\noverconfident network ({' '.join(OVERCONFIDENT)}), seed {seed}:")
    print(HEADER)
    print(row("slice", seed, run))
    lowered = run.applied and run.after[0] < run.before[0]
    print(f"  goal T lowers test NLL on an overconfident network: "
          f"{'met' if lowered else 'NOT met'} ({run.reason})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sms_seeds", type=int, default=3)
    parser.add_argument("--first_seed", type=int, default=0)
    parser.add_argument("--sms", type=Path, help="the SMS spam TSV (label, text); --quick uses "
                        "a stand-in when not given")
    add_quick_flag(parser)
    args = parser.parse_args()
    digits = ["--model_type", "image_classifier", "--dataset_path", "builtin:digits"]
    if args.quick:
        args.seeds, args.sms_seeds = 1, 1
        digits += ["--epochs", "1"]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    today, sliced = compare("builtin:digits", digits, seeds)
    if args.first_seed == 0:
        main_job_goal(today[0], sliced[0])
    given = args.sms if args.sms and args.sms.exists() else None  # --quick: the stand-in
    sms = sms_or_standin(given, args.quick)
    if not (sms and Path(sms).exists()):
        print(f"\nSMS: skipped, {args.sms} not found")
        return
    text = ["--model_type", "text_classifier", "--dataset_path", sms, "--label_column", "0",
            "--text_column", "1"]
    if args.quick:  # the stand-in's 80 rows: a slice of 11, not 6
        text += ["--epochs", "1", "--calibration_fraction", "0.2"]
    compare(f"SMS ({Path(sms).name})", text,
            range(args.first_seed, args.first_seed + args.sms_seeds))
    overconfident(text, args.first_seed)


if __name__ == "__main__":
    main()
