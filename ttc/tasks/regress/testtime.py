"""A regressor's test-time methods on the test split, each beside the plain pass (its
Parts.test_split runs them after the plain figures; the report's `evaluation` holds them):

- `--iterative mc_dropout`: K passes through the bundle's MC-dropout graph (model.mc.onnx, its
  Dropout nodes seeded from --seed, run with ONNX Runtime's EliminateDropout disabled, as the
  classifiers' python backend runs theirs); their mean ± z·std is a nominal interval at the
  conformal interval's level (intervals.gaussian_interval), whose test coverage and mean width
  are set beside the conformal interval's: nominal is what it claims, coverage what it holds.
- `--iterative ensemble`: the members of the bundle's ensemble graph (model.ensemble.onnx,
  written by export after `--ensemble_size K`: ensemble.py), their spread as MC-dropout's.
- `--tta` (tabular_regressor): the mean of the predictions over the plain view and the
  --tta_transforms views (jitter:SIGMA, the tabular classifier's feature-noise views, one seeded
  draw each), RMSE with and without.
- `--ttt` (bn): each test batch normalised by its own BatchNorm statistics through the bundle's
  adaptation graph (model.bn.onnx; ttc/testtime/ttt.py's AdaptationGraph, blended with the
  stored ones by --ttt_bn_prior), RMSE with and without.
numpy, onnx and ONNX Runtime only."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ttc.tasks.regress import PREDICTION
from ttc.tasks.regress.intervals import coverage, gaussian_interval, mean_width
from ttc.serving.runtime import batches_of, create_session, graph_padding_id, session_runner
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.serving.stages import SplitRun

DEFAULT_LEVEL = 0.9  # the nominal interval's level for a bundle trained without --interval


def rmse(predicted: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.asarray(predicted, np.float64) - y) ** 2)))


def compared(name: str, plain: float, other: float) -> str:
    """The verdict of a method against the plain pass, by test RMSE."""
    if other > plain:
        return f"{name} hurts: test RMSE {other:.4g} vs {plain:.4g} plain"
    if other < plain:
        return f"{name} helps: test RMSE {other:.4g} vs {plain:.4g} plain"
    return f"{name} changes nothing: test RMSE {plain:.4g}"


def _graph(run: SplitRun, key: str, why: str,
           hint: str = "drop the flag, or train --arch mlp or resmlp (both have dropout and "
                       "BatchNorm)"):
    """The bundle's extra graph `key` ("mc", "bn", "ensemble"), or exit 2 saying why it has
    none."""
    import onnx

    from ttc.serving.bundle import require_onnx_in_bundle

    if getattr(run.manifest.extra_graphs, key, None) is None:
        raise ConfigError(why, hint)
    return onnx.load(str(require_onnx_in_bundle(run.paths, run.manifest, key)))


def mc_dropout_passes(run: SplitRun, x: np.ndarray) -> np.ndarray:
    """(K, N) predictions of K passes with dropout on (K = --iterations)."""
    from ttc.testtime.iterative import MC_SESSION_ARGS, seeded_dropout

    options = run.options
    model = seeded_dropout(_graph(run, "mc", "--iterative mc_dropout needs dropout, and this "
                                  "network has none"), options.seed)
    session = create_session(model.SerializeToString(), options.runtime(), MC_SESSION_ARGS,
                             source=run.paths.variant("mc"))
    predict = session_runner(session, PREDICTION)
    batches = batches_of(x, options.batch_size, graph_padding_id(session))
    return np.stack([np.concatenate([predict(b) for b in batches]).astype(np.float64)
                     for _ in range(options.iterations)])


def ensemble_members(run: SplitRun, x: np.ndarray) -> np.ndarray:
    """(K, N) predictions of the K members of the bundle's ensemble graph."""
    from ttc.tasks.regress.ensemble import member_spread

    model = _graph(run, "ensemble", "--iterative ensemble needs the bundle's ensemble graph, "
                   "and this bundle has none", "train the bundle with pipeline.py "
                   "--ensemble_size K (K ≥ 2)")
    session = create_session(model.SerializeToString(), run.options.runtime(),
                             source=run.paths.variant("ensemble"))
    return member_spread(session, x, run.options.batch_size)


# each spread's words: (its name in the verdict, what its rows are called in the report)
SPREADS = {"mc_dropout": ("MC-dropout", "passes"), "ensemble": ("the ensemble", "members")}


def spread_section(passes: np.ndarray, y: np.ndarray, plain: np.ndarray, level: float,
                   conformal: dict | None, mode: str = "mc_dropout") -> dict:
    """The passes' (or members') mean and nominal interval (mean ± z·std) against the plain
    pass and the conformal interval: RMSE, coverage, mean width, and whether the nominal level
    holds."""
    mean, std = passes.mean(0), passes.std(0)
    lower, upper = gaussian_interval(mean, std, level)
    held = coverage(y, lower, upper)
    section = {"mode": mode, SPREADS[mode][1]: int(len(passes)), "level": level,
               "rmse_plain": rmse(plain, y), "rmse": rmse(mean, y),
               "mean_std": float(std.mean()), "coverage": held,
               "mean_width": mean_width(lower, upper),
               "conformal_coverage": (conformal or {}).get("coverage"),
               "conformal_mean_width": (conformal or {}).get("mean_width")}
    section["verdict"] = spread_verdict(section)
    return section


def spread_verdict(section: dict) -> str:
    """What the nominal interval holds, said plainly, beside the conformal one's."""
    level, held = section["level"], section["coverage"]
    name = SPREADS[section.get("mode", "mc_dropout")][0]
    claim = (f"{name[0].upper()}{name[1:]}'s nominal {level:.0%} interval covers {held:.1%} of "
             f"test targets "
             f"(mean width {section['mean_width']:.4g})")
    if held < level - 0.04:
        claim += f": it under-covers, its spread is not a {level:.0%} interval"
    if section.get("conformal_coverage") is not None:
        claim += (f"; the conformal interval covers {section['conformal_coverage']:.1%} (mean "
                  f"width {section['conformal_mean_width']:.4g})")
    return claim


def tta_section(run: SplitRun, x: np.ndarray, y: np.ndarray, plain: np.ndarray) -> dict:
    """The mean of the views' predictions (the plain view and each --tta_transforms view)."""
    from ttc.tasks.registry import task_of_kind
    from ttc.testtime.transforms import parse_transform_specs, transform

    options, spec = run.options, run.manifest.preprocessing.spec
    entries = parse_transform_specs(options.tta_transforms, spec["kind"],
                                    task_of_kind(spec["kind"]).default_tta)
    transforms = [transform(name, value).compile(spec, np.random.default_rng([options.seed, k]))
                  for k, (name, value) in enumerate(entries)]
    views = [view for t in transforms for view in t.views(x)]
    predict = session_runner(run.session, PREDICTION)
    pad = graph_padding_id(run.session)
    predictions = [plain] + [np.concatenate([predict(b) for b in
                                             batches_of(v, options.batch_size, pad)])
                             for v in views]
    merged = np.mean(predictions, axis=0)
    section = {"transforms": [t.spec for t in transforms], "views": len(predictions),
               "merge": "mean", "rmse_plain": rmse(plain, y), "rmse": rmse(merged, y),
               "mae_plain": float(np.mean(np.abs(plain - y))),
               "mae": float(np.mean(np.abs(merged - y)))}
    section["verdict"] = compared("TTA", section["rmse_plain"], section["rmse"])
    return section


def bn_section(run: SplitRun, x: np.ndarray, y: np.ndarray, plain: np.ndarray) -> dict:
    """Each test batch through the adaptation graph with its own BatchNorm statistics."""
    from ttc.testtime.ttt import AdaptationGraph, ttt_batches

    options = run.options
    model = _graph(run, "bn", "--ttt (bn) re-estimates BatchNorm statistics, and this "
                   "network has no BatchNorm layers")
    graph = AdaptationGraph(model, lambda data: create_session(data, options.runtime()),
                            primary=(PREDICTION,))
    adapted = np.concatenate([graph.run(b, options.ttt_bn_prior, {})[0] for b in
                              ttt_batches(x, options.batch_size, graph.pad_id)])
    adapted = adapted.astype(np.float64)
    section = {"method": "bn", "mode": "episodic", "batch_size": options.batch_size,
               "bn_prior": options.ttt_bn_prior, "batchnorm_layers": len(graph.layers),
               "rmse_plain": rmse(plain, y), "rmse": rmse(adapted, y)}
    section["verdict"] = compared("BN adaptation", section["rmse_plain"], section["rmse"])
    return section


def run_test_time(run: SplitRun, x: np.ndarray, y: np.ndarray, plain: np.ndarray,
                  evaluation: dict) -> None:
    """The test-time methods the flags ask for, into `evaluation` (iterative, tta, ttt)."""
    options = run.options
    y = np.asarray(y, np.float64)
    if options.iterative not in SPREADS and options.iterative != "none":
        raise ConfigError(f"--iterative {options.iterative} does not apply to a regressor: only "
                          "mc_dropout and ensemble (their spread) are measured on a number",
                          "use --iterative mc_dropout or ensemble (docs/regression.md)")
    if options.iterative in SPREADS:
        interval = run.manifest.preprocessing.spec.get("interval") or {}
        passes = (mc_dropout_passes(run, x) if options.iterative == "mc_dropout"
                  else ensemble_members(run, x))
        evaluation["iterative"] = spread_section(
            passes, y, plain, float(interval.get("level", DEFAULT_LEVEL)),
            evaluation.get("interval"), options.iterative)
        LOG.info("%s", evaluation["iterative"]["verdict"])
    if options.tta:
        evaluation["tta"] = tta_section(run, x, y, plain)
        LOG.info("%s", evaluation["tta"]["verdict"])
    if options.ttt:
        evaluation["ttt"] = bn_section(run, x, y, plain)
        LOG.info("%s", evaluation["ttt"]["verdict"])
