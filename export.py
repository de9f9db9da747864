"""Export a trained network to ONNX, slim it, check it, validate it numerically against PyTorch,
and write the model bundle (model.onnx, model.json, model.pt) atomically.

    python export.py --output_model runs/digits/model.onnx

reads the weights and manifest that train.py wrote beside that path.
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import onnx

from ttc.testtime.calibrate import calibrate_scores, log_scores, rescale, softmax
from config import Config, build_parser, start_cli
from ttc.inputs.data import bundle_data_options, load_bundle_dataset, split_paths_of
from ttc.reporting.metrics import top1_agreement
from ttc.serving.runtime import RuntimeOptions, create_session, session_feeder
from ttc.tasks.registry import task_of_kind
from ttc.inputs.preprocess import text_graph_feed, trim_padding
from ttc.serving.bundle import (BundlePaths, InputSpec, Manifest, as_manifest, mark_padding_id,
                    manifest_text, read_manifest, record_export,
                    require_trusted_model_code, stamp_contract)
from report import run_with_report
from utils import (DataError, ExportError, LOG, debug_enabled, exit_cli, quiet_library_loggers,
                   run_cli, sha256_of, staged_files, stdout_to_stderr, first_line)

if TYPE_CHECKING:  # torch loads only once flags are parsed: --help stays instant
    import torch

MIN_CHECK_SAMPLES = 32
MAX_CHECK_SAMPLES = 64
# Logits this large are a diverged model: float32 rounding alone then exceeds any sensible
# --validate_atol (a healthy classifier's logits stay within a few tens).
DIVERGED_LOGIT = 1e4
RETRAIN = "retrain with a lower --learning_rate (e.g. 1e-3)"


@dataclass
class NumericCheck:
    max_abs_diff: float
    top1_agreement: float
    samples: int
    batch_sizes: list[int]
    probes: list[str]
    padding_max_diff: float | None = None


@dataclass
class ExportResult:
    paths: BundlePaths
    manifest: Manifest
    draft: dict  # the manifest's JSON, which write_bundle fills and writes
    opset: int
    nodes_before_slim: int
    nodes_after_slim: int
    check: NumericCheck
    atol: float
    size_bytes: int
    seconds: float
    fusion: dict | None = None  # the hf graph ONNX Runtime's transformer fusion made (model.onnx)
    own_check: dict | None = None  # a segmenter's or detector's own figures (masks, boxes)

    def report_section(self) -> dict:
        return {**(self.own_check or {}), "path": str(self.paths.onnx), "opset": self.opset,
                "nodes_before_slim": self.nodes_before_slim,
                "nodes_after_slim": self.nodes_after_slim,
                "max_abs_diff": self.check.max_abs_diff, "checker": "passed",
                "top1_agreement": self.check.top1_agreement,
                "samples_checked": self.check.samples, "probes": self.check.probes,
                "padding_max_diff": self.check.padding_max_diff, "size_bytes": self.size_bytes,
                "seconds": self.seconds, "fusion": self.fusion}


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
    """The graphs export_bundle checks, from one trace (trace_graphs)."""

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

    from ttc.convert.graphs import optimised, without_dropout

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


def padding_id(input_spec: InputSpec) -> int | None:
    """The padding id of a token-id input (None for images and tables)."""
    return input_spec.pad_id if input_spec.dtype == "int64" else None


def check_samples(held_out: np.ndarray, fallback: np.ndarray, input_spec: InputSpec) -> np.ndarray:
    """32-64 real samples, held-out first; topped up from training data for tiny datasets."""
    samples = held_out[:MAX_CHECK_SAMPLES]
    pad = padding_id(input_spec)
    if len(samples) < MIN_CHECK_SAMPLES:
        samples = _concat_padded(samples, fallback[: MIN_CHECK_SAMPLES - len(samples)], pad)
    while len(samples) < MIN_CHECK_SAMPLES:
        samples = _concat_padded(samples, samples, pad)[:MIN_CHECK_SAMPLES]
    return np.ascontiguousarray(samples)


def _concat_padded(a: np.ndarray, b: np.ndarray, pad: int | None) -> np.ndarray:
    """Concatenate along the batch axis; token-id arrays of different lengths are right-padded."""
    if pad is not None and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a, b = (np.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=pad) for t in (a, b))
    return np.concatenate([a, b])


def validation_probes(samples: np.ndarray, input_spec: InputSpec) -> dict[str, np.ndarray]:
    """Inputs to compare PyTorch and ONNX Runtime on. For text: the real lengths (texts longer
    than the tokenizer's max_length arrive truncated), every text cut to its first token (length
    1), and extra padding, up to 7 columns within max_length (it must not change a
    prediction)."""
    pad = padding_id(input_spec)
    if pad is None:
        return {"held_out": samples}
    trimmed = trim_padding(samples, pad)
    longest = input_spec.max_length if input_spec.max_length is not None else \
        trimmed.shape[1] + 7
    extra = min(7, longest - trimmed.shape[1])
    probes = {"held_out": trimmed, "length_1": np.ascontiguousarray(trimmed[:, :1])}
    if extra > 0:
        probes["padded"] = np.pad(trimmed, ((0, 0), (0, extra)), constant_values=pad)
    return probes


def compare_with_torch(model: onnx.ModelProto, net: torch.nn.Module, samples: np.ndarray,
                       input_spec: InputSpec, atol: float, batch_size: int,
                       num_threads: int, temperature: float = 1.0) -> NumericCheck:
    """Run PyTorch and ONNX Runtime on the same inputs at batch 1, an odd batch and a large one
    (the probabilities with the manifest's temperature)."""
    import torch
    from ttc.nets.models import WithProbabilities

    session = create_session(model.SerializeToString(), RuntimeOptions(intra_op_threads=num_threads))
    feed = session_feeder(session)
    wrapper = WithProbabilities(net, temperature).eval()
    large = max(2, min(len(samples), batch_size))
    batch_sizes = sorted({1, 7, large})
    probes = validation_probes(samples, input_spec)
    max_diff, agreement, largest_logit = 0.0, 1.0, 0.0
    outputs: dict[str, list[np.ndarray]] = {}
    for name, probe in probes.items():
        with torch.no_grad():
            expected = [t.numpy() for t in wrapper(torch.from_numpy(probe))]
        require_finite_outputs(net, probe, expected[0], "PyTorch")
        for size in batch_sizes:
            got = [np.concatenate(parts) for parts in zip(*(
                session.run(None, feed(probe[i:i + size]))
                for i in range(0, len(probe), size)))]
            require_finite_outputs(net, probe, got[0], "ONNX Runtime")
            max_diff = max(max_diff, *(float(np.abs(g - e).max()) for g, e in zip(got, expected)))
            largest_logit = max(largest_logit, float(np.abs(got[0]).max()),
                                float(np.abs(expected[0]).max()))
            agreement = min(agreement, top1_agreement(got[0], expected[0]))
        outputs[name] = got
    padding_diff = None
    if "padded" in outputs:
        padding_diff = float(np.abs(outputs["padded"][1] - outputs["held_out"][1]).max())
        if not padding_diff <= atol:
            raise ExportError(f"padding changes predictions: max probability difference "
                              f"{padding_diff:.3g} > --validate_atol {atol:g}; the bundle was not "
                              "written", "report this: pooling must ignore padding")
    check = NumericCheck(max_diff, agreement, len(samples), batch_sizes, list(probes), padding_diff)
    if not max_diff <= atol:
        hint = (f"the model's logits reach {largest_logit:.3g}: its weights likely diverged "
                f"in training, and no tolerance fixes that; {RETRAIN}"
                if largest_logit >= DIVERGED_LOGIT else
                "raise --validate_atol if this difference is acceptable")
        raise ExportError(f"numeric check failed: max |onnx - torch| = {max_diff:.3g} > "
                          f"--validate_atol {atol:g} (top-1 agreement {agreement:.1%} on "
                          f"{len(samples)} held-out samples, batch sizes {batch_sizes}); "
                          "the bundle was not written", hint)
    return check


def require_finite_outputs(net: torch.nn.Module, probe: np.ndarray, logits: np.ndarray,
                           engine: str) -> None:
    """NaN or inf outputs are never a tolerance question (and NaN compares as no difference at
    all): infinite inputs are a data error (exit 3); otherwise the weights are non-finite or so
    large that they overflow, i.e. training diverged (exit 4)."""
    import torch

    bad_rows = ~np.isfinite(logits).all(axis=1)
    if not bad_rows.any():
        return
    what = "nan" if np.isnan(logits).any() else "inf"
    shown = f"{int(bad_rows.sum())} of {len(logits)} held-out samples"
    if np.issubdtype(probe.dtype, np.floating):
        bad_inputs = np.isinf(probe).reshape(len(probe), -1).any(axis=1)
        if bad_inputs.any() and not (bad_rows & ~bad_inputs).any():
            count = int(bad_inputs.sum())
            samples_hold = "1 held-out sample holds" if count == 1 else \
                f"{count} held-out samples hold"
            raise DataError(f"{samples_hold} an infinite value (inf, 1e400, or a number beyond "
                            f"float32's ±3.4e38), and the model's outputs on them are not finite "
                            f"({what}); the bundle was not written",
                            "remove those rows, or empty those cells so that they count as "
                            "missing")
    broken = [name for name, tensor in net.state_dict().items()
              if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if broken:
        cause = (f"its weights are not finite (in {', '.join(broken[:3])}): training likely "
                 "diverged")
    else:
        largest = max((float(t.abs().max()) for t in net.state_dict().values()
                       if t.is_floating_point() and t.numel()), default=0.0)
        cause = (f"its weights are likely diverged (largest |weight| {largest:.3g}) and "
                 "overflow float32")
    raise ExportError(f"the model produces non-finite outputs ({what}) in {engine} on {shown}: "
                      f"{cause}; the bundle was not written",
                      f"a tolerance cannot fix this: {RETRAIN}")


def validation_tolerance(config: Config, manifest: Manifest | dict) -> float:
    """--validate_atol, or the default for the manifest's network (of a typed manifest, or of
    its JSON dict)."""
    from config import VALIDATE_ATOL, VALIDATE_ATOL_FOR_ARCH

    if config.validate_atol is not None:
        return config.validate_atol
    return VALIDATE_ATOL_FOR_ARCH.get(as_manifest(manifest).architecture.arch, VALIDATE_ATOL)


def export_example(samples: np.ndarray, input_spec: InputSpec) -> np.ndarray:
    """Two real samples: with a batch (or length) of 1 the exporter would fix that axis."""
    example = samples[:2]
    pad = padding_id(input_spec)
    if pad is not None:
        example = trim_padding(example, pad)
        if example.shape[1] < 2:
            example = np.pad(example, ((0, 0), (0, 1)), constant_values=pad)
    return example


def export_bundle(config: Config, net: torch.nn.Module, manifest: Manifest | dict,
                  held_out: np.ndarray,
                  train_samples: np.ndarray, paths: BundlePaths,
                  members: Sequence[torch.nn.Module] = (),
                  val: tuple[np.ndarray, np.ndarray] | None = None) -> ExportResult:
    """Export → slim → check → validate; only a model that passes every step is written. Every
    graph bakes the manifest's temperature in; the MC-dropout and ensemble graphs' averages get
    their own, fitted on `val` (the validation split) when the manifest's is. `manifest`:
    training's draft (a JSON dict, filled in place) or a bundle's (typed: its JSON is copied)."""
    started = time.perf_counter()
    draft = manifest.to_json_dict() if isinstance(manifest, Manifest) else manifest
    manifest = as_manifest(manifest)
    config.validate_atol = validation_tolerance(config, manifest)
    net = net.eval()
    output_names = list(manifest.output_names)
    samples = check_samples(held_out, train_samples, manifest.input)
    spec = manifest.input
    temperature = manifest.temperature
    if task_of_kind(manifest.preprocessing.kind).dense:
        return export_dense_bundle(config, net, manifest, draft, samples, paths, started)
    if manifest.preprocessing.kind == "detection":
        return export_detection_bundle(config, net, manifest, draft, samples, paths, started)
    traced = trace_graphs(net, export_example(samples, spec), config.opset, spec, output_names,
                          temperature)
    exported = traced.deployable
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    check = compare_with_torch(slimmed, net, samples, manifest.input, config.validate_atol,
                               config.batch_size, config.num_threads, temperature)
    LOG.info("export ok: %d → %d nodes after onnxslim, max |onnx - torch| %.2g, top-1 agreement "
             "%.1f%%", len(exported.graph.node), len(slimmed.graph.node), check.max_abs_diff,
             100 * check.top1_agreement)
    result = ExportResult(paths=paths, manifest=manifest, draft=draft, opset=config.opset,
                          nodes_before_slim=len(exported.graph.node),
                          nodes_after_slim=len(slimmed.graph.node), check=check,
                          atol=config.validate_atol, size_bytes=slimmed.ByteSize(),
                          seconds=round(time.perf_counter() - started, 3))
    fused = fused_hf_graph(net, samples, config, manifest)
    if fused is not None:  # the deployable graph from here on: extras are checked against it
        slimmed, result.check, result.fusion = fused
        result.size_bytes = slimmed.ByteSize()
        result.seconds = round(time.perf_counter() - started, 3)
    extras: dict[str, ExtraGraph] = {}
    adaptation = export_adaptation_graph(net, traced.adaptation, samples, slimmed, config,
                                         manifest)
    if adaptation is not None:
        extras["bn"] = adaptation
    mc = export_mc_dropout_graph(net, traced.sampling, samples, slimmed, config, manifest, val)
    if mc is not None:
        extras["mc"] = mc
    if members:
        extras["ensemble"] = export_ensemble_graph([net, *members], samples, config, manifest,
                                                   val)
    write_bundle(slimmed, net, result, extras)
    return result


def export_dense_bundle(config: Config, net: torch.nn.Module, manifest: Manifest, draft: dict,
                        samples: np.ndarray, paths: BundlePaths, started: float) -> ExportResult:
    """A segmenter's bundle: SegmentationGraph (logits, probabilities and mask per pixel) with
    dynamic batch, height and width, slimmed, checked, and compared with PyTorch at two
    resolutions (ttc/tasks/segment/export.py); its BatchNorm graph (model.bn.onnx) for --ttt bn,
    checked against model.onnx. Both graphs come from one trace (ttc/convert/graphs.py)."""
    from ttc.convert.graphs import optimised
    from ttc.tasks.segment.export import compare_segmentation
    from ttc.tasks.segment.nets import SegmentationGraph

    spec, temperature = manifest.input, manifest.temperature
    raw = export_graph(net, samples[:2], config.opset, spec, manifest.output_names,
                       optimize=False, temperature=temperature,
                       wrapper=SegmentationGraph(net, temperature))
    exported = optimised(raw)
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    session = create_session(slimmed.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    masks = compare_segmentation(lambda batch: session.run(None, {spec.name: batch}), net,
                                 samples, config.validate_atol, config.batch_size, temperature)
    LOG.info("export ok: %d → %d nodes after onnxslim, max |onnx - torch| %.2g, mask agreement "
             "%.4f%% of %d pixels at %s", len(exported.graph.node), len(slimmed.graph.node),
             masks.max_abs_diff, 100 * masks.top1_agreement, masks.pixels,
             " and ".join(masks.probes))
    check = NumericCheck(masks.max_abs_diff, masks.top1_agreement, masks.samples,
                         masks.batch_sizes, masks.probes)
    result = ExportResult(paths=paths, manifest=manifest, draft=draft, opset=config.opset,
                          nodes_before_slim=len(exported.graph.node),
                          nodes_after_slim=len(slimmed.graph.node), check=check,
                          atol=config.validate_atol, size_bytes=slimmed.ByteSize(),
                          seconds=round(time.perf_counter() - started, 3))
    result.own_check = {"mask_agreement": masks.top1_agreement,
                        "pixels_checked": masks.pixels,
                        "mask_disagreements": masks.mask_disagreements,
                        "resolutions_checked": masks.resolutions}
    unoptimised = fold_constants(raw)
    has_batchnorm = any(n.op_type == "BatchNormalization" for n in unoptimised.graph.node)
    extras = {"bn": export_adaptation_graph(net, unoptimised if has_batchnorm else None,
                                            samples, slimmed, config, manifest)}
    if config.tta:
        extras["tta"] = segmentation_tta_graph(config, net, samples, manifest)
    write_bundle(slimmed, net, result, {k: v for k, v in extras.items() if v is not None})
    return result


def export_detection_bundle(config: Config, net: torch.nn.Module, manifest: Manifest,
                            draft: dict, samples: np.ndarray, paths: BundlePaths,
                            started: float) -> ExportResult:
    """A detector's bundle: the network, its decoding and class-aware NMS in one graph
    (ttc/tasks/detect/nms.py: padded boxes, scores, labels and num_detections, with dynamic
    batch, height and width), slimmed, checked, and compared with PyTorch's detections at batch
    sizes 1, 4 and 8 and two image sizes (ttc/tasks/detect/export.py). The NMS settings it
    bakes are recorded in the manifest's preprocessing.nms."""
    from ttc.convert.graphs import optimised
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.export import compare_detections, nms_settings
    from ttc.tasks.detect.nms import append_nms, export_candidates

    nms = nms_settings(config, draft["preprocessing"])
    draft["preprocessing"]["nms"] = nms.record()
    manifest = as_manifest(draft)
    try:  # one trace for the deployable graph and the adaptation graph (ttc/convert/graphs.py)
        raw = export_candidates(net, samples[:2], config.opset, optimize=False)
        exported = append_nms(optimised(raw), nms.iou_threshold, nms.score_threshold,
                              nms.max_detections)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(f"torch.onnx.export failed at opset {config.opset}: "
                          f"{first_line(err)}", "rerun with --log_level DEBUG") from err
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    session = create_session(slimmed.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    check = compare_detections(detection_runner(session), net, samples, nms,
                               config.validate_atol)
    LOG.info("export ok: %d → %d nodes after onnxslim; %d detections equal to PyTorch's "
             "(IoU ≥ %.4f, scores within %.2g) at batch %s and %s", len(exported.graph.node),
             len(slimmed.graph.node), check.detections, check.min_matched_iou,
             check.max_abs_diff, ", ".join(map(str, check.batch_sizes)),
             " and ".join(check.resolutions))
    numeric = NumericCheck(check.max_abs_diff, check.top1_agreement, check.samples,
                           check.batch_sizes, check.probes)
    result = ExportResult(paths=paths, manifest=manifest, draft=draft, opset=config.opset,
                          nodes_before_slim=len(exported.graph.node),
                          nodes_after_slim=len(slimmed.graph.node), check=numeric,
                          atol=config.validate_atol, size_bytes=slimmed.ByteSize(),
                          seconds=round(time.perf_counter() - started, 3))
    result.own_check = {"detections_checked": check.detections,
                        "min_matched_iou": check.min_matched_iou,
                        "count_mismatches": check.count_mismatches, "ties": check.ties,
                        "resolutions_checked": check.resolutions, "nms": nms.record()}
    adaptation = detection_adaptation_graph(config, raw, samples, nms,
                                            detection_runner(session))
    extras = {"bn": adaptation} if adaptation else {}
    if config.tta:
        extras["tta"] = detection_tta_graph(config, net, samples, nms)
    write_bundle(slimmed, net, result, extras)
    return result


def detection_adaptation_graph(config: Config, raw: onnx.ModelProto, samples: np.ndarray, nms,
                               deployed: Callable) -> ExtraGraph | None:
    """A detector's graph for --ttt bn (model.bn.onnx): the candidates' unoptimised export
    (`raw`, the same trace the deployable graph was optimised from) constant-folded, so that
    the BatchNormalization nodes survive, with the same NMS appended; its detections checked
    against the deployable graph's (`deployed`) on held-out images. None for a network without
    BatchNorm."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.export import MAX_CHECK_IMAGES, max_score_diff
    from ttc.tasks.detect.nms import append_nms

    candidates = fold_constants(copy.deepcopy(raw))
    if not any(n.op_type == "BatchNormalization" for n in candidates.graph.node):
        return None
    graph = append_nms(candidates, nms.iou_threshold, nms.score_threshold, nms.max_detections)
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    diff = max_score_diff(detection_runner(session), deployed,
                          np.ascontiguousarray(samples[:MAX_CHECK_IMAGES]),
                          "BatchNorm adaptation graph")
    _require_close(diff, "BatchNorm adaptation graph", config)
    layers = sum(n.op_type == "BatchNormalization" for n in graph.graph.node)
    LOG.info("adaptation graph: %d BatchNorm layers kept, max score diff to the exported graph "
             "%.2g", layers, diff)
    return ExtraGraph(graph, {"purpose": "test-time training: BatchNorm nodes kept "
                              "(unoptimised export, constant-folded, not slimmed), the same NMS",
                              "batchnorm_layers": layers, "max_abs_diff": diff})


def detection_tta_graph(config: Config, net: torch.nn.Module, samples: np.ndarray,
                        nms) -> ExtraGraph:
    """--tta for a detector: its views (--tta_transforms, default the TASK entry's) with their
    boxes mapped back and fused inside one graph (model.tta.onnx: ttc/tasks/detect/tta.py and
    fusion.py), checked against the same computation in PyTorch and numpy at batch sizes 1,
    4 and 8 and two image sizes, as model.onnx is."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.export import compare_detections
    from ttc.tasks.detect.flags import detector_views
    from ttc.tasks.detect.fusion import append_fusion
    from ttc.tasks.detect.tta import (default_settings, export_view_candidates,
                                      parse_box_views, tta_reference)

    views_text = detector_views(config.tta_transforms)
    views = parse_box_views(views_text)
    settings = default_settings(nms, len(views))
    candidates = export_view_candidates(net, views, samples[:2], config.opset)
    graph = append_fusion(slim_graph(candidates), len(views), settings)
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    check = compare_detections(detection_runner(session), net, samples, nms,
                               config.validate_atol, tta_reference(net, views, settings))
    LOG.info("TTA graph (%s, box fusion at IoU %.2f) ok: %d detections equal to PyTorch's and "
             "numpy's (IoU ≥ %.4f, scores within %.2g)", views_text, settings.fusion_iou,
             check.detections, check.min_matched_iou, check.max_abs_diff)
    return ExtraGraph(graph, {"views": views_text, "fusion": settings.record(),
                              "max_abs_diff": check.max_abs_diff,
                              "detections_checked": check.detections,
                              "min_matched_iou": check.min_matched_iou,
                              "resolutions_checked": check.resolutions})


def segmentation_tta_graph(config: Config, net: torch.nn.Module, samples: np.ndarray,
                           manifest: Manifest) -> ExtraGraph:
    """--tta for a segmenter: its views (--tta_transforms, default hflip) and the mean of their
    logits, mapped back onto the input's pixels, in one graph (model.tta.onnx), checked against
    the same module in PyTorch at two resolutions as model.onnx is."""
    from ttc.tasks.segment.export import compare_segmentation
    from ttc.tasks.segment.nets import SegmentationGraph
    from ttc.tasks.segment.tta import SegmentationTTA, parse_views
    from ttc.tasks.segment.views import parse_view_specs, views_text

    spec, temperature = manifest.input, manifest.temperature
    views = views_text(parse_view_specs(config.tta_transforms))
    merged = SegmentationTTA(net, parse_views(views)).eval()
    graph = slim_graph(export_graph(merged, samples[:2], config.opset, spec,
                                    manifest.output_names, temperature=temperature,
                                    wrapper=SegmentationGraph(merged, temperature)))
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    check = compare_segmentation(lambda batch: session.run(None, {spec.name: batch}), merged,
                                 samples, config.validate_atol, config.batch_size, temperature)
    LOG.info("TTA graph (%s) ok: max |onnx - torch| %.2g, mask agreement %.4f%%", views,
             check.max_abs_diff, 100 * check.top1_agreement)
    return ExtraGraph(graph, {"views": views, "max_abs_diff": check.max_abs_diff,
                              "mask_agreement": check.top1_agreement,
                              "resolutions_checked": check.resolutions})


def fused_hf_graph(net: torch.nn.Module, samples: np.ndarray, config: Config, manifest: Manifest
                   ) -> tuple[onnx.ModelProto, NumericCheck, dict] | None:
    """An hf network's graph with ONNX Runtime's transformer fusion (hf.fused_graph: one
    Attention node per layer; measured on the tiny BERT of bench/hf_text.py, fp32 1.33x the
    dynamo graph at batch 32 and dynamic int8 1.3x the fused fp32), checked like the exported
    graph (checker, PyTorch on the same probes and batch sizes): (graph, check, the manifest's
    record), or None, and the dynamo graph serves, when it does not fuse or fails a check."""
    from ttc.nets.hf import FUSED_OPS, HFTextNet, fused_graph

    if not isinstance(net, HFTextNet):
        return None
    spec = manifest.input
    output_names = list(manifest.output_names)
    temperature = manifest.temperature
    try:
        feed = graph_inputs(np.ascontiguousarray(export_example(samples, spec)), spec)
        model = fused_graph(net, feed, output_names, config.opset, temperature)
        if model is None:
            return None
        model = mark_padding_id(model, spec)
        check_graph(model)
        check = compare_with_torch(model, net, samples, spec, config.validate_atol,
                                   config.batch_size, config.num_threads, temperature)
    except Exception as err:  # noqa: BLE001 - an optimisation: the unfused graph serves
        LOG.warning("the fused transformer graph was not used: %s", first_line(err, 300))
        return None
    fused = {op: sum(n.op_type == op for n in model.graph.node) for op in FUSED_OPS}
    LOG.info("transformer fusion: %s; %d nodes, max |onnx - torch| %.2g", fused,
             len(model.graph.node), check.max_abs_diff)
    return model, check, {"exporter": "torch.onnx.export (TorchScript, eager attention) + "
                          "onnxruntime.transformers optimize_model (bert)", "fused": fused,
                          "nodes": len(model.graph.node)}


@dataclass
class ExtraGraph:
    """A graph the bundle carries besides model.onnx, with its manifest entry."""

    model: onnx.ModelProto
    info: dict


def _max_diff_to(graph: onnx.ModelProto, reference: onnx.ModelProto, samples: np.ndarray,
                 config: Config, manifest: Manifest, **session_args: object) -> float:
    runtime = RuntimeOptions(intra_op_threads=config.num_threads)
    probe = validation_probes(samples, manifest.input)["held_out"]
    sessions = [create_session(m.SerializeToString(), runtime) for m in (graph, reference)]
    got, expected = (s.run(["probabilities"], session_feeder(s)(probe))[0] for s in sessions)
    return float(np.abs(got - expected).max())


def _require_close(diff: float, what: str, config: Config) -> None:
    if not np.isfinite(diff):  # NaN or inf outputs: no tolerance covers them
        raise ExportError(f"the {what} gives non-finite outputs ({diff:g} difference to the "
                          "exported graph): a model's weights likely diverged in training; the "
                          "bundle was not written", f"a tolerance cannot fix this: {RETRAIN}")
    if not diff <= config.validate_atol:
        raise ExportError(f"the {what} differs from the exported graph by {diff:.3g} > "
                          f"--validate_atol {config.validate_atol:g}; the bundle was not written",
                          "raise --validate_atol, or report it")


def export_adaptation_graph(net: torch.nn.Module, graph: onnx.ModelProto | None,
                            samples: np.ndarray, slimmed: onnx.ModelProto, config: Config,
                            manifest: Manifest) -> ExtraGraph | None:
    """The graph test-time training adapts (`graph`, trace_graphs' adaptation graph):
    unoptimised and not slimmed, so that its BatchNormalization nodes survive (the deployable
    graph has them folded into Conv/Gemm). Checked against the deployable graph on the same
    samples. None without BatchNorm: tent then adapts the LayerNorm/GroupNorm nodes of the
    deployable graph itself (check_norms_adaptable)."""
    if graph is None:
        check_norms_adaptable(net, slimmed)
        return None
    check_graph(graph)
    diff = _max_diff_to(graph, slimmed, samples, config, manifest)
    _require_close(diff, "BatchNorm adaptation graph", config)
    layers = sum(n.op_type == "BatchNormalization" for n in graph.graph.node)
    LOG.info("adaptation graph: %d BatchNorm layers kept, max |diff| to the exported graph %.2g",
             layers, diff)
    return ExtraGraph(graph, {"purpose": "test-time training: BatchNorm nodes kept "
                              "(unoptimised export, constant-folded, not slimmed)",
                              "batchnorm_layers": layers, "max_abs_diff": diff})


def check_norms_adaptable(net: torch.nn.Module, slimmed: onnx.ModelProto) -> None:
    """For a network without BatchNorm: whether tent can adapt model.onnx's LayerNorm and
    GroupNorm layers, i.e. every such PyTorch layer has a node whose scale and bias are
    initializers holding its values (measured: the exporter and onnxslim keep
    nn.LayerNorm as one LayerNormalization node, its parameters named as in the state_dict).
    A WARNING when not: the bundle still serves, only --ttt refuses it."""
    import torch

    from ttc.testtime.ttt import affine_norm_model, paired_norm_modules
    from utils import PipelineError

    if not any(isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) for m in net.modules()):
        return
    try:
        _, layers = affine_norm_model(slimmed)
        paired_norm_modules(net, layers)
    except PipelineError as err:
        LOG.warning("test-time training (tent) cannot adapt this graph: %s", err.one_line())
        return
    LOG.info("no BatchNorm, so no adaptation graph: tent adapts the %d LayerNorm/GroupNorm "
             "layers of the exported graph itself", len(layers))


def export_mc_dropout_graph(net: torch.nn.Module, graph: onnx.ModelProto | None,
                            samples: np.ndarray, slimmed: onnx.ModelProto, config: Config,
                            manifest: Manifest, val: tuple[np.ndarray, np.ndarray] | None = None
                            ) -> ExtraGraph | None:
    """The graph MC-dropout samples (`graph`, trace_graphs' sampling graph): the network with
    its Dropout layers in training mode, optimised but not slimmed (onnxslim drops Dropout).
    With ONNX Runtime's default optimisations (EliminateDropout) it must equal the deployable
    graph: that checks the rest of it. Its passes are averaged from their logits, and the
    average gets its own temperature (fitted on `val` with --iterations passes). None without
    dropout."""
    if graph is None:
        return None
    dropouts = dropout_layers(net)
    check_graph(graph)
    layers = sum(n.op_type == "Dropout" for n in graph.graph.node)  # a module used twice: 2
    if layers == 0:
        raise ExportError(f"the MC-dropout graph lost its {len(dropouts)} dropout layers",
                          "report it; export with --log_level DEBUG")
    diff = _max_diff_to(graph, slimmed, samples, config, manifest)
    _require_close(diff, "MC-dropout graph (dropout off)", config)
    info = {"purpose": "MC-dropout: Dropout nodes in training mode, not slimmed; run with "
            "EliminateDropout disabled", "dropout_layers": layers, "rates": [m.p for m in dropouts]}
    if calibrating(manifest, val):
        sampling = sampling_copy(net)
        passes = [softmax(network_logits(sampling, val[0], manifest.input,
                                            seed=config.seed + k))
                  for k in range(config.iterations)]
        info.update(averaged_temperature("MC-dropout", np.mean(passes, axis=0), val[1],
                                         manifest, passes=config.iterations))
    return ExtraGraph(graph, info)


def calibrating(manifest: Manifest, val: tuple[np.ndarray, np.ndarray] | None) -> bool:
    """Whether averaged outputs get a temperature: the network's was fitted, and there is a
    validation split to fit theirs on."""
    method = manifest.calibration.method if manifest.calibration else "none"
    return method != "none" and val is not None and len(val[1]) > 0


def network_logits(net: torch.nn.Module, x: np.ndarray, input_spec: InputSpec,
                   seed: int | None = None, batch_size: int = 256) -> np.ndarray:
    """The network's logits on x in the modes its modules are in (dropout sampling from
    `seed`); token ids trimmed of the padding no text in a batch needs."""
    import torch

    pad = padding_id(input_spec)
    with torch.random.fork_rng(), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        return torch.cat([net(torch.from_numpy(np.ascontiguousarray(
            trim_padding(x[i:i + batch_size], pad) if pad is not None else x[i:i + batch_size])))
            for i in range(0, len(x), batch_size)]).float().numpy()


def averaged_temperature(what: str, mean: np.ndarray, y: np.ndarray, manifest: Manifest,
                         **details: object) -> dict:
    """The temperature an average (of passes or members) is rescaled by: calibrate.rescale,
    fitted on the validation split's averaged probabilities and decided by the network's rule
    (--calibrate). The manifest's entry: no `temperature` where it is not applied."""
    fit = calibrate_scores(log_scores(mean), y, manifest.calibration.rule or "always")
    LOG.info("calibration of the %s average: temperature %.4f (%s), validation NLL %.4f → %.4f;"
             " %s", what, fit.fitted, fit.method, fit.nll_before, fit.nll_after,
             "applied" if fit.applied else f"not applied: {fit.reason}")
    return {**({"temperature": fit.temperature} if fit.applied else {}),
            "temperature_fit": {**fit.manifest_entry(), **details}}


def export_ensemble_graph(nets: Sequence[torch.nn.Module], samples: np.ndarray, config: Config,
                          manifest: Manifest, val: tuple[np.ndarray, np.ndarray] | None = None
                          ) -> ExtraGraph:
    """Every member exported and slimmed like model.onnx, merged into one graph that returns
    their mean (iterative.ensemble_model), rescaled by a temperature fitted on `val`; checked
    against the PyTorch members' mean, rescaled the same way."""
    from ttc.testtime.iterative import ensemble_model

    output_names = list(manifest.output_names)
    spec = manifest.input
    members = [slim_graph(export_graph(net.eval(), export_example(samples, spec), config.opset,
                                       spec, output_names)) for net in nets]
    calibration = {}
    if calibrating(manifest, val):
        mean = np.mean([softmax(network_logits(net, val[0], spec)) for net in nets], axis=0)
        calibration = averaged_temperature("ensemble", mean, val[1], manifest,
                                           members=len(nets))
    temperature = calibration.get("temperature", 1.0)
    graph = ensemble_model(members, manifest.classes, temperature)
    check_graph(graph)
    probe = validation_probes(samples, manifest.input)["held_out"]
    expected = rescale(np.mean([softmax(network_logits(net, probe, spec)) for net in nets],
                               axis=0), temperature)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=config.num_threads))
    got = session.run(["probabilities"], session_feeder(session)(probe))[0]
    diff = float(np.abs(got - expected).max())
    _require_close(diff, "ensemble graph (against the PyTorch members' mean)", config)
    LOG.info("ensemble graph: %d members, max |onnx - torch| %.2g", len(nets), diff)
    return ExtraGraph(graph, {"purpose": "the mean of several models trained with different "
                              "seeds, in one graph", "members": len(nets),
                              "seeds": [config.seed + k for k in range(len(nets))],
                              "max_abs_diff": diff, **calibration})


def write_bundle(model: onnx.ModelProto, net: torch.nn.Module, result: ExportResult,
                 extras: dict[str, ExtraGraph] | None = None) -> None:
    """Weights, graphs and the manifest that names them by hash, all written to temporary
    files first and then moved into place, manifest last (utils.StagedFiles): a run killed
    while writing leaves the previous bundle as it was."""
    from ttc.nets.models import side_files, weights_bytes

    paths, manifest, draft = result.paths, result.manifest, result.draft
    extras = extras or {}
    weights = weights_bytes(net)
    with staged_files() as stage:
        hashes = {"weights": sha256_of(stage(paths.weights,
                                             lambda tmp: tmp.write_bytes(weights)))}
        for key, data in side_files(manifest).items():
            hashes[key] = sha256_of(stage(paths.side_file(key),
                                          lambda tmp, d=data: tmp.write_bytes(d)))
        for key, extra in extras.items():
            graph = stamp_contract(extra.model, manifest)
            hashes[key] = sha256_of(stage(paths.variant(key),
                                          lambda tmp, m=graph: onnx.save_model(m, str(tmp))))
        stamp_contract(model, manifest)
        staged_onnx = stage(paths.onnx, lambda tmp: onnx.save_model(model, str(tmp)))
        hashes["onnx"] = sha256_of(staged_onnx)
        result.size_bytes = staged_onnx.stat().st_size
        record_export(draft, paths, export_section(result),
                      {key: extra.info for key, extra in extras.items()}, hashes)
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(draft),
                                                          encoding="utf-8"))


def export_section(result: ExportResult) -> dict:
    """The manifest's record of how model.onnx was made and checked."""
    import torch

    return {
        "exporter": f"torch.onnx.export (dynamo) torch {torch.__version__}",
        "slimmer": "onnxslim", "opset": result.opset, "checker": "passed (full_check)",
        "nodes_before_slim": result.nodes_before_slim, "nodes_after_slim": result.nodes_after_slim,
        "max_abs_diff": result.check.max_abs_diff, "top1_agreement": result.check.top1_agreement,
        "samples_checked": result.check.samples, "batch_sizes_checked": result.check.batch_sizes,
        "probes": result.check.probes, "padding_max_diff": result.check.padding_max_diff,
        "validate_atol": result.atol, "size_bytes": result.size_bytes, "seconds": result.seconds,
        "fusion": result.fusion, **(result.own_check or {})}


# ----------------------------------------------------------------------------- compressed variants

# A QDQ graph runs integer kernels where PyTorch's fake quantization rounds in float: their
# outputs differ by about one quantization step, so the check is on decisions (top-1 agreement
# on held-out samples) and the difference is recorded, not bounded by --validate_atol.
QDQ_MIN_AGREEMENT = 0.98


@dataclass
class CompressedGraph:
    """A compressed variant's graph, exported and checked against its own PyTorch network."""

    name: str
    model: onnx.ModelProto
    check: NumericCheck
    nodes: int
    structure: dict | None  # a QDQ graph's nodes and the integer kernels ONNX Runtime runs


def export_compressed_graph(config: Config, variant, samples: np.ndarray, manifest: Manifest
                            ) -> CompressedGraph:
    """Export one compressed variant (a pruned network as fp32, slimmed; a fake-quantized one as
    a QDQ int8 graph), onnx.checker, and the numeric check against its own PyTorch network."""
    spec, output_names = manifest.input, list(manifest.output_names)
    example = export_example(samples, spec)
    def exported(net: torch.nn.Module, x: np.ndarray) -> onnx.ModelProto:
        return export_graph(net, x, config.opset, spec, output_names,
                            temperature=manifest.temperature)

    if variant.quantized:
        from ttc.compress.qat import export_qdq, qdq_structure, require_integer_kernels

        graph = slim_graph(export_qdq(variant.net, example, exported))
    else:
        graph = slim_graph(exported(variant.net, example))
    check_graph(graph)
    structure = None
    if variant.quantized:
        require_integer_kernels(graph)
        structure = qdq_structure(graph)
    atol = float("inf") if variant.quantized else config.validate_atol
    check = compare_with_torch(graph, variant.net, samples, spec, atol, config.batch_size,
                               config.num_threads, manifest.temperature)
    if variant.quantized and check.top1_agreement < QDQ_MIN_AGREEMENT:
        raise ExportError(f"numeric check failed for the {variant.name} graph: top-1 agreement "
                          f"with its fake-quantized PyTorch network is {check.top1_agreement:.1%}"
                          f" (< {QDQ_MIN_AGREEMENT:.0%}) on {check.samples} held-out samples; "
                          "the bundle was not changed",
                          "train without --qat, or report it with --log_level DEBUG")
    LOG.info("%s graph ok: %d nodes, max |onnx - torch| %.2g, top-1 agreement %.1f%%",
             variant.name, len(graph.graph.node), check.max_abs_diff,
             100 * check.top1_agreement)
    return CompressedGraph(variant.name, graph, check, len(graph.graph.node), structure)


def export_compressed(config: Config, variants: Sequence, paths: BundlePaths,
                      held_out: np.ndarray, train_samples: np.ndarray) -> list[CompressedGraph]:
    """Every compressed variant exported and checked, then written with its weights and the
    manifest that names them, staged together (graphs first, manifest last)."""
    from ttc.compress.variants import compression_record
    from ttc.nets.models import weights_bytes

    manifest = read_manifest(paths)
    samples = check_samples(held_out, train_samples, manifest.input)
    graphs = [export_compressed_graph(config, v, samples, manifest) for v in variants]
    draft = manifest.to_json_dict()
    with staged_files() as stage:
        for variant, graph in zip(variants, graphs):
            weights_path = paths.variant_weights(variant.name)
            draft["files"][f"weights_{variant.name}"] = weights_path.name
            draft["files"]["sha256"][f"weights_{variant.name}"] = sha256_of(
                stage(weights_path, lambda tmp, b=weights_bytes(variant.net): tmp.write_bytes(b)))
            model = stamp_contract(graph.model, manifest)
            draft["files"][variant.name] = paths.variant(variant.name).name
            draft["files"]["sha256"][variant.name] = sha256_of(
                stage(paths.variant(variant.name),
                      lambda tmp, m=model: onnx.save_model(m, str(tmp))))
        draft["compression"] = compression_record(variants, graphs, paths, draft)
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(draft), encoding="utf-8"))
    return graphs


# ----------------------------------------------------------------------------- CLI

def load_held_out(config: Config, manifest: Manifest
                  ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray],
                             tuple[np.ndarray, np.ndarray]]:
    """For a bundle on disk, decoded as at training time: the test split's inputs (the numeric
    check), the validation split's inputs (its fallback), the validation split (the averaged
    graphs' temperatures, the compression gate) and the test split (the gate's report)."""
    data = load_bundle_dataset(manifest, config.dataset_path, ("val", "test"),
                               not config.no_progress, split_paths_of(config))
    return data.test.x, data.val.x, (data.val.x, data.val.y), (data.test.x, data.test.y)


def bundle_compressed_nets(manifest: Manifest, paths: BundlePaths, net: torch.nn.Module,
                           samples: np.ndarray) -> list:
    """export.py on a bundle train.py compressed (--prune, --qat): its variants rebuilt from
    their weights and recorded shapes (checked against the manifest train.py wrote, before any
    export rewrites it); [] for a bundle without."""
    if not manifest.compression or not manifest.compression.variants:
        return []
    from ttc.compress.variants import example_input, load_compressed

    return load_compressed(manifest, paths, net, example_input(samples, manifest.input.pad_id
                                                               or 0))


def require_tta_graph_applies(config: Config, manifest: Manifest) -> None:
    """export.py --tta writes a segmenter's or a detector's TTA graph; a classifier's TTA is
    built at inference."""
    if not (config.tta or config.tta_transforms):
        return
    kind = manifest.preprocessing.kind
    if not (task_of_kind(kind).dense or kind == "detection"):
        from utils import ConfigError

        raise ConfigError(f"export.py --tta writes an image_segmenter's or an "
                          f"object_detector's TTA graph, and this bundle is an "
                          f"{manifest.model_type}", "drop --tta here: inference.py "
                          "--tta true runs a classifier's TTA")
    config.validate_tta(manifest.model_type)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "export", "Export the weights train.py wrote to ONNX, slim, check and validate them "
        "against PyTorch on held-out data, and complete the bundle.",
        required=["output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits --output_model "
               "runs/digits/model.onnx\n  python export.py --output_model runs/digits/model.onnx")
    config = start_cli(parser, argv)
    import torch

    from ttc.nets.models import load_weights

    quiet_library_loggers()
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)

    def stages(report: dict) -> None:
        paths = BundlePaths.from_model_path(config.output_model)
        manifest = read_manifest(paths)
        require_trusted_model_code(manifest, paths, config.trust_model_code)  # before any work
        require_tta_graph_applies(config, manifest)
        bundle_data_options(manifest, config.dataset_path,  # the data is named: before any work
                            split_paths=split_paths_of(config))
        net = load_weights(manifest, paths.weights, config.trust_model_code)
        held_out, fallback, val, test = load_held_out(config, manifest)
        compressed = bundle_compressed_nets(manifest, paths, net,
                                            check_samples(held_out, fallback, manifest.input))
        result = export_bundle(config, net, manifest, held_out, fallback, paths, val=val)
        report["export"] = result.report_section()
        if compressed:
            from quantize import judge_compressed

            export_compressed(config, compressed, paths, held_out, fallback)
            report["compression"] = judge_compressed(config, paths, val, test)

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
