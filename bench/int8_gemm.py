"""Are ONNX Runtime's int8 matrix kernels faster than its fp32 ones on this CPU?

    python bench/int8_gemm.py [--threads 1] [--runs 30] [--quick]

Whether `--quantize dynamic` can speed a model up is decided below the graph: by the CPU's int8
instructions and the kernels ONNX Runtime picks for them. This times one MatMul against the same
MatMul as the tool's dynamic quantizer writes it (onnxruntime.quantization.quantize_dynamic,
int8 weights, which ONNX Runtime fuses into DynamicQuantizeMatMul), in turns on the same
inputs, for the shapes of the tiny BERT of bench/hf_text.py (a batch of 32 texts of 64 tokens)
and of BERT-base (hidden 768). No model, no data: the CPU and ONNX Runtime alone. --quick: one
small shape, 3 turns.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from common import add_quick_flag  # also puts the repository on sys.path
from config import Config
from ttc.serving.runtime import cpu_info, create_session, time_runners

# (rows, in, out): rows = texts x tokens of a batch
SHAPES = [("tiny BERT, attention out", 2048, 128, 128), ("tiny BERT, FFN in", 2048, 128, 512),
          ("tiny BERT, FFN out", 2048, 512, 128), ("BERT-base, attention out", 512, 768, 768),
          ("BERT-base, FFN in", 512, 768, 3072), ("BERT-base, FFN out", 512, 3072, 768)]
QUICK_SHAPES = [("quick, 64 rows", 64, 128, 128)]


def matmul_graph(k: int, n: int, seed: int) -> onnx.ModelProto:
    """y = x @ W with a random fp32 W (k x n) and x of any number of rows."""
    weight = np.random.default_rng(seed).normal(0, 0.05, (k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # what ONNX Runtime 1.31 reads
    return model


def quantized(model: onnx.ModelProto, folder: Path) -> str:
    """The graph as `--quantize dynamic` writes it: int8 weights, activations quantized per run."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = folder / "fp32.onnx", folder / "int8.onnx"
    onnx.save(model, src)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"])
    return str(dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--runs", type=int, default=30, help="timed turns per shape (at least)")
    add_quick_flag(parser)
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        args.runs = 3
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer's advice to pre-process
    runtime = Config(num_threads=args.threads).cpu_runtime()
    print(f"CPU: {cpu_info().describe()}; {args.threads} ONNX Runtime thread(s)")
    print(f"{'shape':<26} {'rows x in -> out':>20} {'fp32 ms':>9} {'int8 ms':>9} "
          f"{'fp32 GFLOP/s':>13} {'int8 / fp32 speed':>18}")
    ratios = []
    for k, (name, rows, d_in, d_out) in enumerate(shapes):
        model = matmul_graph(d_in, d_out, seed=k)
        with tempfile.TemporaryDirectory(prefix="int8-gemm-") as scratch:
            sessions = [create_session(model.SerializeToString(), runtime),
                        create_session(quantized(model, Path(scratch)), runtime)]
        x = np.random.default_rng(k).normal(0, 1, (rows, d_in)).astype(np.float32)
        runners = [lambda batch, s=s: s.run(None, {"x": batch}) for s in sessions]
        timings = time_runners(runners, [x], runs=args.runs)
        fp32_ms, int8_ms = timings.percentile_ms(0, 50), timings.percentile_ms(1, 50)
        ratios.append(fp32_ms / int8_ms)
        print(f"{name:<26} {f'{rows} x {d_in} -> {d_out}':>20} {fp32_ms:>9.3f} {int8_ms:>9.3f} "
              f"{2 * rows * d_in * d_out / fp32_ms / 1e6:>13.1f} {ratios[-1]:>17.2f}x")
    print(f"\nint8 / fp32 speed over these shapes: median {np.median(ratios):.2f}x "
          f"(from {min(ratios):.2f}x to {max(ratios):.2f}x); the quantize judge asks int8 to be "
          "at least 1.05x fp32 end to end.")


if __name__ == "__main__":
    main()
