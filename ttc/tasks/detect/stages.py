"""A detector's inference stage (its Parts.test_split and Parts.new_input, which
ttc/online/evaluate.py and ttc/online/predict.py hand the opened bundle to): the test split's
detections (NMS in the graph) scored with COCO's metrics, with --tta (the bundle's
model.tta.onnx against exact WBF of the same views) and --ttt (bn through model.bn.onnx)
beside; and --input's boxes, in this process or on Ray workers.

Light at import (numpy): each stage loads its modules (onnx, Ray) when it runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ttc.serving.bundle import require_onnx_in_bundle
from ttc.serving.runtime import create_session
from utils import LOG

if TYPE_CHECKING:
    from ttc.serving.bundle import BundlePaths
    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions
    from ttc.serving.stages import InputRun, SplitRun
    from ttc.tasks.detect.predict import DetectBatchOptions
    from ttc.testtime.ttt import TTTSettings


def evaluate_detector(run: SplitRun) -> None:
    """A detector's inference stage: the test split's detections in ONNX Runtime (NMS in the
    graph), scored with COCO's metrics (evaluate.py), and its latency."""
    from ttc.tasks.detect.evaluate import run_test_split

    options, manifest, report = run.options, run.manifest, run.report
    result, report["evaluation"], found = run_test_split(
        run.session, str(run.model_path), *run.test, manifest.labels,
        manifest.dataset.train_class_counts, options.batch_size)
    LOG.info("inference on %s: mAP@[.5:.95] %.4f, mAP@.5 %.4f, p50 %.3f ms/batch of %d, "
             "%.0f images/s", ", ".join(result.providers_active), result.map, result.map50,
             result.latency_ms_p50, options.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if options.tta:
        plain_model = Path(run.model_path) == run.paths.onnx
        report["tta"] = detector_tta(run.paths, manifest, run.test, found if plain_model else None,
                                     options.tta_transforms, options.runtime(), options.batch_size)
    if options.ttt:
        report["ttt"] = detector_ttt(run.paths, manifest, run.test,
                                     options.ttt_settings(manifest.preprocessing.kind),
                                     options.runtime())


def detector_tta(paths: BundlePaths, manifest: Manifest, test: tuple[np.ndarray, Sequence],
                 found: list | None, transforms: str, runtime: RuntimeOptions,
                 batch_size: int) -> dict:
    """--tta for a detector: the bundle's TTA graph (model.tta.onnx, its views and box fusion
    fixed at export) against model.onnx (whose test detections are `found` when known), with
    exact WBF of the same views' detections beside (evaluate.py); `transforms`:
    --tta_transforms, which views different from the graph's only warn of."""
    import onnx

    from ttc.tasks.detect.evaluate import detection_runner, tta_section
    from ttc.tasks.detect.flags import detector_views
    from ttc.tasks.detect.fusion import graph_settings, inner_runner, with_inner_outputs

    graph = manifest.extra_graphs.tta
    tta_path = require_onnx_in_bundle(paths, manifest, "tta")
    if transforms and graph is not None and detector_views(transforms) != graph.views:
        LOG.warning("the bundle's TTA graph has the views %s (fixed at export); --tta_transforms "
                    "%s is not used (re-export with them to change the views)", graph.views,
                    transforms)
    model = onnx.load(str(tta_path))
    settings = graph_settings(model)
    plain = create_session(str(require_onnx_in_bundle(paths, manifest)), runtime)
    merged = create_session(str(tta_path), runtime)
    inner = create_session(with_inner_outputs(model).SerializeToString(), runtime,
                           source=tta_path)
    section = tta_section(detection_runner(plain), detection_runner(merged),
                          inner_runner(inner, settings), graph.views if graph else "", *test,
                          manifest.labels, batch_size, settings.record(), found)
    LOG.info("%s", section["verdict"])
    return section


def detector_ttt(paths: BundlePaths, manifest: Manifest, test: tuple[np.ndarray, Sequence],
                 ttt: TTTSettings, runtime: RuntimeOptions) -> dict:
    """--ttt for a detector: bn through the bundle's adaptation graph (model.bn.onnx, its fp32
    candidates and the same NMS), against model.onnx, on the test split and on each
    --eval_shift corruption of it (adapt.py)."""
    import onnx

    from ttc.tasks.detect.adapt import adaptation_graph, adapted_runner, detection_ttt_section
    from ttc.tasks.detect.evaluate import detection_runner

    path = require_onnx_in_bundle(paths, manifest, "bn")
    graph = adaptation_graph(onnx.load(str(path)), lambda model: create_session(
        model, runtime, source=path))
    source = create_session(str(require_onnx_in_bundle(paths, manifest)), runtime)
    section = detection_ttt_section(
        detection_runner(source), {"bn": adapted_runner(graph, ttt.bn_prior)}, *test,
        manifest.labels, manifest.preprocessing.spec, ttt.batch_size, ttt.shifts, ttt.severity,
        ttt.seed, {"method": "bn", "bn_prior": ttt.bn_prior})
    LOG.info("test-time training: %s", section["verdict"])
    return section


def predict_detections(run: InputRun) -> None:
    """An object detector's --input: one row per box (or a COCO results JSON) at --output, and
    each image with its boxes drawn with --overlay true (predict.py); on Ray workers with
    --engine ray."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.predict import DetectBatchOptions, predict_detections_input

    options = run.options
    batch = DetectBatchOptions(
        input=Path(options.input), output=Path(options.output), output_format=options.output_format,
        min_score=options.min_score, overlay=options.overlay, batch_size=options.batch_size,
        errors=options.errors, allow_errors=options.allow_errors,
        show_progress=not options.no_progress)
    if options.engine == "ray":
        predict_detections_with_ray(run, batch)
        return
    manifest, session, _ = run.open()
    predict_detections_input(batch, manifest.preprocessing.spec, list(manifest.labels),
                             detection_runner(session), run.report)


def predict_detections_with_ray(run: InputRun, options: DetectBatchOptions) -> None:
    """A detector's --engine ray (cluster.py): chunks of --worker_batch_size images (default
    --batch_size; rounded up to whole --batch_size batches), detected by workers that write the
    overlays themselves."""
    from ttc.tasks.detect.cluster import predict_detections_on_ray

    workers = run.ray_workers()
    predict_detections_on_ray(options, workers.manifest.preprocessing.spec,
                              list(workers.manifest.labels), workers.runner_factory, run.report,
                              workers.options)
