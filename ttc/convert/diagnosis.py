"""Per-layer diagnosis of an int8 graph: which nodes cost the accuracy.

fp32 and int8 run on the same calibration batches with every intermediate float tensor exposed
(ONNX Runtime's qdq_loss_debug.modify_model_output_intermediate_tensors), and each tensor the two
graphs share is compared: its noise-to-signal ratio NSR = |int8 - fp32|² / |fp32|² (SQNR is
-10·log10 NSR, in dB). Error accumulates along the graph, so a node is ranked by the noise it
adds, NSR at its output minus the largest NSR at its inputs (both before the rounding of the
next node's input), not by the error it inherits: the rounding of its inputs and weights and
what the node does to the noise it gets. A node whose own scale is wrong ranks first; the
nodes after it do not.

Nodes are named as in the graph that was quantized (after quant_pre_process), the names
ONNX Runtime's nodes_to_exclude takes.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx

from ttc.serving.runtime import stoppable_session
from utils import stdout_to_stderr

# Ops the int8 graph computes in integers, or that carry quantized tensors
INTEGER_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear",
               "DequantizeLinear", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul",
               "MatMulIntegerToFloat", "QAttention", "QGemm", "DynamicQuantizeLSTM",
               "QEmbedLayerNormalization")
# ONNX Runtime's names for a tensor before and after its QuantizeLinear → DequantizeLinear pair
# (a graph output keeps its name after the pair)
QUANTIZE_INPUT, DEQUANTIZED = "_QuantizeLinear_Input", "_DequantizeLinear_Output"
SHOWN_LAYERS = 10
MAX_HOPS = 4  # how far a node's output is followed to a tensor both graphs share


@dataclass
class LayerError:
    """One quantized node, measured against its fp32 twin."""

    node: str
    op_type: str
    output: str  # the tensor measured (the node's output, or the next one both graphs share)
    sqnr_db: float  # at that tensor; error inherited from earlier nodes included
    noise_added: float  # NSR at the output minus the largest NSR at the inputs

    def report_row(self) -> dict:
        row = asdict(self)
        row["sqnr_db"] = round(self.sqnr_db, 2)
        row["noise_added"] = float(f"{self.noise_added:.4g}")
        return row


def quantized_nodes(fp32: onnx.ModelProto, int8: onnx.ModelProto, op_types: Iterable[str]
                    ) -> list[onnx.NodeProto]:
    """The fp32 graph's nodes of `op_types` that the int8 graph changed: gone (folded into
    quantization, or replaced by integer ops named after them) or fed by a DequantizeLinear."""
    by_name = {n.name: n for n in int8.graph.node}
    producer = {out: n.op_type for n in int8.graph.node for out in n.output}
    wanted = set(op_types)
    changed = []
    for node in fp32.graph.node:
        if node.op_type not in wanted:
            continue
        twin = by_name.get(node.name)
        if (twin is None or twin.op_type != node.op_type
                or any(producer.get(i) == "DequantizeLinear" for i in twin.input)):
            changed.append(node)
    return changed


def tensor_noise(fp32_path: Path, int8_path: Path, feeds: Sequence[dict[str, np.ndarray]]
                 ) -> dict[str, float]:
    """NSR of every float tensor both graphs compute, over all `feeds`, as the node that makes
    it leaves it: before the QuantizeLinear → DequantizeLinear pair that quantizes it for the
    next node (that rounding is the next node's input quantization). Where the int8 graph folded
    the producer into the pair (a Relu), only the tensor after the pair is comparable."""
    fp32_ops = _producer_ops(onnx.load(str(fp32_path)))
    int8_ops = _producer_ops(onnx.load(str(int8_path)))
    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    fp32_runs, int8_runs = (_intermediate_runs(p, feeds) for p in (fp32_path, int8_path))
    for reference, quantized in zip(fp32_runs, int8_runs):
        for name in reference.keys() & quantized.keys():
            before_pair = name + QUANTIZE_INPUT if name + QUANTIZE_INPUT in quantized else name
            chosen = (before_pair if int8_ops.get(before_pair) == fp32_ops.get(name)
                      else name + DEQUANTIZED if name + DEQUANTIZED in quantized else name)
            a = reference[name].astype(np.float64).ravel()
            b = quantized[chosen].astype(np.float64).ravel()
            if a.shape != b.shape:
                continue
            signal[name] = signal.get(name, 0.0) + float(a @ a)
            noise[name] = noise.get(name, 0.0) + float((a - b) @ (a - b))
    return {name: noise[name] / signal[name] if signal[name] > 0 else 0.0 for name in signal}


def _producer_ops(model: onnx.ModelProto) -> dict[str, str]:
    return {out: node.op_type for node in model.graph.node for out in node.output}


def _intermediate_runs(model_path: Path, feeds: Sequence[dict[str, np.ndarray]]
                       ) -> Iterable[dict[str, np.ndarray]]:
    """Each feed's intermediate float tensors, by name, without ORT's graph optimisations (so
    every tensor exists as the graph names it)."""
    import onnxruntime as ort
    from onnxruntime.quantization.qdq_loss_debug import modify_model_output_intermediate_tensors

    suffix = "_ReshapedSavedOutput"  # qdq_loss_debug's name for a saved tensor
    with tempfile.TemporaryDirectory() as tmp:
        augmented = Path(tmp) / "augmented.onnx"
        with stdout_to_stderr():
            modify_model_output_intermediate_tensors(str(model_path), str(augmented))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = stoppable_session(str(augmented), options,
                                    providers=["CPUExecutionProvider"])  # SIGTERM ends its runs
    names = [o.name for o in session.get_outputs()]
    for feed in feeds:
        values = session.run(None, feed)
        yield {name[:-len(suffix)]: value for name, value in zip(names, values)
               if name.endswith(suffix)}


def rank_layers(fp32: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], nsr: dict[str, float]
                ) -> list[LayerError]:
    """The quantized nodes, the one adding the most noise first."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    producers = {out: n for n in fp32.graph.node for out in n.output}
    for node in fp32.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def measured_output(node: onnx.NodeProto) -> str | None:
        for _ in range(MAX_HOPS):  # QDQ folds a Relu into the node before it: follow the chain
            if node.output[0] in nsr:
                return node.output[0]
            after = consumers.get(node.output[0], [])
            if len(after) != 1:
                return None
            node = after[0]
        return None

    def input_noise(name: str, depth: int = 0) -> float:
        if name in nsr:
            return nsr[name]
        producer = producers.get(name)
        if producer is None or depth >= MAX_HOPS:  # a graph input or a weight
            return 0.0
        return max((input_noise(i, depth + 1) for i in producer.input if i), default=0.0)

    rows = []
    for node in nodes:
        output = measured_output(node)
        if output is None:
            continue
        before = max((input_noise(i) for i in node.input if i), default=0.0)
        after = nsr[output]
        rows.append(LayerError(node.name, node.op_type, output, sqnr_db(after),
                               max(0.0, after - before)))
    return sorted(rows, key=lambda r: (-r.noise_added, r.sqnr_db))


def sqnr_db(nsr: float) -> float:
    return 120.0 if nsr <= 1e-12 else -10.0 * math.log10(nsr)


def diagnose(fp32_path: Path, int8_path: Path, feeds: Sequence[dict[str, np.ndarray]],
             op_types: Iterable[str]) -> list[LayerError]:
    """Every quantized node of `op_types`, ranked by the noise it adds (worst first)."""
    fp32, int8 = onnx.load(str(fp32_path)), onnx.load(str(int8_path))
    nodes = quantized_nodes(fp32, int8, op_types)
    if not nodes:
        return []
    return rank_layers(fp32, nodes, tensor_noise(fp32_path, int8_path, feeds))
