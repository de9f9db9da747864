"""Batched TTA vs a per-view loop, measured side by side in one run.

    python bench/tta_speed.py [--epochs 10]

Trains the digits CNN (views: plain, hflip, vflip, rot180) and the breast_cancer MLP (views:
plain and three jitters), then times, at batch 1 and 64: the pipeline's batched TTA (views
stacked into runs of about --batch_size rows, then merged) against a loop of one session.run per
view (merged the same way), and plain inference. Prints the
loop/batched speed-up and the TTA cost ratio (TTA time / plain time). Goals: batched ≥ 2x faster
than the loop at batch 1; cost ratio at batch 64 ≤ 1.1 × views.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from common import Config, quiet_single_thread, train_bundle

VIEWS = 4
CASES = [("digits CNN", "image_classifier", "builtin:digits", "hflip,vflip,rot180"),
         ("breast_cancer MLP", "tabular_classifier", "builtin:breast_cancer",
          "jitter:0.1,jitter:0.2,jitter:0.3")]


def measure(name: str, model_type: str, dataset_path: str, specs: str, epochs: int, runs: int
            ) -> None:
    from inference import batches_of, create_session, interleaved_timings, session_runner
    from tta import build_transforms, merge, tta_predict

    config = Config(model_type=model_type, dataset_path=dataset_path, epochs=epochs,
                    no_progress=True, output_model=str(Path(tempfile.mkdtemp()) / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    predict = session_runner(create_session(str(paths.onnx), config.cpu_runtime()))
    transforms = build_transforms(specs, dataset.preprocessing)
    rng = np.random.default_rng(0)

    def batched(batch: np.ndarray) -> np.ndarray:  # what the pipeline runs
        return tta_predict(predict, batch, transforms, "mean", len(batch))

    def loop(batch: np.ndarray) -> np.ndarray:  # one session.run per view
        probs = [predict(batch)] + [predict(v) for t in transforms for v in t.views(batch, rng)]
        return merge(np.concatenate(probs), None, len(batch), "mean")

    x, y = dataset.test.x, dataset.test.y
    plain_acc = np.mean(np.concatenate([predict(b) for b in batches_of(x, 64)]).argmax(1) == y)
    tta_acc = np.mean(batched(x).argmax(1) == y)
    print(f"\n{name}: {len(x)} test samples, views: plain + {specs} = {VIEWS}; accuracy plain "
          f"{plain_acc:.4f}, TTA {tta_acc:.4f}")
    print(f"{'batch':>5}  {'plain ms':>9}  {'batched TTA ms':>14}  {'loop TTA ms':>11}  "
          f"{'loop/batched':>12}  {'cost ratio':>10}  {'≤ 1.1×views':>11}")
    for size in (1, 64):
        times = interleaved_timings([predict, batched, loop], batches_of(x, size), runs)
        plain_ms, batched_ms, loop_ms = (float(np.median(t)) * 1e3 for t in times)
        cost = batched_ms / plain_ms
        print(f"{size:>5}  {plain_ms:>9.4f}  {batched_ms:>14.4f}  {loop_ms:>11.4f}  "
              f"{loop_ms / batched_ms:>12.2f}  {cost:>10.2f}  "
              f"{'yes' if cost <= 1.1 * VIEWS else 'no':>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs", type=int, default=200, help="timed turns per batch size")
    args = parser.parse_args()
    quiet_single_thread()
    for case in CASES:
        measure(*case, args.epochs, args.runs)


if __name__ == "__main__":
    main()
