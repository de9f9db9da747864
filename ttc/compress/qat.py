"""Quantization-aware training (--qat): a trained fp32 network fine-tuned with fake quantization,
then exported as a QDQ int8 ONNX graph that ONNX Runtime runs as integer kernels.

The route is torch.ao's FX graph mode QAT (`prepare_qat_fx`), still in torch 2.14 though
deprecated in favour of torchao's PT2E (not a dependency here): it traces the network, fuses
Conv-BN(-ReLU) and Linear-BN into modules that fold BatchNorm into the weights while training,
and inserts fake quantization with the scheme of ONNX Runtime's static QDQ quantization (U8S8):
per-channel symmetric int8 weights, per-tensor affine uint8 activations, full ranges (no
reduce_range). Only Conv, Linear and what joins them (BatchNorm, ReLU, pooling, residual adds)
are quantized: the network's in-forward preprocessing, masks and embedding lookups (a quantized
Gather makes ONNX Runtime dequantize the whole table on every run) and the logits stay float.

For export (frozen_for_export) each fused module's BatchNorm is folded into its weights and bias
(a BatchNorm node between a Conv and its QuantizeLinear would keep ONNX Runtime from fusing
them), and each fake quantization becomes a fixed quantize → dequantize of torch.ao's
`quantized_decomposed` ops, PT2E's representation, which torch.export takes (it rejects the
fake_quantize ops: pytorch #167063) and ONNX Script writes as QuantizeLinear → DequantizeLinear.
So the project's exporter (export.export_graph, dynamo) exports it; finish_qdq then folds the
weights' quantization into int8 initializers and quantizes the biases to int32, the form ONNX
Runtime's quantizer writes. onnxslim keeps every QDQ pair. qdq_structure and
require_integer_kernels check the graph ONNX Runtime actually runs.
"""
from __future__ import annotations

import contextlib
import copy
import operator
import warnings
from typing import Callable, Iterator, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn
from torch.ao.quantization import FakeQuantize, FakeQuantizeBase
# Registers torch.ops.quantized_decomposed, which frozen graphs call. Imported before a process's
# first torch.onnx.export: export.torchlib_registry_built_once keeps the first ONNX registry built,
# which has no translation for these ops unless they were registered by then.
from torch.ao.quantization.fx import _decomposed  # noqa: F401

from utils import ConfigError, ExportError, TrainingError, first_line, stdout_to_stderr

# The op types ONNX Runtime's optimised graph runs in integers (its QDQ node units fused).
INTEGER_KERNELS = ("QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm",
                   "ConvInteger", "MatMulInteger", "DynamicQuantizeMatMul", "QAttention",
                   "QLinearAdd", "QLinearMul", "QLinearConcat", "QLinearGlobalAveragePool",
                   "QLinearAveragePool", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax")
# Of those, the ones that compute a Conv, Gemm or MatMul.
WEIGHT_KERNELS = INTEGER_KERNELS[:8]
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")
RELUS = (nn.ReLU, F.relu, torch.relu)
# Identities at inference: a fake quantization right after one repeats the one before it.
IDENTITY_MODULES = (nn.Dropout, nn.Identity)
ACTIVATION_RANGE = (0, 255)  # uint8, affine, per tensor
WEIGHT_RANGE = (-128, 127)  # int8, symmetric, per output channel
INT32_LIMIT = 2 ** 31 - 1


# ----------------------------------------------------------------------------- fake quantization


class TrainingFakeQuantize(FakeQuantize):
    """FakeQuantize whose observer moves the range only in train mode: evaluating the network
    while it is fine-tuned (validation, candidate search) leaves the ranges alone, and two
    evaluations agree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or not bool(self.observer_enabled[0] == 1):
            return super().forward(x)
        self.observer_enabled[0] = 0
        try:
            return super().forward(x)
        finally:
            self.observer_enabled[0] = 1


def qconfig() -> "torch.ao.quantization.QConfig":
    """U8S8: uint8 affine per-tensor activations, int8 symmetric per-channel weights, full
    ranges (ONNX's QuantizeLinear takes exactly these)."""
    from torch.ao.quantization import (MovingAverageMinMaxObserver,
                                       MovingAveragePerChannelMinMaxObserver, QConfig)

    activation = TrainingFakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, quant_min=ACTIVATION_RANGE[0],
        quant_max=ACTIVATION_RANGE[1], dtype=torch.quint8, qscheme=torch.per_tensor_affine,
        reduce_range=False)
    weight = TrainingFakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=WEIGHT_RANGE[0],
        quant_max=WEIGHT_RANGE[1], dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
        reduce_range=False, ch_axis=0)
    return QConfig(activation=activation, weight=weight)


def qconfig_mapping() -> "torch.ao.quantization.QConfigMapping":
    """Only the weighted layers and what joins them; everything else (preprocessing, masks,
    embeddings, reductions) stays float."""
    from torch.ao.quantization import QConfigMapping

    mapping, config = QConfigMapping(), qconfig()
    for kind in (nn.Conv1d, nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, *RELUS,
                 nn.MaxPool1d, nn.MaxPool2d, nn.AdaptiveAvgPool2d, torch.flatten,
                 operator.add, torch.add, operator.iadd):
        mapping.set_object_type(kind, config)
    return mapping.set_object_type(nn.Embedding, None)


# ----------------------------------------------------------------------------- preparing


def qat_unsupported_reason(net: nn.Module) -> str | None:
    """None when this route can fine-tune and export `net`; otherwise why not, in one line."""
    from torch.ao.quantization.fx.tracer import QuantizationTracer
    from ttc.nets.hf import HFTextNet
    from ttc.nets.models import UserNetwork

    if isinstance(net, HFTextNet):
        return ("quantization-aware training does not support hf: networks (torch.fx cannot "
                "trace a Hugging Face model for torch.ao's quantization); use post-training "
                "--quantize dynamic instead")
    if not any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)) for m in net.modules()):
        return "the network has no Conv1d, Conv2d or Linear layer to quantize"
    traced = net.module if isinstance(net, UserNetwork) else net
    try:
        with _quiet():
            QuantizationTracer([], []).trace(traced)
    except Exception as err:  # noqa: BLE001 - the tracer's errors are many and varied
        return f"torch.fx cannot trace the network for quantization-aware training: " \
               f"{first_line(_root_cause(err), 200)}"
    return None


def prepare_qat(net: nn.Module, example: torch.Tensor) -> nn.Module:
    """A copy of the trained fp32 `net` prepared for QAT, in train mode: Conv-BN(-ReLU) and
    Linear-BN fused, fake quantization on the weights and the activations around them, the
    ranges started from `example` (a batch of real inputs, run in eval mode: BatchNorm's running
    statistics must be the trained ones). `net(x)` gives logits as before."""
    from torch.ao.quantization.backend_config import get_native_backend_config
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    reason = qat_unsupported_reason(net)
    if reason:
        raise ConfigError(reason)
    model = copy.deepcopy(net).train()
    try:
        with _quiet():
            prepared = prepare_qat_fx(model, qconfig_mapping(), (example,),
                                      backend_config=get_native_backend_config())
    except Exception as err:  # noqa: BLE001 - as above
        raise ConfigError(f"torch.ao could not prepare the network for quantization-aware "
                          f"training: {first_line(_root_cause(err), 200)}") from None
    _drop(prepared, _on_integer_tensors(prepared, example))
    _drop(prepared, _repeated(prepared))
    _drop(prepared, _before_relu(prepared))
    _drop(prepared, _on_outputs(prepared))
    _calibrate(prepared, example)
    return prepared.train()


def frozen_for_export(qat_net: nn.Module) -> nn.Module:
    """The QAT network as it is exported and checked: ranges and BatchNorm statistics frozen,
    BatchNorm folded into the weights, each fake quantization a fixed QuantizeLinear →
    DequantizeLinear, eval mode. A copy: `qat_net` can go on training."""
    from torch.ao.nn.intrinsic.qat import freeze_bn_stats
    from torch.ao.quantization import disable_observer

    model = copy.deepcopy(qat_net)
    model.apply(disable_observer)
    model.apply(freeze_bn_stats)
    _fold_batchnorms(model)
    _freeze_fake_quantizers(model)
    return model.eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.ao's deprecation warnings (it points at torchao, not a dependency here) and the
    tracer's prints stay off the terminal."""
    with warnings.catch_warnings(), stdout_to_stderr():
        warnings.simplefilter("ignore")
        yield


def _root_cause(err: BaseException) -> BaseException:
    """The first exception of a chain (a --model_def forward's own error inside user_code)."""
    while err.__cause__ is not None or (err.__context__ is not None
                                        and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return err


def _fake_quant_nodes(model: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    for node in model.graph.nodes:
        if node.op == "call_module" and isinstance(model.get_submodule(node.target),
                                                   FakeQuantizeBase):
            yield node


def _drop(model: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> None:
    """Remove fake quantizations from the graph (their users take their input)."""
    for node in nodes:
        node.replace_all_uses_with(node.args[0])
        model.graph.erase_node(node)
    model.graph.eliminate_dead_code()
    model.delete_all_unused_submodules()
    model.recompile()


def _on_integer_tensors(model: torch.fx.GraphModule, example: torch.Tensor) -> list[torch.fx.Node]:
    """The fake quantizations FX put on integer or boolean tensors (an add of token counts, a
    mask): found by running the example, which such a node cannot take."""
    found: list[str] = []

    class Finder(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):  # noqa: ANN001, ANN202 - Interpreter's
            if isinstance(self.module.get_submodule(target), FakeQuantizeBase) and not (
                    torch.is_tensor(args[0]) and args[0].is_floating_point()):
                found.append(target)
                return args[0]
            return super().call_module(target, args, kwargs)

    with _quantizers_off(model), torch.no_grad(), _quiet():
        Finder(model).run(example)
    return [n for n in _fake_quant_nodes(model) if n.target in found]


def _skip_identities(node: torch.fx.Node, model: torch.fx.GraphModule) -> torch.fx.Node:
    """The node whose value `node` has at inference, past dropouts and identities."""
    while isinstance(node, torch.fx.Node) and (
            (node.op == "call_module" and isinstance(model.get_submodule(node.target),
                                                     IDENTITY_MODULES))
            or (node.op == "call_function" and node.target is F.dropout)):
        node = node.args[0]
    return node


def _is_fake_quant(node: object, model: torch.fx.GraphModule) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_module"
            and isinstance(model.get_submodule(node.target), FakeQuantizeBase))


def _repeated(model: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """A fake quantization of what already is one at inference (after a dropout): it would
    round twice, with two scales."""
    return [n for n in _fake_quant_nodes(model)
            if _is_fake_quant(_skip_identities(n.args[0], model), model)]


def _is_relu(node: torch.fx.Node, model: torch.fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(model.get_submodule(node.target), nn.ReLU)
    return ((node.op == "call_function" and node.target in (F.relu, torch.relu))
            or (node.op == "call_method" and node.target == "relu"))


def _before_relu(model: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """An op's output quantization followed by a ReLU whose output is quantized too: ONNX
    Runtime drops the ReLU before a QuantizeLinear of zero point 0, and the op's integer kernel
    then writes the ReLU's quantized output directly. Two roundings would stop that."""
    return [n for n in _fake_quant_nodes(model)
            if len(n.users) == 1 and _is_relu(next(iter(n.users)), model)
            and all(_is_fake_quant(u, model) for u in next(iter(n.users)).users)]


def _on_outputs(model: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The logits stay float: the last layer's integer kernel writes float32 (256 levels of
    logits would coarsen the probabilities)."""
    output = next(n for n in model.graph.nodes if n.op == "output")
    return [n for n in _flat_nodes(output.args) if _is_fake_quant(n, model)]


def _flat_nodes(args: object) -> list[torch.fx.Node]:
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, nodes.append)
    return nodes


@contextlib.contextmanager
def _quantizers_off(model: nn.Module) -> Iterator[None]:
    """Every fake quantizer neither observing nor rounding (the identity), for a look at the
    tensors alone."""
    saved = {m: (int(m.observer_enabled[0]), int(m.fake_quant_enabled[0]))
             for m in model.modules() if isinstance(m, FakeQuantizeBase)}
    for module in saved:
        module.observer_enabled[0], module.fake_quant_enabled[0] = 0, 0
    try:
        yield
    finally:
        for module, (observing, rounding) in saved.items():
            module.observer_enabled[0], module.fake_quant_enabled[0] = observing, rounding


def _calibrate(model: nn.Module, example: torch.Tensor) -> None:
    """Start every range from the example batch, with the network in eval mode (BatchNorm's
    running statistics untouched, no dropout) and the fake quantizers observing."""
    model.eval()
    for module in model.modules():
        if isinstance(module, FakeQuantizeBase):
            module.train()
    with torch.no_grad():
        model(example)
    model.train()


# ----------------------------------------------------------------------------- freezing


class FoldedLayer(nn.Module):
    """A fused Conv-BN(-ReLU) or Linear-BN of QAT with its BatchNorm folded into the weights
    and bias: what the fused module computes in eval mode, as one Conv or Gemm."""

    def __init__(self, layer: nn.Module, weight_fake_quant: nn.Module, relu: bool) -> None:
        super().__init__()
        self.layer = layer
        self.weight_fake_quant = weight_fake_quant
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_fake_quant(self.layer.weight)
        if isinstance(self.layer, nn.Linear):
            y = F.linear(x, weight, self.layer.bias)
        else:
            y = self.layer._conv_forward(x, weight, self.layer.bias)
        return F.relu(y) if self.relu else y


class FrozenFakeQuantize(nn.Module):
    """A fake quantization with fixed scale and zero point, written as the quantize and
    dequantize of torch.ao's `quantized_decomposed` ops (PT2E's representation): torch.export
    takes them, where it rejects the fake_quantize ops (pytorch #167063), and ONNX Script
    writes each as QuantizeLinear → DequantizeLinear (per channel along `axis` when it is not
    None). Same rounding as the fake quantization it replaces (round(x * (1 / scale)))."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                 quant_max: int, axis: int | None) -> None:
        super().__init__()
        self.quant_min, self.quant_max, self.axis = quant_min, quant_max, axis
        self.dtype = torch.uint8 if quant_min >= 0 else torch.int8
        if axis is None:  # constants of the graph, as ONNX Runtime's quantizer writes them
            self.scale = float(scale.reshape(-1)[0])
            self.zero_point = int(zero_point.reshape(-1)[0])
        else:
            self.register_buffer("scales", scale.detach().clone().float())
            self.register_buffer("zero_points", zero_point.detach().clone().to(torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.quantized_decomposed
        if self.axis is None:
            qparams = (self.scale, self.zero_point, self.quant_min, self.quant_max, self.dtype)
            return ops.dequantize_per_tensor(ops.quantize_per_tensor(x, *qparams), *qparams)
        qparams = (self.scales, self.zero_points, self.axis, self.quant_min, self.quant_max,
                   self.dtype)
        return ops.dequantize_per_channel(ops.quantize_per_channel(x, *qparams), *qparams)


def _fused_with_batchnorm() -> tuple[type, ...]:
    import torch.ao.nn.intrinsic.qat as nniqat

    return (nniqat.ConvBn1d, nniqat.ConvBn2d, nniqat.ConvBnReLU1d, nniqat.ConvBnReLU2d,
            nniqat.LinearBn1d)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, new)


def _fold_batchnorms(model: nn.Module) -> None:
    import torch.ao.nn.intrinsic.qat as nniqat

    fused = _fused_with_batchnorm()
    for name, module in list(model.named_modules()):
        if isinstance(module, fused):
            relu = isinstance(module, (nniqat.ConvBnReLU1d, nniqat.ConvBnReLU2d))
            _replace(model, name, FoldedLayer(_folded(module), module.weight_fake_quant, relu))


def _folded(module: nn.Module) -> nn.Module:
    """The plain Conv or Linear a fused module computes with frozen BatchNorm statistics: the
    weight scaled exactly as the fused module scales it before its fake quantization."""
    bn = module.bn
    with torch.no_grad():
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # as the fused module has it
        weight = module.weight * scale.reshape([-1] + [1] * (module.weight.dim() - 1))
        bias = module.bias if module.bias is not None else torch.zeros_like(bn.running_mean)
        bias = (bias - bn.running_mean) * scale + bn.bias
        if isinstance(module, nn.Linear):
            layer: nn.Module = nn.Linear(module.in_features, module.out_features)
        else:
            kind = nn.Conv1d if isinstance(module, nn.Conv1d) else nn.Conv2d
            layer = kind(module.in_channels, module.out_channels, module.kernel_size,
                         module.stride, module.padding, module.dilation, module.groups, True,
                         module.padding_mode)
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer.to(module.weight.device)


def _freeze_fake_quantizers(model: nn.Module) -> None:
    """Each fake quantizer replaced by its frozen form (one module shared under two names, as
    FX shares an observer between a pooling's input and output, stays one)."""
    frozen: dict[int, nn.Module] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, FakeQuantizeBase):
            if not bool(torch.isfinite(module.scale).all()):
                raise TrainingError(f"quantization-aware training diverged: the range of {name} "
                                    "is not a finite number", "retrain with a lower "
                                    "--learning_rate, from a network trained to convergence")
            if id(module) not in frozen:
                axis = module.ch_axis if module.is_per_channel else None
                frozen[id(module)] = FrozenFakeQuantize(module.scale, module.zero_point,
                                                        module.quant_min, module.quant_max, axis)
            _replace(model, name, frozen[id(module)])


# ----------------------------------------------------------------------------- the ONNX graph


def export_qdq(qat_net: nn.Module, example: np.ndarray,
               export_graph: Callable[[nn.Module, np.ndarray], onnx.ModelProto]
               ) -> onnx.ModelProto:
    """The QDQ int8 graph of a QAT network (or of its frozen_for_export copy): exported by
    `export_graph`, the project's exporter with its opset, input spec, output names and
    temperature bound (export.export_graph: torch.export and ONNX Script, dynamic batch and
    length), then finish_qdq. Slim and check it as any graph (onnxslim keeps the QDQ pairs)."""
    frozen = qat_net if not any(isinstance(m, FakeQuantizeBase) for m in qat_net.modules()) \
        else frozen_for_export(qat_net)
    return finish_qdq(export_graph(frozen.eval(), example))


def finish_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exported QDQ graph in the form ONNX Runtime's quantizer writes: each constant
    weight's QuantizeLinear (and the Clip ONNX Script puts after a per-channel one) folded into
    an int8 initializer feeding its DequantizeLinear, and the float bias of each Conv or Gemm
    whose input and weight are dequantized given as an int32 initializer (scale: input scale ×
    weight scale) and a DequantizeLinear, which ONNX Runtime needs to run a Gemm whose output
    stays float (the logits) as QGemm. A bias that int32 cannot hold stays float."""
    _fold_weight_quantization(model)
    _quantize_biases(model)
    _drop_unused_initializers(model)
    return model


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant nodes' values, by name."""
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def _broadcast(values: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A per-channel parameter shaped to broadcast along `axis` of a rank-`rank` tensor."""
    if values.ndim == 0:
        return values
    shape = [1] * rank
    shape[axis % rank] = -1
    return values.reshape(shape)


def _quantized(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int,
               low: int, high: int) -> np.ndarray:
    """round(x * (1 / scale)) + zero_point, clamped: the rounding of torch's quantize ops (the
    frozen network's), in float32, half to even."""
    inverse = (np.float32(1.0) / scale.astype(np.float32))
    q = np.rint(x.astype(np.float32) * _broadcast(inverse, axis, x.ndim))
    q = q + _broadcast(zero_point.astype(np.float32), axis, x.ndim)
    return np.clip(q, low, high).astype(zero_point.dtype)


def _clip_bounds(node: onnx.NodeProto, values: dict[str, np.ndarray],
                 dtype: np.dtype) -> tuple[int, int] | None:
    """A Clip's constant (min, max) in `dtype`'s range; None when a bound is not constant."""
    names = list(node.input[1:3]) + ["", ""]
    if any(name and name not in values for name in names[:2]):
        return None
    info = np.iinfo(dtype)
    return (int(values[names[0]]) if names[0] else info.min,
            int(values[names[1]]) if names[1] else info.max)


def _fold_weight_quantization(model: onnx.ModelProto) -> None:
    graph = model.graph
    values = _constants(model)
    users = _users(graph)
    removed: list[onnx.NodeProto] = []
    for node in list(graph.node):
        if node.op_type != "QuantizeLinear" or len(node.input) < 3 \
                or not all(n in values for n in node.input[:3]):
            continue
        x, scale, zero_point = (values[n] for n in node.input[:3])
        info = np.iinfo(zero_point.dtype)
        low, high, out, dropped = info.min, info.max, node.output[0], [node]
        after = users.get(out, [])
        if len(after) == 1 and after[0].op_type == "Clip":
            bounds = _clip_bounds(after[0], values, zero_point.dtype)
            if bounds is not None:
                (low, high), out = bounds, after[0].output[0]
                dropped.append(after[0])
        name = _fresh_name(f"{node.input[0]}_quantized", values)
        values[name] = x
        graph.initializer.append(numpy_helper.from_array(
            _quantized(x, scale, zero_point, _axis(node), low, high), name))
        for user in users.get(out, []):
            user.input[:] = [name if i == out else i for i in user.input]
        removed += dropped
    for node in removed:
        graph.node.remove(node)


def _quantize_biases(model: onnx.ModelProto) -> None:
    graph = model.graph
    values = _constants(model)
    producers = {o: n for n in graph.node for o in n.output}
    for node in list(graph.node):
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3 \
                or node.input[2] not in values:
            continue
        feeding = [producers.get(name) for name in node.input[:2]]
        if not all(f is not None and f.op_type == "DequantizeLinear" and f.input[1] in values
                   for f in feeding):
            continue
        bias = values[node.input[2]].astype(np.float64)
        scale = (values[feeding[0].input[1]].astype(np.float64).reshape(-1)[0]
                 * values[feeding[1].input[1]].astype(np.float64).reshape(-1))
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        quantized = np.rint(bias / scale.astype(np.float64))
        if bias.ndim != 1 or not np.all(np.abs(quantized) < INT32_LIMIT):
            continue
        name = node.input[2]
        graph.initializer.extend([
            numpy_helper.from_array(quantized.astype(np.int32), f"{name}_int32"),
            numpy_helper.from_array(scale, f"{name}_int32_scale"),
            numpy_helper.from_array(np.zeros(bias.shape, np.int32), f"{name}_int32_zero_point")])
        dequantize = onnx.helper.make_node(
            "DequantizeLinear", [f"{name}_int32", f"{name}_int32_scale",
                                 f"{name}_int32_zero_point"], [f"{name}_dequantized"],
            name=f"{name}_DequantizeLinear", axis=0)
        graph.node.insert(list(graph.node).index(node), dequantize)
        node.input[2] = f"{name}_dequantized"


def _fresh_name(name: str, taken: dict) -> str:
    while name in taken:
        name += "_"
    return name


def _users(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    return users


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


# ----------------------------------------------------------------------------- checking it


def qdq_structure(model: onnx.ModelProto) -> dict:
    """Counts that show what the graph is: its QuantizeLinear and DequantizeLinear nodes, its
    Conv/Gemm/MatMul nodes and how many of them take both a dequantized activation and a
    dequantized constant weight, the Gathers whose table is dequantized (0 is right), and
    `integer_kernels`: the op types ONNX Runtime runs after its graph optimisations (CPU, all
    levels) that compute in integers, by count, with `float_weighted_ops`, the Conv/Gemm/MatMul
    it still runs in float."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    constants = set(_constants(model))

    def dequantized(name: str, constant: bool) -> bool:
        node = producers.get(name)
        return (node is not None and node.op_type == "DequantizeLinear"
                and (node.input[0] in constants) == constant)

    weighted = [n for n in graph.node if n.op_type in WEIGHTED_OPS]
    optimised = _optimised_op_types(model)
    return {
        "quantize_linear": sum(n.op_type == "QuantizeLinear" for n in graph.node),
        "dequantize_linear": sum(n.op_type == "DequantizeLinear" for n in graph.node),
        "weighted_ops": len(weighted),
        "quantized_weighted_ops": sum(dequantized(n.input[0], False) and
                                      dequantized(n.input[1], True) for n in weighted),
        "quantized_gathers": sum(n.op_type == "Gather" and producers.get(n.input[0]) is not None
                                 and producers[n.input[0]].op_type == "DequantizeLinear"
                                 for n in graph.node),
        "integer_kernels": {op: optimised[op] for op in INTEGER_KERNELS if optimised.get(op)},
        "float_weighted_ops": sum(optimised.get(op, 0) for op in WEIGHTED_OPS),
    }


def require_integer_kernels(model: onnx.ModelProto) -> dict:
    """The QDQ graph's structure (qdq_structure), or ExportError (exit 4) when ONNX Runtime
    runs none of its Conv/Gemm/MatMul as an integer kernel or a Gather's table is quantized:
    the int8 graph would not be the one intended."""
    structure = qdq_structure(model)
    kernels = sum(structure["integer_kernels"].get(op, 0) for op in WEIGHT_KERNELS)
    if structure["quantized_gathers"]:
        raise ExportError(f"the QAT graph quantizes {structure['quantized_gathers']} embedding "
                          "table(s) (Gather): ONNX Runtime would dequantize each whole table on "
                          "every run", "report this: embeddings must stay float")
    if not kernels:
        raise ExportError(f"ONNX Runtime runs none of the QAT graph's "
                          f"{structure['weighted_ops']} Conv/Gemm/MatMul nodes as an integer "
                          f"kernel ({structure['quantized_weighted_ops']} have dequantized "
                          "inputs and weights): the int8 graph would be no faster than fp32",
                          "report this with the network's --arch")
    return structure


def _optimised_op_types(model: onnx.ModelProto) -> dict[str, int]:
    """The op types of the graph ONNX Runtime runs on the CPU after all its optimisations."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(folder) / "optimised.onnx")
        options.intra_op_num_threads = 1
        options.log_severity_level = 3  # its note that an ALL-level graph is CPU-specific
        ort.InferenceSession(model.SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
        optimised = onnx.load(options.optimized_model_filepath)
    return dict(Counter(node.op_type for node in optimised.graph.node))
