"""The inference stage on a bundle's test split (inference.py, pipeline.py): the chosen graph
opened here (predictor.py's one way), handed to its model type's `test_split` part
(Parts.test_split), which fills the report's `inference`, `evaluation` and test-time sections.
A classifier's is here (`evaluate_classifier`: accuracy, latency and throughput, calibration,
each test-time method of the registry, the benchmark table); a segmenter's and a detector's sit
in their folders (ttc/tasks/segment/stages.py, ttc/tasks/detect/stages.py).

Neither torch nor DSPy is imported here (Tent, a test-time method, loads PyTorch when it runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ttc.online.predictor import load_bundle_session, served_graph
from ttc.reporting.evaluation import Tally, bundle_evaluation
from ttc.reporting.metrics import accuracy
from ttc.serving.bundle import BundlePaths, require_onnx_in_bundle
from ttc.serving.profiling import profile_runs, profile_section, profiled_batches
from ttc.serving.runtime import (batches_of, create_session, graph_padding_id, predict_proba,
                                 session_device, session_runner, time_runners, whole_batches)
from ttc.options.stages import InferenceOptions
from ttc.serving.stages import SplitRun, Variant
from ttc.tasks.registry import task_of_kind
from ttc.testtime.calibration import (calibration_under_shift, joined, run_calibration,
                                      single_variants, without_temperature)
from ttc.testtime.registry import asked_methods
from ttc.testtime.served import Heldout
from utils import LOG, RuntimeFailure

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.options.sessions import RuntimeFlags
    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions


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


def bundle_variants(paths: BundlePaths, manifest: Manifest, options: RuntimeFlags
                    ) -> list[Variant]:
    """ONNX Runtime fp32, and int8 when the bundle has it, on the requested providers."""
    variants = []
    for variant, label in (("onnx", "onnxruntime fp32"), ("int8", "onnxruntime int8"),
                           ("fp16", "onnxruntime fp16")):
        if variant != "onnx" and variant not in manifest.files:
            continue
        path = require_onnx_in_bundle(paths, manifest, variant)
        session = create_session(str(path), options.runtime(), classes=manifest.classes)
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


def evaluate(session: ort.InferenceSession, x: np.ndarray, y: np.ndarray,
             options: InferenceOptions, model_path: Path) -> tuple[InferenceResult, np.ndarray]:
    """Test accuracy, then per-batch latency and throughput at --batch_size; and the test
    probabilities (for the evaluation section)."""
    if len(x) == 0:
        raise RuntimeFailure("no test samples to run", "check the dataset's test split")
    probabilities = predict_proba(session, x, options.batch_size)
    score = accuracy(probabilities, y)
    batches = whole_batches(batches_of(x, options.batch_size, graph_padding_id(session)),
                            options.batch_size)
    # at least 30 batches and one whole pass; one variant, so no floor on the time spent
    timings = time_runners([session_runner(session)], batches, max(30, len(batches)),
                           min_seconds=0)
    return InferenceResult(
        providers_requested=options.providers(), providers_active=session.get_providers(),
        provider_options=options.runtime().provider_options,
        io_binding=session_device(session) is not None,
        model_path=str(model_path), accuracy=score,
        latency_ms_p50=timings.percentile_ms(0, 50), latency_ms_p95=timings.percentile_ms(0, 95),
        throughput_per_s=timings.throughput(0), batch_size=options.batch_size, samples=len(x),
        timed_batches=len(timings.samples)), probabilities


def run_on_bundle(options: InferenceOptions, paths: BundlePaths, variant: str,
                  test: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray] | None,
                  report: dict, *, benchmark: bool, baseline: Sequence[Variant] = (),
                  calibration: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The inference stage on one session of the chosen graph, handed to the bundle's model
    type's `test_split` part (a classifier's: evaluate_classifier), into `report`.
    `calibration`: the calibration slice, for the test-time methods that choose on it."""
    manifest, session, model_path = load_bundle_session(paths, options, variant)
    evaluate_split = task_of_kind(manifest.preprocessing.kind).part("test_split")
    evaluate_split(SplitRun(options, paths, manifest, session, model_path, test, val, report,
                            benchmark, baseline, calibration))


def evaluate_classifier(run: SplitRun) -> None:
    """A classifier's inference stage: accuracy, latency and throughput; the calibration
    section; then each test-time method asked for (the registry's order, each into its section;
    --eval_shift measures the variants they hand back) and the benchmark table (`baseline` rows
    first)."""
    options, manifest, session, test, report = (run.options, run.manifest, run.session,
                                                run.test, run.report)
    result, probabilities = evaluate(session, *test, options, run.model_path)
    LOG.info("inference on %s: accuracy %.4f, p50 %.3f ms/batch of %d, %.0f samples/s",
             ", ".join(result.providers_active), result.accuracy, result.latency_ms_p50,
             options.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if options.profile:
        report["profile"] = profile_graph(options.runtime(), options.batch_size,
                                          options.profile_path(), run.model_path, test[0],
                                          graph_padding_id(session))
    section_of = task_of_kind(manifest.preprocessing.kind).part("evaluation")
    report["evaluation"] = bundle_evaluation(
        section_of, manifest.labels, manifest.dataset.train_class_counts,
        Tally(manifest.classes).add(probabilities, test[1]), dataset=report.get("dataset"))
    raw = without_temperature(session, test[0], options.batch_size)
    report["calibration"] = run_calibration(manifest, raw, probabilities, test[1], options.seed)
    served = served_graph(options, run.paths, manifest, session, run.model_path)
    heldout = Heldout(test, run.val, raw, run.calibration)
    variants = single_variants(session, manifest, options.batch_size)
    for method in asked_methods(options):
        evaluation = method.evaluate(options, served, heldout)
        report[method.key] = evaluation.section
        if evaluation.variants is not None:
            variants = joined(variants, evaluation.variants)
    if options.eval_shift and report["calibration"] is not None:
        report["calibration"].update(calibration_under_shift(
            options.eval_shift, options.shift_severity, options.seed, manifest.preprocessing,
            variants, test))
    if run.benchmark:
        variants = [*run.baseline, *bundle_variants(run.paths, manifest, options)]
        report["benchmark"] = benchmark_variants(variants, *test, options.batch_size,
                                                 manifest.input.pad_id)


def profile_graph(runtime: RuntimeOptions, batch_size: int, trace: Path, model_path: Path,
                  x: np.ndarray, pad_id: int) -> dict:
    """--profile: the served graph's plain pass under ONNX Runtime's profiler, in a session of
    its own on the first PROFILED_RUNS batches of `x` (so that the profiler's overhead stays out
    of the timings above); the trace kept at `trace` (InferenceOptions.profile_path())."""
    profile = profile_runs(str(model_path), runtime,
                           profiled_batches(batches_of(x, batch_size, pad_id)), trace)
    section = profile_section(profile, trace)
    top = section["top"][0] if section["top"] else None
    if top is not None:
        LOG.info("profile: %s (%s) takes %.0f%% of kernel time; trace in %s", top["node"],
                 top["op_type"], 100 * top["share"], trace)
    return section
