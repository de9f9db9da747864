"""A regressor's exporter (its Parts.exporter): the network traced with its one output,
`prediction` ((batch,) float32 in the target's units: the standardisation is undone inside the
graph), slimmed, checked by onnx, and compared with PyTorch on held-out rows at batch 1 and a
larger batch. The difference is measured in the target's standard deviations (a target in the
thousands would make any absolute tolerance meaningless) and bounded by --validate_atol.
Beside it, where the network has them, the graphs the test-time methods run (testtime.py): the
MC-dropout graph (model.mc.onnx, Dropout in training mode) and the BatchNorm adaptation graph
(model.bn.onnx, BatchNorm nodes kept), both from one more unoptimised export, each checked
against model.onnx."""
from __future__ import annotations

import numpy as np
import torch

from ttc.convert.checking import NumericCheck
from ttc.convert.tracing import check_graph, export_graph, slim_graph
from ttc.convert.writing import ExportJob, ExportResult, ExtraGraph, write_bundle
from ttc.serving.runtime import (RuntimeOptions, batches_of, create_session, graph_padding_id,
                                 session_runner)
from utils import LOG, ExportError

MAX_CHECK_ROWS = 64


class PredictionGraph(torch.nn.Module):
    """What is traced: the inputs in, the prediction in the target's units out."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class HFPredictionGraph(torch.nn.Module):
    """What is traced for an hf network: its graph inputs (input_ids, attention_mask and, where
    the model reads them, token_type_ids) in, the prediction out."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.net.graph_prediction(input_ids, attention_mask, token_type_ids)


def prediction_graph(net: torch.nn.Module) -> torch.nn.Module:
    return HFPredictionGraph(net) if hasattr(net, "graph_prediction") else PredictionGraph(net)


def compare_predictions(session, net: torch.nn.Module, samples: np.ndarray, atol: float,
                        batch_size: int, std: float) -> NumericCheck:
    """ONNX Runtime against PyTorch on `samples` at batch 1 and `batch_size`: the largest
    difference in target standard deviations; ExportError (exit 4) beyond `atol` or on a
    non-finite prediction."""
    rows = samples[:MAX_CHECK_ROWS]
    pad = graph_padding_id(session)
    predict = session_runner(session, "prediction")
    with torch.no_grad():
        expected = np.concatenate([net(torch.from_numpy(b)).numpy()
                                   for b in batches_of(rows, batch_size, pad)])
    sizes = sorted({1, max(2, min(len(rows), batch_size))})
    worst = 0.0
    for size in sizes:
        got = np.concatenate([predict(b) for b in batches_of(rows, size, pad)])
        if got.shape != expected.shape or not np.isfinite(got).all():
            raise ExportError(f"the graph's prediction is {got.shape} or not finite on held-out "
                              "rows; the bundle was not written",
                              "retrain with a lower --learning_rate (e.g. 1e-3)")
        worst = max(worst, float(np.abs(got - expected).max()) / std)
    if not worst <= atol:
        raise ExportError(f"numeric check failed: max |onnx - torch| = {worst:.3g} target "
                          f"standard deviations > --validate_atol {atol:g}; the bundle was not "
                          "written", "raise --validate_atol if this difference is acceptable",
                          raise_flags=("validate_atol",))
    # no top-1 agreement for a number: the report shows the largest difference instead
    return NumericCheck(worst, None, len(rows), sizes, ["held_out"])  # type: ignore[arg-type]


def export_regression_bundle(job: ExportJob) -> ExportResult:
    """A regressor's bundle: model.onnx with `prediction`, checked against PyTorch."""
    options, net, manifest, samples = job.options, job.net, job.manifest, job.samples
    std = float(manifest.preprocessing.spec["target"]["std"])
    exported = export_graph(net, samples[:2], options.opset, manifest.input,
                            manifest.output_names, wrapper=prediction_graph(net))
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    session = create_session(slimmed.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    check = compare_predictions(session, net, samples, options.validate_atol, options.batch_size,
                                std)
    LOG.info("export ok: %d → %d nodes after onnxslim, max |onnx - torch| %.2g target standard "
             "deviations", len(exported.graph.node), len(slimmed.graph.node), check.max_abs_diff)
    result = job.result(exported, slimmed, check, {
        "max_abs_diff_units": "target standard deviations",
        "max_abs_diff_target_units": check.max_abs_diff * std})
    extras = test_time_graphs(net, samples, options, manifest, slimmed, std)
    if job.members:
        extras["ensemble"] = ensemble_graph([net, *job.members], samples, options, manifest, std)
    write_bundle(slimmed, net, result, extras)
    return result


def ensemble_graph(nets, samples: np.ndarray, options, manifest, std: float) -> ExtraGraph:
    """Every member exported and slimmed like model.onnx, merged into one graph (ensemble.py);
    its mean checked against the PyTorch members' mean (ExportError beyond --validate_atol)."""
    from ttc.convert.checking import export_example
    from ttc.tasks.regress.ensemble import merged_members

    spec, outputs = manifest.input, manifest.output_names
    graph = merged_members([slim_graph(export_graph(
        member.eval(), export_example(samples, spec), options.opset, spec, outputs,
        wrapper=prediction_graph(member))) for member in nets])
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    rows = samples[:MAX_CHECK_ROWS]
    with torch.no_grad():
        expected = np.mean([member(torch.from_numpy(rows)).numpy() for member in nets], axis=0)
    worst = float(np.abs(session_runner(session, "prediction")(rows) - expected).max()) / std
    if not worst <= options.validate_atol:
        raise ExportError(f"the ensemble graph differs from its PyTorch members' mean by "
                          f"{worst:.3g} target standard deviations > --validate_atol "
                          f"{options.validate_atol:g}; the bundle was not written",
                          "raise --validate_atol if this difference is acceptable")
    LOG.info("ensemble graph: %d members, max |onnx - torch| %.2g target standard deviations",
             len(nets), worst)
    return ExtraGraph(graph, {"purpose": "the mean of several regressors trained with "
                              "different seeds on the same split, in one graph; "
                              "member_predictions: each member's",
                              "members": len(nets),
                              "seeds": [options.seed + k for k in range(len(nets))],
                              "max_abs_diff": worst})


def test_time_graphs(net: torch.nn.Module, samples: np.ndarray, options, manifest,
                     deployable, std: float) -> dict[str, ExtraGraph]:
    """{"mc": the graph with Dropout in training mode, "bn": the graph with BatchNorm nodes}
    where the network has them (as the classifiers' trace_graphs makes them), each equal to the
    deployable graph under ONNX Runtime's default optimisations (which drop Dropout)."""
    from ttc.convert.graphs import optimised, without_dropout
    from ttc.convert.tracing import dropout_layers, fold_constants, sampling_copy
    from ttc.serving.bundle import mark_padding_id

    batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    dropouts = dropout_layers(net)
    if not batchnorm and not dropouts:
        return {}
    spec, outputs = manifest.input, manifest.output_names
    sampling = sampling_copy(net) if dropouts else net
    raw = export_graph(sampling, samples[:2], options.opset, spec, outputs, optimize=False,
                       keep_modes=bool(dropouts), wrapper=prediction_graph(sampling))
    extras: dict[str, ExtraGraph] = {}
    if dropouts:
        mc = mark_padding_id(optimised(raw), spec)
        extras["mc"] = ExtraGraph(mc, {
            "purpose": "MC-dropout: Dropout nodes in training mode, not slimmed; run with "
                       "EliminateDropout disabled",
            "dropout_layers": sum(n.op_type == "Dropout" for n in mc.graph.node),
            "rates": [m.p for m in dropouts],
            "max_abs_diff": _graph_diff(mc, deployable, samples, options, std)})
    if batchnorm:
        plain = without_dropout(raw) if dropouts else raw
        if plain is None:
            plain = export_graph(net, samples[:2], options.opset, spec, outputs, optimize=False,
                                 wrapper=prediction_graph(net))
        adaptation = fold_constants(plain)
        extras["bn"] = ExtraGraph(adaptation, {
            "purpose": "test-time training: BatchNorm nodes kept (unoptimised export, "
                       "constant-folded, not slimmed)",
            "batchnorm_layers": sum(n.op_type == "BatchNormalization"
                                    for n in adaptation.graph.node),
            "max_abs_diff": _graph_diff(adaptation, deployable, samples, options, std)})
    return extras


def _graph_diff(graph, deployable, samples: np.ndarray, options, std: float) -> float:
    """The largest |graph − deployable| prediction on the check's rows, in target standard
    deviations; ExportError (exit 4) beyond --validate_atol."""
    runtime = RuntimeOptions(intra_op_threads=options.num_threads)
    rows = samples[:MAX_CHECK_ROWS]
    got, expected = (session_runner(create_session(m.SerializeToString(), runtime),
                                    "prediction")(rows) for m in (graph, deployable))
    worst = float(np.abs(got - expected).max()) / std
    if not worst <= options.validate_atol:
        raise ExportError(f"a test-time graph differs from model.onnx by {worst:.3g} target "
                          f"standard deviations > --validate_atol {options.validate_atol:g}; "
                          "the bundle was not written", "report it; export with --log_level DEBUG")
    return worst
