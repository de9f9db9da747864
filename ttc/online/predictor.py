"""A model bundle opened for prediction, the one way every caller opens it: inference.py (test
split, --input, Ray Data workers), serve.py, and users' own code through the public API

    from ttc.online.predictor import Predictor
    model = Predictor.load("runs/sms/model.onnx", variant="fp32", tta=False)
    model.predict([{"text": "WINNER! Claim your prize"}])
    # [{"label": "spam", "confidence": 0.98, "top": [["spam", 0.98]]}]

Opening checks the bundle as inference.py always has (manifest, the graph's fingerprint, a
tokenizer's hash, a --model_def network's trust), picks the graph (fp32, int8, fp16), and hands
it to the model type's `served` part (Parts.served; ttc/online/served.py says its shape), which
predicts and answers: a classifier's builds the predictor of the test-time method asked for (the
registry's) and encodes rows by records.RecordReader, the rules of an `inference.py --input`
JSONL file; a detector's answers boxes and a segmenter's masks, the values `inference.py --input`
writes for the image. Predictions are rounded as every prediction file is. ONNX Runtime only:
neither torch nor DSPy is imported here (Tent rebuilds its network in PyTorch when asked for;
as_dspy_tool imports DSPy); nor any model type's own folder (the part is resolved by name).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from ttc.options.stages import InferenceOptions, ServeOptions, view_of
from ttc.options.ttt import no_batchnorm_error, norm_without_batchnorm
from ttc.serving.bundle import (BundlePaths, read_manifest, require_onnx_in_bundle,
                                require_trusted_model_code)
from ttc.serving.records import RecordReader
from ttc.serving.runtime import create_session, gpu_runs_first, int8_saturating_cpu
from ttc.tasks.registry import task_of_kind
from ttc.testtime.registry import asked_methods
from ttc.testtime.served import Served, plain_predictor
from utils import LOG, ConfigError, ExportError

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.options.sessions import RuntimeFlags
    from ttc.serving.batch import Predictor as BatchPredictor
    from ttc.serving.manifest import Manifest

# The flags checked against the bundle's model type once its manifest names it: the CLI's
# config.Config.validate_tta (the Python API's: ServeOptions.validate_tta)
FlagCheck = Callable[[str], None]

# --variant → the bundle's file key
GRAPH_OF = {"fp32": "onnx", "int8": "int8", "fp16": "fp16", "pruned": "pruned", "qat": "qat",
            "pruned_qat": "pruned_qat"}


# ----------------------------------------------------------------------------- opening a bundle


def check_bundle(options: InferenceOptions | ServeOptions, paths: BundlePaths,
                 check_flags: FlagCheck) -> Manifest:
    """What inference.py checks before any data is read: the manifest, a --model_def network's
    trust where Tent rebuilds it, the graph against its manifest, the flags against its model
    type (`check_flags`: the TTA transforms, the flags the type refuses) and the test-time
    training method against the model."""
    manifest = read_manifest(paths)
    if options.ttt and options.ttt_method in ("tent", "all"):  # Tent rebuilds it in PyTorch
        require_trusted_model_code(manifest, paths, options.trust_model_code)
    require_onnx_in_bundle(paths, manifest)  # graph and manifest agree, before any data
    check_flags(manifest.model_type)
    if options.ttt:
        require_ttt_method_applies(options.ttt_method, manifest)
    return manifest


def load_bundle_session(paths: BundlePaths, options: RuntimeFlags, variant: str = "onnx"
                        ) -> tuple[Manifest, ort.InferenceSession, Path]:
    """Manifest + verified graph (fp32 "onnx", "int8" or "fp16") + a session whose input
    matches what the manifest promises."""
    manifest = read_manifest(paths)
    model_path = require_onnx_in_bundle(paths, manifest, variant)
    warn_if_int8_saturates(manifest, variant, model_path)
    session = create_session(str(model_path), options.runtime(), classes=manifest.classes)
    graph_input = session.get_inputs()[0]
    if graph_input.name != manifest.input.name:
        raise ExportError(f"{paths.onnx} takes input {graph_input.name!r} but its manifest says "
                          f"{manifest.input.name!r}", "re-run export.py or pipeline.py")
    return manifest, session, model_path


def input_variant(manifest: Manifest, sessions: RuntimeFlags, *, fp16: bool, quantized: bool,
                  variant: str) -> str:
    """inference.py's graph: --fp16, --quantized, else --variant (fp32 by default; auto as
    serve.py's, on the providers of `sessions`)."""
    if fp16 or quantized:
        return "fp16" if fp16 else "int8"
    return served_variant(variant, manifest, gpu_runs_first(sessions.runtime().providers))


def served_variant(variant: str, manifest: Manifest, gpu: bool = False) -> str:
    """serve.py's --variant as the bundle's file key; auto: on a GPU (`gpu`: a CUDA or
    TensorRT provider runs first) the fp16 graph where the bundle has one, else int8 where
    quantize.py judged it worth using for inference (a CPU's judgement), else fp32. A variant
    the bundle lacks is exit 4 (the graph check names the command that adds it)."""
    if variant != "auto":
        return GRAPH_OF[variant]
    if gpu and "fp16" in manifest.files:
        return "fp16"
    chosen = manifest.compression.served if manifest.compression else None
    if not (chosen and chosen in manifest.files):  # else the compression gate chose among all
        verdict = manifest.variant("int8")
        chosen = "int8" if "int8" in manifest.files and verdict and verdict.used_for_inference \
            else "onnx"
    return unsaturated(chosen, manifest)


def unsaturated(chosen: str, manifest: Manifest) -> str:
    """--variant auto's graph where this CPU does not saturate it: a full-range int8 graph
    (Manifest.full_range_int8) on an x86 CPU without VNNI or AMX gives way to the fastest other
    graph that passed its gate, else fp32 (the gate's figures came from a CPU without
    saturation, or its loss was the saturation's)."""
    cpu = int8_saturating_cpu() if manifest.full_range_int8(chosen) else None
    if cpu is None:
        return chosen
    passed = [(v.speedup or 0.0, v.name) for v in (manifest.compression.variants
              if manifest.compression else ()) if v.used_for_inference
              and v.name in manifest.files and not manifest.full_range_int8(v.name)]
    instead = max(passed)[1] if passed else "onnx"
    LOG.warning("--variant auto: the gate chose the %s graph, whose full-range int8 weights can "
                "saturate on this CPU (%s: no VNNI or AMX): serving %s instead; quantize.py "
                "--int8_range reduced (or auto, on this machine) makes an int8 graph this CPU "
                "runs correctly", chosen, cpu, "fp32" if instead == "onnx" else instead)
    return instead


def warn_if_int8_saturates(manifest: Manifest, variant: str, model_path: Path) -> None:
    """A full-range int8 graph opened on a CPU whose int8 kernels saturate it: one WARNING."""
    cpu = int8_saturating_cpu() if manifest.full_range_int8(variant) else None
    if cpu is not None:
        LOG.warning("%s has full-range (8-bit) int8 weights, which can saturate on this CPU "
                    "(%s: no VNNI or AMX): its accuracy may fall far below what quantize.py "
                    "measured; re-quantize with quantize.py --int8_range reduced",
                    model_path.name, cpu)


def chunk_predictor(options: InferenceOptions | ServeOptions, paths: BundlePaths,
                    manifest: Manifest, session: ort.InferenceSession, model_path: Path
                    ) -> tuple[BatchPredictor, list[str]]:
    """encoded rows → (probabilities, extra columns), with the test-time compute asked for
    (one of --tta, --ttt, --iterative), and the extra columns' names."""
    asked = asked_methods(options)
    if len(asked) > 1:
        raise ConfigError(f"predicting new data takes one test-time method at a time, not "
                          f"{' and '.join(method.flag for method in asked)}", "keep one of them")
    served = served_graph(options, paths, manifest, session, model_path)
    if asked:
        return asked[0].predictor(options, served)
    return plain_predictor(served, options.batch_size)


def served_graph(options: RuntimeFlags, paths: BundlePaths, manifest: Manifest,
                 session: ort.InferenceSession, model_path: Path) -> Served:
    """The chosen graph as the test-time methods see it, with the sessions' settings and the
    BatchNorm check test-time training runs when it picks its graph."""
    return Served(paths, manifest, session, model_path, options.runtime(),
                  lambda method: require_ttt_method_applies(method, manifest))


def without_batchnorm(manifest: Manifest) -> bool:
    """Whether the bundle's network has no BatchNorm: an --arch known to have none, or a bundle
    whose export listed its extra graphs without model.bn.onnx (export writes it wherever
    BatchNorm exists). A bundle from before the extra graphs counts as having BatchNorm: its
    missing model.bn.onnx is exit 4 with the command that adds it."""
    return (norm_without_batchnorm(manifest.architecture.arch) is not None
            or (manifest.extra_graphs.listed and manifest.extra_graphs.bn is None
                and "bn" not in manifest.files))


def require_ttt_method_applies(method: str, manifest: Manifest) -> bool:
    """Whether the bundle's network has no BatchNorm; then `--ttt_method bn` alone is exit 2
    (checked before any data is read)."""
    if not without_batchnorm(manifest):
        return False
    arch = manifest.architecture.arch
    if method == "bn" and norm_without_batchnorm(arch):
        raise no_batchnorm_error(arch)
    if method == "bn":
        raise ConfigError("--ttt_method bn re-estimates BatchNorm statistics, and this bundle's "
                          "network has none (its export wrote no model.bn.onnx)",
                          "use --ttt_method tent, which adapts LayerNorm and GroupNorm affine "
                          "parameters")
    return True


def worker_predictor(options: InferenceOptions, variant: str
                     ) -> tuple[BatchPredictor, list[str]]:
    """inference.py's predictor of the `variant` graph, built on a Ray Data worker
    (cluster.PredictorFactory)."""
    paths = BundlePaths.from_model_path(options.output_model)
    manifest, session, model_path = load_bundle_session(paths, options, variant)
    return chunk_predictor(options, paths, manifest, session, model_path)


def worker_runner(options: InferenceOptions, variant: str) -> Callable[[np.ndarray], Any]:
    """A segmenter's or a detector's batch run (its served part's `runner`: the masks, or the
    detections with padding removed) in a session of its own, built on a Ray Data worker
    (ttc/tasks/segment/cluster.py's and ttc/tasks/detect/cluster.py's RunnerFactory): the graph
    inference.py's local engine runs."""
    paths = BundlePaths.from_model_path(options.output_model)
    manifest, session, _ = load_bundle_session(paths, options, variant)
    return served_part(manifest).runner(session)


worker_mask_runner = worker_detection_runner = worker_runner  # inference.py's names for it


def served_part(manifest: Manifest) -> type:
    """The bundle's model type's `served` part (a class; ttc/online/served.py)."""
    return task_of_kind(manifest.preprocessing.kind).part("served")


@dataclass
class Opened:
    """A bundle opened for prediction, what a served part is built from: serve.py's flags,
    its paths, manifest, chosen graph (its session and file), and the request rows' reader."""

    options: ServeOptions
    paths: BundlePaths
    manifest: Manifest
    session: ort.InferenceSession
    model_path: Path
    reader: RecordReader


# ----------------------------------------------------------------------------- the public API


@dataclass
class Predictor:
    """A bundle ready to predict rows: `predict` (rows → one answer each), built on
    `predict_parts` (several requests' rows, one model run: what serve.py's batcher calls) and
    `predictions` (their outputs → the answers), which the model type's served part does."""

    options: ServeOptions  # serve.py's flags, --batch_size the batcher's --max_batch_size
    paths: BundlePaths
    manifest: Manifest
    variant: str  # the graph's file key: "onnx" (fp32), "int8" or "fp16"
    model_path: Path
    providers: list[str]
    serving: Any  # its model type's served part (ttc/online/served.py's TypeServing shape)
    reader: RecordReader

    @classmethod
    def load(cls, bundle: str | Path, *, variant: str = "fp32", tta: bool = False,
             ttt: str | None = None, iterative: str | None = None, top_k: int = 1,
             num_threads: int = 1, ep: str = "cpu", **flags: Any) -> "Predictor":
        """Open a bundle (its model.onnx path) as serve.py does: `variant` fp32, int8, fp16 or
        auto; `ttt` bn, tent or all; `iterative` mc_dropout, ensemble or state; any other
        serve.py flag by name (e.g. tta_merge="gmean", iterations=8), checked as serve.py
        checks them (ServeOptions.validate)."""
        given = dict(output_model=str(bundle), variant=variant, tta=tta, ttt=ttt is not None,
                     ttt_method=ttt or "bn", iterative=iterative or "none", top_k=top_k,
                     num_threads=num_threads, ep=ep, **flags)
        known = {f.name for f in dataclasses.fields(ServeOptions)}
        if unknown := [name for name in flags if name not in known]:
            raise ConfigError(f"Predictor.load takes serve.py's flags, and {unknown[0]!r} is "
                              "not one", "see python serve.py --help")
        options = ServeOptions(**given)
        options.script, options.given = "serve", frozenset(given)
        return cls.open(options.validate(), options.validate_tta)

    @classmethod
    def from_config(cls, config: Any) -> "Predictor":
        """The bundle of --model with serve.py's flags (a validated config.Config, of which it
        keeps its ServeOptions; the flags checked against the bundle's model type by the
        Config's validate_tta)."""
        return cls.open(view_of(config, ServeOptions), config.validate_tta)

    @classmethod
    def open(cls, options: ServeOptions, check_flags: FlagCheck | None) -> "Predictor":
        """The bundle of --model with serve.py's (validated) flags: checked as inference.py
        checks it (`check_flags`: the flags against its model type; None where they already
        were, as in a Ray Serve replica), its graph (--variant) opened in a session, handed to
        its model type's served part."""
        paths = BundlePaths.from_model_path(options.output_model)
        manifest = check_bundle(options, paths, check_flags or (lambda model_type: None))
        variant = served_variant(options.variant, manifest,
                                 gpu_runs_first(options.runtime().providers))
        options = dataclasses.replace(options, batch_size=options.max_batch_size)
        options.script = "serve"
        manifest, session, model_path = load_bundle_session(paths, options, variant)
        reader = RecordReader(manifest)
        serving = served_part(manifest)(Opened(options, paths, manifest, session, model_path,
                                               reader))
        LOG.info("serving %s (%s graph, %s) on %s", paths.onnx, variant, manifest.model_type,
                 ", ".join(session.get_providers()))
        return cls(options, paths, manifest, variant, model_path, session.get_providers(),
                   serving, reader)

    # ------------------------------------------------------------------ predicting

    @property
    def run(self) -> BatchPredictor:
        """The served graph's batch run (model inputs → its outputs)."""
        return self.serving.run

    @property
    def extra(self) -> list[str]:
        """The test-time method's extra values in each answer (uncertainty, ...)."""
        return self.serving.extra

    def encode(self, rows: Sequence[Mapping]) -> np.ndarray:
        """Rows (dicts of the trained columns; images as {"image": base64}) → model inputs.
        Raises DataError for the request, records.RowError for a row."""
        return self.reader.encode(rows)

    def predictions(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        """A part's outputs → one answer per row: a classifier's {"label", "confidence", "top":
        [[label, p], ...], extras}, a detector's {"height", "width", "boxes"}, a segmenter's
        {"height", "width", "mask", "pixels", "shares"}; values rounded as in a prediction
        file."""
        return self.serving.answers(outputs, extra)

    def predict(self, rows: Sequence[Mapping]) -> list[dict]:
        """Rows → predictions, in order (what serve.py's /predict answers). Raises DataError
        for the request, records.RowError for a row."""
        self.reader.check(rows)
        outcome = self.predict_parts([(rows, 1)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return self.predictions(*outcome)

    def predict_parts(self, parts: Sequence[tuple[Sequence[Mapping], int]]) -> list:
        """A batch of several requests' rows (each part: a request's checked rows and the
        number of its first row) → per part (outputs, extra values), or the error that
        request alone gets; one model run."""
        return self.serving.predict_parts(parts)

    def warm_up(self) -> None:
        """One row predicted and answered as a request is (before serving, on a reload)."""
        self.serving.warm_up()

    def output_metadata(self) -> list[dict]:
        """The V2 output tensors this model answers."""
        return self.serving.output_metadata()

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        """A request's outputs as the V2 output tensors (output_metadata's)."""
        return self.serving.v2_outputs(outputs, extra)

    # ------------------------------------------------------------------ describing

    @property
    def inputs(self) -> list[str]:
        """The keys of a row: the trained input columns ("image" for an image model)."""
        return self.reader.names

    @property
    def variant_name(self) -> str:
        return {v: k for k, v in GRAPH_OF.items()}[self.variant]

    def describe(self) -> dict:
        """What the model is, for metadata endpoints and tools."""
        return {"model_type": self.manifest.model_type, "classes": list(self.manifest.labels),
                "inputs": self.inputs, "variant": self.variant_name,
                "temperature": self.manifest.temperature, "bundle": str(self.paths.onnx),
                "version": self.version, "test_time": self.test_time(),
                "providers": self.providers}

    @property
    def version(self) -> str:
        """The graph's fingerprint (its first 12 hex digits): a reload of other weights
        changes it."""
        digest = self.manifest.files.digest(self.variant) or ""
        return digest[:12] or "unknown"

    def test_time(self) -> str:
        asked = asked_methods(self.options)
        return asked[0].flag.removeprefix("--") if asked else "none"

    def as_dspy_tool(self) -> Any:
        """This model as a `dspy.Tool`: its name, description and arguments from the manifest
        (task, classes, input columns); calling it runs ONNX Runtime on one row and returns its
        answer (a classifier's label and confidence, a detector's boxes, a segmenter's mask and
        pixel counts)."""
        from ttc.online.tool import model_tool

        return model_tool(self)

