"""Test-time training as inference.py runs it (`--ttt true`, bn or Tent): the registry's entry
and the adaptation graph it opens. The graphs, methods and modes are ttt.py's; this module only
wires them to a served bundle. Light at import: ttt.py (onnx) loads when the method runs, and
PyTorch only when Tent does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from ttc.serving.bundle import require_onnx_in_bundle
from ttc.serving.runtime import create_session, session_runner
from ttc.testtime.served import Evaluation, Heldout, RunFlags, Served
from utils import LOG, ConfigError

if TYPE_CHECKING:
    from ttc.serving.batch import Predictor
    from ttc.serving.manifest import Manifest
    from ttc.testtime.ttt import AdaptationGraph, Tent, TTTSettings


@dataclass(frozen=True)
class TTT:
    flag: ClassVar[str] = "--ttt"
    key: ClassVar[str] = "ttt"

    def asked(self, flags: RunFlags) -> bool:
        return flags.ttt

    def options(self, flags: RunFlags, manifest: Manifest) -> TTTSettings:
        return flags.ttt_settings(manifest.preprocessing.kind)

    def evaluate(self, flags: RunFlags, served: Served, heldout: Heldout) -> Evaluation:
        return Evaluation(run_ttt(self.options(flags, served.manifest), served,
                                  session_runner(served.session), heldout.test))

    def predictor(self, flags: RunFlags, served: Served) -> tuple[Predictor, list[str]]:
        if flags.ttt_method == "all":
            raise ConfigError("--ttt_method all compares methods on the test split; predictions "
                              "need one", "use --ttt_method bn or tent with --input")
        return ttt_predictor(self.options(flags, served.manifest), served), []


def run_ttt(settings: TTTSettings, served: Served, predict: Callable[[np.ndarray], np.ndarray],
            test: tuple[np.ndarray, np.ndarray]) -> dict:
    """Test-time training on the bundle's adaptation graph, on the test split and its corrupted
    copies; `predict` (the chosen graph, unadapted) is the baseline, whose predictions the
    shift score compares with the bundle's held-out ones. torch only for tent."""
    from ttc.testtime.shift_score import ShiftReference
    from ttc.testtime.ttt import evaluate_ttt

    graph, tent = adaptation(settings, served)
    result = evaluate_ttt(settings, graph, predict, tent, *test,
                          served.manifest.preprocessing.spec,
                          ShiftReference.of_manifest(served.manifest))
    if result.shift and result.shift.get("available"):
        LOG.info("shift score: %s", result.shift["verdict"])
    if settings.stream:
        from ttc.testtime.ttt_stream import evaluate_stream

        result.stream = evaluate_stream(settings, graph, tent, *test,
                                        served.manifest.preprocessing.spec)
    for warning in result.warnings:
        LOG.warning("test-time training: %s", warning)
    LOG.info("test-time training: %s", result.verdict)
    return result.report_section()


def adaptation(settings: TTTSettings, served: Served) -> tuple[AdaptationGraph, Tent | None]:
    """The graph test-time training adapts, and Tent's PyTorch copy when a method needs it: a
    network with BatchNorm adapts the bundle's model.bn.onnx; one without, model.onnx itself,
    whose LayerNorm/GroupNorm nodes keep their parameters, with tent only (bn alone is exit 2;
    with `all` it is reported not applicable)."""
    import onnx

    from ttc.testtime.ttt import AdaptationGraph, Tent

    manifest = served.manifest
    variant = "onnx" if served.adapts_model_graph(settings.method) else "bn"
    path = require_onnx_in_bundle(served.paths, manifest, variant)
    graph = AdaptationGraph(onnx.load(str(path)), lambda m: create_session(
        m, served.runtime, classes=served.classes, source=path))
    tent = (Tent(manifest, served.paths.weights, graph.layers, settings.learning_rate,
                 settings.iterations, settings.num_threads, settings.trust_model_code,
                 filter_unreliable=settings.guard == "filter")
            if "tent" in settings.methods else None)
    return graph, tent


def ttt_predictor(settings: TTTSettings, served: Served) -> Predictor:
    """Each chunk adapted, then predicted; online adaptation, and the guard's memory of the
    stream, go on from chunk to chunk."""
    from ttc.testtime.ttt import OnlineCarry

    graph, tent = adaptation(settings, served)
    carry, guard = OnlineCarry(), settings.new_guard()
    return lambda x: (settings.run(graph, settings.method, x, tent, carry, guard).probabilities,
                      {})
