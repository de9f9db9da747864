"""Text model: PyTorch vs ONNX Runtime agreement and latency, measured side by side in one run.

    python bench/text_export.py --data sms_spam.tsv  # the SMS Spam Collection
    python bench/text_export.py --data my.tsv --label_column 0 --text_column 1 --epochs 10
    python bench/text_export.py --quick  # a smoke run on generated texts

Trains the text classifier as pipeline.py does, exports and validates it, then on the test split
prints the largest |ONNX Runtime - PyTorch| difference and the p50 latency of both at batch 1 and
64 (1 thread each, the same batches, interleaved so machine noise hits both alike). --quick: 1
epoch, 5 timed runs, on a generated stand-in for the SMS texts without --data.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import (Config, add_quick_flag, quiet_single_thread, scratch_dir, sms_or_standin,
                    train_bundle)


def p50_ms(samples: list[float]) -> float:
    return float(np.percentile(np.array(samples) * 1e3, 50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a text TSV, e.g. the SMS Spam Collection (label<TAB>text)")
    parser.add_argument("--label_column", default="0")
    parser.add_argument("--text_column", default="1")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=200, help="timed runs per batch size")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.repeats = 1, 5
    args.data = sms_or_standin(args.data, args.quick)
    if not args.data:
        parser.exit(0, "skipped: pass --data PATH (e.g. the SMS Spam Collection TSV)\n")

    quiet_single_thread(args.quick)
    import torch

    from ttc.serving.runtime import batches_of, create_session
    from ttc.nets.models import WithProbabilities

    out = scratch_dir()
    config = Config(model_type="text_classifier", dataset_path=args.data,
                    label_column=args.label_column, text_column=args.text_column,
                    epochs=args.epochs, output_model=str(out / "model.onnx"), no_progress=True)
    dataset, trained, paths, exported = train_bundle(config)

    session = create_session(str(paths.onnx), config.cpu_runtime())
    wrapper = WithProbabilities(trained.net).eval()
    x, y = dataset.test.x, dataset.test.y

    def run_torch(batch: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return wrapper(torch.from_numpy(batch))[1].numpy()

    def run_onnx(batch: np.ndarray) -> np.ndarray:
        return session.run(["probabilities"], {"token_ids": batch})[0]

    batches = batches_of(x, 64)
    torch_probs = np.concatenate([run_torch(b) for b in batches])
    onnx_probs = np.concatenate([run_onnx(b) for b in batches])
    print(f"data: {args.data}  test texts: {len(x)}  vocabulary: "
          f"{dataset.preprocessing['vocab_size']}  model: {paths.onnx.stat().st_size / 1e6:.2f} MB")
    print(f"max |onnx - torch| (probabilities, all test texts): "
          f"{np.abs(onnx_probs - torch_probs).max():.3g}   export check: "
          f"{exported.check.max_abs_diff:.3g}   padding: {exported.check.padding_max_diff:.3g}")
    print(f"accuracy  onnxruntime {np.mean(onnx_probs.argmax(1) == y):.4f}   "
          f"torch {np.mean(torch_probs.argmax(1) == y):.4f}   top-1 agreement "
          f"{np.mean(onnx_probs.argmax(1) == torch_probs.argmax(1)):.4f}")
    print(f"{'batch':>5}  {'onnxruntime p50 ms':>18}  {'torch p50 ms':>12}  {'torch/onnx':>10}")
    for size in (1, 64):
        chosen = batches_of(x, size)
        timed: dict[str, list[float]] = {"onnx": [], "torch": []}
        for i in range(args.repeats + 5):
            batch = chosen[i % len(chosen)]
            for name, fn in (("onnx", run_onnx), ("torch", run_torch)):
                start = time.perf_counter()
                fn(batch)
                if i >= 5:  # warm-up
                    timed[name].append(time.perf_counter() - start)
        onnx_ms, torch_ms = p50_ms(timed["onnx"]), p50_ms(timed["torch"])
        print(f"{size:>5}  {onnx_ms:>18.4f}  {torch_ms:>12.4f}  {torch_ms / onnx_ms:>10.2f}")


if __name__ == "__main__":
    main()
