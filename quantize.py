"""Make faster variants of a bundle's fp32 graph (int8, fp16), validate and time each against
fp32 in the same process, and decide honestly whether inference should use it.

    python quantize.py --output_model runs/digits/model.onnx --quantize static [--fp16 true]

writes model.int8.onnx (and model.fp16.onnx) beside the bundle and records the figures and the
verdict in model.json. A variant that is slower than fp32 or loses more than --max_accuracy_drop
is kept on disk but not used (int8: unless --force_quantized true). fp16 is only used on a GPU
provider.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from config import Config, build_parser, start_cli
from metrics import accuracy, top1_agreement
from runtime import (Feeder, RuntimeOptions, batches_of, create_session, graph_padding_id,
                     model_feeder, predict_proba, session_runner, time_runners)
from bundle import (BundlePaths, read_manifest, record_variant, require_onnx_in_bundle,
                    stamp_contract)
from report import run_with_report
from utils import LOG, ExportError, exit_cli, run_cli, stdout_to_stderr, first_line

# Static QDQ only around the weight-heavy ops: quantizing the in-graph preprocessing (raw
# features, the -1e4 padding fill before text max-pooling) or an embedding Gather costs accuracy
# or speed (measured: breast_cancer 0.95 → 0.72, SMS 0.988 → 0.866 when every op was quantized).
STATIC_OPS = ("Conv", "MatMul", "Gemm")
# Dynamic only on MatMul: dynamic Conv becomes ConvInteger (~11x slower, measured here), and ORT's
# dynamic quantizer has no Gemm at all, so Gemm with constant weights is first rewritten as
# MatMul + Add (torch.nn.Linear exports as Gemm: without this nothing would be quantized).
# An hf graph's fused Attention nodes (export.fused_hf_graph) become QAttention: their Q, K, V
# projection in int8 (measured on a tiny BERT: 1.33x the fused fp32 graph at batch 32 with
# Attention, 1.25x MatMul only).
DYNAMIC_OPS = ("MatMul", "Attention")
QUANTIZED_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear",
                 "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                 "QAttention")
TIMED_RUNS = 40
# A variant replaces fp32 only when clearly faster: a tie would flip between runs.
MIN_SPEEDUP = 1.05


@dataclass
class VariantResult:
    """A variant graph measured against fp32 on the same data, sessions and batches."""

    mode: str  # dynamic, static or fp16
    requested: str
    path: str
    provider: str
    size_bytes_fp32: int
    size_bytes: int
    accuracy: float
    accuracy_fp32: float
    top1_agreement: float
    max_abs_diff: float
    batch_size: int
    latency_ms_p50: float  # at --batch_size
    latency_ms_p50_fp32: float
    latency_ms_p50_batch1: float
    latency_ms_p50_batch1_fp32: float
    used_for_inference: bool
    verdict: str
    problems: list[str] = field(default_factory=list)
    calibration: dict | None = None

    def report_section(self) -> dict:
        return asdict(self)


def choose_mode(requested: str, model: onnx.ModelProto) -> str:
    """auto: static for convolutional models, dynamic otherwise (ONNX Runtime's advice)."""
    if requested != "auto":
        return requested
    return "static" if any(n.op_type == "Conv" for n in model.graph.node) else "dynamic"


def prepare_for_quantization(src: Path, dst: Path) -> None:
    """quant_pre_process (shape inference + optimisation); symbolic shape inference fails on some
    graphs (the text model's Concat), so fall back to ONNX's own shape inference there."""
    import contextlib

    from onnxruntime.quantization.shape_inference import quant_pre_process

    # When symbolic shape inference gives up (transformers graphs do) it leaves
    # sym_shape_infer_temp.onnx and a <uuid>.data file in the working directory: run it in
    # dst's folder, a temporary one.
    with contextlib.chdir(dst.parent):
        try:
            with stdout_to_stderr():
                quant_pre_process(str(src.resolve()), str(dst.resolve()))
        except Exception as err:  # noqa: BLE001 - the tool raises plain errors from deep inside
            LOG.debug("symbolic shape inference failed (%s); retrying without it", err)
            with stdout_to_stderr():
                quant_pre_process(str(src.resolve()), str(dst.resolve()), skip_symbolic_shape=True)


def gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite Gemm(A, W, C) with a constant W (alpha = beta = 1, A not transposed) as
    MatMul(A, W') + C, in place; return how many were rewritten."""
    from onnx import helper, numpy_helper

    weights = {init.name: init for init in model.graph.initializer}
    rewritten, nodes = 0, []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in weights or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        matrix = numpy_helper.to_array(weights[node.input[1]])
        name = f"{node.input[1]}__matmul"
        model.graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(matrix.T if attrs.get("transB", 0) else matrix), name))
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}__product" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product],
                                      name=f"{node.name}__matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                          name=f"{node.name}__bias"))
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


def make_calibration_reader(feed: Feeder, pad_id: int, x: np.ndarray, size: int, seed: int):
    from onnxruntime.quantization import CalibrationDataReader

    class SplitReader(CalibrationDataReader):
        """Batches of training samples, the way the graph sees them at inference."""

        def __init__(self) -> None:
            rows = np.random.default_rng(seed).permutation(len(x))[:size]
            self._batches = iter([feed(b) for b in batches_of(x[np.sort(rows)], 32, pad_id)])

        def get_next(self):
            return next(self._batches, None)

    return SplitReader()


def quantize_graph(src: Path, dst: Path, mode: str, calibration_x: np.ndarray,
                   config: Config) -> dict | None:
    """Write the int8 graph for `mode` to dst; return the calibration details (static)."""
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                          quantize_dynamic, quantize_static)

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        prepare_for_quantization(src, prepared)
        present = {n.op_type for n in onnx.load(str(prepared)).graph.node}
        with stdout_to_stderr():
            if mode == "dynamic":
                graph = onnx.load(str(prepared))
                if gemm_to_matmul(graph):
                    onnx.save_model(graph, str(prepared))
                    present.add("MatMul")
                # DefaultTensorType: where shape inference cannot type a contrib op's output
                # (Attention after a failed symbolic inference), its MatMul's input is float
                quantize_dynamic(str(prepared), str(dst), weight_type=QuantType.QInt8,
                                 op_types_to_quantize=[t for t in DYNAMIC_OPS if t in present],
                                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
                return None
            method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                      "percentile": CalibrationMethod.Percentile}[config.calibration_method]
            source = onnx.load(str(src))
            reader = make_calibration_reader(model_feeder(source), graph_padding_id(source),
                                             calibration_x,
                                             config.calibration_size,
                                             config.seed)
            quantize_static(str(prepared), str(dst), reader, quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=QuantType.QUInt8,
                            weight_type=QuantType.QInt8, calibrate_method=method,
                            op_types_to_quantize=[t for t in STATIC_OPS if t in present])
    return {"method": config.calibration_method,
            "samples": min(config.calibration_size, len(calibration_x)), "source": "train split"}


def interleaved_p50_ms(sessions: Sequence, x: np.ndarray, batch_size: int) -> list[float]:
    """p50 ms per batch for each session, timed in turns on the same batches."""
    timings = time_runners([session_runner(s) for s in sessions],
                           batches_of(x, batch_size, graph_padding_id(sessions[0])),
                           TIMED_RUNS)
    return [timings.percentile_ms(k, 50) for k in range(len(sessions))]


def judge(result: VariantResult, max_drop: float, force: bool, problems: Sequence[str] = ()
          ) -> None:
    """Fill problems, verdict and used_for_inference; say plainly what the variant did."""
    label = "fp16" if result.mode == "fp16" else f"int8 {result.mode}"
    result.problems.extend(problems)
    drop = result.accuracy_fp32 - result.accuracy
    if drop > max_drop:
        result.problems.append(f"{label} loses {drop:.3f} accuracy (more than "
                               f"--max_accuracy_drop {max_drop:g})")
    if result.latency_ms_p50 > result.latency_ms_p50_fp32:
        result.problems.append(f"{label} is slower than fp32 at batch {result.batch_size} "
                               f"({result.latency_ms_p50:.3g} vs {result.latency_ms_p50_fp32:.3g} "
                               "ms)")
    elif result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.problems.append(f"{label} is no faster than fp32 at batch {result.batch_size} "
                               f"({result.latency_ms_p50:.3g} vs {result.latency_ms_p50_fp32:.3g} "
                               f"ms; within the {MIN_SPEEDUP - 1:.0%} that timing noise can "
                               "explain)")
    speedup = result.latency_ms_p50_fp32 / max(result.latency_ms_p50, 1e-9)
    note = ""
    if result.latency_ms_p50_batch1 > result.latency_ms_p50_batch1_fp32:
        note = (f" (at batch 1 {label} is slower: {result.latency_ms_p50_batch1:.3g} vs "
                f"{result.latency_ms_p50_batch1_fp32:.3g} ms)")
    if not result.problems:
        result.used_for_inference = True
        result.verdict = (f"{label}: {speedup:.2f}x the speed of fp32 at batch "
                          f"{result.batch_size}, accuracy {result.accuracy:.4f} vs "
                          f"{result.accuracy_fp32:.4f}; inference uses {label}{note}")
    elif force:
        result.used_for_inference = True
        result.verdict = f"{'; '.join(result.problems)}; inference uses {label} (--force_quantized)"
    else:
        outcome = ("inference does not use fp16" if result.mode == "fp16" else
                   "inference uses fp32 (--force_quantized true to use int8 anyway)")
        result.verdict = f"{'; '.join(result.problems)}; {outcome}"


def measure_against_fp32(fp32_path: Path, variant: bytes, runtime: RuntimeOptions,
                         x: np.ndarray, y: np.ndarray, batch_size: int, **fields) -> VariantResult:
    """Accuracy, agreement, difference, size and interleaved p50 latency vs fp32."""
    sessions = [create_session(str(fp32_path), runtime), create_session(variant, runtime)]
    probs_fp32, probs = (predict_proba(s, x, batch_size) for s in sessions)
    p50_batch = interleaved_p50_ms(sessions, x, batch_size)
    p50_one = interleaved_p50_ms(sessions, x, 1)
    return VariantResult(
        provider=sessions[1].get_providers()[0], size_bytes_fp32=fp32_path.stat().st_size,
        size_bytes=len(variant), accuracy=accuracy(probs, y),
        accuracy_fp32=accuracy(probs_fp32, y), top1_agreement=top1_agreement(probs, probs_fp32),
        max_abs_diff=float(np.abs(probs - probs_fp32).max()), batch_size=batch_size,
        latency_ms_p50=p50_batch[1], latency_ms_p50_fp32=p50_batch[0],
        latency_ms_p50_batch1=p50_one[1], latency_ms_p50_batch1_fp32=p50_one[0],
        used_for_inference=False, verdict="", **fields)


def quantize_bundle(config: Config, paths: BundlePaths, train_x: np.ndarray, test_x: np.ndarray,
                    test_y: np.ndarray) -> VariantResult:
    """Quantize, validate on the test split, time against fp32, write model.int8.onnx."""
    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    mode = choose_mode(config.quantize, onnx.load(str(paths.onnx)))
    LOG.info("quantizing %s to int8 (%s%s)", paths.onnx.name, mode,
             ", auto" if config.quantize == "auto" else "")
    with tempfile.TemporaryDirectory(dir=paths.onnx.parent) as tmp:
        quantized = Path(tmp) / "model.int8.onnx"
        try:
            calibration = quantize_graph(paths.onnx, quantized, mode, train_x, config)
            int8_bytes = stamp_contract(onnx.load(str(quantized)), manifest).SerializeToString()
        except Exception as err:  # noqa: BLE001 - the quantizer fails in many ways
            first = first_line(err)
            raise ExportError(f"{mode} quantization failed: {first}",
                              "try --quantize dynamic, or --quantize none") from None
    result = measure_against_fp32(paths.onnx, int8_bytes, config.cpu_runtime(), test_x, test_y,
                                  config.batch_size, mode=mode, requested=config.quantize,
                                  path=str(paths.int8), calibration=calibration)
    nodes = onnx.load_from_string(int8_bytes).graph.node
    empty = [] if any(n.op_type in QUANTIZED_OPS for n in nodes) else [
        f"{mode} quantization found nothing to quantize in this graph"]
    judge(result, config.max_accuracy_drop, config.force_quantized, empty)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "int8", int8_bytes, result.report_section())
    return result


def fp16_bundle(config: Config, paths: BundlePaths, test_x: np.ndarray, test_y: np.ndarray
                ) -> VariantResult:
    """An fp16 graph (inputs and outputs stay fp32) for GPU providers, validated and timed
    against fp32 on the requested providers; used only where a GPU provider runs it faster."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    with stdout_to_stderr():
        half = convert_float_to_float16(onnx.load(str(paths.onnx)), keep_io_types=True)
    data = stamp_contract(half, manifest).SerializeToString()
    result = measure_against_fp32(paths.onnx, data, config.runtime(), test_x, test_y,
                                  config.batch_size, mode="fp16", requested="fp16",
                                  path=str(paths.fp16))
    cpu_only = [] if result.provider != "CPUExecutionProvider" else [
        "fp16 is for GPU providers and only CPUExecutionProvider is active here (timings above "
        "are CPU timings)"]
    judge(result, config.max_accuracy_drop, False, cpu_only)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "fp16", data, result.report_section())
    return result


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "quantize", "Quantize an exported bundle to int8 (model.int8.onnx), validate it on the "
        "test split and time it against fp32.", required=["output_model"],
        epilog="example:\n  python quantize.py --output_model runs/digits/model.onnx "
               "--quantize static --calibration_size 256")
    config = start_cli(parser, argv)

    def stages(report: dict) -> None:
        from data import load_bundle_dataset

        paths = BundlePaths.from_model_path(config.output_model)
        data = load_bundle_dataset(read_manifest(paths), config.dataset_path, ("train", "test"),
                                   not config.no_progress)
        report["dataset"] = data.report_section()
        if config.quantize == "none" and not config.fp16:
            config.quantize = "auto"
        if config.quantize != "none":
            result = quantize_bundle(config, paths, data.train.x, data.test.x, data.test.y)
            report["quantize"] = result.report_section()
        if config.fp16:
            report["fp16"] = fp16_bundle(config, paths, data.test.x, data.test.y).report_section()

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
