"""A classifier's graphs besides model.onnx, each checked against it: the BatchNorm adaptation
graph (test-time training), the MC-dropout graph, the ensemble graph, and an hf network's graph
with ONNX Runtime's transformer fusion (which replaces model.onnx when it passes)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx

from ttc.convert.checking import (NumericCheck, _require_close, compare_with_torch,
                                  export_example, padding_id, validation_probes)
from ttc.convert.tracing import (check_graph, dropout_layers, export_graph, graph_inputs,
                                 sampling_copy, slim_graph)
from ttc.convert.writing import ExtraGraph
from ttc.inputs.preprocess import trim_padding
from ttc.options.stages import ExportOptions
from ttc.serving.bundle import InputSpec, Manifest, mark_padding_id
from ttc.serving.runtime import RuntimeOptions, create_session, session_feeder
from ttc.testtime.calibrate import calibrate_scores, log_scores, rescale, softmax
from utils import LOG, ExportError, first_line

if TYPE_CHECKING:  # torch loads only when a graph is exported
    import torch


def fused_hf_graph(net: torch.nn.Module, samples: np.ndarray, options: ExportOptions,
                   manifest: Manifest) -> tuple[onnx.ModelProto, NumericCheck, dict] | None:
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
        model = fused_graph(net, feed, output_names, options.opset, temperature)
        if model is None:
            return None
        model = mark_padding_id(model, spec)
        check_graph(model)
        check = compare_with_torch(model, net, samples, spec, options.validate_atol,
                                   options.batch_size, options.num_threads, temperature)
    except Exception as err:  # noqa: BLE001 - an optimisation: the unfused graph serves
        LOG.warning("the fused transformer graph was not used: %s", first_line(err, 300))
        return None
    fused = {op: sum(n.op_type == op for n in model.graph.node) for op in FUSED_OPS}
    LOG.info("transformer fusion: %s; %d nodes, max |onnx - torch| %.2g", fused,
             len(model.graph.node), check.max_abs_diff)
    return model, check, {"exporter": "torch.onnx.export (TorchScript, eager attention) + "
                          "onnxruntime.transformers optimize_model (bert)", "fused": fused,
                          "nodes": len(model.graph.node)}


def _max_diff_to(graph: onnx.ModelProto, reference: onnx.ModelProto, samples: np.ndarray,
                 options: ExportOptions, manifest: Manifest, **session_args: object) -> float:
    runtime = RuntimeOptions(intra_op_threads=options.num_threads)
    probe = validation_probes(samples, manifest.input)["held_out"]
    sessions = [create_session(m.SerializeToString(), runtime) for m in (graph, reference)]
    got, expected = (s.run(["probabilities"], session_feeder(s)(probe))[0] for s in sessions)
    return float(np.abs(got - expected).max())


def export_adaptation_graph(net: torch.nn.Module, graph: onnx.ModelProto | None,
                            samples: np.ndarray, slimmed: onnx.ModelProto, options: ExportOptions,
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
    diff = _max_diff_to(graph, slimmed, samples, options, manifest)
    _require_close(diff, "BatchNorm adaptation graph", options)
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
                            samples: np.ndarray, slimmed: onnx.ModelProto, options: ExportOptions,
                            manifest: Manifest, val: tuple[np.ndarray, np.ndarray] | None = None
                            ) -> ExtraGraph | None:
    """The graph MC-dropout samples (`graph`, trace_graphs' sampling graph): the network with
    its Dropout layers in training mode, optimised but not slimmed (onnxslim drops Dropout).
    With ONNX Runtime's default optimisations (EliminateDropout) it must equal the deployable
    graph: that checks the rest of it. Its passes are averaged from their logits, and the
    average gets its own temperature (fitted on `val`, the calibration slice, with --iterations
    passes: averaging_data). None without dropout."""
    if graph is None:
        return None
    dropouts = dropout_layers(net)
    check_graph(graph)
    layers = sum(n.op_type == "Dropout" for n in graph.graph.node)  # a module used twice: 2
    if layers == 0:
        raise ExportError(f"the MC-dropout graph lost its {len(dropouts)} dropout layers",
                          "report it; export with --log_level DEBUG")
    diff = _max_diff_to(graph, slimmed, samples, options, manifest)
    _require_close(diff, "MC-dropout graph (dropout off)", options)
    info = {"purpose": "MC-dropout: Dropout nodes in training mode, not slimmed; run with "
            "EliminateDropout disabled", "dropout_layers": layers, "rates": [m.p for m in dropouts]}
    if calibrating(manifest, val):
        sampling = sampling_copy(net)
        passes = [softmax(network_logits(sampling, val[0], manifest.input,
                                            seed=options.seed + k))
                  for k in range(options.iterations)]
        info.update(averaged_temperature("MC-dropout", np.mean(passes, axis=0), val[1],
                                         manifest, passes=options.iterations))
    return ExtraGraph(graph, info)


def calibrating(manifest: Manifest, val: tuple[np.ndarray, np.ndarray] | None) -> bool:
    """Whether averaged outputs get a temperature: the network's was fitted, and there is data
    to fit theirs on (averaging_data)."""
    method = manifest.calibration.method if manifest.calibration else "none"
    return method != "none" and val is not None and len(val[1]) > 0


def averaging_data(manifest: Manifest, data) -> tuple[np.ndarray, np.ndarray]:
    """What the averaged graphs' temperatures are fitted on: where the network's was, the
    calibration slice (`data`: a Dataset loaded with it), or the validation split for a bundle
    whose temperature was fitted there (written before the slice existed)."""
    fitted_on = manifest.calibration.entry.get("fitted_on") if manifest.calibration else None
    split = data.val if fitted_on == "validation" else data.calibration
    return split.x, split.y


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
    fitted on the averaged probabilities of the data the network's temperature was fitted on
    (averaging_data) and decided by the network's rule (--calibrate). The manifest's entry: no
    `temperature` where it is not applied."""
    fitted_on = manifest.calibration.entry.get("fitted_on", "validation")
    fit = calibrate_scores(log_scores(mean), y, manifest.calibration.rule or "always",
                           fitted_on=fitted_on)
    LOG.info("calibration of the %s average: temperature %.4f (%s), %s NLL %.4f → %.4f; %s",
             what, fit.fitted, fit.method, fitted_on, fit.nll_before, fit.nll_after,
             "applied" if fit.applied else f"not applied: {fit.reason}")
    return {**({"temperature": fit.temperature} if fit.applied else {}),
            "temperature_fit": {**fit.manifest_entry(), **details}}


def export_ensemble_graph(nets: Sequence[torch.nn.Module], samples: np.ndarray,
                          options: ExportOptions, manifest: Manifest,
                          val: tuple[np.ndarray, np.ndarray] | None = None) -> ExtraGraph:
    """Every member exported and slimmed like model.onnx, merged into one graph that returns
    their mean (iterative.ensemble_model), rescaled by a temperature fitted on `val`; checked
    against the PyTorch members' mean, rescaled the same way."""
    from ttc.testtime.iterative import ensemble_model

    output_names = list(manifest.output_names)
    spec = manifest.input
    members = [slim_graph(export_graph(net.eval(), export_example(samples, spec), options.opset,
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
                             RuntimeOptions(intra_op_threads=options.num_threads))
    got = session.run(["probabilities"], session_feeder(session)(probe))[0]
    diff = float(np.abs(got - expected).max())
    _require_close(diff, "ensemble graph (against the PyTorch members' mean)", options)
    LOG.info("ensemble graph: %d members, max |onnx - torch| %.2g", len(nets), diff)
    return ExtraGraph(graph, {"purpose": "the mean of several models trained with different "
                              "seeds, in one graph", "members": len(nets),
                              "seeds": [options.seed + k for k in range(len(nets))],
                              "max_abs_diff": diff, **calibration})
