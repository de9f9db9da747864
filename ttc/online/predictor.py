"""A model bundle opened for prediction, the one way every caller opens it: inference.py (test
split, --input, Ray Data workers), serve.py, and users' own code through the public API

    from ttc.online.predictor import Predictor
    model = Predictor.load("runs/sms/model.onnx", variant="fp32", tta=False)
    model.predict([{"text": "WINNER! Claim your prize"}])
    # [{"label": "spam", "confidence": 0.98, "top": [["spam", 0.98]]}]

Opening checks the bundle as inference.py always has (manifest, the graph's fingerprint, a
tokenizer's hash, a --model_def network's trust), picks the graph (fp32, int8, fp16), and builds
the predictor of the test-time method asked for (the registry's). Rows are encoded by
records.RecordReader, the rules of an `inference.py --input` JSONL file; predictions are rounded
as every prediction file is. ONNX Runtime only: neither torch nor DSPy is imported here (Tent
rebuilds its network in PyTorch when asked for; as_dspy_tool imports DSPy).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from config import Config
from ttc.options.ttt import no_batchnorm_error, norm_without_batchnorm
from ttc.serving.batch import NON_FINITE_OUTPUT, non_finite_rows, top_classes
from ttc.serving.bundle import (BundlePaths, read_manifest, require_onnx_in_bundle,
                                require_trusted_model_code)
from ttc.serving.records import RecordReader, RowError
from ttc.serving.runtime import create_session, int8_saturating_cpu
from ttc.testtime.registry import asked_methods
from ttc.testtime.served import Served, plain_predictor
from utils import LOG, ConfigError, ExportError

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.batch import Predictor as BatchPredictor
    from ttc.serving.manifest import Manifest
    from ttc.tasks.detect.evaluate import DetectionRunner
    from ttc.tasks.segment.evaluate import MaskRunner

# --variant → the bundle's file key
GRAPH_OF = {"fp32": "onnx", "int8": "int8", "fp16": "fp16", "pruned": "pruned", "qat": "qat",
            "pruned_qat": "pruned_qat"}


# ----------------------------------------------------------------------------- opening a bundle


def check_bundle(config: Config, paths: BundlePaths) -> Manifest:
    """What inference.py checks before any data is read: the manifest, a --model_def network's
    trust where Tent rebuilds it, the graph against its manifest, the TTA transforms and the
    test-time training method against the model."""
    manifest = read_manifest(paths)
    if config.ttt and config.ttt_method in ("tent", "all"):  # Tent rebuilds it in PyTorch
        require_trusted_model_code(manifest, paths, config.trust_model_code)
    require_onnx_in_bundle(paths, manifest)  # graph and manifest agree, before any data
    config.validate_tta(manifest.model_type)
    if config.ttt:
        require_ttt_method_applies(config.ttt_method, manifest)
    return manifest


def load_bundle_session(paths: BundlePaths, config: Config, variant: str = "onnx"
                        ) -> tuple[Manifest, ort.InferenceSession, Path]:
    """Manifest + verified graph (fp32 "onnx", "int8" or "fp16") + a session whose input
    matches what the manifest promises."""
    manifest = read_manifest(paths)
    model_path = require_onnx_in_bundle(paths, manifest, variant)
    warn_if_int8_saturates(manifest, variant, model_path)
    session = create_session(str(model_path), config.runtime(), classes=manifest.classes)
    graph_input = session.get_inputs()[0]
    if graph_input.name != manifest.input.name:
        raise ExportError(f"{paths.onnx} takes input {graph_input.name!r} but its manifest says "
                          f"{manifest.input.name!r}", "re-run export.py or pipeline.py")
    return manifest, session, model_path


def input_variant(config: Config, manifest: Manifest | None = None) -> str:
    """inference.py's graph: --fp16, --quantized, else --variant (fp32 by default)."""
    if config.fp16 or config.quantized:
        return "fp16" if config.fp16 else "int8"
    if config.variant == "auto" and manifest is None:
        manifest = read_manifest(BundlePaths.from_model_path(config.output_model))
    return served_variant(config.variant, manifest)


def served_variant(variant: str, manifest: Manifest) -> str:
    """serve.py's --variant as the bundle's file key; auto: int8 where quantize.py judged it
    worth using for inference, else fp32. A variant the bundle lacks is exit 4 (the graph check
    names the command that adds it)."""
    if variant != "auto":
        return GRAPH_OF[variant]
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


def chunk_predictor(config: Config, paths: BundlePaths, manifest: Manifest,
                    session: ort.InferenceSession, model_path: Path
                    ) -> tuple[BatchPredictor, list[str]]:
    """encoded rows → (probabilities, extra columns), with the test-time compute asked for
    (one of --tta, --ttt, --iterative), and the extra columns' names."""
    asked = asked_methods(config)
    if len(asked) > 1:
        raise ConfigError(f"predicting new data takes one test-time method at a time, not "
                          f"{' and '.join(method.flag for method in asked)}", "keep one of them")
    served = served_graph(config, paths, manifest, session, model_path)
    if asked:
        return asked[0].predictor(config, served)
    return plain_predictor(served, config.batch_size)


def served_graph(config: Config, paths: BundlePaths, manifest: Manifest,
                 session: ort.InferenceSession, model_path: Path) -> Served:
    """The chosen graph as the test-time methods see it, with the sessions' settings and the
    BatchNorm check test-time training runs when it picks its graph."""
    return Served(paths, manifest, session, model_path, config.runtime(),
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


def worker_predictor(config: Config) -> tuple[BatchPredictor, list[str]]:
    """inference.py's predictor, built on a Ray Data worker (cluster.PredictorFactory)."""
    paths = BundlePaths.from_model_path(config.output_model)
    manifest, session, model_path = load_bundle_session(paths, config, input_variant(config))
    return chunk_predictor(config, paths, manifest, session, model_path)


def worker_mask_runner(config: Config) -> MaskRunner:
    """A segmenter's `mask` output in a session of its own, built on a Ray Data worker
    (ttc/tasks/segment/cluster.py's RunnerFactory): the graph inference.py's local engine runs."""
    from ttc.tasks.segment.evaluate import mask_runner

    paths = BundlePaths.from_model_path(config.output_model)
    _, session, _ = load_bundle_session(paths, config, input_variant(config))
    return mask_runner(session)


def worker_detection_runner(config: Config) -> DetectionRunner:
    """A detector's detections (padding removed) in a session of its own, built on a Ray Data
    worker (ttc/tasks/detect/cluster.py's RunnerFactory): the graph inference.py's local engine
    runs."""
    from ttc.tasks.detect.evaluate import detection_runner

    paths = BundlePaths.from_model_path(config.output_model)
    _, session, _ = load_bundle_session(paths, config, input_variant(config))
    return detection_runner(session)


def join_inputs(parts: list[np.ndarray], pad_id: int) -> np.ndarray:
    """Inputs of several requests as one batch: token ids of different lengths are right-padded
    with the graph's padding id (batches_of trims what no row needs)."""
    if len(parts) == 1:
        return parts[0]
    if parts[0].ndim == 2 and parts[0].dtype == np.int64:
        width = max(p.shape[1] for p in parts)
        parts = [p if p.shape[1] == width else
                 np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=pad_id)
                 for p in parts]
    return np.concatenate(parts)


# ----------------------------------------------------------------------------- the public API


@dataclass
class Predictor:
    """A bundle ready to predict rows: `encode` (rows → model inputs, in the caller's thread),
    `run` (inputs → probabilities and the method's extra values, one batch), `predictions`
    (→ the response rows); `predict` chains them."""

    config: Config
    paths: BundlePaths
    manifest: Manifest
    variant: str  # the graph's file key: "onnx" (fp32), "int8" or "fp16"
    model_path: Path
    providers: list[str]
    run: BatchPredictor
    extra: list[str]
    reader: RecordReader

    @classmethod
    def load(cls, bundle: str | Path, *, variant: str = "fp32", tta: bool = False,
             ttt: str | None = None, iterative: str | None = None, top_k: int = 1,
             num_threads: int = 1, ep: str = "cpu", **flags: Any) -> "Predictor":
        """Open a bundle (its model.onnx path) as serve.py does: `variant` fp32, int8, fp16 or
        auto; `ttt` bn, tent or all; `iterative` mc_dropout, ensemble or state; any other
        serve.py flag by name (e.g. tta_merge="gmean", iterations=8)."""
        config = Config(output_model=str(bundle), variant=variant, tta=tta, ttt=ttt is not None,
                        ttt_method=ttt or "bn", iterative=iterative or "none", top_k=top_k,
                        num_threads=num_threads, ep=ep, **flags)
        config.script = "serve"
        return cls.from_config(config.validate())

    @classmethod
    def from_config(cls, config: Config) -> "Predictor":
        """The bundle of --model with serve.py's flags (a validated Config)."""
        paths = BundlePaths.from_model_path(config.output_model)
        manifest = check_bundle(config, paths)
        variant = served_variant(config.variant, manifest)
        config = dataclasses.replace(config, batch_size=config.max_batch_size)
        config.script = "serve"
        manifest, session, model_path = load_bundle_session(paths, config, variant)
        run, extra = chunk_predictor(config, paths, manifest, session, model_path)
        LOG.info("serving %s (%s graph, %s) on %s", paths.onnx, variant, manifest.model_type,
                 ", ".join(session.get_providers()))
        return cls(config, paths, manifest, variant, model_path, session.get_providers(), run,
                   extra, RecordReader(manifest))

    # ------------------------------------------------------------------ predicting

    def encode(self, rows: Sequence[Mapping]) -> np.ndarray:
        """Rows (dicts of the trained columns; images as {"image": base64}) → model inputs.
        Raises DataError for the request, records.RowError for a row."""
        return self.reader.encode(rows)

    def predictions(self, probabilities: np.ndarray, extra: Mapping[str, np.ndarray]
                    ) -> list[dict]:
        """Probabilities → [{"label", "confidence", "top": [[label, p], ...], extras}], the
        values rounded as in a prediction file."""
        labels = self.manifest.labels
        order, top = top_classes(probabilities, min(self.config.top_k, len(labels)))
        rows = []
        for k in range(len(probabilities)):
            row = {"label": labels[order[k, 0]], "confidence": float(top[k, 0]),
                   "top": [[labels[c], float(p)] for c, p in zip(order[k], top[k])]}
            for name, values in extra.items():
                row[name] = round(float(values[k]), 6)
            rows.append(row)
        return rows

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
        number of its first row) → per part (probabilities, extra values), or the error that
        request alone gets: encoded together where their keys agree, one model run."""
        firsts = [first for _, first in parts]
        encoded = self.reader.encode_parts([rows for rows, _ in parts], firsts)
        good = [k for k, x in enumerate(encoded) if not isinstance(x, Exception)]
        out: list = list(encoded)
        for k, outcome in zip(good, self._run_parts([encoded[k] for k in good],
                                                    [firsts[k] for k in good])):
            out[k] = outcome
        return out

    def _run_parts(self, inputs: list[np.ndarray], firsts: list[int]) -> list:
        """Encoded parts → each one's (probabilities, extra), or its error: a row whose output
        is not finite fails its part (a RowError naming it). A part that failed in the joined
        run (or all, where the run raised) is run again alone, so that one request's rows never
        cost another its answer (test-time training adapts to the whole batch: one overflowing
        row makes every row's statistics NaN)."""
        if not inputs:
            return []
        try:
            outcomes = self._split_run(inputs, firsts)
        except Exception as err:  # noqa: BLE001 - blamed below on the part that raises it
            outcomes = [err] * len(inputs)
        if len(inputs) == 1:
            return outcomes
        for k, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                try:
                    outcomes[k] = self._split_run([inputs[k]], [firsts[k]])[0]
                except Exception as err:  # noqa: BLE001 - this part's own failure
                    outcomes[k] = err
        return outcomes

    def _split_run(self, inputs: list[np.ndarray], firsts: list[int]) -> list:
        """One model run of the parts joined; each part's rows back, or its RowError."""
        probabilities, extra = self.run(join_inputs(inputs, self.manifest.input.pad_id))
        bad = non_finite_rows(probabilities, extra)
        outcomes, offset = [], 0
        for x, first in zip(inputs, firsts):
            rows = slice(offset, offset + len(x))
            offset = rows.stop
            failed = np.flatnonzero(bad[rows])
            if len(failed):
                more = f" (and {len(failed) - 1} more rows)" if len(failed) > 1 else ""
                outcomes.append(RowError(f"row {first + int(failed[0])}: {NON_FINITE_OUTPUT}"
                                         f"{more}", "fix the row"))
                continue
            outcomes.append((probabilities[rows], {name: v[rows] for name, v in extra.items()}))
        return outcomes

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
        asked = asked_methods(self.config)
        return asked[0].flag.removeprefix("--") if asked else "none"

    def warmup_rows(self) -> np.ndarray:
        """Model inputs of one row, to run once before serving (a reload's warm-up)."""
        if self.reader.task.image_files:
            return np.zeros((1, *self.manifest_image_shape()), dtype=np.float32)
        if self.reader.role == "text":
            return self.reader.encode([{name: "warm up" for name in self.inputs}])
        features = self.manifest.input.shape[-1]
        return np.zeros((1, int(features)), dtype=np.float32)

    def manifest_image_shape(self) -> tuple[int, int, int]:
        spec = self.manifest.preprocessing.spec
        return (int(spec["channels"]), *map(int, spec["image_size"]))

    def as_dspy_tool(self) -> Any:
        """This model as a `dspy.Tool`: its name, description and arguments from the manifest
        (task, classes, input columns); calling it runs ONNX Runtime on one row and returns the
        label and confidence."""
        from ttc.online.tool import model_tool

        return model_tool(self)

