"""The label-free shift score (ttc/testtime/shift_score.py): does it tell shifted batches from
clean ones, and does it stay flat on a clean stream.

    python bench/shift_score.py [--seeds 0 1 2] [--batches 200] [--quick]

For each seed, trains the digits CNN with pipeline.py (the bundle records the reference: the
scaled prediction entropies of its calibration slice), then scores random batches of 64 drawn
from the test split, clean and under each corruption of --eval_shift at severity 3 (every
batch corrupted with its own seed), with the unadapted model's predictions:

1. AUROC of the score, clean batches against each corruption's. Goal: ≥ 0.9 for each.
2. Flatness: the score's quantiles over a long clean stream (--batches batches of 64 drawn from
   the test and validation splits) and its false alarm rate (batches over the threshold); then
   serve.py's gauge (the last 64 rows) after each of 1,000 batches of 8 clean rows. Goal: false
   alarms ≤ 5% (the threshold is set for 1%).
3. Cost: the score of one batch of 64 against one plain session.run of it.

--quick: 1 epoch, 30 batches, seed 0.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from common import REPO, add_quick_flag, scratch_dir
from utils import setup_logging

SHIFTS = ["gaussian_noise", "contrast", "blur", "shift", "brightness"]
BATCH = 64


def auroc(clean: np.ndarray, shifted: np.ndarray) -> float:
    """P(a shifted batch scores above a clean one), ties counting half."""
    above = (shifted[:, None] > clean[None, :]).mean()
    return float(above + 0.5 * (shifted[:, None] == clean[None, :]).mean())


def bundle(seed: int, epochs: int) -> str:
    """A digits bundle trained and exported by pipeline.py, as a user's."""
    out = scratch_dir() / "model.onnx"
    subprocess.run([sys.executable, str(REPO / "pipeline.py"), "--dataset_path", "builtin:digits",
                    "--output_model", str(out), "--seed", str(seed), "--epochs", str(epochs),
                    "--log_level", "ERROR"], check=True,
                   stdout=subprocess.DEVNULL)
    return str(out)


def measure(seed: int, epochs: int, batches: int) -> tuple[dict, float]:
    from ttc.inputs.data import load_bundle_dataset
    from ttc.inputs.shifts import corrupt
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.runtime import RuntimeOptions, create_session, session_runner
    from ttc.testtime.shift_score import ShiftMonitor, ShiftReference

    paths = BundlePaths.from_model_path(bundle(seed, epochs))
    manifest = read_manifest(paths)
    reference = ShiftReference.of_manifest(manifest)
    data = load_bundle_dataset(manifest, "builtin:digits", ("val", "test"), False)
    predict = session_runner(create_session(str(paths.onnx), RuntimeOptions()))
    rng = np.random.default_rng(1000 + seed)
    test = data.test.x

    def draws(x: np.ndarray, count: int) -> list[np.ndarray]:
        return [x[rng.choice(len(x), BATCH, replace=False)] for _ in range(count)]

    clean = np.array([reference.score(predict(b)) for b in draws(test, batches)])
    threshold = reference.threshold(BATCH)
    print(f"\nseed {seed}: reference of {reference.samples} held-out predictions, "
          f"threshold {threshold:.3f} per batch of {BATCH}; test split {len(test)}")
    print(f"  {'corruption (severity 3)':<26} {'AUROC':>6} {'median score':>13} {'flagged':>8}")
    print(f"  {'clean':<26} {'':>6} {np.median(clean):>13.3f} {(clean > threshold).mean():>8.0%}")
    aurocs = {}
    for name in SHIFTS:
        scores = np.array([reference.score(predict(corrupt(b, name, 3, manifest.preprocessing.spec,
                                                           seed * 10_000 + k)))
                           for k, b in enumerate(draws(test, batches))])
        aurocs[name] = auroc(clean, scores)
        print(f"  {name:<26} {aurocs[name]:>6.3f} {np.median(scores):>13.3f} "
              f"{(scores > threshold).mean():>8.0%}")
    stream = np.concatenate([test, data.val.x])
    long = np.array([reference.score(predict(b)) for b in draws(stream, batches)])
    alarms = float((long > threshold).mean())
    quantiles = np.quantile(long, [0.05, 0.5, 0.95, 1.0])
    print(f"  clean stream, {batches} batches of {BATCH} (test and validation): score p5 "
          f"{quantiles[0]:.3f}, p50 {quantiles[1]:.3f}, p95 {quantiles[2]:.3f}, max "
          f"{quantiles[3]:.3f}; false alarms {alarms:.1%}")
    monitor, gauge = ShiftMonitor(reference), []
    for _ in range(1000 if batches > 50 else 100):
        monitor.observe(predict(stream[rng.choice(len(stream), 8, replace=False)]))
        gauge.append(monitor.score)
    gauge_alarms = float((np.array(gauge[8:]) > monitor.threshold).mean())
    print(f"  serve.py's gauge over {len(gauge)} batches of 8 clean rows: p50 "
          f"{np.median(gauge[8:]):.3f}, max {np.max(gauge[8:]):.3f} (threshold "
          f"{monitor.threshold:.3f}); false alarms {gauge_alarms:.1%}")
    batch = np.ascontiguousarray(test[:BATCH])
    probabilities = predict(batch)
    plain, scoring = best_time(lambda: predict(batch)), best_time(
        lambda: reference.score(probabilities))
    print(f"  cost: scoring a batch of {BATCH} {scoring * 1e6:.0f} µs, plain session.run "
          f"{plain * 1e6:.0f} µs ({scoring / plain:.2f}x)")
    return aurocs, max(alarms, gauge_alarms)


def best_time(run, rounds: int = 50) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches", type=int, default=200)
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs, args.batches = [0], 1, 30
    setup_logging("ERROR")
    results = [measure(seed, args.epochs, args.batches) for seed in args.seeds]
    worst = {name: min(r[0][name] for r in results) for name in SHIFTS}
    alarms = max(r[1] for r in results)
    low = min(worst.values())
    print(f"\ngoal AUROC ≥ 0.9 per corruption at severity 3, batches of {BATCH} (lowest over "
          f"seeds {args.seeds}): " + ", ".join(f"{n} {a:.3f}" for n, a in worst.items())
          + f" {'met' if low >= 0.9 else 'NOT met'}")
    print(f"goal flat on a clean stream, false alarms ≤ 5%: {alarms:.1%} "
          f"{'met' if alarms <= 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
