"""A segmenter's inference stage (its Parts.test_split and Parts.new_input, which
ttc/online/evaluate.py and ttc/online/predict.py hand the opened bundle to): the test split's
masks scored over pixels, with --tta (the bundle's model.tta.onnx) and --ttt (bn and Tent
through model.bn.onnx) beside; and --input's mask files, in this process or on Ray workers.

Light at import (numpy): each stage loads its modules (onnx, Ray, PyTorch for Tent) when it runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ttc.serving.bundle import require_onnx_in_bundle
from ttc.serving.runtime import create_session
from utils import LOG

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.bundle import BundlePaths
    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions
    from ttc.serving.stages import InputRun, SplitRun
    from ttc.tasks.segment.predict import SegmentBatchOptions
    from ttc.testtime.ttt import TTTSettings


def evaluate_dense(run: SplitRun) -> None:
    """A segmenter's inference stage: the test split's masks in ONNX Runtime, scored over
    pixels (mean IoU and the rest: evaluate.py), and its latency."""
    from ttc.tasks.segment.evaluate import run_test_split

    options, manifest, test, report = run.options, run.manifest, run.test, run.report
    ignore_index = manifest.preprocessing.spec["ignore_index"]
    result, report["evaluation"], masks = run_test_split(
        run.session, str(run.model_path), *test, manifest.labels, ignore_index,
        manifest.dataset.train_class_counts, options.batch_size)
    LOG.info("inference on %s: pixel accuracy %.4f, mean IoU %.4f, p50 %.3f ms/batch of %d, "
             "%.0f images/s", ", ".join(result.providers_active), result.pixel_accuracy,
             result.mean_iou, result.latency_ms_p50, options.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if not (options.tta or options.ttt):
        return
    session = run.session
    if Path(run.model_path) != run.paths.onnx:
        # TTA's and bn's graphs are fp32: they are compared with the fp32 graph
        session = create_session(str(require_onnx_in_bundle(run.paths, manifest)),
                                 options.runtime(), classes=manifest.classes)
        masks = None
    if options.tta:
        report["tta"] = dense_tta(run.paths, manifest, session, test, masks,
                                  options.tta_transforms, options.runtime(), options.batch_size)
    if options.ttt:
        report["ttt"] = dense_ttt(run.paths, manifest, session, test,
                                  options.ttt_settings(manifest.preprocessing.kind),
                                  options.runtime())


def dense_ttt(paths: BundlePaths, manifest: Manifest, session: ort.InferenceSession,
              test: tuple[np.ndarray, np.ndarray], ttt: TTTSettings,
              runtime: RuntimeOptions) -> dict:
    """--ttt for a segmenter: bn and/or tent through the bundle's adaptation graph
    (model.bn.onnx), against `session` (the fp32 graph), on the test split and on each
    --eval_shift corruption of it (adapt.py)."""
    import onnx

    from ttc.tasks.segment.adapt import adapted_runner, dense_ttt_section, tent_runner
    from ttc.tasks.segment.evaluate import mask_runner
    from ttc.testtime.ttt import AdaptationGraph, Tent

    path = require_onnx_in_bundle(paths, manifest, "bn")
    graph = AdaptationGraph(onnx.load(str(path)), lambda model: create_session(
        model, runtime, classes=manifest.classes, source=path))
    methods = ttt.methods
    adapted = {}
    if "bn" in methods:
        adapted["bn"] = adapted_runner(graph, ttt.bn_prior)
    if "tent" in methods:
        tent = Tent(manifest, paths.weights, graph.layers, ttt.learning_rate, ttt.iterations,
                    ttt.num_threads, ttt.trust_model_code, filter_unreliable=ttt.guard == "filter")
        adapted["tent"] = tent_runner(graph, tent, ttt.predict == "before")
    settings = {"method": ttt.method, "bn_prior": ttt.bn_prior, "iterations": ttt.iterations,
                "learning_rate": ttt.learning_rate,
                "guard": ttt.guard if "tent" in methods else None,
                "predict": ttt.predict if "tent" in methods else None}
    section = dense_ttt_section(mask_runner(session), adapted, *test, manifest.labels,
                                manifest.preprocessing.spec, ttt.batch_size, ttt.shifts,
                                ttt.severity, ttt.seed, settings)
    if "tent" in methods:  # EATA's filter: pixels, not batches, are left out
        section.update(resets={"tent": 0}, skipped={"tent": 0}, filtered_pixels=tent.filtered)
    LOG.info("test-time training: %s", section["verdict"])
    return section


def dense_tta(paths: BundlePaths, manifest: Manifest, session: ort.InferenceSession,
              test: tuple[np.ndarray, np.ndarray], masks: np.ndarray | None, transforms: str,
              runtime: RuntimeOptions, batch_size: int) -> dict:
    """--tta for a segmenter: the bundle's TTA graph (model.tta.onnx, its views fixed at
    export) against model.onnx (`session`, whose test masks are `masks` when known);
    `transforms`: --tta_transforms, which a view different from the graph's only warns of."""
    from ttc.tasks.segment.evaluate import mask_runner, predict_masks as masks_of, tta_section
    from ttc.tasks.segment.views import parse_view_specs, views_text

    graph = manifest.extra_graphs.tta
    tta_path = require_onnx_in_bundle(paths, manifest, "tta")
    asked = views_text(parse_view_specs(transforms))
    if transforms and graph is not None and asked != graph.views:
        LOG.warning("the bundle's TTA graph has the views %s (fixed at export); --tta_transforms "
                    "%s is not used (re-export with them to change the views)", graph.views,
                    transforms)
    merged = create_session(str(tta_path), runtime, classes=manifest.classes)
    if masks is None:
        masks = masks_of(mask_runner(session), test[0], batch_size)
    section = tta_section(mask_runner(session), mask_runner(merged),
                          graph.views if graph else "", *test, masks, manifest.labels,
                          manifest.preprocessing.spec["ignore_index"], batch_size)
    LOG.info("%s", section["verdict"])
    return section


def predict_masks(run: InputRun) -> None:
    """A segmenter's --input: one mask PNG per image (and an overlay with --overlay true), and
    the summary table at --output (predict.py); on Ray workers with --engine ray."""
    from ttc.tasks.segment.evaluate import mask_runner
    from ttc.tasks.segment.predict import SegmentBatchOptions, predict_images

    options = run.options
    batch = SegmentBatchOptions(
        input=Path(options.input), output=Path(options.output), mask_dir=options.mask_dir,
        overlay=options.overlay, batch_size=options.batch_size, errors=options.errors,
        allow_errors=options.allow_errors, show_progress=not options.no_progress)
    if options.engine == "ray":
        predict_masks_with_ray(run, batch)
        return
    manifest, session, _ = run.open()
    predict_images(batch, manifest.preprocessing.spec, list(manifest.labels),
                   mask_runner(session), run.report)


def predict_masks_with_ray(run: InputRun, options: SegmentBatchOptions) -> None:
    """A segmenter's --engine ray (cluster.py): chunks of --worker_batch_size images (default
    --batch_size; rounded up to whole --batch_size batches), segmented by workers that write
    the masks themselves."""
    from ttc.tasks.segment.cluster import predict_images_on_ray

    workers = run.ray_workers()
    predict_images_on_ray(options, workers.manifest.preprocessing.spec,
                          list(workers.manifest.labels), workers.runner_factory, run.report,
                          workers.options)
