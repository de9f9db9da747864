"""Tracing a network into an ONNX graph: torch.onnx.export (dynamo) with the input's named axes
dynamic, the bundle's graphs from one trace (ttc/convert/graphs.py), onnxslim, constant folding
and onnx.checker. Every model type's exporter traces through here."""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import onnx

from ttc.convert.graphs import optimised, without_dropout
from ttc.inputs.preprocess import text_graph_feed
from ttc.serving.bundle import InputSpec, mark_padding_id
from utils import ExportError, debug_enabled, first_line, stdout_to_stderr

if TYPE_CHECKING:  # torch loads only when a graph is traced
    import torch


def export_graph(net: torch.nn.Module, example: np.ndarray, opset: int, input_spec: InputSpec,
                 output_names: Sequence[str], optimize: bool = True,
                 keep_modes: bool = False, temperature: float = 1.0,
                 wrapper: torch.nn.Module | None = None) -> onnx.ModelProto:
    """torch.onnx.export (dynamo) with the input's named axes dynamic (batch; length for text).
    optimize=False keeps BatchNorm nodes, with parameters named as in the state_dict;
    keep_modes=True exports each module in its own train/eval mode (MC-dropout), not all in eval;
    the probabilities output is softmax(logits / temperature). `wrapper`: the module traced
    instead of the classifiers' (a segmenter's SegmentationGraph, with its mask output).

    The exporter's progress prints go to stderr."""
    import torch

    from ttc.nets.models import export_wrapper

    wrapper = wrapper if wrapper is not None else export_wrapper(net, temperature)
    wrapper = wrapper if keep_modes else wrapper.eval()
    feed = graph_inputs(np.ascontiguousarray(example), input_spec)
    dims = {name: torch.export.Dim(name, **({"max": input_spec.max_length}
                                             if name == "length" and
                                             input_spec.max_length is not None else {}))
            for name in input_spec.shape if isinstance(name, str)}
    dynamic = tuple({axis: dims[name] for axis, name in enumerate(input_spec.shape)
                     if isinstance(name, str)} for _ in feed)
    try:
        with stdout_to_stderr(), torchlib_registry_built_once(), warnings.catch_warnings():
            # keep_modes: the wrapper and the Dropout layers are in training mode on purpose
            warnings.filterwarnings("ignore", "Exporting a model while it is in training mode")
            program = torch.onnx.export(
                wrapper, tuple(torch.from_numpy(v) for v in feed.values()),
                input_names=list(feed), output_names=list(output_names), dynamic_shapes=dynamic,
                opset_version=opset, external_data=False, dynamo=True, optimize=optimize,
                verbose=debug_enabled())
        return mark_padding_id(without_stack_traces(program.model_proto), input_spec)
    except Exception as err:  # noqa: BLE001 - exporter failures are many and varied
        first = first_line(err)
        raise ExportError(f"torch.onnx.export failed at opset {opset}: {first}",
                          "try the default --opset 18, or --log_level DEBUG for details") from None


@dataclass
class TracedGraphs:
    """The graphs a classifier's exporter checks, from one trace (trace_graphs)."""

    deployable: onnx.ModelProto  # optimised: model.onnx before slimming
    adaptation: onnx.ModelProto | None  # BatchNorm nodes kept (None without BatchNorm)
    sampling: onnx.ModelProto | None  # Dropout nodes in training mode (None without dropout)


def dropout_layers(net: torch.nn.Module) -> list:
    import torch

    return [m for m in net.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]


def sampling_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of the network in eval mode but for its Dropout layers: what MC-dropout samples."""
    import torch

    sampling = copy.deepcopy(net).eval()
    for module in sampling.modules():
        if isinstance(module, torch.nn.Dropout):
            module.train()
            module.inplace = False  # in place (torchvision's heads), it exports no Dropout op
    return sampling


def trace_graphs(net: torch.nn.Module, example: np.ndarray, opset: int, input_spec: InputSpec,
                 output_names: Sequence[str], temperature: float) -> TracedGraphs:
    """The deployable graph, and the adaptation and MC-dropout graphs where the network has
    BatchNorm or dropout, from one unoptimised export of it with Dropout in training mode
    (ttc/convert/graphs.py says why and what was measured). A Dropout whose mask the network
    reads gets the deployable graph exported on its own."""
    import torch

    batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    dropout = bool(dropout_layers(net))
    if not batchnorm and not dropout:
        return TracedGraphs(export_graph(net, example, opset, input_spec, output_names,
                                         temperature=temperature), None, None)
    raw = export_graph(sampling_copy(net) if dropout else net, example, opset, input_spec,
                       output_names, optimize=False, keep_modes=dropout, temperature=temperature)
    eval_raw = without_dropout(raw) if dropout else raw
    if eval_raw is None:
        eval_raw = export_graph(net, example, opset, input_spec, output_names, optimize=False,
                                temperature=temperature)
    deployable = mark_padding_id(optimised(eval_raw), input_spec)
    return TracedGraphs(deployable, fold_constants(eval_raw) if batchnorm else None,
                        mark_padding_id(optimised(raw), input_spec) if dropout else None)


STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def without_stack_traces(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exporter records each node's Python stack trace, with the absolute paths of the
    source files: a bundle's graphs (those onnxslim does not rewrite) would carry the path of
    the checkout that made them, and differ by it. Dropped; the node's namespace stays."""
    def clean(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            kept = [p for p in node.metadata_props if p.key != STACK_TRACE_KEY]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
            for attribute in node.attribute:
                for sub in ([attribute.g] if attribute.HasField("g") else []) + list(
                        attribute.graphs):
                    clean(sub)

    clean(model.graph)
    return model


# ONNX Script's tables of ATen decompositions, one per opset, built once per process.
_TORCHLIB_REGISTRIES: dict[int | None, object] = {}


@contextlib.contextmanager
def torchlib_registry_built_once() -> Iterator[None]:
    """torch.onnx.export builds its table of ATen → ONNX decompositions anew on every call
    (about 1 s of CPU each, most of a small network's export), and a bundle exports two to
    four graphs: within this block each opset's table is built once per process and then
    reused. The exporter only reads the table unless it is given a custom_translation_table,
    which this tool never passes (torch 2.14, torch/onnx/_internal/exporter/_compat.py). A
    torch without this private API exports as before, building it each time."""
    # torch.ops.quantized_decomposed (the QDQ ops of a --qat graph) exists only once this is
    # imported, and the table holds its translations only if built after that (13 ms)
    import torch.ao.quantization.fx._decomposed  # noqa: F401

    try:
        from torch.onnx._internal.exporter import _registration
        saved = _registration.ONNXRegistry.__dict__["from_torchlib"]
        build = saved.__func__
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def built_once(cls: type, opset_version: int | None = None) -> object:
        if opset_version not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[opset_version] = (build(cls) if opset_version is None else
                                                   build(cls, opset_version=opset_version))
        return _TORCHLIB_REGISTRIES[opset_version]

    _registration.ONNXRegistry.from_torchlib = classmethod(built_once)
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = saved


def graph_inputs(x: np.ndarray, input_spec: InputSpec) -> dict[str, np.ndarray]:
    """The graph's inputs for the pipeline's one input array (an hf graph's attention mask and
    token types from its ids: preprocess.text_graph_feed)."""
    if not input_spec.extra_inputs:
        return {input_spec.name: x}
    return text_graph_feed(x, input_spec.names, input_spec.padding_id)


def slim_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    with stdout_to_stderr():
        return onnxslim.slim(model)


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding only (no fusion: BatchNorm stays). The unoptimised export computes the
    zero bias of bias-free convolutions from a CastLike of the input, which keeps ONNX Runtime
    from pre-packing those Conv nodes (NCHWc): 2.4x slower convolutions until folded."""
    from onnxscript import optimizer

    with stdout_to_stderr():
        optimizer.fold_constants(model)
    return model


def check_graph(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as err:  # noqa: BLE001 - ValidationError and shape-inference errors
        first = first_line(err)
        raise ExportError(f"onnx.checker rejected the exported graph: {first}",
                          "rerun with --log_level DEBUG and report it") from None
