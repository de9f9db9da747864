"""Run a model bundle with ONNX Runtime: accuracy, latency and throughput on held-out data.

    python inference.py --model runs/digits/model.onnx

evaluates the test split of the dataset recorded in the bundle (or --dataset_path, split the same
way). This path imports neither torch nor dspy.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import onnxruntime as ort

from config import Config, RuntimeOptions, build_parser, start_cli
from preprocess import trim_padding
from utils import (LOG, BundlePaths, ConfigError, DataError, ExportError, RuntimeFailure,
                   captured_stderr, debug_enabled, exit_cli, progress, read_manifest,
                   require_onnx_in_bundle, run_cli, run_with_report, stdout_to_stderr)

if TYPE_CHECKING:
    from iterative import MCSampler
    from tta import TTARunner

WARMUP_RUNS = 3
MIN_TIMED_BATCHES = 30
MAX_TIMING_SECONDS = 2.0


def create_session(model: str | bytes, runtime: RuntimeOptions,
                   session_args: dict | None = None) -> ort.InferenceSession:
    """An ORT session with all graph optimisations, on the first usable of `runtime.providers`.

    onnxruntime-gpu lists CUDA and TensorRT as available even without a GPU, prints red errors
    and silently runs on CPU. We capture those errors, compare the active providers with the
    request, and say in one WARNING which provider is inactive and why (exit 5 with `strict`).
    """
    strict = runtime.strict
    available = ort.get_available_providers()
    missing = [p for p in runtime.providers if p not in available]
    if missing:
        fallback(f"{', '.join(missing)} not in this onnxruntime build (it has "
                 f"{', '.join(available)})", strict)
    usable = [p for p in runtime.providers if p in available] or ["CPUExecutionProvider"]
    with_options = [(p, runtime.provider_options.get(p, {})) for p in usable]
    cache = runtime.provider_options.get("TensorrtExecutionProvider", {}).get("trt_engine_cache_path")
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = runtime.intra_op_threads
    options.inter_op_num_threads = runtime.inter_op_threads
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if runtime.execution_mode == "parallel"
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    options.log_severity_level = 0 if debug_enabled() else 3
    try:
        # ORT's Python layer print()s provider errors to stdout: keep them off our stdout.
        if debug_enabled():
            with stdout_to_stderr():
                session = ort.InferenceSession(model, options, providers=with_options,
                                               **(session_args or {}))
            ort_errors: list[str] = []
        else:
            with captured_stderr() as ort_errors, stdout_to_stderr():
                session = ort.InferenceSession(model, options, providers=with_options,
                                               **(session_args or {}))
    except Exception as err:  # noqa: BLE001 - ORT raises several types for a bad model
        name = model if isinstance(model, str) else "the exported graph"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(f"ONNX Runtime cannot load {name}: {first}",
                          "the file may be truncated or not an ONNX model; re-run export.py "
                          "or pipeline.py") from None
    inactive = [p for p in usable if p not in session.get_providers()]
    if inactive:
        fallback(f"{', '.join(inactive)} could not start: {provider_failure_reason(ort_errors)}; "
                 f"running on {', '.join(session.get_providers())}", strict)
    return session


def fallback(message: str, strict: bool) -> None:
    if strict:
        raise RuntimeFailure(f"execution provider fallback: {message}",
                             "fix the provider's drivers, or drop --strict_ep to allow fallback")
    LOG.warning("execution provider fallback: %s", message)


def provider_failure_reason(lines: Sequence[str]) -> str:
    """The most telling line of ONNX Runtime's provider errors, without colours and prefixes."""
    clean = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in lines]
    for key in ("cannot open shared object", "Failed to load", "Error", "error"):
        for line in clean:
            if key in line:
                return line.split("FAIL : ", 1)[-1].split("] ", 1)[-1][:400]
    return "its libraries or drivers are missing (no details from ONNX Runtime)"


def batches_of(x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Contiguous batches; token ids lose the padding columns no text in the batch needs."""
    out = [np.ascontiguousarray(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
    if x.ndim == 2 and x.dtype == np.int64:
        out = [np.ascontiguousarray(trim_padding(b)) for b in out]
    return out


GPU_DEVICES = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}


def session_device(session: ort.InferenceSession) -> str | None:
    """The device IOBinding should use: "cuda" when a CUDA-type provider runs the session."""
    return GPU_DEVICES.get(session.get_providers()[0])


def iobinding_runner(session: ort.InferenceSession, device: str, device_id: int = 0,
                     output: str = "probabilities") -> Callable[[np.ndarray], np.ndarray]:
    """Run through IOBinding: the input is copied to `device` once and the output is allocated
    there by ORT, instead of session.run's own copies (what matters on CUDA)."""
    name = session.get_inputs()[0].name
    binding = session.io_binding()

    def run(batch: np.ndarray) -> np.ndarray:
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(batch, device,
                                                                           device_id))
        binding.bind_output(output, device, device_id)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    return run


def session_runner(session: ort.InferenceSession, output: str = "probabilities",
                   state_passes: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """A batch → probabilities; through IOBinding when a GPU provider runs the session. A graph
    with a `state` input is run `state_passes` times, fed its own `state_out` (zeros first)."""
    state = state_input(session)
    if state is not None:
        from iterative import STATE_INPUT, STATE_OUTPUT, state_loop

        name = session.get_inputs()[0].name

        def run_with_state(batch: np.ndarray, current: np.ndarray):
            return session.run([output, STATE_OUTPUT], {name: batch, STATE_INPUT: current})

        return lambda batch: state_loop(run_with_state, batch, state, state_passes)
    device = session_device(session)
    if device is not None:
        provider = session.get_providers()[0]
        options = session.get_provider_options().get(provider, {})
        return iobinding_runner(session, device, int(options.get("device_id", 0)), output)
    name = session.get_inputs()[0].name
    return lambda batch: session.run([output], {name: batch})[0]


def state_input(session: ort.InferenceSession) -> list[int] | None:
    """The per-sample shape of a recurrent graph's `state` input, or None."""
    for graph_input in session.get_inputs()[1:]:
        if graph_input.name == "state":
            shape = graph_input.shape[1:]
            if not all(isinstance(d, int) for d in shape):
                raise ExportError(f"the state input's shape {graph_input.shape} is not fixed "
                                  "after the batch axis", "export the state with a fixed size")
            return shape
    return None


def predict_proba(session: ort.InferenceSession, x: np.ndarray, batch_size: int,
                  output: str = "probabilities") -> np.ndarray:
    run = session_runner(session, output=output)
    return np.concatenate([run(batch) for batch in batches_of(x, batch_size)])


def time_batches(session: ort.InferenceSession, x: np.ndarray, batch_size: int,
                 show_progress: bool) -> list[tuple[float, int]]:
    """(seconds, samples) per session.run over whole passes of `x`, after a warm-up.

    Enough passes for at least MIN_TIMED_BATCHES batches (so p95 means something), stopping
    early once MAX_TIMING_SECONDS are spent (always at least one full pass).
    """
    run = session_runner(session)
    batches = batches_of(x, batch_size)
    for _ in range(WARMUP_RUNS):
        run(batches[0])
    passes = max(1, math.ceil(MIN_TIMED_BATCHES / len(batches)))
    timings: list[tuple[float, int]] = []
    budget_end = time.perf_counter() + MAX_TIMING_SECONDS
    for _ in progress(range(passes), desc="timing", enabled=show_progress):
        for batch in batches:
            start = time.perf_counter()
            run(batch)
            timings.append((time.perf_counter() - start, len(batch)))
        if time.perf_counter() > budget_end:
            break
    return timings


MIN_TIMING_SECONDS = 0.3


def interleaved_timings(runners: Sequence[Callable[[np.ndarray], object]],
                        batches: Sequence[np.ndarray], runs: int, warmup: int = 3
                        ) -> list[list[float]]:
    """Seconds per call for each runner, taking turns on the same batches so that machine noise
    hits all of them alike: at least `runs` turns and MIN_TIMING_SECONDS (sub-millisecond models
    need many turns for a stable p50), at most 20 × `runs`."""
    times: list[list[float]] = [[] for _ in runners]
    started = time.perf_counter()
    i = 0
    while i < runs + warmup or (time.perf_counter() - started < MIN_TIMING_SECONDS
                                and i < 20 * runs + warmup):
        batch = batches[i % len(batches)]
        for k, run in enumerate(runners):
            start = time.perf_counter()
            run(batch)
            if i >= warmup:
                times[k].append(time.perf_counter() - start)
        i += 1
    return times


@dataclass
class Variant:
    """One way of running the model, for the benchmark table."""

    name: str
    provider: str
    size_bytes: int
    predict: Callable[[np.ndarray], np.ndarray]  # a batch → probabilities


BENCHMARK_RUNS = 40


def benchmark_variants(variants: Sequence[Variant], x: np.ndarray, y: np.ndarray,
                       batch_size: int) -> list[dict]:
    """One row per variant: size, accuracy, p50/p95 latency at batch 1, throughput at batch_size
    (the yolo-benchmark table)."""
    accuracy = [float((np.concatenate([v.predict(b) for b in batches_of(x, batch_size)])
                       .argmax(1) == y).mean()) for v in variants]
    single = interleaved_timings([v.predict for v in variants], batches_of(x, 1), BENCHMARK_RUNS)
    large = batches_of(x, batch_size)
    batched = interleaved_timings([v.predict for v in variants], large, BENCHMARK_RUNS)
    rows = []
    for k, variant in enumerate(variants):
        ms = np.array(single[k]) * 1e3
        samples = sum(len(large[i % len(large)]) for i in range(len(batched[k])))
        rows.append({"variant": variant.name, "provider": variant.provider,
                     "size_mb": round(variant.size_bytes / 1e6, 3), "accuracy": accuracy[k],
                     "latency_ms_p50_batch1": round(float(np.percentile(ms, 50)), 4),
                     "latency_ms_p95_batch1": round(float(np.percentile(ms, 95)), 4),
                     "throughput_per_s": round(samples / float(np.sum(batched[k])), 1),
                     "batch_size": batch_size})
    return rows


def bundle_variants(paths: BundlePaths, manifest: dict, config: Config) -> list[Variant]:
    """ONNX Runtime fp32, and int8 when the bundle has it, on the requested providers."""
    variants = []
    for variant, label in (("onnx", "onnxruntime fp32"), ("int8", "onnxruntime int8"),
                           ("fp16", "onnxruntime fp16")):
        if variant != "onnx" and variant not in (manifest.get("files") or {}):
            continue
        path = require_onnx_in_bundle(paths, manifest, variant)
        session = create_session(str(path), config.runtime())
        if variant == "fp16" and session.get_providers()[0] == "CPUExecutionProvider":
            continue  # fp16 rows only where a GPU provider runs them
        mode = (manifest.get("quantization") or {}).get("mode")
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


def load_bundle_session(paths: BundlePaths, config: Config, variant: str = "onnx"
                        ) -> tuple[dict, ort.InferenceSession, Path]:
    """Manifest + verified graph (fp32 "onnx" or "int8") + a session whose input matches what
    the manifest promises."""
    manifest = read_manifest(paths)
    model_path = require_onnx_in_bundle(paths, manifest, variant)
    session = create_session(str(model_path), config.runtime())
    graph_input = session.get_inputs()[0]
    if graph_input.name != manifest["input"]["name"]:
        raise ExportError(f"{paths.onnx} takes input {graph_input.name!r} but its manifest says "
                          f"{manifest['input']['name']!r}", "re-run export.py or pipeline.py")
    return manifest, session, model_path


def evaluate(session: ort.InferenceSession, x: np.ndarray, y: np.ndarray, config: Config,
             model_path: Path) -> InferenceResult:
    """Test accuracy, then per-batch latency and throughput at --batch_size."""
    if len(x) == 0:
        raise RuntimeFailure("no test samples to run", "check the dataset's test split")
    accuracy = float((predict_proba(session, x, config.batch_size).argmax(1) == y).mean())
    timings = time_batches(session, x, config.batch_size, not config.no_progress)
    seconds = np.array([s for s, _ in timings])
    latencies_ms = seconds * 1e3
    return InferenceResult(
        providers_requested=config.providers(), providers_active=session.get_providers(),
        provider_options=config.runtime().provider_options,
        io_binding=session_device(session) is not None,
        model_path=str(model_path), accuracy=accuracy,
        latency_ms_p50=round(float(np.percentile(latencies_ms, 50)), 4),
        latency_ms_p95=round(float(np.percentile(latencies_ms, 95)), 4),
        throughput_per_s=round(sum(n for _, n in timings) / float(seconds.sum()), 1),
        batch_size=config.batch_size, samples=len(x), timed_batches=len(timings))


def tta_runner(session: ort.InferenceSession, model_path: Path, manifest: dict, config: Config
               ) -> TTARunner:
    """TTA on the chosen graph: in one ONNX graph with the views and the merge (a second session
    on the same providers) where the transforms allow, else numpy views around `session`."""
    import onnx

    from tta import TTARunner, build_transforms, tta_model

    transforms = build_transforms(config.tta_transforms, manifest["preprocessing"], config.seed)
    model = tta_model(onnx.load(str(model_path)), transforms, config.tta_merge,
                      len(manifest["labels"]))
    merged = None
    if model is not None:
        merged = session_runner(create_session(model.SerializeToString(), config.runtime()))
    return TTARunner(session_runner(session), transforms, config.tta_merge, config.batch_size,
                     merged)


def run_ttt(config: Config, paths: BundlePaths, manifest: dict,
            predict: Callable[[np.ndarray], np.ndarray], test: tuple[np.ndarray, np.ndarray]
            ) -> dict:
    """Test-time training on the bundle's adaptation graph, on the test split and its corrupted
    copies; `predict` (the chosen graph, unadapted) is the baseline. torch only for tent."""
    import onnx

    from shifts import parse_shift_names
    from ttt import AdaptationGraph, Tent, TTTSettings, evaluate_ttt

    settings = TTTSettings(config.ttt_method, config.ttt_mode, config.ttt_iterations,
                           config.ttt_learning_rate, config.ttt_bn_prior, config.ttt_reset_every,
                           config.batch_size,
                           parse_shift_names(config.eval_shift, manifest["preprocessing"]["kind"]),
                           config.shift_severity, config.seed)
    model = onnx.load(str(require_onnx_in_bundle(paths, manifest, "bn")))
    graph = AdaptationGraph(model, lambda m: create_session(m, config.runtime()))
    tent = None
    if "tent" in settings.methods:
        tent = Tent(manifest, paths.weights, graph.layers, config.ttt_learning_rate,
                    config.ttt_iterations, config.num_threads)
    result = evaluate_ttt(settings, graph, predict, tent, *test, manifest["preprocessing"])
    for warning in result.warnings:
        LOG.warning("test-time training: %s", warning)
    LOG.info("test-time training: %s", result.verdict)
    return result.report_section()


def run_iterative(config: Config, paths: BundlePaths, manifest: dict,
                  session: ort.InferenceSession, test: tuple[np.ndarray, np.ndarray]) -> dict:
    """The chosen iterative mode against a single pass: accuracy, NLL, ECE, accuracy at 90%
    coverage, passes used and cost, on the test split."""
    import iterative as it

    x, y = test
    batches = batches_of(x, config.batch_size)
    single = session_runner(session)
    single(batches[0])
    single_seconds, single_probs = min(
        (it.timed(lambda: np.concatenate([single(b) for b in batches])) for _ in range(3)),
        key=lambda t: t[0])
    rows = [it.calibration_row("single", single_probs, y, single_seconds, single_seconds, 1)]
    if config.iterative == "mc_dropout":
        sampler = mc_sampler(config, paths, manifest)
        sampler(batches[:1])  # warm-up
        seconds, passes = it.timed(lambda: sampler(batches))
        probs = passes.mean
        rows.append(it.calibration_row("mc_dropout", probs, y, seconds, single_seconds,
                                       passes.passes_used))
    elif config.iterative == "ensemble":
        model, members = ensemble_graph(config, paths, manifest)
        ens_session = create_session(model.SerializeToString(), config.runtime())
        run = session_runner(ens_session)
        run(batches[0])
        seconds, probs = it.timed(lambda: np.concatenate([run(b) for b in batches]))
        rows.append(it.calibration_row("ensemble", probs, y, seconds, single_seconds, members))
    else:  # state: the bundle's session fed its state K times
        if state_input(session) is None:
            raise RuntimeFailure("--iterative state needs a graph with a 'state' input and a "
                                 "'state_out' output", "see README, Iterative inference")
        looped = session_runner(session, state_passes=config.iterations)
        seconds, probs = it.timed(lambda: np.concatenate([looped(b) for b in batches]))
        rows.append(it.calibration_row("state_feedback", probs, y, seconds, single_seconds,
                                       config.iterations))
    it.log_rows(rows)
    interval = it.ece_change_interval(single_probs, probs, y, seed=config.seed)
    verdict = it.calibration_verdict(rows[0], rows[-1], interval, len(y))
    (LOG.warning if rows[-1]["ece"] > rows[0]["ece"] else LOG.info)("%s", verdict)
    return {"mode": config.iterative, "backend": config.iterative_backend,
            "iterations": config.iterations, "passes_used": rows[-1]["passes_used"],
            "rows": rows, "ece_change": rows[-1]["ece"] - rows[0]["ece"],
            "ece_change_interval_90": list(interval), "verdict": verdict}


def mc_sampler(config: Config, paths: BundlePaths, manifest: dict) -> "MCSampler":
    """MC-dropout over the bundle's MC graph in the form --iterative_backend runs."""
    import onnx

    import iterative as it

    mc_model = onnx.load(str(require_onnx_in_bundle(paths, manifest, "mc")))
    graph = it.mc_model_for(config.iterative_backend, mc_model, config.iterations,
                            len(manifest["labels"]), config.seed)
    session = create_session(graph.SerializeToString(), config.runtime(), it.MC_SESSION_ARGS)
    output = "probabilities" if config.iterative_backend == "python" else it.PASSES_OUTPUT
    return it.MCSampler(config.iterative_backend, config.iterations,
                        session_runner(session, output), config.iterative_tol,
                        config.iterative_patience)


def ensemble_graph(config: Config, paths: BundlePaths, manifest: dict) -> tuple[object, int]:
    """The bundle's ensemble graph, or one merged from --model and the --ensemble bundles."""
    import onnx

    from iterative import ensemble_model

    if not config.ensemble:
        model = onnx.load(str(require_onnx_in_bundle(paths, manifest, "ensemble")))
        return model, manifest["extra_graphs"]["ensemble"]["members"]
    members = [onnx.load(str(require_onnx_in_bundle(paths, manifest)))]
    for item in (p.strip() for p in config.ensemble.split(",")):
        if not item:
            continue
        other_paths = BundlePaths.from_model_path(item)
        other = read_manifest(other_paths)
        if other["labels"] != manifest["labels"] or \
                other["preprocessing"] != manifest["preprocessing"]:
            raise ConfigError(f"--ensemble member {item} has other labels or preprocessing than "
                              f"{paths.onnx}", "ensemble bundles trained on the same data")
        members.append(onnx.load(str(require_onnx_in_bundle(other_paths, other))))
    return ensemble_model(members, len(manifest["labels"])), len(members)


def run_on_bundle(config: Config, paths: BundlePaths, variant: str,
                  test: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray] | None,
                  report: dict, *, benchmark: bool, baseline: Sequence[Variant] = ()) -> None:
    """The inference stage on one session of the chosen graph: accuracy, latency and throughput;
    then TTA (with --tta) and the benchmark table (`baseline` rows first), into `report`."""
    manifest, session, model_path = load_bundle_session(paths, config, variant)
    result = evaluate(session, *test, config, model_path)
    LOG.info("inference on %s: accuracy %.4f, p50 %.3f ms/batch of %d, %.0f samples/s",
             ", ".join(result.providers_active), result.accuracy, result.latency_ms_p50,
             config.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if config.tta:
        from tta import evaluate_tta

        tta = evaluate_tta(tta_runner(session, model_path, manifest, config), test, val,
                           config.tta_threshold)
        (LOG.warning if tta.lowers else LOG.info)("%s", tta.verdict)
        report["tta"] = tta.report_section()
    if config.ttt:
        report["ttt"] = run_ttt(config, paths, manifest, session_runner(session), test)
    if config.iterative != "none":
        report["iterative"] = run_iterative(config, paths, manifest, session, test)
    if benchmark:
        variants = [*baseline, *bundle_variants(paths, manifest, config)]
        report["benchmark"] = benchmark_variants(variants, *test, config.batch_size)


# ----------------------------------------------------------------------------- batch inference

Predictor = Callable[[np.ndarray], tuple[np.ndarray, dict[str, np.ndarray]]]


def chunk_predictor(config: Config, paths: BundlePaths, manifest: dict,
                    session: ort.InferenceSession, model_path: Path) -> tuple[Predictor, list[str]]:
    """encoded chunk → (probabilities, extra columns), with the test-time compute asked for
    (one of --tta, --ttt, --iterative), and the extra columns' names."""
    asked = [name for name, on in (("--tta", config.tta), ("--ttt", config.ttt),
                                   ("--iterative", config.iterative != "none")) if on]
    if len(asked) > 1:
        raise ConfigError(f"--input runs take one test-time method at a time, not "
                          f"{' and '.join(asked)}", "keep one of them")
    size = config.batch_size
    if config.tta:
        runner = tta_runner(session, model_path, manifest, config)
        return (lambda x: (runner(x), {})), []
    if config.ttt:
        return ttt_predictor(config, paths, manifest), []
    if config.iterative in ("mc_dropout", "ensemble"):
        return passes_predictor(config, paths, manifest), ["entropy", "std"]
    run = session_runner(session, state_passes=config.iterations
                         if config.iterative == "state" else 1)
    return (lambda x: (np.concatenate([run(b) for b in batches_of(x, size)]), {})), []


def ttt_predictor(config: Config, paths: BundlePaths, manifest: dict) -> Predictor:
    import onnx

    from ttt import AdaptationGraph, OnlineCarry, Tent, adapt_and_predict

    if config.ttt_method == "all":
        raise ConfigError("--ttt_method all compares methods on the test split; predictions "
                          "need one", "use --ttt_method bn or tent with --input")
    graph = AdaptationGraph(onnx.load(str(require_onnx_in_bundle(paths, manifest, "bn"))),
                            lambda m: create_session(m, config.runtime()))
    tent = (Tent(manifest, paths.weights, graph.layers, config.ttt_learning_rate,
                 config.ttt_iterations, config.num_threads)
            if config.ttt_method == "tent" else None)
    carry = OnlineCarry()  # online adaptation goes on from chunk to chunk of the input
    return lambda x: (adapt_and_predict(graph, config.ttt_method, x, config.batch_size,
                                        config.ttt_mode, config.ttt_bn_prior,
                                        config.ttt_reset_every, tent, carry).probabilities, {})


def passes_predictor(config: Config, paths: BundlePaths, manifest: dict) -> Predictor:
    """MC-dropout or ensemble: the mean, its entropy, and the std across passes (or members)
    of the predicted class's probability."""
    import iterative as it

    if config.iterative == "ensemble":
        model, _ = ensemble_graph(config, paths, manifest)
        run = session_runner(create_session(model.SerializeToString(), config.runtime()),
                             it.PASSES_OUTPUT)
        sampler = it.MCSampler("batched", 0, run)
    else:
        sampler = mc_sampler(config, paths, manifest)

    def predict(x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        passes = sampler(batches_of(x, config.batch_size))
        mean = passes.mean
        chosen = mean.argmax(1)
        return mean, {"entropy": it.entropy(mean),
                      "std": passes.std[np.arange(len(mean)), chosen]}

    return predict


def prefetched(chunks, depth: int = 2):
    """Read and encode the next chunks in a thread while the model runs on this one (ONNX
    Runtime releases the GIL); the reader's errors are raised here."""
    import queue
    import sys
    import threading

    # The reader holds the GIL while it tokenises; hand it back to the model thread sooner than
    # the default 5 ms after each session.run (SMS texts at batch 256: 18k → 26k rows/s).
    sys.setswitchinterval(0.0001)
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for chunk in chunks:
                items.put(chunk)
            items.put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            items.put(err)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = items.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


@dataclass
class BatchRun:
    input: str
    output: str
    rows: int = 0
    predicted: int = 0
    failed: int = 0
    labeled: int = 0
    correct: int = 0
    errors_path: str | None = None
    seconds: float = 0.0

    def report_section(self) -> dict:
        section = dict(vars(self))
        section["accuracy"] = self.correct / self.labeled if self.labeled else None
        section["rows_per_s"] = round(self.predicted / self.seconds, 1) if self.seconds else None
        del section["correct"]
        return section


def predict_input(config: Config, paths: BundlePaths, report: dict) -> None:
    """--input → --output: chunks read in a thread, predicted, and written as they come, to a
    temporary file moved into place at the end (and the errors to --errors likewise)."""
    from stream import PredictionWriter, StreamOptions, input_chunks
    from utils import atomic_write_stream

    variant = "fp16" if config.fp16 else "int8" if config.quantized else "onnx"
    manifest, session, model_path = load_bundle_session(paths, config, variant)
    predict, extra_names = chunk_predictor(config, paths, manifest, session, model_path)
    chunk_rows = config.chunk_rows
    if config.ttt:  # whole adaptation batches per chunk, as if the input were read at once
        chunk_rows = -(-chunk_rows // config.batch_size) * config.batch_size
    options = StreamOptions(config.input, chunk_rows, config.label_column,
                            config.text_column, config.image_column, config.dataset_format)
    chunks = input_chunks(manifest, options)
    run = BatchRun(config.input, config.output, errors_path=config.errors)
    fmt = Path(config.output).suffix.lower().lstrip(".")
    labels = manifest["labels"]
    error_rows: list[tuple[str, str]] = []
    started = time.perf_counter()
    with atomic_write_stream(config.output) as handle:
        writer = None
        for chunk in progress(prefetched(chunks), desc="predict", enabled=not config.no_progress):
            run.rows += len(chunk.ids) + len(chunk.errors)
            run.failed += len(chunk.errors)
            error_rows += chunk.errors
            if chunk.x is None:
                continue
            if writer is None:
                writer = PredictionWriter(handle, fmt, labels, min(config.top_k, len(labels)),
                                          chunk.labels is not None, extra_names)
            probabilities, extra = predict(chunk.x)
            writer.write(chunk.ids, probabilities, extra, chunk.labels)
            run.predicted += len(chunk.ids)
            if chunk.labels is not None:
                index = {label: i for i, label in enumerate(labels)}
                known = [(i, index.get(t)) for i, t in enumerate(chunk.labels) if t is not None]
                run.labeled += len(known)
                run.correct += sum(probabilities[i].argmax() == k for i, k in known)
        if writer is None:
            PredictionWriter(handle, fmt, labels, min(config.top_k, len(labels)), False,
                             extra_names)
    run.seconds = round(time.perf_counter() - started, 3)
    if config.errors:
        write_errors(config.errors, error_rows)
    report["predictions"] = run.report_section()
    LOG.info("predicted %d of %d rows into %s (%.0f rows/s)%s", run.predicted, run.rows,
             config.output, run.predicted / max(run.seconds, 1e-9),
             f", {run.failed} failed" if run.failed else "")
    if run.rows == 0:
        raise DataError(f"{config.input} has no rows to predict", "check the input")
    if run.failed and not config.allow_errors:
        where = f"listed in {config.errors}" if config.errors else "add --errors PATH to list them"
        raise DataError(f"{run.failed} of {run.rows} rows could not be predicted ({where}); the "
                        f"other predictions are in {config.output}",
                        "fix those rows, or pass --allow_errors true")


def write_errors(path: str, rows: Sequence[tuple[str, str]]) -> None:
    import csv as csv_module

    from stream import neutralised
    from utils import atomic_write_stream

    with atomic_write_stream(path) as handle:
        writer = csv_module.writer(handle)
        writer.writerow(["id", "reason"])
        writer.writerows([neutralised(ident), neutralised(reason)] for ident, reason in rows)


# ----------------------------------------------------------------------------- CLI

INFERENCE_FLAGS = ["output_model", "input", "output", "errors", "allow_errors", "top_k",
                   "chunk_rows", "json", "quiet", "label_column", "text_column", "image_column",
                   "dataset_format", "dataset_path", "quantized", "fp16", "tta", "tta_transforms",
                   "tta_merge", "tta_threshold", "ttt", "ttt_method", "ttt_mode",
                   "ttt_reset_every", "ttt_bn_prior", "ttt_iterations", "ttt_learning_rate",
                   "eval_shift", "shift_severity", "iterative", "iterations",
                   "iterative_backend", "iterative_tol", "iterative_patience", "ensemble",
                   "seed", "benchmark", "batch_size", "ep",
                   "ep_options", "strict_ep", "num_threads", "intra_op_threads",
                   "inter_op_threads", "execution_mode", "report_json", "log_level",
                   "no_progress"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "inference.py", "Evaluate a model bundle with ONNX Runtime on the test split of its "
        "dataset (or of --dataset_path): accuracy, latency p50/p95 and throughput.",
        INFERENCE_FLAGS, required=["output_model"], aliases={"output_model": ["--model"]},
        epilog="example:\n  python inference.py --model runs/digits/model.onnx --batch_size 64 "
               "--ep cpu --report_json runs/digits/inference.json")
    config = start_cli(parser, argv, INFERENCE_FLAGS)

    def stages(report: dict) -> None:
        paths = BundlePaths.from_model_path(config.output_model)
        manifest = read_manifest(paths)
        config.validate_tta(manifest["model_type"])
        if config.input:
            predict_input(config, paths, report)
            return
        from data import load_bundle_dataset

        data = load_bundle_dataset(manifest, config.dataset_path,
                                   ("val", "test") if config.tta else ("test",),
                                   not config.no_progress)
        report["dataset"] = data.report_section()
        variant = "fp16" if config.fp16 else "int8" if config.quantized else "onnx"
        if variant != "onnx":
            verdict = manifest.get("quantization" if variant == "int8" else "fp16") or {}
            if verdict and not verdict.get("used_for_inference"):
                LOG.warning("using the %s graph as asked, although it was judged: %s", variant,
                            verdict.get("verdict"))
        val = (data.val.x, data.val.y) if config.tta else None
        run_on_bundle(config, paths, variant, (data.test.x, data.test.y), val, report,
                      benchmark=config.benchmark)

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
