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

from ttc.serving.bundle import (BundlePaths, network_temperature, read_manifest, require_onnx_in_bundle,
                    require_trusted_model_code)
from config import Config, build_parser, start_cli
from ttc.reporting.evaluation import Tally, bundle_evaluation
from ttc.reporting.metrics import accuracy, ece_change_interval, entropy
from ttc.serving.profiling import PROFILED_RUNS, profile_runs, profile_section, profiled_batches
from report import run_with_report
from ttc.serving.runtime import (batches_of, best_of, create_session, graph_padding_id, input_padding_id,
                     predict_proba, session_device, session_runner, state_input, time_runners,
                     whole_batches)
from utils import LOG, ConfigError, ExportError, RuntimeFailure, exit_cli, run_cli

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import BatchOptions, Predictor
    from ttc.testtime.iterative import MCSampler, Passes
    from ttc.serving.runtime import RuntimeOptions
    from ttc.testtime.tta import TTAOptions, TTARunner
    from ttc.testtime.ttt import AdaptationGraph, Tent, TTTSettings


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


def bundle_variants(paths: BundlePaths, manifest: dict, config: Config) -> list[Variant]:
    """ONNX Runtime fp32, and int8 when the bundle has it, on the requested providers."""
    variants = []
    for variant, label in (("onnx", "onnxruntime fp32"), ("int8", "onnxruntime int8"),
                           ("fp16", "onnxruntime fp16")):
        if variant != "onnx" and variant not in (manifest.get("files") or {}):
            continue
        path = require_onnx_in_bundle(paths, manifest, variant)
        session = create_session(str(path), config.runtime(), classes=len(manifest["labels"]))
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
    session = create_session(str(model_path), config.runtime(), classes=len(manifest["labels"]))
    graph_input = session.get_inputs()[0]
    if graph_input.name != manifest["input"]["name"]:
        raise ExportError(f"{paths.onnx} takes input {graph_input.name!r} but its manifest says "
                          f"{manifest['input']['name']!r}", "re-run export.py or pipeline.py")
    return manifest, session, model_path


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


def tta_runner(session: ort.InferenceSession, model_path: Path, manifest: dict,
               options: TTAOptions, runtime: RuntimeOptions) -> TTARunner:
    """TTA on the chosen graph: in one ONNX graph with the views and the merge (a second session
    on the same providers) where the transforms allow, else numpy views around `session`."""
    import onnx

    from ttc.testtime.tta import TTARunner, build_transforms, tta_model

    transforms = build_transforms(options.transforms, manifest["preprocessing"], options.seed)
    model = tta_model(onnx.load(str(model_path)), transforms, options.merge,
                      len(manifest["labels"]))
    merged = None
    if model is not None:
        merged = session_runner(create_session(model.SerializeToString(), runtime,
                                               classes=len(manifest["labels"]), source=model_path))
    return TTARunner(session_runner(session), transforms, options.merge, options.batch_size,
                     merged)


def run_ttt(config: Config, paths: BundlePaths, manifest: dict,
            predict: Callable[[np.ndarray], np.ndarray], test: tuple[np.ndarray, np.ndarray]
            ) -> dict:
    """Test-time training on the bundle's adaptation graph, on the test split and its corrupted
    copies; `predict` (the chosen graph, unadapted) is the baseline. torch only for tent."""
    from ttc.testtime.ttt import evaluate_ttt

    settings = config.ttt_settings(manifest["preprocessing"]["kind"])
    graph, tent = adaptation(settings, paths, manifest, config.runtime())
    result = evaluate_ttt(settings, graph, predict, tent, *test, manifest["preprocessing"])
    for warning in result.warnings:
        LOG.warning("test-time training: %s", warning)
    LOG.info("test-time training: %s", result.verdict)
    return result.report_section()


Variants = Callable[[np.ndarray], dict]  # inputs → {variant name: probabilities}


def single_variants(session: ort.InferenceSession, manifest: dict, batch_size: int) -> Variants:
    """The single pass without the temperature (softmax of the graph's logits) and, for a
    calibrated bundle, with it (the graph's probabilities)."""
    calibrated = network_temperature(manifest) != 1.0

    def variants(x: np.ndarray) -> dict:
        out = {"single": without_temperature(session, x, batch_size)}
        if calibrated:
            out["single+T"] = predict_proba(session, x, batch_size)
        return out

    return variants


def averaged_variants(name: str, passes: Callable[[np.ndarray], "Passes"],
                      temperature: float | None) -> Variants:
    """An average of passes or members, and the average rescaled by its own temperature."""
    from ttc.testtime.calibrate import rescale

    def variants(x: np.ndarray) -> dict:
        mean = passes(x).mean
        return {name: mean, **({f"{name}+T": rescale(mean, temperature)}
                               if temperature is not None else {})}

    return variants


def without_temperature(session: ort.InferenceSession, x: np.ndarray, batch_size: int
                        ) -> np.ndarray | None:
    """softmax(logits) of the graph on x: the single pass without its temperature (None for a
    graph without a logits output)."""
    from ttc.testtime.calibrate import softmax

    if "logits" not in {o.name for o in session.get_outputs()}:
        return None
    return softmax(predict_proba(session, x, batch_size, "logits"))


def run_calibration(config: Config, manifest: dict, raw: np.ndarray | None,
                    probabilities: np.ndarray, y: np.ndarray) -> dict | None:
    """The report's `calibration`: the bundle's temperature and what it does on the test split,
    from the single pass without (`raw`) and with it (None without a raw pass)."""
    from ttc.testtime.calibrate import calibration_section, no_fit

    if raw is None:
        return None
    fit = manifest.get("calibration") or no_fit(
        "a bundle written before calibration: re-run pipeline.py to fit a temperature"
    ).manifest_entry()
    section = calibration_section(fit, raw, probabilities, y, config.seed)
    (LOG.warning if section["ece_change_interval_90"][0] > 0 else LOG.info)(
        "calibration: %s", section["verdict"])
    return section


def calibration_under_shift(config: Config, manifest: dict, variants: Variants,
                            test: tuple[np.ndarray, np.ndarray]) -> dict:
    """--eval_shift: accuracy, ECE and NLL of every variant on each corrupted copy of the test
    split (Ovadia et al. 2019's protocol), and which variant is best calibrated on average."""
    from ttc.testtime.calibrate import best_calibrated, shift_rows
    from ttc.inputs.shifts import corrupt, parse_shift_names

    x, y = test
    shifts = []
    for name in parse_shift_names(config.eval_shift, manifest["preprocessing"]["kind"]):
        shifted = corrupt(x, name, config.shift_severity, manifest["preprocessing"], config.seed)
        shifts.append({"name": name, "severity": config.shift_severity,
                       "rows": shift_rows(variants(shifted), y)})
    best = best_calibrated(shifts)
    LOG.info("calibration under shift (severity %d): mean ECE %s; best calibrated: %s",
             config.shift_severity, ", ".join(f"{k} {v:.4f}" for k, v in best["mean_ece"].items()),
             best["best"])
    return {"shifts": shifts, "under_shift": best}


def run_iterative(config: Config, paths: BundlePaths, manifest: dict,
                  session: ort.InferenceSession, test: tuple[np.ndarray, np.ndarray],
                  raw: np.ndarray | None) -> tuple[dict, Variants | None]:
    """The chosen iterative mode against a single pass: accuracy, NLL, ECE, accuracy at 90%
    coverage, passes used and cost, on the test split, each without and with its temperature
    (the single pass: the bundle's; an average: its own, calibrate.rescale). Also the mode's
    variants as a function of the inputs (--eval_shift), None for state. `raw`: the test
    split's single pass without temperature (None: the graph has no logits output)."""
    from ttc.testtime import iterative as it

    x, y = test
    batches = batches_of(x, config.batch_size, input_padding_id(manifest["input"]))
    single = session_runner(session)
    single(batches[0])
    single_seconds, single_probs = best_of(3, lambda: np.concatenate([single(b) for b in batches]))
    raw = single_probs if raw is None else raw
    rows = [it.calibration_row("single", raw, y, single_seconds, single_seconds, 1)]
    temperature = network_temperature(manifest)
    if temperature != 1.0 and raw is not single_probs:
        rows.append(it.calibration_row("single+T", single_probs, y, single_seconds,
                                       single_seconds, 1, temperature=temperature))
    variants = None
    if config.iterative in ("mc_dropout", "ensemble"):
        method_probs, more, variants = run_averaged(config, paths, manifest, batches, y,
                                                    single_seconds)
        rows += more
    else:  # state: the bundle's session fed its state K times
        if state_input(session) is None:
            raise RuntimeFailure("--iterative state needs a graph with a 'state' input and a "
                                 "'state_out' output", "see docs/test-time-compute.md, Iterative inference")
        looped = session_runner(session, state_passes=config.iterations)
        seconds, method_probs = best_of(1, lambda: np.concatenate([looped(b) for b in batches]))
        rows.append(it.calibration_row("state_feedback", method_probs, y, seconds,
                                       single_seconds, config.iterations))
    it.log_rows(rows)
    method = next(r for r in rows if r["variant"] in ("mc_dropout", "ensemble", "state_feedback"))
    interval = ece_change_interval(raw, method_probs, y, seed=config.seed)
    verdict = it.calibration_verdict(rows[0], method, interval, len(y))
    (LOG.warning if method["ece"] > rows[0]["ece"] else LOG.info)("%s", verdict)
    best = min(rows, key=lambda r: r["ece"])
    return {"mode": config.iterative, "backend": config.iterative_backend,
            "iterations": config.iterations, "passes_used": method["passes_used"],
            "rows": rows, "ece_change": method["ece"] - rows[0]["ece"],
            "ece_change_interval_90": list(interval), "verdict": verdict,
            "best_calibrated": best["variant"]}, variants


def run_averaged(config: Config, paths: BundlePaths, manifest: dict,
                 batches: list[np.ndarray], y: np.ndarray, single_seconds: float
                 ) -> tuple[np.ndarray, list[dict], Variants]:
    """MC-dropout or an ensemble on the test batches: its mean, its row and, where its average
    has a temperature, its "+T" row; and its variants as a function of the inputs."""
    from ttc.testtime import iterative as it
    from ttc.testtime.calibrate import rescale

    name, members = config.iterative, None
    if name == "mc_dropout":
        sampler, temperature = mc_sampler(config, paths, manifest)
    else:
        sampler, temperature, members = ensemble_sampler(config, paths, manifest)
    sampler(batches[:1])  # warm-up
    seconds, passes = best_of(1, lambda: sampler(batches))
    used = passes.passes_used if members is None else members
    rows = [it.calibration_row(name, passes.mean, y, seconds, single_seconds, used)]
    if temperature is not None:
        rows.append(it.calibration_row(f"{name}+T", rescale(passes.mean, temperature), y,
                                       seconds, single_seconds, used, temperature=temperature))
    pad = input_padding_id(manifest["input"])
    variants = averaged_variants(
        name, lambda x: sampler(batches_of(x, config.batch_size, pad)), temperature)
    return passes.mean, rows, variants


def mc_sampler(config: Config, paths: BundlePaths, manifest: dict
               ) -> tuple["MCSampler", float | None]:
    """MC-dropout over the bundle's MC graph in the form --iterative_backend runs, the passes
    taken from the graph's logits (uncalibrated); and the temperature of their average (None
    for a bundle without one)."""
    import onnx

    from ttc.testtime import iterative as it
    from ttc.testtime.calibrate import softmax

    mc_path = require_onnx_in_bundle(paths, manifest, "mc")
    mc_model = onnx.load(str(mc_path))
    graph = it.mc_model_for(config.iterative_backend, mc_model, config.iterations,
                            len(manifest["labels"]), config.seed)
    session = create_session(graph.SerializeToString(), config.runtime(), it.MC_SESSION_ARGS,
                             classes=len(manifest["labels"]), source=mc_path)
    if config.iterative_backend == "python":
        logits = session_runner(session, "logits")
        run = lambda batch: softmax(logits(batch)).astype(np.float32)  # noqa: E731
    else:
        run = session_runner(session, it.PASSES_OUTPUT)
    info = (manifest.get("extra_graphs") or {}).get("mc") or {}
    fitted_passes = (info.get("temperature_fit") or {}).get("passes")
    if info.get("temperature") is not None and fitted_passes != config.iterations:
        LOG.info("the MC-dropout average's temperature was fitted with %s passes, this run "
                 "takes %d", fitted_passes, config.iterations)
    return (it.MCSampler(config.iterative_backend, config.iterations, run, config.iterative_tol,
                         config.iterative_patience), info.get("temperature"))


def ensemble_sampler(config: Config, paths: BundlePaths, manifest: dict
                     ) -> tuple["MCSampler", float | None, int]:
    """The ensemble's members (uncalibrated) per batch, the temperature of their average (the
    bundle's ensemble graph's; None for --ensemble bundles merged here) and their count."""
    from ttc.testtime import iterative as it

    model, members = ensemble_graph(config, paths, manifest)
    source = paths.variant("ensemble") if not config.ensemble else "the --ensemble graphs"
    run = session_runner(create_session(model.SerializeToString(), config.runtime(),
                                        classes=len(manifest["labels"]), source=source),
                         it.PASSES_OUTPUT)
    temperature = None
    if not config.ensemble:
        temperature = manifest["extra_graphs"]["ensemble"].get("temperature")
    return it.MCSampler("batched", 0, run), temperature, members


def ensemble_graph(config: Config, paths: BundlePaths, manifest: dict) -> tuple[object, int]:
    """The bundle's ensemble graph, or one merged from --model and the --ensemble bundles."""
    import onnx

    from ttc.testtime.iterative import ensemble_model

    if not config.ensemble:
        model = onnx.load(str(require_onnx_in_bundle(paths, manifest, "ensemble")))
        return model, manifest["extra_graphs"]["ensemble"]["members"]
    members = [onnx.load(str(require_onnx_in_bundle(paths, manifest)))]
    for item in config.ensemble_members():
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
    result, probabilities = evaluate(session, *test, config, model_path)
    LOG.info("inference on %s: accuracy %.4f, p50 %.3f ms/batch of %d, %.0f samples/s",
             ", ".join(result.providers_active), result.accuracy, result.latency_ms_p50,
             config.batch_size, result.throughput_per_s)
    report["inference"] = result.report_section()
    if config.profile:
        report["profile"] = profile_graph(config, model_path, test[0], graph_padding_id(session))
    report["evaluation"] = bundle_evaluation(manifest, Tally(len(manifest["labels"])).add(
        probabilities, test[1]))
    raw = without_temperature(session, test[0], config.batch_size)
    report["calibration"] = run_calibration(config, manifest, raw, probabilities, test[1])
    if config.tta:
        from ttc.testtime.tta import evaluate_tta

        tta = evaluate_tta(tta_runner(session, model_path, manifest, config.tta_options(),
                                      config.runtime()), test, val,
                           config.tta_threshold)
        (LOG.warning if tta.lowers else LOG.info)("%s", tta.verdict)
        report["tta"] = tta.report_section()
    if config.ttt:
        report["ttt"] = run_ttt(config, paths, manifest, session_runner(session), test)
    variants = single_variants(session, manifest, config.batch_size)
    if config.iterative != "none":
        report["iterative"], more = run_iterative(config, paths, manifest, session, test, raw)
        if more is not None:
            variants = joined(variants, more)
    if config.eval_shift and report["calibration"] is not None:
        report["calibration"].update(calibration_under_shift(config, manifest, variants, test))
    if benchmark:
        variants = [*baseline, *bundle_variants(paths, manifest, config)]
        report["benchmark"] = benchmark_variants(variants, *test, config.batch_size,
                                                 input_padding_id(manifest["input"]))


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


def joined(*parts: Variants) -> Variants:
    return lambda x: {name: p for part in parts for name, p in part(x).items()}


# ----------------------------------------------------------------------------- batch inference


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
        runner = tta_runner(session, model_path, manifest, config.tta_options(),
                            config.runtime())
        return (lambda x: (runner(x), {})), []
    if config.ttt:
        return ttt_predictor(config, paths, manifest), []
    if config.iterative in ("mc_dropout", "ensemble"):
        return passes_predictor(config, paths, manifest), ["entropy", "std"]
    run = session_runner(session, state_passes=config.iterations
                         if config.iterative == "state" else 1)
    if manifest["preprocessing"]["kind"] == "text":
        return by_length(run, size, input_padding_id(manifest["input"])), []
    return (lambda x: (np.concatenate([run(b) for b in batches_of(x, size)]), {})), []


def by_length(run: Callable[[np.ndarray], np.ndarray], size: int, pad_id: int) -> Predictor:
    """Token ids → probabilities in the rows' order, the rows batched by length: a batch is
    padded to its longest text, so texts of like length waste the least compute (3.2-3.5x the
    throughput for a transformer on SMS texts, benchmarks.md). Each row is predicted on its own
    here (no test-time method adapts to the batch on this path), so the order changes the speed
    only, up to float rounding; dynamic int8 quantizes activations by each batch's range, so
    there a row's probabilities move by about 1e-3 with its batch, in any order."""

    def predict(x: np.ndarray) -> tuple[np.ndarray, dict]:
        order = np.argsort((x != pad_id).sum(axis=1), kind="stable")
        probabilities = np.concatenate([run(b) for b in batches_of(x[order], size, pad_id)])
        restored = np.empty_like(probabilities)
        restored[order] = probabilities
        return restored, {}

    return predict


def adaptation(settings: TTTSettings, paths: BundlePaths, manifest: dict,
               runtime: RuntimeOptions) -> tuple[AdaptationGraph, Tent | None]:
    """The graph test-time training adapts, and Tent's PyTorch copy when a method needs it: a
    network with BatchNorm adapts the bundle's model.bn.onnx; one without, model.onnx itself,
    whose LayerNorm/GroupNorm nodes keep their parameters, with tent only (bn alone is exit 2;
    with `all` it is reported not applicable)."""
    import onnx

    from ttc.testtime.ttt import AdaptationGraph, Tent

    variant = "onnx" if require_ttt_method_applies(settings.method, manifest) else "bn"
    path = require_onnx_in_bundle(paths, manifest, variant)
    graph = AdaptationGraph(onnx.load(str(path)), lambda m: create_session(
        m, runtime, classes=len(manifest["labels"]), source=path))
    tent = (Tent(manifest, paths.weights, graph.layers, settings.learning_rate,
                 settings.iterations, settings.num_threads, settings.trust_model_code)
            if "tent" in settings.methods else None)
    return graph, tent


def without_batchnorm(manifest: dict) -> bool:
    """Whether the bundle's network has no BatchNorm: an --arch known to have none
    (config.norm_without_batchnorm), or a bundle whose export listed its extra graphs without
    model.bn.onnx (export writes it wherever BatchNorm exists). A bundle from before the extra
    graphs counts as having BatchNorm: its missing model.bn.onnx is exit 4 with the command that
    adds it."""
    from config import norm_without_batchnorm

    extra = manifest.get("extra_graphs")
    return (norm_without_batchnorm(manifest["architecture"].get("arch")) is not None
            or (extra is not None and "bn" not in extra
                and "bn" not in (manifest.get("files") or {})))


def require_ttt_method_applies(method: str, manifest: dict) -> bool:
    """Whether the bundle's network has no BatchNorm; then `--ttt_method bn` alone is exit 2
    (checked before any data is read)."""
    from config import no_batchnorm_error, norm_without_batchnorm

    if not without_batchnorm(manifest):
        return False
    arch = manifest["architecture"].get("arch")
    if method == "bn" and norm_without_batchnorm(arch):
        raise no_batchnorm_error(arch)
    if method == "bn":
        raise ConfigError("--ttt_method bn re-estimates BatchNorm statistics, and this bundle's "
                          "network has none (its export wrote no model.bn.onnx)",
                          "use --ttt_method tent, which adapts LayerNorm and GroupNorm affine "
                          "parameters")
    return True


def ttt_predictor(config: Config, paths: BundlePaths, manifest: dict) -> Predictor:
    from ttc.testtime.ttt import OnlineCarry, adapt_and_predict

    if config.ttt_method == "all":
        raise ConfigError("--ttt_method all compares methods on the test split; predictions "
                          "need one", "use --ttt_method bn or tent with --input")
    settings = config.ttt_settings(manifest["preprocessing"]["kind"])
    graph, tent = adaptation(settings, paths, manifest, config.runtime())
    carry = OnlineCarry()  # online adaptation goes on from chunk to chunk of the input
    return lambda x: (adapt_and_predict(graph, settings.method, x, settings.batch_size,
                                        settings.mode, settings.bn_prior, settings.reset_every,
                                        tent, carry).probabilities, {})


def passes_predictor(config: Config, paths: BundlePaths, manifest: dict) -> Predictor:
    """MC-dropout or ensemble: the mean (rescaled by its temperature where the bundle has one),
    its entropy, and the std across passes (or members) of the predicted class's probability."""
    from ttc.testtime.calibrate import rescale

    if config.iterative == "ensemble":
        sampler, temperature, _ = ensemble_sampler(config, paths, manifest)
    else:
        sampler, temperature = mc_sampler(config, paths, manifest)

    def predict(x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        passes = sampler(batches_of(x, config.batch_size, input_padding_id(manifest["input"])))
        mean = passes.mean if temperature is None else \
            rescale(passes.mean, temperature).astype(np.float32)
        chosen = mean.argmax(1)
        return mean, {"entropy": entropy(mean),
                      "std": passes.std[np.arange(len(mean)), chosen]}

    return predict


def predict_new_data(config: Config, paths: BundlePaths, report: dict) -> None:
    """--input: the chosen graph with the test-time compute asked for, over the input's chunks:
    in this process (batch.py), or on Ray workers (cluster.py) running the same predictor."""
    from ttc.serving.batch import BatchOptions, predict_input

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


def keeping_first_rows(predict: Predictor, seen: list[np.ndarray], rows: int) -> Predictor:
    """`predict`, keeping in `seen` the first `rows` encoded rows it is given (what --profile
    then profiles the graph on, after the input is predicted)."""

    def keep(x: np.ndarray) -> tuple[np.ndarray, dict]:
        wanted = rows - sum(len(part) for part in seen)
        if wanted > 0:
            seen.append(x[:wanted].copy())
        return predict(x)

    return keep


def input_variant(config: Config) -> str:
    return "fp16" if config.fp16 else "int8" if config.quantized else "onnx"


def worker_predictor(config: Config) -> tuple[Predictor, list[str]]:
    """The local engine's predictor, built on a Ray worker (cluster.PredictorFactory)."""
    paths = BundlePaths.from_model_path(config.output_model)
    manifest, session, model_path = load_bundle_session(paths, config, input_variant(config))
    return chunk_predictor(config, paths, manifest, session, model_path)


def predict_with_ray(config: Config, paths: BundlePaths, options: BatchOptions,
                     report: dict) -> None:
    """--engine ray: workers with --num_threads ONNX Runtime intra-op threads each (their
    num_cpus: Ray's OMP_NUM_THREADS does not reach ONNX Runtime) and one inter-op thread, the
    bundle read by absolute path."""
    import dataclasses
    import functools

    from ttc.serving.cluster import RayOptions, predict_on_ray

    threads = config.ray_threads()
    worker_config = dataclasses.replace(
        config, intra_op_threads=threads, inter_op_threads=1, no_progress=True,
        output_model=str(Path(config.output_model).absolute()))
    # the workers' predictor built once here: a bundle, provider or test-time method that cannot
    # work fails now, with its own message, not as a worker that dies at start on the cluster
    manifest, session, model_path = load_bundle_session(paths, worker_config,
                                                        input_variant(config))
    chunk_predictor(worker_config, paths, manifest, session, model_path)
    gpu = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
    del session
    predict_on_ray(options, manifest, functools.partial(worker_predictor, worker_config), report,
                   RayOptions(None if config.local_ray() else config.ray_address,
                              config.ray_workers(),
                              options.chunk_rows, threads, 1.0 if gpu else 0.0,
                              config.log_level == "DEBUG"))


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
        manifest = read_manifest(paths)
        if config.ttt and config.ttt_method in ("tent", "all"):  # Tent rebuilds it in PyTorch
            require_trusted_model_code(manifest, paths, config.trust_model_code)
        require_onnx_in_bundle(paths, manifest)  # graph and manifest agree, before any data
        config.validate_tta(manifest["model_type"])
        if config.ttt:
            require_ttt_method_applies(config.ttt_method, manifest)
        if config.input:
            predict_new_data(config, paths, report)
            return
        from ttc.inputs.data import load_bundle_dataset, split_paths_of

        data = load_bundle_dataset(manifest, config.dataset_path,
                                   ("val", "test") if config.tta else ("test",),
                                   not config.no_progress, split_paths_of(config),
                                   ", or --input PATH to predict new data")
        report["dataset"] = data.report_section()
        variant = input_variant(config)
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
