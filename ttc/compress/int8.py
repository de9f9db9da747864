"""ONNX Runtime's quantizer, step by step: the graph prepared (shape inference, nodes named,
dynamic's constant Gemms as MatMul), the calibration feeds, the op types int8 may quantize, the
int8 weights' range, one quantization with some nodes kept fp32, and its failures as one line.
ttc/compress/quantization.py runs these steps; no torch.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np
import onnx

from ttc.compress.quantizing import CALIBRATION_BATCH
from ttc.serving.runtime import CpuInfo, batches_of, graph_padding_id, model_feeder
from utils import (LOG, ConfigError, ExportError, debug_enabled, first_line, native_section,
                   stdout_to_stderr)

# --quantize_ops default. Static QDQ only around the weight-heavy ops: quantizing the in-graph
# preprocessing or an embedding Gather too costs speed (bench/quantize_layers.py, every op type:
# SMS 0.82-0.84x fp32's speed at batch 64 against 1.03-1.11x for these three) and, on earlier
# models, accuracy (breast_cancer 0.95 → 0.72, SMS 0.988 → 0.866).
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
T = TypeVar("T")


@dataclass(frozen=True)
class Int8Range:
    """The int8 weights' range (--int8_range resolved) and why: the report's
    quantize.reduce_range and quantize.reduce_range_reason, kept in the manifest."""

    reduce_range: bool
    reason: str


def choose_int8_range(requested: str, cpu: CpuInfo) -> Int8Range:
    """--int8_range: full or reduced as asked; auto: reduced (7-bit weights) where this CPU's
    int8 kernels saturate full-range weights (x86 without VNNI or AMX: runtime.saturates) or
    its instructions are unknown, full (the more precise) where they cannot saturate. Measured
    on an AVX2-only EPYC: the detector's static int8 lost 17.8 mAP points with full range and
    0.12 with reduced (docs/deploy.md)."""
    if requested in ("full", "reduced"):
        return Int8Range(requested == "reduced", f"--int8_range {requested}")
    if cpu.int8_saturates is None:
        return Int8Range(True, f"auto: the int8 instructions of this CPU ({cpu.name}) are "
                               "unknown, and 7-bit weights saturate on none")
    if cpu.int8_saturates:
        return Int8Range(True, f"auto: this CPU ({cpu.name}) has no VNNI or AMX, and its int8 "
                               "kernels saturate with full-range (8-bit) weights")
    has = (f"has {', '.join(cpu.int8_dot_product)}" if cpu.int8_dot_product
           else "is not x86 (its int8 kernels widen to 16 bits without pairing products)")
    return Int8Range(False, f"auto: this CPU ({cpu.name}) {has}, where full-range (8-bit) "
                            "weights do not saturate")


def choose_mode(requested: str, model: onnx.ModelProto) -> str:
    """auto: static for convolutional models, dynamic otherwise (ONNX Runtime's advice)."""
    if requested != "auto":
        return requested
    return "static" if any(n.op_type == "Conv" for n in model.graph.node) else "dynamic"


def prepare_for_quantization(src: Path, dst: Path) -> None:
    """quant_pre_process (shape inference + optimisation); symbolic shape inference fails on some
    graphs (the text model's Concat), so fall back to ONNX's own shape inference there."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # When symbolic shape inference gives up (transformers graphs do) it leaves
    # sym_shape_infer_temp.onnx and a <uuid>.data file in the working directory: run it in
    # dst's folder, a temporary one. Both paths are made absolute before the change of folder:
    # a relative one would be read from inside it.
    src, dst = src.resolve(), dst.resolve()
    with contextlib.chdir(dst.parent):
        try:
            with stdout_to_stderr():
                quant_pre_process(str(src), str(dst))
        except Exception as err:  # noqa: BLE001 - the tool raises plain errors from deep inside
            LOG.debug("symbolic shape inference failed (%s); retrying without it", err)
            with stdout_to_stderr():
                quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)


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



def calibration_feeds(source: onnx.ModelProto, x: np.ndarray, size: int, seed: int,
                      batch: int = CALIBRATION_BATCH) -> list[dict]:
    """Feeds of batches of `size` training samples, the way the graph sees them at inference."""
    rows = np.random.default_rng(seed).permutation(len(x))[:size]
    feed = model_feeder(source)
    return [feed(b) for b in batches_of(x[np.sort(rows)], batch, graph_padding_id(source))]


def make_calibration_reader(feeds: Sequence[dict]):
    from onnxruntime.quantization import CalibrationDataReader

    class SplitReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(feeds)

        def get_next(self):
            return next(self._batches, None)

    return SplitReader()


def quantizable_op_types(mode: str) -> set[str]:
    """Every op type ONNX Runtime's quantizer handles in `mode` (static: QDQ and QLinear
    registries; dynamic: the integer-op registry)."""
    from onnxruntime.quantization.registry import (IntegerOpsRegistry, QDQRegistry,
                                                   QLinearOpsRegistry)

    return set(IntegerOpsRegistry) if mode == "dynamic" else {*QDQRegistry, *QLinearOpsRegistry}


def op_set_candidates(requested: str, mode: str, present: set[str]) -> list[list[str]]:
    """The op sets to try: --quantize_ops auto tries the default set and, where the graph has
    more that int8 can quantize, every quantizable op type; anything else is one set."""
    if requested != "auto":
        return [resolve_op_types(requested, mode, present)]
    default, wider = (resolve_op_types(r, mode, present) for r in ("default", "all"))
    if wider == default or not default:  # no choice to make, or the wider set against fp32
        return [wider]
    return [default, wider]


def resolve_op_types(requested: str, mode: str, present: set[str]) -> list[str]:
    """--quantize_ops for `mode`, limited to the op types the graph has."""
    if requested.strip().lower() == "default":
        wanted = set(DYNAMIC_OPS if mode == "dynamic" else STATIC_OPS)
    elif requested.strip().lower() == "all":
        wanted = quantizable_op_types(mode)
    else:
        wanted = {t.strip() for t in requested.split(",") if t.strip()}
        unknown = sorted(wanted - quantizable_op_types(mode) - {"Gemm"})
        if unknown:
            raise ConfigError(f"--quantize_ops: {', '.join(unknown)} cannot be quantized in "
                              f"{mode} mode", "use op types ONNX Runtime's quantizer handles: "
                              f"{', '.join(sorted(quantizable_op_types(mode)))}")
    if mode == "dynamic" and "Gemm" in wanted:
        wanted.add("MatMul")  # gemm_to_matmul made the constant Gemms MatMuls
    return sorted(wanted & present)


def prepare_graph(src: Path, folder: Path, mode: str) -> Path:
    """The graph quantization starts from (its node names are what --quantize_exclude and the
    diagnosis use): shape inference and optimisation, unnamed nodes named; for dynamic,
    constant Gemms as MatMul."""
    prepared = folder / "prepared.onnx"
    prepare_for_quantization(src, prepared)
    graph = onnx.load(str(prepared))
    changed = name_unnamed_nodes(graph)
    if mode == "dynamic":
        changed += gemm_to_matmul(graph)
    if changed:
        onnx.save_model(graph, str(prepared))
    return prepared


def name_unnamed_nodes(model: onnx.ModelProto) -> int:
    """Name each unnamed node after its first output (the nodes a detector's append_nms wrote:
    "nms/selected", ..., "boxes"), so that nodes_to_exclude and the diagnosis can name it; in
    place. Returns how many were named."""
    taken = {node.name for node in model.graph.node if node.name}
    named = 0
    for k, node in enumerate(model.graph.node):
        if node.name:
            continue
        name = node.output[0] if node.output and node.output[0] else f"{node.op_type}_{k}"
        while name in taken:
            name += "_node"
        node.name = name
        taken.add(name)
        named += 1
    return named


def quantize_prepared(prepared: Path, dst: Path, mode: str, op_types: Sequence[str],
                      exclude: Sequence[str], feeds: Sequence[dict],
                      calibration_method: str = "minmax", reduce_range: bool = False) -> Path:
    """Write the int8 graph of `prepared` to dst, with the nodes `exclude` names kept fp32,
    static's ranges calibrated by --calibration_method on `feeds`, and 7-bit weights where
    `reduce_range` (choose_int8_range)."""
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                          quantize_dynamic, quantize_static)

    if not op_types:  # ONNX Runtime's quantizer reads an empty list as "every op type"
        shutil.copyfile(prepared, dst)
        return dst
    with stdout_to_stderr(), quiet_root_logger():
        if mode == "dynamic":
            # DefaultTensorType: where shape inference cannot type a contrib op's output
            # (Attention after a failed symbolic inference), its MatMul's input is float
            quantize_dynamic(str(prepared), str(dst), weight_type=QuantType.QInt8,
                             op_types_to_quantize=list(op_types), nodes_to_exclude=list(exclude),
                             reduce_range=reduce_range,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
            return dst
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[calibration_method]
        with native_section("ONNX Runtime's quantization calibration"):  # its own sessions
            quantize_static(str(prepared), str(dst), make_calibration_reader(feeds),
                            quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=method, op_types_to_quantize=list(op_types),
                            nodes_to_exclude=list(exclude), reduce_range=reduce_range)
    return dst


@contextlib.contextmanager
def quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizer warns through the root logger ("Axis 1 is out-of-range for
    weight ..." for a rank-1 weight it then quantizes per tensor): shown only at DEBUG."""
    root = logging.getLogger()
    level = root.level
    if not debug_enabled():
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def require_known_nodes(names: Sequence[str], graph: onnx.ModelProto, op_types: Sequence[str]
                        ) -> None:
    """--quantize_exclude NODE,... must name nodes of the graph being quantized."""
    known = {n.name for n in graph.graph.node}
    unknown = [name for name in names if name not in known]
    if unknown:
        candidates = [n.name for n in graph.graph.node if n.op_type in op_types]
        shown = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
        raise ConfigError(f"--quantize_exclude names {', '.join(unknown)}, which the graph "
                          "does not have", f"its quantizable nodes are: {shown or 'none'} "
                          "(quantize.py --diagnose ranks them)")


def quantizer_step(mode: str, step: Callable[[], T]) -> T:
    """Run a step of ONNX Runtime's quantizer; its many failures become one ExportError line
    (a ConfigError from our own checks passes through)."""
    try:
        return step()
    except (ConfigError, ExportError):
        raise
    except Exception as err:  # noqa: BLE001 - the quantizer fails in many ways
        other = "static" if mode == "dynamic" else "dynamic"
        raise ExportError(f"{mode} quantization failed: {first_line(err)}",
                          f"try --quantize {other}, or --quantize none") from None

