"""ONNX Runtime vs PyTorch eager, and int8 vs fp32, on the built-in models, measured in one run.

    python bench/runtime_speed.py [--epochs 10] [--hidden 1024] [--quick]

For each model (digits CNN; a Gemm-heavy MLP on digits' 64 pixels with 1024-1024 hidden units;
the default breast_cancer MLP) it trains, exports, then prints, from timings taken in turns on
the same batches with one thread each:
- ORT fp32 / PyTorch eager: speed-up of the p50 latency at batch 1 and of throughput at batch 64;
- int8 (static and dynamic) / ORT fp32 at batch 64, and the accuracy change;
- what --quantize auto picks and whether inference would use a variant slower than fp32.
--quick: 1 epoch, hidden layers of 32, the first two models.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import Config, add_quick_flag, quiet_single_thread, scratch_dir, train_bundle
from ttc.serving.bundle import read_manifest


def digits_table(folder: Path) -> str:
    """scikit-learn's digits as a 64-feature CSV, for the Gemm-heavy MLP."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    path = folder / "digits_features.csv"
    header = ",".join(f"p{i}" for i in range(64)) + ",label\n"
    rows = "".join(",".join(str(int(v)) for v in row) + f",{t}\n"
                   for row, t in zip(digits.data, digits.target))
    path.write_text(header + rows)
    return str(path)


def measure(name: str, config: Config) -> None:
    from ttc.online.evaluate import benchmark_variants, bundle_variants
    from ttc.training.stage import torch_variant
    from ttc.compress.quantization import quantize_bundle

    dataset, trained, paths, _ = train_bundle(config)
    x, y = dataset.test.x, dataset.test.y
    manifest = read_manifest(paths)
    rows = benchmark_variants([torch_variant(trained.net, paths)] + bundle_variants(
        paths, manifest, config), x, y, config.batch_size, manifest.input.pad_id)
    eager, ort32 = rows
    params = trained.architecture["num_parameters"]
    print(f"\n{name}: {trained.architecture['name']} {params:,} parameters, {len(x)} test samples")
    print(f"  ORT fp32 / PyTorch eager: batch 1 p50 {eager['latency_ms_p50_batch1']:.4f} → "
          f"{ort32['latency_ms_p50_batch1']:.4f} ms = "
          f"{eager['latency_ms_p50_batch1'] / ort32['latency_ms_p50_batch1']:.2f}x faster; batch "
          f"{config.batch_size} throughput {eager['throughput_per_s']:.0f} → "
          f"{ort32['throughput_per_s']:.0f}/s = "
          f"{ort32['throughput_per_s'] / eager['throughput_per_s']:.2f}x")
    for mode in ("static", "dynamic", "auto"):
        config.quantize = mode
        q = quantize_bundle(config, paths, dataset.train.x, (dataset.val.x, dataset.val.y),
                            (x, y))
        used_slower = q.used_for_inference and q.latency_ms_p50 > q.latency_ms_p50_fp32
        print(f"  int8 {mode:<7}({q.mode:<7}) / ORT fp32 at batch {config.batch_size}: "
              f"{q.latency_ms_p50_fp32:.4f} → {q.latency_ms_p50:.4f} ms = "
              f"{q.latency_ms_p50_fp32 / q.latency_ms_p50:.2f}x; accuracy "
              f"{q.accuracy_fp32:.4f} → {q.accuracy:.4f}; size {q.size_bytes_fp32 / 1e6:.2f} → "
              f"{q.size_bytes / 1e6:.2f} MB; inference uses {'int8' if q.used_for_inference else 'fp32'}"
              + ("  <-- SLOWER VARIANT USED" if used_slower else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024,
                        help="width of the Gemm-heavy MLP's two hidden layers")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.hidden = 1, 32
    quiet_single_thread(args.quick)
    from ttc.nets import models

    work = scratch_dir()
    common = dict(epochs=args.epochs, no_progress=True, batch_size=64)
    measure("digits CNN", Config(dataset_path="builtin:digits",
                                 output_model=str(work / "cnn" / "model.onnx"), **common))
    default_tabular = models.TABULAR_NETWORKS["mlp"]  # the default tabular network
    models.TABULAR_NETWORKS["mlp"] = lambda pre, k: {**default_tabular(pre, k),
                                                  "hidden": [args.hidden] * 2}
    measure(f"Gemm-heavy MLP (digits pixels, 64-{args.hidden}-{args.hidden}-10)",
            Config(model_type="tabular_classifier", dataset_path=digits_table(work),
                   output_model=str(work / "mlp" / "model.onnx"), **common))
    models.TABULAR_NETWORKS["mlp"] = default_tabular
    if args.quick:  # the same measure() as the MLP above
        return
    measure("breast_cancer MLP", Config(model_type="tabular_classifier",
                                        dataset_path="builtin:breast_cancer",
                                        output_model=str(work / "bc" / "model.onnx"), **common))


if __name__ == "__main__":
    main()
