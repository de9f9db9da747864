"""Run a model bundle with ONNX Runtime: accuracy, latency and throughput on held-out data.

    python inference.py --model runs/sms/model.onnx --dataset_path sms.tsv

evaluates the test split of --dataset_path, split as at training (a bundle trained on a built-in
data set such as builtin:digits needs no --dataset_path; a path the bundle records is never
read), with test-time augmentation, test-time training or iterative inference when asked; with
--input it predicts new data (batch.py). This path imports neither torch nor dspy.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ttc.serving.bundle import BundlePaths, read_manifest, require_onnx_in_bundle
from config import Config, build_parser, start_cli
from ttc.reporting.evaluation import Tally, bundle_evaluation
from ttc.reporting.metrics import accuracy
from ttc.serving.profiling import PROFILED_RUNS, profile_runs, profile_section, profiled_batches
from report import run_with_report
from ttc.serving.runtime import (batches_of, create_session, graph_padding_id, predict_proba,
                     session_device, session_runner, time_runners, whole_batches)
from ttc.tasks.registry import task_of_kind
from ttc.testtime.calibration import (calibration_under_shift, joined, run_calibration,
                                      single_variants, without_temperature)
from ttc.online.predictor import (check_bundle, chunk_predictor, input_variant,
                                  load_bundle_session, served_graph, worker_predictor)
from ttc.testtime.registry import asked_methods
from ttc.testtime.served import Heldout
from utils import LOG, RuntimeFailure, exit_cli, run_cli

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import BatchOptions, Predictor
    from ttc.serving.cluster import RayOptions
    from ttc.serving.manifest import Manifest
    from ttc.tasks.detect.predict import DetectBatchOptions
    from ttc.tasks.segment.predict import SegmentBatchOptions


@dataclass
class Variant:
    """One way of running the model, for the benchmark table."""

    name: str
    provider: str
    size_bytes: int
    predict: Callable[[np.ndarray], np.ndarray]  # a batch → probabilities


BENCHMARK_RUNS = 40


def benchmark_variants(variants: Sequence[Variant], x: np.ndarray, y: np.ndarray,
                       batch_size: int, pad_id: int) -> list[dict]:
    """One row per variant: size, accuracy, p50/p95 latency at batch 1, throughput at batch_size
    (the yolo-benchmark table)."""
    scores = [accuracy(np.concatenate([v.predict(b) for b in batches_of(x, batch_size, pad_id)]),
                       y) for v in variants]
    single = time_runners([v.predict for v in variants], batches_of(x, 1, pad_id), BENCHMARK_RUNS)
    batched = time_runners([v.predict for v in variants], batches_of(x, batch_size, pad_id),
                           BENCHMARK_RUNS)
    return [{"variant": variant.name, "provider": variant.provider,
             "size_mb": round(variant.size_bytes / 1e6, 3), "accuracy": scores[k],
             "latency_ms_p50_batch1": single.percentile_ms(k, 50),
             "latency_ms_p95_batch1": single.percentile_ms(k, 95),
             "throughput_per_s": batched.throughput(k), "batch_size": batch_size}
            for k, variant in enumerate(variants)]


def bundle_variants(paths: BundlePaths, manifest: Manifest, config: Config) -> list[Variant]:
    """ONNX Runtime fp32, and int8 when the bundle has it, on the requested providers."""
    variants = []
    for variant, label in (("onnx", "onnxruntime fp32"), ("int8", "onnxruntime int8"),
                           ("fp16", "onnxruntime fp16")):
        if variant != "onnx" and variant not in manifest.files:
            continue
        path = require_onnx_in_bundle(paths, manifest, variant)
        session = create_session(str(path), config.runtime(), classes=manifest.classes)
        if variant == "fp16" and session.get_providers()[0] == "CPUExecutionProvider":
            continue  # fp16 rows only where a GPU provider runs them
        mode = manifest.quantization.mode if manifest.quantization else None
        name = f"{label} ({mode})" if variant == "int8" and mode else label
        variants.append(Variant(name, session.get_providers()[0], path.stat().st_size,
                                session_runner(session)))
    return variants


@dataclass
class InferenceResult:
    providers_requested: list[str]
    providers_active: list[str]
    provider_options: dict
    io_binding: bool
    model_path: str
    accuracy: float
    latency_ms_p50: float
    latency_ms_p95: float
    throughput_per_s: float
    batch_size: int
    samples: int
    timed_batches: int

    def report_section(self) -> dict:
        return dict(vars(self))


def evaluate(session: ort.InferenceSession, x: np.ndarray, y: np.ndarray, config: Config,
             model_path: Path) -> tuple[InferenceResult, np.ndarray]:
    """Test accuracy, then per-batch latency and throughput at --batch_size; and the test
    probabilities (for the evaluation section)."""
    if len(x) == 0:
        raise RuntimeFailure("no test samples to run", "check the dataset's test split")
    probabilities = predict_proba(session, x, config.batch_size)
    score = accuracy(probabilities, y)
    batches = whole_batches(batches_of(x, config.batch_size, graph_padding_id(session)),
                            config.batch_size)
    # at least 30 batches and one whole pass; one variant, so no floor on the time spent
    timings = time_runners([session_runner(session)], batches, max(30, len(batches)),
                           min_seconds=0)
    return InferenceResult(
        providers_requested=config.providers(), providers_active=session.get_providers(),
        provider_options=config.runtime().provider_options,
        io_binding=session_device(session) is not None,
        model_path=str(model_path), accuracy=score,
        latency_ms_p50=timings.percentile_ms(0, 50), latency_ms_p95=timings.percentile_ms(0, 95),
        throughput_per_s=timings.throughput(0), batch_size=config.batch_size, samples=len(x),
        timed_batches=len(timings.samples)), probabilities


def run_on_bundle(config: Config, paths: BundlePaths, variant: str,
                  test: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray] | None,
                  report: dict, *, benchmark: bool, baseline: Sequence[Variant] = ()) -> None:
    """The inference stage on one session of the chosen graph: accuracy, latency and throughput;
    the calibration section; then each test-time method asked for (the registry's order, each
    into its section; --eval_shift measures the variants they hand back) and the benchmark table
    (`baseline` rows first), into `report`."""
    manifest, session, model_path = load_bundle_session(paths, config, variant)
    if task_of_kind(manifest.preprocessing.kind).dense:
        evaluate_dense(config, manifest, session, model_path, test, report)
        return
    if manifest.preprocessing.kind == "detection":
        evaluate_detector(config, manifest, session, model_path, test, report)
        return
    result, probabilities = evaluate(session, *test, config, model_path)
    LOG.info("inference on %s: accuracy %.4f, p50 %.3f ms/batch of %d, %.0f samples/s",
             ", ".join(result.providers_active), result.accuracy, result.latency_ms_p50,
             config.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if config.profile:
        report["profile"] = profile_graph(config, model_path, test[0], graph_padding_id(session))
    section_of = task_of_kind(manifest.preprocessing.kind).part("evaluation")
    report["evaluation"] = bundle_evaluation(
        section_of, manifest.labels, manifest.dataset.train_class_counts,
        Tally(manifest.classes).add(probabilities, test[1]))
    raw = without_temperature(session, test[0], config.batch_size)
    report["calibration"] = run_calibration(manifest, raw, probabilities, test[1], config.seed)
    served = served_graph(config, paths, manifest, session, model_path)
    heldout = Heldout(test, val, raw)
    variants = single_variants(session, manifest, config.batch_size)
    for method in asked_methods(config):
        evaluation = method.evaluate(config, served, heldout)
        report[method.key] = evaluation.section
        if evaluation.variants is not None:
            variants = joined(variants, evaluation.variants)
    if config.eval_shift and report["calibration"] is not None:
        report["calibration"].update(calibration_under_shift(
            config.eval_shift, config.shift_severity, config.seed, manifest.preprocessing,
            variants, test))
    if benchmark:
        variants = [*baseline, *bundle_variants(paths, manifest, config)]
        report["benchmark"] = benchmark_variants(variants, *test, config.batch_size,
                                                 manifest.input.pad_id)


def evaluate_dense(config: Config, manifest: Manifest, session: ort.InferenceSession,
                   model_path: Path, test: tuple[np.ndarray, np.ndarray], report: dict) -> None:
    """A segmenter's inference stage: the test split's masks in ONNX Runtime, scored over
    pixels (mean IoU and the rest: ttc/tasks/segment/evaluate.py), and its latency."""
    from ttc.tasks.segment.evaluate import run_test_split

    ignore_index = manifest.preprocessing.spec["ignore_index"]
    result, report["evaluation"], masks = run_test_split(
        session, str(model_path), *test, manifest.labels, ignore_index,
        manifest.dataset.train_class_counts, config.batch_size)
    LOG.info("inference on %s: pixel accuracy %.4f, mean IoU %.4f, p50 %.3f ms/batch of %d, "
             "%.0f images/s", ", ".join(result.providers_active), result.pixel_accuracy,
             result.mean_iou, result.latency_ms_p50, config.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if not (config.tta or config.ttt):
        return
    if Path(model_path) != BundlePaths.from_model_path(config.output_model).onnx:
        # TTA's and bn's graphs are fp32: they are compared with the fp32 graph
        session = create_session(str(require_onnx_in_bundle(
            BundlePaths.from_model_path(config.output_model), manifest)), config.runtime(),
            classes=manifest.classes)
        masks = None
    if config.tta:
        report["tta"] = dense_tta(config, manifest, session, test, masks)
    if config.ttt:
        report["ttt"] = dense_ttt(config, manifest, session, test)


def evaluate_detector(config: Config, manifest: Manifest, session: ort.InferenceSession,
                      model_path: Path, test: tuple[np.ndarray, np.ndarray],
                      report: dict) -> None:
    """A detector's inference stage: the test split's detections in ONNX Runtime (NMS in the
    graph), scored with COCO's metrics (ttc/tasks/detect/evaluate.py), and its latency."""
    from ttc.tasks.detect.evaluate import run_test_split

    result, report["evaluation"], found = run_test_split(
        session, str(model_path), *test, manifest.labels, manifest.dataset.train_class_counts,
        config.batch_size)
    LOG.info("inference on %s: mAP@[.5:.95] %.4f, mAP@.5 %.4f, p50 %.3f ms/batch of %d, "
             "%.0f images/s", ", ".join(result.providers_active), result.map, result.map50,
             result.latency_ms_p50, config.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if config.tta:
        plain_model = Path(model_path) == BundlePaths.from_model_path(config.output_model).onnx
        report["tta"] = detector_tta(config, manifest, test, found if plain_model else None)
    if config.ttt:
        report["ttt"] = detector_ttt(config, manifest, test)


def detector_tta(config: Config, manifest: Manifest, test: tuple[np.ndarray, np.ndarray],
                 found: list | None) -> dict:
    """--tta for a detector: the bundle's TTA graph (model.tta.onnx, its views and box fusion
    fixed at export) against model.onnx (whose test detections are `found` when known), with
    exact WBF of the same views' detections beside (ttc/tasks/detect/evaluate.py)."""
    import onnx

    from ttc.tasks.detect.evaluate import detection_runner, tta_section
    from ttc.tasks.detect.flags import detector_views
    from ttc.tasks.detect.fusion import graph_settings, inner_runner, with_inner_outputs

    paths = BundlePaths.from_model_path(config.output_model)
    graph = manifest.extra_graphs.tta
    tta_path = require_onnx_in_bundle(paths, manifest, "tta")
    if config.tta_transforms and graph is not None \
            and detector_views(config.tta_transforms) != graph.views:
        LOG.warning("the bundle's TTA graph has the views %s (fixed at export); --tta_transforms "
                    "%s is not used (re-export with them to change the views)", graph.views,
                    config.tta_transforms)
    model = onnx.load(str(tta_path))
    settings = graph_settings(model)
    plain = create_session(str(require_onnx_in_bundle(paths, manifest)), config.runtime())
    merged = create_session(str(tta_path), config.runtime())
    inner = create_session(with_inner_outputs(model).SerializeToString(), config.runtime(),
                           source=tta_path)
    section = tta_section(detection_runner(plain), detection_runner(merged),
                          inner_runner(inner, settings), graph.views if graph else "", *test,
                          manifest.labels, config.batch_size, settings.record(), found)
    LOG.info("%s", section["verdict"])
    return section


def detector_ttt(config: Config, manifest: Manifest, test: tuple[np.ndarray, np.ndarray]) -> dict:
    """--ttt for a detector: bn through the bundle's adaptation graph (model.bn.onnx, its fp32
    candidates and the same NMS), against model.onnx, on the test split and on each
    --eval_shift corruption of it (ttc/tasks/detect/adapt.py)."""
    import onnx

    from ttc.tasks.detect.adapt import adaptation_graph, adapted_runner, detection_ttt_section
    from ttc.tasks.detect.evaluate import detection_runner

    paths = BundlePaths.from_model_path(config.output_model)
    path = require_onnx_in_bundle(paths, manifest, "bn")
    graph = adaptation_graph(onnx.load(str(path)), lambda model: create_session(
        model, config.runtime(), source=path))
    source = create_session(str(require_onnx_in_bundle(paths, manifest)), config.runtime())
    section = detection_ttt_section(
        detection_runner(source), {"bn": adapted_runner(graph, config.ttt_bn_prior)}, *test,
        manifest.labels, manifest.preprocessing.spec, config.batch_size,
        config.shift_names("detection"), config.shift_severity, config.seed,
        {"method": "bn", "bn_prior": config.ttt_bn_prior})
    LOG.info("test-time training: %s", section["verdict"])
    return section


def dense_ttt(config: Config, manifest: Manifest, session: ort.InferenceSession,
              test: tuple[np.ndarray, np.ndarray]) -> dict:
    """--ttt for a segmenter: bn and/or tent through the bundle's adaptation graph
    (model.bn.onnx), on the test split and on each --eval_shift corruption of it
    (ttc/tasks/segment/adapt.py)."""
    import onnx

    from ttc.tasks.segment.adapt import adapted_runner, dense_ttt_section, tent_runner
    from ttc.tasks.segment.evaluate import mask_runner
    from ttc.testtime.ttt import AdaptationGraph, Tent

    paths = BundlePaths.from_model_path(config.output_model)
    path = require_onnx_in_bundle(paths, manifest, "bn")
    graph = AdaptationGraph(onnx.load(str(path)), lambda model: create_session(
        model, config.runtime(), classes=manifest.classes, source=path))
    methods = ("bn", "tent") if config.ttt_method == "all" else (config.ttt_method,)
    adapted = {}
    if "bn" in methods:
        adapted["bn"] = adapted_runner(graph, config.ttt_bn_prior)
    if "tent" in methods:
        tent = Tent(manifest, paths.weights, graph.layers, config.ttt_learning_rate,
                    config.ttt_iterations, config.num_threads, config.trust_model_code,
                    filter_unreliable=config.ttt_guard == "filter")
        adapted["tent"] = tent_runner(graph, tent, config.ttt_predict == "before")
    settings = {"method": config.ttt_method, "bn_prior": config.ttt_bn_prior,
                "iterations": config.ttt_iterations, "learning_rate": config.ttt_learning_rate,
                "guard": config.ttt_guard if "tent" in methods else None,
                "predict": config.ttt_predict if "tent" in methods else None}
    section = dense_ttt_section(mask_runner(session), adapted, *test, manifest.labels,
                                manifest.preprocessing.spec, config.batch_size,
                                config.shift_names("segmentation"), config.shift_severity,
                                config.seed, settings)
    if "tent" in methods:  # EATA's filter: pixels, not batches, are left out
        section.update(resets={"tent": 0}, skipped={"tent": 0}, filtered_pixels=tent.filtered)
    LOG.info("test-time training: %s", section["verdict"])
    return section


def dense_tta(config: Config, manifest: Manifest, session: ort.InferenceSession,
              test: tuple[np.ndarray, np.ndarray], masks: np.ndarray | None) -> dict:
    """--tta for a segmenter: the bundle's TTA graph (model.tta.onnx, its views fixed at
    export) against model.onnx (`session`, whose test masks are `masks` when known)."""
    from ttc.tasks.segment.evaluate import mask_runner, predict_masks, tta_section
    from ttc.tasks.segment.views import parse_view_specs, views_text

    paths = BundlePaths.from_model_path(config.output_model)
    graph = manifest.extra_graphs.tta
    tta_path = require_onnx_in_bundle(paths, manifest, "tta")
    asked = views_text(parse_view_specs(config.tta_transforms))
    if config.tta_transforms and graph is not None and asked != graph.views:
        LOG.warning("the bundle's TTA graph has the views %s (fixed at export); --tta_transforms "
                    "%s is not used (re-export with them to change the views)", graph.views,
                    config.tta_transforms)
    merged = create_session(str(tta_path), config.runtime(), classes=manifest.classes)
    if masks is None:
        masks = predict_masks(mask_runner(session), test[0], config.batch_size)
    section = tta_section(mask_runner(session), mask_runner(merged),
                          graph.views if graph else "", *test, masks, manifest.labels,
                          manifest.preprocessing.spec["ignore_index"], config.batch_size)
    LOG.info("%s", section["verdict"])
    return section


def profile_graph(config: Config, model_path: Path, x: np.ndarray, pad_id: int) -> dict:
    """--profile: the served graph's plain pass under ONNX Runtime's profiler, in a session of
    its own on the first PROFILED_RUNS batches of `x` (so that the profiler's overhead stays out
    of the timings above); the trace kept at config.profile_path()."""
    trace = config.profile_path()
    profile = profile_runs(str(model_path), config.runtime(),
                           profiled_batches(batches_of(x, config.batch_size, pad_id)), trace)
    section = profile_section(profile, trace)
    top = section["top"][0] if section["top"] else None
    if top is not None:
        LOG.info("profile: %s (%s) takes %.0f%% of kernel time; trace in %s", top["node"],
                 top["op_type"], 100 * top["share"], trace)
    return section


# ----------------------------------------------------------------------------- batch inference


def predict_new_data(config: Config, paths: BundlePaths, report: dict) -> None:
    """--input: the chosen graph with the test-time compute asked for, over the input's chunks:
    in this process (batch.py), or on Ray workers (cluster.py) running the same predictor."""
    from ttc.serving.batch import BatchOptions, predict_input

    manifest = read_manifest(paths)
    if task_of_kind(manifest.preprocessing.kind).dense:
        predict_masks(config, paths, report)
        return
    if manifest.preprocessing.kind == "detection":
        predict_detections(config, paths, report)
        return
    chunk_rows = config.worker_batch_size or config.chunk_rows
    if config.ttt:  # whole adaptation batches per chunk, as if the input were read at once
        chunk_rows = -(-chunk_rows // config.batch_size) * config.batch_size
    options = BatchOptions.from_config(config, chunk_rows)
    if config.engine == "ray":
        predict_with_ray(config, paths, options, report)
        return
    manifest, session, model_path = load_bundle_session(paths, config, input_variant(config))
    predict, _ = chunk_predictor(config, paths, manifest, session, model_path)
    seen: list[np.ndarray] = []
    if config.profile:
        predict = keeping_first_rows(predict, seen, config.batch_size * PROFILED_RUNS)
    run = predict_input(options, manifest, predict, report)
    from ttc.serving.cluster import local_engine_section

    report["engine"] = local_engine_section(run, config.runtime().intra_op_threads)
    if config.profile and seen:
        report["profile"] = profile_graph(config, model_path, np.concatenate(seen),
                                          graph_padding_id(session))


def predict_masks(config: Config, paths: BundlePaths, report: dict) -> None:
    """A segmenter's --input: one mask PNG per image (and an overlay with --overlay true), and
    the summary table at --output (ttc/tasks/segment/predict.py)."""
    from ttc.tasks.segment.evaluate import mask_runner
    from ttc.tasks.segment.predict import SegmentBatchOptions, predict_images

    options = SegmentBatchOptions(
        input=Path(config.input), output=Path(config.output), mask_dir=config.mask_dir,
        overlay=config.overlay, batch_size=config.batch_size, errors=config.errors,
        allow_errors=config.allow_errors, show_progress=not config.no_progress)
    if config.engine == "ray":
        predict_masks_with_ray(config, paths, options, report)
        return
    manifest, session, _ = load_bundle_session(paths, config, input_variant(config))
    predict_images(options, manifest.preprocessing.spec, list(manifest.labels),
                   mask_runner(session), report)


def predict_detections(config: Config, paths: BundlePaths, report: dict) -> None:
    """An object detector's --input: one row per box (or a COCO results JSON) at --output, and
    each image with its boxes drawn with --overlay true (ttc/tasks/detect/predict.py)."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.predict import DetectBatchOptions, predict_detections_input

    options = DetectBatchOptions(
        input=Path(config.input), output=Path(config.output), output_format=config.output_format,
        min_score=config.min_score, overlay=config.overlay, batch_size=config.batch_size,
        errors=config.errors, allow_errors=config.allow_errors,
        show_progress=not config.no_progress)
    if config.engine == "ray":
        predict_detections_with_ray(config, paths, options, report)
        return
    manifest, session, _ = load_bundle_session(paths, config, input_variant(config))
    predict_detections_input(options, manifest.preprocessing.spec, list(manifest.labels),
                             detection_runner(session), report)


def predict_detections_with_ray(config: Config, paths: BundlePaths,
                                options: DetectBatchOptions, report: dict) -> None:
    """A detector's --engine ray (ttc/tasks/detect/cluster.py): chunks of
    --worker_batch_size images (default --batch_size; rounded up to whole --batch_size
    batches), detected by workers that write the overlays themselves."""
    import functools

    from ttc.online.predictor import worker_detection_runner
    from ttc.tasks.detect.cluster import predict_detections_on_ray

    worker_config = ray_worker_config(config)
    # the workers' session made once here: a bundle or provider that cannot work fails now
    manifest, session, _ = load_bundle_session(paths, worker_config, input_variant(config))
    chunk = -(-(config.worker_batch_size or config.batch_size) // config.batch_size) \
        * config.batch_size
    ray_options = ray_options_of(config, chunk, session)
    del session
    predict_detections_on_ray(options, manifest.preprocessing.spec, list(manifest.labels),
                              functools.partial(worker_detection_runner, worker_config), report,
                              ray_options)


def predict_masks_with_ray(config: Config, paths: BundlePaths, options: SegmentBatchOptions,
                           report: dict) -> None:
    """A segmenter's --engine ray (ttc/tasks/segment/cluster.py): chunks of
    --worker_batch_size images (default --batch_size; rounded up to whole --batch_size
    batches), segmented by workers that write the masks themselves."""
    import functools

    from ttc.online.predictor import worker_mask_runner
    from ttc.tasks.segment.cluster import predict_images_on_ray

    worker_config = ray_worker_config(config)
    # the workers' session made once here: a bundle or provider that cannot work fails now
    manifest, session, _ = load_bundle_session(paths, worker_config, input_variant(config))
    chunk = -(-(config.worker_batch_size or config.batch_size) // config.batch_size) \
        * config.batch_size
    ray_options = ray_options_of(config, chunk, session)
    del session
    predict_images_on_ray(options, manifest.preprocessing.spec, list(manifest.labels),
                          functools.partial(worker_mask_runner, worker_config), report,
                          ray_options)


def keeping_first_rows(predict: Predictor, seen: list[np.ndarray], rows: int) -> Predictor:
    """`predict`, keeping in `seen` the first `rows` encoded rows it is given (what --profile
    then profiles the graph on, after the input is predicted)."""

    def keep(x: np.ndarray) -> tuple[np.ndarray, dict]:
        wanted = rows - sum(len(part) for part in seen)
        if wanted > 0:
            seen.append(x[:wanted].copy())
        return predict(x)

    return keep


def predict_with_ray(config: Config, paths: BundlePaths, options: BatchOptions,
                     report: dict) -> None:
    """--engine ray: workers (ray_worker_config) running the local engine's predictor."""
    import functools

    from ttc.serving.cluster import predict_on_ray

    worker_config = ray_worker_config(config)
    # the workers' predictor built once here: a bundle, provider or test-time method that cannot
    # work fails now, with its own message, not as a worker that dies at start on the cluster
    manifest, session, model_path = load_bundle_session(paths, worker_config,
                                                        input_variant(config))
    chunk_predictor(worker_config, paths, manifest, session, model_path)
    ray_options = ray_options_of(config, options.chunk_rows, session)
    del session
    predict_on_ray(options, manifest, functools.partial(worker_predictor, worker_config), report,
                   ray_options)


def ray_worker_config(config: Config) -> Config:
    """A Ray worker's Config: --num_threads ONNX Runtime intra-op threads (its num_cpus: Ray's
    OMP_NUM_THREADS does not reach ONNX Runtime) and one inter-op thread, no progress bar, the
    bundle read by absolute path."""
    import dataclasses

    return dataclasses.replace(config, intra_op_threads=config.ray_threads(), inter_op_threads=1,
                               no_progress=True,
                               output_model=str(Path(config.output_model).absolute()))


def ray_options_of(config: Config, worker_batch_size: int,
                   session: ort.InferenceSession) -> RayOptions:
    """Where and how wide --engine ray runs: a GPU per worker where the session runs on one."""
    from ttc.serving.cluster import RayOptions

    gpu = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    return RayOptions(None if config.local_ray() else config.ray_address, config.ray_workers(),
                      worker_batch_size, config.ray_threads(), 1.0 if gpu else 0.0,
                      config.log_level == "DEBUG")


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "inference", "Evaluate a model bundle with ONNX Runtime on the test split of "
        "--dataset_path, split as at training (not needed for a bundle trained on a builtin: "
        "data set; a path the bundle records is never read): accuracy, latency p50/p95 and "
        "throughput; or predict new data with --input.",
        required=["output_model"], aliases={"output_model": ["--model"]},
        epilog="example:\n  python inference.py --model runs/digits/model.onnx --batch_size 64 "
               "--ep cpu --report_json runs/digits/inference.json")
    config = start_cli(parser, argv)

    def stages(report: dict) -> None:
        paths = BundlePaths.from_model_path(config.output_model)
        manifest = check_bundle(config, paths)
        if config.input:
            predict_new_data(config, paths, report)
            return
        from ttc.inputs.data import load_bundle_dataset, split_paths_of

        data = load_bundle_dataset(manifest, config.dataset_path,
                                   ("val", "test") if config.tta else ("test",),
                                   not config.no_progress, split_paths_of(config),
                                   ", or --input PATH to predict new data")
        report["dataset"] = data.report_section()
        variant = input_variant(config, manifest)
        if variant != "onnx":
            verdict = manifest.variant(variant)
            if verdict and not verdict.used_for_inference:
                LOG.warning("using the %s graph as asked, although it was judged: %s", variant,
                            verdict.verdict)
        val = (data.val.x, data.val.y) if config.tta else None
        run_on_bundle(config, paths, variant, (data.test.x, data.test.y), val, report,
                      benchmark=config.benchmark)

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
