"""Iterative inference as inference.py runs it (`--iterative mc_dropout|ensemble|state`, each
--iterative_backend): the registry's entry, its options, the samplers it opens on a bundle, and
the comparison with a single pass. The graphs, backends and rows are iterative.py's; this module
only wires them to a served bundle. Light at import (iterative.py, which imports onnx, loads
when the method runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ttc.reporting.metrics import ece_change_interval, entropy
from ttc.serving.bundle import BundlePaths, read_manifest, require_onnx_in_bundle
from ttc.serving.manifest import ExtraGraph
from ttc.serving.runtime import batches_of, best_of, create_session, session_runner, state_input
from ttc.testtime.calibration import averaged_variants
from ttc.testtime.served import Evaluation, Heldout, RunFlags, Served, Variants, plain_predictor
from utils import LOG, ConfigError, RuntimeFailure

if TYPE_CHECKING:
    from ttc.serving.batch import Predictor
    from ttc.serving.manifest import Manifest
    from ttc.testtime.iterative import MCSampler


@dataclass(frozen=True)
class IterativeOptions:
    """What iterative inference takes from the flags. `ensemble`: the --ensemble bundles merged
    with the served one (None: the bundle's own ensemble graph)."""

    mode: str  # mc_dropout, ensemble or state
    backend: str
    iterations: int
    tol: float | None
    patience: int
    ensemble: tuple[str, ...] | None
    batch_size: int
    seed: int


@dataclass(frozen=True)
class Iterative:
    flag: ClassVar[str] = "--iterative"
    key: ClassVar[str] = "iterative"

    def asked(self, flags: RunFlags) -> bool:
        return flags.iterative != "none"

    def options(self, flags: RunFlags, manifest: Manifest) -> IterativeOptions:
        return IterativeOptions(flags.iterative, flags.iterative_backend, flags.iterations,
                                flags.iterative_tol, flags.iterative_patience,
                                tuple(flags.ensemble_members()) if flags.ensemble else None,
                                flags.batch_size, flags.seed)

    def evaluate(self, flags: RunFlags, served: Served, heldout: Heldout) -> Evaluation:
        section, variants = run_iterative(self.options(flags, served.manifest), served,
                                          heldout.test, heldout.raw)
        return Evaluation(section, variants)

    def predictor(self, flags: RunFlags, served: Served) -> tuple[Predictor, list[str]]:
        options = self.options(flags, served.manifest)
        if options.mode in ("mc_dropout", "ensemble"):
            return passes_predictor(options, served), ["entropy", "std"]
        return plain_predictor(served, options.batch_size, state_passes=options.iterations)


def run_iterative(options: IterativeOptions, served: Served, test: tuple[np.ndarray, np.ndarray],
                  raw: np.ndarray | None) -> tuple[dict, Variants | None]:
    """The chosen iterative mode against a single pass: accuracy, NLL, ECE, accuracy at 90%
    coverage, passes used and cost, on the test split, each without and with its temperature
    (the single pass: the bundle's; an average: its own, calibrate.rescale). Also the mode's
    variants as a function of the inputs (--eval_shift), None for state. `raw`: the test
    split's single pass without temperature (None: the graph has no logits output)."""
    from ttc.testtime import iterative as it

    x, y = test
    batches = batches_of(x, options.batch_size, served.pad_id)
    single = session_runner(served.session)
    single(batches[0])
    single_seconds, single_probs = best_of(3, lambda: np.concatenate([single(b) for b in batches]))
    raw = single_probs if raw is None else raw
    rows = [it.calibration_row("single", raw, y, single_seconds, single_seconds, 1)]
    temperature = served.manifest.temperature
    if temperature != 1.0 and raw is not single_probs:
        rows.append(it.calibration_row("single+T", single_probs, y, single_seconds,
                                       single_seconds, 1, temperature=temperature))
    variants = None
    if options.mode in ("mc_dropout", "ensemble"):
        method_probs, more, variants = run_averaged(options, served, batches, y, single_seconds)
        rows += more
    else:
        method_probs = run_state(options, served, batches, y, single_seconds, rows)
    it.log_rows(rows)
    method = next(r for r in rows if r["variant"] in ("mc_dropout", "ensemble", "state_feedback"))
    interval = ece_change_interval(raw, method_probs, y, seed=options.seed)
    verdict = it.calibration_verdict(rows[0], method, interval, len(y))
    (LOG.warning if method["ece"] > rows[0]["ece"] else LOG.info)("%s", verdict)
    best = min(rows, key=lambda r: r["ece"])
    return {"mode": options.mode, "backend": options.backend,
            "iterations": options.iterations, "passes_used": method["passes_used"],
            "rows": rows, "ece_change": method["ece"] - rows[0]["ece"],
            "ece_change_interval_90": list(interval), "verdict": verdict,
            "best_calibrated": best["variant"]}, variants


def run_state(options: IterativeOptions, served: Served, batches: list[np.ndarray],
              y: np.ndarray, single_seconds: float, rows: list[dict]) -> np.ndarray:
    """State: the bundle's session fed its state K times on the test batches; its row appended
    to `rows`, its probabilities returned."""
    from ttc.testtime import iterative as it

    if state_input(served.session) is None:
        raise RuntimeFailure("--iterative state needs a graph with a 'state' input and a "
                             "'state_out' output",
                             "see docs/test-time-compute.md, Iterative inference")
    looped = session_runner(served.session, state_passes=options.iterations)
    seconds, probs = best_of(1, lambda: np.concatenate([looped(b) for b in batches]))
    rows.append(it.calibration_row("state_feedback", probs, y, seconds, single_seconds,
                                   options.iterations))
    return probs


def run_averaged(options: IterativeOptions, served: Served, batches: list[np.ndarray],
                 y: np.ndarray, single_seconds: float
                 ) -> tuple[np.ndarray, list[dict], Variants]:
    """MC-dropout or an ensemble on the test batches: its mean, its row and, where its average
    has a temperature, its "+T" row; and its variants as a function of the inputs."""
    from ttc.testtime import iterative as it
    from ttc.testtime.calibrate import rescale

    name = options.mode
    sampler, temperature, members = sampler_for(options, served)
    sampler(batches[:1])  # warm-up
    seconds, passes = best_of(1, lambda: sampler(batches))
    used = passes.passes_used if members is None else members
    rows = [it.calibration_row(name, passes.mean, y, seconds, single_seconds, used)]
    if temperature is not None:
        rows.append(it.calibration_row(f"{name}+T", rescale(passes.mean, temperature), y,
                                       seconds, single_seconds, used, temperature=temperature))
    variants = averaged_variants(
        name, lambda x: sampler(batches_of(x, options.batch_size, served.pad_id)), temperature)
    return passes.mean, rows, variants


def sampler_for(options: IterativeOptions, served: Served
                ) -> tuple[MCSampler, float | None, int | None]:
    """The passes of --iterative mc_dropout or ensemble, the temperature of their average (None
    where it has none) and, for an ensemble, its member count."""
    if options.mode == "ensemble":
        return ensemble_sampler(options, served)
    return (*mc_sampler(options, served), None)


def mc_sampler(options: IterativeOptions, served: Served) -> tuple[MCSampler, float | None]:
    """MC-dropout over the bundle's MC graph in the form --iterative_backend runs, the passes
    taken from the graph's logits (uncalibrated); and the temperature of their average (None
    for a bundle without one)."""
    import onnx

    from ttc.testtime import iterative as it
    from ttc.testtime.calibrate import softmax

    mc_path = require_onnx_in_bundle(served.paths, served.manifest, "mc")
    mc_model = onnx.load(str(mc_path))
    graph = it.mc_model_for(options.backend, mc_model, options.iterations, served.classes,
                            options.seed)
    session = create_session(graph.SerializeToString(), served.runtime, it.MC_SESSION_ARGS,
                             classes=served.classes, source=mc_path)
    if options.backend == "python":
        logits = session_runner(session, "logits")
        run = lambda batch: softmax(logits(batch)).astype(np.float32)  # noqa: E731
    else:
        run = session_runner(session, it.PASSES_OUTPUT)
    info = served.manifest.extra_graphs.mc or ExtraGraph()
    fitted_passes = info.fitted_passes
    if info.temperature is not None and fitted_passes != options.iterations:
        LOG.info("the MC-dropout average's temperature was fitted with %s passes, this run "
                 "takes %d", fitted_passes, options.iterations)
    return (it.MCSampler(options.backend, options.iterations, run, options.tol,
                         options.patience), info.temperature)


def ensemble_sampler(options: IterativeOptions, served: Served
                     ) -> tuple[MCSampler, float | None, int]:
    """The ensemble's members (uncalibrated) per batch, the temperature of their average (the
    bundle's ensemble graph's; None for --ensemble bundles merged here) and their count."""
    from ttc.testtime import iterative as it

    model, members = ensemble_graph(options.ensemble, served)
    source = (served.paths.variant("ensemble") if options.ensemble is None
              else "the --ensemble graphs")
    run = session_runner(create_session(model.SerializeToString(), served.runtime,
                                        classes=served.classes, source=source),
                         it.PASSES_OUTPUT)
    temperature = None
    if options.ensemble is None:
        temperature = served.manifest.extra_graphs.ensemble.temperature
    return it.MCSampler("batched", 0, run), temperature, members


def ensemble_graph(others: tuple[str, ...] | None, served: Served) -> tuple[object, int]:
    """The bundle's ensemble graph, or one merged from the served bundle's model.onnx and the
    `others` (--ensemble bundles)."""
    import onnx

    from ttc.testtime.iterative import ensemble_model

    paths, manifest = served.paths, served.manifest
    if others is None:
        model = onnx.load(str(require_onnx_in_bundle(paths, manifest, "ensemble")))
        return model, manifest.extra_graphs.ensemble.members
    members = [onnx.load(str(require_onnx_in_bundle(paths, manifest)))]
    for item in others:
        other_paths = BundlePaths.from_model_path(item)
        other = read_manifest(other_paths)
        if other.labels != manifest.labels or \
                other.preprocessing.spec != manifest.preprocessing.spec:
            raise ConfigError(f"--ensemble member {item} has other labels or preprocessing than "
                              f"{paths.onnx}", "ensemble bundles trained on the same data")
        members.append(onnx.load(str(require_onnx_in_bundle(other_paths, other))))
    return ensemble_model(members, served.classes), len(members)


def passes_predictor(options: IterativeOptions, served: Served) -> Predictor:
    """MC-dropout or ensemble: the mean (rescaled by its temperature where the bundle has one),
    its entropy, and the std across passes (or members) of the predicted class's probability."""
    from ttc.testtime.calibrate import rescale

    sampler, temperature, _ = sampler_for(options, served)

    def predict(x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        passes = sampler(batches_of(x, options.batch_size, served.pad_id))
        mean = passes.mean if temperature is None else \
            rescale(passes.mean, temperature).astype(np.float32)
        chosen = mean.argmax(1)
        return mean, {"entropy": entropy(mean),
                      "std": passes.std[np.arange(len(mean)), chosen]}

    return predict
