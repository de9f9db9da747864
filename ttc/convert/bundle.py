"""The export stage: a trained network to a checked bundle. export_bundle prepares what every
model type's exporter is given (ExportJob) and hands it to the type's Parts.exporter; the
classifiers' exporter (export_classifier_bundle) is here, a segmenter's and a detector's live
in their folders (ttc/tasks/TYPE/export.py). export_saved_bundle is export.py's run on a bundle
train.py wrote. Both take export's options (ttc/options/stages.py: ExportOptions), not the
whole Config."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ttc.convert.checking import (check_samples, compare_with_torch, export_example,
                                  validation_tolerance)
from ttc.convert.compressed import bundle_compressed_nets
from ttc.convert.extras import (averaging_data, export_adaptation_graph, export_ensemble_graph,
                                export_mc_dropout_graph, fused_hf_graph)
from ttc.convert.tracing import check_graph, slim_graph, trace_graphs
from ttc.convert.writing import ExportJob, ExportResult, ExtraGraph, write_bundle
from ttc.inputs.data import bundle_data_options, load_bundle_dataset, split_paths_of
from ttc.options.stages import ExportOptions
from ttc.serving.bundle import (BundlePaths, Manifest, as_manifest, read_manifest,
                                require_trusted_model_code)
from ttc.tasks.registry import TASKS, task_of_kind
from utils import LOG, ConfigError

if TYPE_CHECKING:  # torch loads only once flags are parsed: --help stays instant
    import torch


def export_bundle(options: ExportOptions, net: torch.nn.Module, manifest: Manifest | dict,
                  held_out: np.ndarray,
                  train_samples: np.ndarray, paths: BundlePaths,
                  members: Sequence[torch.nn.Module] = (),
                  val: tuple[np.ndarray, np.ndarray] | None = None) -> ExportResult:
    """Export → slim → check → validate; only a model that passes every step is written. Every
    graph bakes the manifest's temperature in; the MC-dropout and ensemble graphs' averages get
    their own, fitted on `val` (the calibration slice; the validation split for a bundle whose
    temperature was fitted there: extras.averaging_data) when the manifest's is. `manifest`:
    training's draft (a JSON dict, filled in place) or a bundle's (typed: its JSON is copied).
    The manifest's model type exports (its Parts.exporter). `options.validate_atol` is set to
    the tolerance resolved for the manifest's network (the result's `atol`)."""
    started = time.perf_counter()
    draft = manifest.to_json_dict() if isinstance(manifest, Manifest) else manifest
    manifest = as_manifest(manifest)
    options.validate_atol = validation_tolerance(options, manifest)
    samples = check_samples(held_out, train_samples, manifest.input)
    job = ExportJob(options, net.eval(), manifest, draft, samples, paths, started, members, val)
    return task_of_kind(manifest.preprocessing.kind).part("exporter")(job)


def export_classifier_bundle(job: ExportJob) -> ExportResult:
    """A classifier's bundle: model.onnx (logits and probabilities; an hf network's fused by ONNX
    Runtime where that passes), and beside it the adaptation graph (BatchNorm), the MC-dropout
    graph (dropout) and the ensemble graph (members), each checked against it."""
    options, net, manifest, samples = job.options, job.net, job.manifest, job.samples
    spec, temperature = manifest.input, manifest.temperature
    traced = trace_graphs(net, export_example(samples, spec), options.opset, spec,
                          list(manifest.output_names), temperature)
    exported = traced.deployable
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    check = compare_with_torch(slimmed, net, samples, spec, options.validate_atol,
                               options.batch_size, options.num_threads, temperature)
    LOG.info("export ok: %d → %d nodes after onnxslim, max |onnx - torch| %.2g, top-1 agreement "
             "%.1f%%", len(exported.graph.node), len(slimmed.graph.node), check.max_abs_diff,
             100 * check.top1_agreement)
    result = job.result(exported, slimmed, check)
    fused = fused_hf_graph(net, samples, options, manifest)
    if fused is not None:  # the deployable graph from here on: extras are checked against it
        slimmed, result.check, result.fusion = fused
        result.size_bytes = slimmed.ByteSize()
        result.seconds = round(time.perf_counter() - job.started, 3)
    extras: dict[str, ExtraGraph] = {}
    adaptation = export_adaptation_graph(net, traced.adaptation, samples, slimmed, options,
                                         manifest)
    if adaptation is not None:
        extras["bn"] = adaptation
    mc = export_mc_dropout_graph(net, traced.sampling, samples, slimmed, options, manifest,
                                 job.val)
    if mc is not None:
        extras["mc"] = mc
    if job.members:
        extras["ensemble"] = export_ensemble_graph([net, *job.members], samples, options,
                                                   manifest, job.val)
    record_shift_reference(result.draft, slimmed, job.val, options, manifest)
    write_bundle(slimmed, net, result, extras)
    return result


def record_shift_reference(draft: dict, model, val: tuple[np.ndarray, np.ndarray] | None,
                           options: ExportOptions, manifest: Manifest) -> None:
    """The shift score's reference (ttc/testtime/shift_score.py) in the manifest: the
    deployable graph's predictions on the held-out split its temperature is fitted on (none
    without one)."""
    from ttc.serving.runtime import RuntimeOptions, batches_of, create_session, session_runner
    from ttc.testtime.shift_score import MIN_REFERENCE, reference_record

    if val is None or len(val[0]) < MIN_REFERENCE:  # too few to say what clean looks like
        return
    run = session_runner(create_session(model.SerializeToString(),
                                        RuntimeOptions(intra_op_threads=options.num_threads)))
    probabilities = np.concatenate([run(b) for b in batches_of(val[0], options.batch_size,
                                                               manifest.input.pad_id)])
    draft["shift_reference"] = reference_record(probabilities)


def require_tta_graph_applies(options: ExportOptions, manifest: Manifest,
                              check_flags: Callable[[str], None]) -> None:
    """export.py --tta writes the TTA graph of a model type that has one in its bundle
    (Task.tta_graph); a classifier's TTA is built at inference. `check_flags(model_type)`
    checks the flags against the bundle's model type (the CLI's Config.validate_tta)."""
    if not (options.tta or options.tta_transforms):
        return
    if not task_of_kind(manifest.preprocessing.kind).tta_graph:
        having = " or ".join(f"an {task.name}'s" for task in TASKS if task.tta_graph)
        raise ConfigError(f"export.py --tta writes {having} TTA graph, and this bundle is an "
                          f"{manifest.model_type}", "drop --tta here: inference.py "
                          "--tta true runs a classifier's TTA")
    check_flags(manifest.model_type)


def load_held_out(options: ExportOptions, manifest: Manifest
                  ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray],
                             tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """For a bundle on disk, decoded as at training time: the test split's inputs (the numeric
    check), the validation split's inputs (its fallback), the validation split (the compression
    gate), the test split (the gate's report) and the data the averaged graphs' temperatures
    are fitted on (averaging_data: where the network's was)."""
    data = load_bundle_dataset(manifest, options.dataset_path, ("val", "test", "calibration"),
                               not options.no_progress, split_paths_of(options))
    return (data.test.x, data.val.x, (data.val.x, data.val.y), (data.test.x, data.test.y),
            averaging_data(manifest, data))


@dataclass
class SavedExport:
    """export_saved_bundle's result: the export, and what the compressed variants' export and
    gate read (the variants rebuilt from the bundle, [] for a bundle without)."""

    result: ExportResult
    paths: BundlePaths
    compressed: list
    held_out: np.ndarray
    fallback: np.ndarray
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]


def export_saved_bundle(options: ExportOptions, check_flags: Callable[[str], None]
                        ) -> SavedExport:
    """export.py's run on the bundle at --output_model: its manifest and weights read and
    checked (`check_flags`: require_tta_graph_applies), its data loaded as at training time,
    its network exported (export_bundle) and its compressed variants rebuilt (written by the
    caller: compressed.export_compressed)."""
    from ttc.nets.models import load_weights

    paths = BundlePaths.from_model_path(options.output_model)
    manifest = read_manifest(paths)
    require_trusted_model_code(manifest, paths, options.trust_model_code)  # before any work
    require_tta_graph_applies(options, manifest, check_flags)
    bundle_data_options(manifest, options.dataset_path,  # the data is named: before any work
                        split_paths=split_paths_of(options))
    net = load_weights(manifest, paths.weights, options.trust_model_code)
    held_out, fallback, val, test, fitting = load_held_out(options, manifest)
    compressed = bundle_compressed_nets(manifest, paths, net,
                                        check_samples(held_out, fallback, manifest.input))
    result = export_bundle(options, net, manifest, held_out, fallback, paths, val=fitting)
    return SavedExport(result, paths, compressed, held_out, fallback, val, test)
