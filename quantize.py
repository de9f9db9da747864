"""Make faster variants of a bundle's fp32 graph (int8, fp16), validate and time each against
fp32 in the same process, and decide honestly whether inference should use it.

    python quantize.py --output_model runs/digits/model.onnx --quantize static [--fp16 true]

writes model.int8.onnx (and model.fp16.onnx) beside the bundle and records the figures and the
verdict in model.json. A variant that is slower than fp32 or loses more than --max_accuracy_drop
is kept on disk but not used (int8: unless --force_quantized true). fp16 is only used on a GPU
provider.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np
import onnx

from config import Config, build_parser, start_cli
from ttc.convert.diagnosis import SHOWN_LAYERS, LayerError, diagnose
from ttc.reporting.metrics import accuracy, top1_agreement
from ttc.serving.runtime import (CpuInfo, RuntimeOptions, batches_of, cpu_info, create_session,
                                graph_padding_id, model_feeder, predict_proba, session_runner,
                                time_runners, whole_batches)
from ttc.serving.bundle import (BundlePaths, read_manifest, record_variant, require_onnx_in_bundle,
                    stamp_contract, write_manifest_section)
from report import run_with_report
from ttc.tasks.registry import task_of_kind
from utils import (LOG, ConfigError, ExportError, debug_enabled, exit_cli, first_line,
                   native_section, run_cli, scratch_folder, stdout_to_stderr)

# --quantize_ops default. Static QDQ only around the weight-heavy ops: quantizing the in-graph
# preprocessing or an embedding Gather too costs speed (bench/quantize_layers.py, every op type:
# SMS 0.82-0.84x fp32's speed at batch 64 against 1.03-1.11x for these three) and, on earlier
# models, accuracy (breast_cancer 0.95 → 0.72, SMS 0.988 → 0.866).
STATIC_OPS = ("Conv", "MatMul", "Gemm")
# Dynamic only on MatMul: dynamic Conv becomes ConvInteger (~11x slower, measured here), and ORT's
# dynamic quantizer has no Gemm at all, so Gemm with constant weights is first rewritten as
# MatMul + Add (torch.nn.Linear exports as Gemm: without this nothing would be quantized).
# An hf graph's fused Attention nodes (export.fused_hf_graph) become QAttention: their Q, K, V
# projection in int8 (measured on a tiny BERT: 1.33x the fused fp32 graph at batch 32 with
# Attention, 1.25x MatMul only).
DYNAMIC_OPS = ("MatMul", "Attention")
QUANTIZED_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear",
                 "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                 "QAttention")
TIMED_RUNS = 40
DIAGNOSIS_BATCHES = 4  # of 32 calibration samples: enough to rank the layers, and quick
MAX_EXCLUSION_STEPS = 8  # --quantize_exclude auto: quantizations tried after the first
T = TypeVar("T")
Split = tuple[np.ndarray, np.ndarray]  # (x, y)
# A variant replaces fp32 only when clearly faster: a tie would flip between runs.
MIN_SPEEDUP = 1.05


@dataclass
class VariantResult:
    """A variant graph measured against fp32 on the same data, sessions and batches."""

    mode: str  # dynamic, static or fp16
    requested: str
    path: str
    provider: str
    size_bytes_fp32: int
    size_bytes: int
    accuracy: float
    accuracy_fp32: float
    top1_agreement: float
    max_abs_diff: float
    batch_size: int
    latency_ms_p50: float  # at --batch_size
    latency_ms_p50_fp32: float
    latency_ms_p50_batch1: float
    latency_ms_p50_batch1_fp32: float
    used_for_inference: bool
    verdict: str
    accuracy_val: float | None = None  # what the verdict judges (the test split without one)
    accuracy_val_fp32: float | None = None
    problems: list[str] = field(default_factory=list)
    calibration: dict | None = None
    op_types: list[str] | None = None  # the op types int8 was allowed to quantize
    layers: list[dict] | None = None  # the diagnosis: the worst nodes first
    exclusion: dict | None = None  # the nodes kept in fp32 and, for auto, each step
    op_sets: list[dict] | None = None  # --quantize_ops auto: the op sets tried, as judged
    slower_op_types: list[dict] | None = None  # --profile: where a slower variant's time grew
    cpu: dict | None = None  # the CPU that timed it (runtime.CpuInfo), for CPU providers
    reduce_range: bool | None = None  # int8: 7-bit weights (ONNX Runtime's reduce_range)
    reduce_range_reason: str | None = None  # why that range (--int8_range, the CPU)
    metric: str = "accuracy"  # what the accuracy* fields hold (segmenter: mean_iou; detector: map)
    test_metrics: dict | None = None  # other test figures, int8's and fp32's (a detector's map50)

    def report_section(self) -> dict:
        return asdict(self)


Metric = Callable[[np.ndarray, np.ndarray], float]  # (probabilities, truth) → a score
# How verdicts name a metric
METRIC_WORDS = {"accuracy": "accuracy", "mean_iou": "mean IoU", "map": "mAP@[.5:.95]",
                "map50": "mAP@.5"}


class ProbabilityScorer:
    """What a variant is judged by, for graphs whose output is "probabilities" (classifiers,
    segmenters): `metric` of the probabilities; agreement: top-1 (per pixel for a segmenter);
    difference: the largest of |p - p_fp32|. A detector's counterpart, with the same methods:
    ttc/tasks/detect/quantize.py's DetectionScorer."""

    def __init__(self, name: str = "accuracy", metric: Metric = accuracy) -> None:
        self.name, self.metric = name, metric

    def runner(self, session) -> Callable[[np.ndarray], np.ndarray]:
        return session_runner(session)

    def predict(self, session, x: np.ndarray, batch_size: int) -> np.ndarray:
        return predict_proba(session, x, batch_size)

    def evaluate(self, probabilities: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """The judged figure first (by `name`), then any other."""
        return {self.name: self.metric(probabilities, y)}

    def compare(self, probabilities: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
        return (top1_agreement(probabilities, reference),
                float(np.abs(probabilities - reference).max()))


def variant_scorer(manifest) -> ProbabilityScorer:
    """What a variant is judged by: accuracy; for a segmenter the mean IoU of the masks its
    probabilities give (argmax over the class axis), void pixels left out; for a detector
    COCO's mAP@[.5:.95] of its detections (ttc/tasks/detect/quantize.py)."""
    if manifest.preprocessing.kind == "detection":
        from ttc.tasks.detect.quantize import DetectionScorer

        return DetectionScorer(manifest.labels)  # type: ignore[return-value]
    if not task_of_kind(manifest.preprocessing.kind).dense:
        return ProbabilityScorer()
    from ttc.tasks.segment.evaluate import probabilities_mean_iou

    ignore_index = manifest.preprocessing.spec["ignore_index"]
    return ProbabilityScorer("mean_iou", lambda probabilities, y: probabilities_mean_iou(
        probabilities, y, manifest.classes, ignore_index))


@dataclass(frozen=True)
class Int8Range:
    """The int8 weights' range (--int8_range resolved) and why: the report's
    quantize.reduce_range and quantize.reduce_range_reason, kept in the manifest."""

    reduce_range: bool
    reason: str


def choose_int8_range(requested: str, cpu: CpuInfo) -> Int8Range:
    """--int8_range: full or reduced as asked; auto: reduced (7-bit weights) where this CPU's
    int8 kernels saturate full-range weights (x86 without VNNI or AMX: runtime.saturates) or
    its instructions are unknown, full (the more precise) where they cannot saturate. Measured
    on an AVX2-only EPYC: the detector's static int8 lost 17.8 mAP points with full range and
    0.12 with reduced (docs/deploy.md)."""
    if requested in ("full", "reduced"):
        return Int8Range(requested == "reduced", f"--int8_range {requested}")
    if cpu.int8_saturates is None:
        return Int8Range(True, f"auto: the int8 instructions of this CPU ({cpu.name}) are "
                               "unknown, and 7-bit weights saturate on none")
    if cpu.int8_saturates:
        return Int8Range(True, f"auto: this CPU ({cpu.name}) has no VNNI or AMX, and its int8 "
                               "kernels saturate with full-range (8-bit) weights")
    has = (f"has {', '.join(cpu.int8_dot_product)}" if cpu.int8_dot_product
           else "is not x86 (its int8 kernels widen to 16 bits without pairing products)")
    return Int8Range(False, f"auto: this CPU ({cpu.name}) {has}, where full-range (8-bit) "
                            "weights do not saturate")


def choose_mode(requested: str, model: onnx.ModelProto) -> str:
    """auto: static for convolutional models, dynamic otherwise (ONNX Runtime's advice)."""
    if requested != "auto":
        return requested
    return "static" if any(n.op_type == "Conv" for n in model.graph.node) else "dynamic"


def prepare_for_quantization(src: Path, dst: Path) -> None:
    """quant_pre_process (shape inference + optimisation); symbolic shape inference fails on some
    graphs (the text model's Concat), so fall back to ONNX's own shape inference there."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # When symbolic shape inference gives up (transformers graphs do) it leaves
    # sym_shape_infer_temp.onnx and a <uuid>.data file in the working directory: run it in
    # dst's folder, a temporary one. Both paths are made absolute before the change of folder:
    # a relative one would be read from inside it.
    src, dst = src.resolve(), dst.resolve()
    with contextlib.chdir(dst.parent):
        try:
            with stdout_to_stderr():
                quant_pre_process(str(src), str(dst))
        except Exception as err:  # noqa: BLE001 - the tool raises plain errors from deep inside
            LOG.debug("symbolic shape inference failed (%s); retrying without it", err)
            with stdout_to_stderr():
                quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)


def gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite Gemm(A, W, C) with a constant W (alpha = beta = 1, A not transposed) as
    MatMul(A, W') + C, in place; return how many were rewritten."""
    from onnx import helper, numpy_helper

    weights = {init.name: init for init in model.graph.initializer}
    rewritten, nodes = 0, []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in weights or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        matrix = numpy_helper.to_array(weights[node.input[1]])
        name = f"{node.input[1]}__matmul"
        model.graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(matrix.T if attrs.get("transB", 0) else matrix), name))
        has_bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}__product" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product],
                                      name=f"{node.name}__matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                          name=f"{node.name}__bias"))
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


# Images per calibration batch. ONNX Runtime's calibration session holds a whole batch's
# activations (its augmented graph outputs every tensor's range): a detector that resizes to
# 320 pixels inside (SSDlite) took 13.8 GB at 32 images on a tiny bundle, and the bench's run was
# killed for memory at 22 GB; at 4 images it took 0.8 GB (27 November 2026). The ranges are those
# of all the batches together, whatever their size.
CALIBRATION_BATCH = 32
DETECTION_CALIBRATION_BATCH = 4


def calibration_feeds(source: onnx.ModelProto, x: np.ndarray, size: int, seed: int,
                      batch: int = CALIBRATION_BATCH) -> list[dict]:
    """Feeds of batches of `size` training samples, the way the graph sees them at inference."""
    rows = np.random.default_rng(seed).permutation(len(x))[:size]
    feed = model_feeder(source)
    return [feed(b) for b in batches_of(x[np.sort(rows)], batch, graph_padding_id(source))]


def calibration_batch(manifest) -> int:
    return (DETECTION_CALIBRATION_BATCH if manifest.preprocessing.kind == "detection"
            else CALIBRATION_BATCH)


def make_calibration_reader(feeds: Sequence[dict]):
    from onnxruntime.quantization import CalibrationDataReader

    class SplitReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(feeds)

        def get_next(self):
            return next(self._batches, None)

    return SplitReader()


def quantizable_op_types(mode: str) -> set[str]:
    """Every op type ONNX Runtime's quantizer handles in `mode` (static: QDQ and QLinear
    registries; dynamic: the integer-op registry)."""
    from onnxruntime.quantization.registry import (IntegerOpsRegistry, QDQRegistry,
                                                   QLinearOpsRegistry)

    return set(IntegerOpsRegistry) if mode == "dynamic" else {*QDQRegistry, *QLinearOpsRegistry}


def op_set_candidates(requested: str, mode: str, present: set[str]) -> list[list[str]]:
    """The op sets to try: --quantize_ops auto tries the default set and, where the graph has
    more that int8 can quantize, every quantizable op type; anything else is one set."""
    if requested != "auto":
        return [resolve_op_types(requested, mode, present)]
    default, wider = (resolve_op_types(r, mode, present) for r in ("default", "all"))
    if wider == default or not default:  # no choice to make, or the wider set against fp32
        return [wider]
    return [default, wider]


def resolve_op_types(requested: str, mode: str, present: set[str]) -> list[str]:
    """--quantize_ops for `mode`, limited to the op types the graph has."""
    if requested.strip().lower() == "default":
        wanted = set(DYNAMIC_OPS if mode == "dynamic" else STATIC_OPS)
    elif requested.strip().lower() == "all":
        wanted = quantizable_op_types(mode)
    else:
        wanted = {t.strip() for t in requested.split(",") if t.strip()}
        unknown = sorted(wanted - quantizable_op_types(mode) - {"Gemm"})
        if unknown:
            raise ConfigError(f"--quantize_ops: {', '.join(unknown)} cannot be quantized in "
                              f"{mode} mode", "use op types ONNX Runtime's quantizer handles: "
                              f"{', '.join(sorted(quantizable_op_types(mode)))}")
    if mode == "dynamic" and "Gemm" in wanted:
        wanted.add("MatMul")  # gemm_to_matmul made the constant Gemms MatMuls
    return sorted(wanted & present)


def prepare_graph(src: Path, folder: Path, mode: str) -> Path:
    """The graph quantization starts from (its node names are what --quantize_exclude and the
    diagnosis use): shape inference and optimisation, unnamed nodes named; for dynamic,
    constant Gemms as MatMul."""
    prepared = folder / "prepared.onnx"
    prepare_for_quantization(src, prepared)
    graph = onnx.load(str(prepared))
    changed = name_unnamed_nodes(graph)
    if mode == "dynamic":
        changed += gemm_to_matmul(graph)
    if changed:
        onnx.save_model(graph, str(prepared))
    return prepared


def name_unnamed_nodes(model: onnx.ModelProto) -> int:
    """Name each unnamed node after its first output (the nodes a detector's append_nms wrote:
    "nms/selected", ..., "boxes"), so that nodes_to_exclude and the diagnosis can name it; in
    place. Returns how many were named."""
    taken = {node.name for node in model.graph.node if node.name}
    named = 0
    for k, node in enumerate(model.graph.node):
        if node.name:
            continue
        name = node.output[0] if node.output and node.output[0] else f"{node.op_type}_{k}"
        while name in taken:
            name += "_node"
        node.name = name
        taken.add(name)
        named += 1
    return named


def quantize_prepared(prepared: Path, dst: Path, mode: str, op_types: Sequence[str],
                      exclude: Sequence[str], feeds: Sequence[dict], config: Config,
                      reduce_range: bool = False) -> Path:
    """Write the int8 graph of `prepared` to dst, with the nodes `exclude` names kept fp32 and
    7-bit weights where `reduce_range` (choose_int8_range)."""
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                          quantize_dynamic, quantize_static)

    if not op_types:  # ONNX Runtime's quantizer reads an empty list as "every op type"
        shutil.copyfile(prepared, dst)
        return dst
    with stdout_to_stderr(), quiet_root_logger():
        if mode == "dynamic":
            # DefaultTensorType: where shape inference cannot type a contrib op's output
            # (Attention after a failed symbolic inference), its MatMul's input is float
            quantize_dynamic(str(prepared), str(dst), weight_type=QuantType.QInt8,
                             op_types_to_quantize=list(op_types), nodes_to_exclude=list(exclude),
                             reduce_range=reduce_range,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
            return dst
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[config.calibration_method]
        with native_section("ONNX Runtime's quantization calibration"):  # its own sessions
            quantize_static(str(prepared), str(dst), make_calibration_reader(feeds),
                            quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=method, op_types_to_quantize=list(op_types),
                            nodes_to_exclude=list(exclude), reduce_range=reduce_range)
    return dst


@contextlib.contextmanager
def quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizer warns through the root logger ("Axis 1 is out-of-range for
    weight ..." for a rank-1 weight it then quantizes per tensor): shown only at DEBUG."""
    root = logging.getLogger()
    level = root.level
    if not debug_enabled():
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def require_known_nodes(names: Sequence[str], graph: onnx.ModelProto, op_types: Sequence[str]
                        ) -> None:
    """--quantize_exclude NODE,... must name nodes of the graph being quantized."""
    known = {n.name for n in graph.graph.node}
    unknown = [name for name in names if name not in known]
    if unknown:
        candidates = [n.name for n in graph.graph.node if n.op_type in op_types]
        shown = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
        raise ConfigError(f"--quantize_exclude names {', '.join(unknown)}, which the graph "
                          "does not have", f"its quantizable nodes are: {shown or 'none'} "
                          "(quantize.py --diagnose ranks them)")


@dataclass
class ExclusionStep:
    """One graph the automatic exclusion tried, judged on the validation split."""

    excluded: list[str]
    accuracy_val: float
    accuracy_val_fp32: float
    latency_ms_p50: float
    latency_ms_p50_fp32: float
    within_bound: bool
    faster: bool

    @property
    def accuracy_drop(self) -> float:
        return self.accuracy_val_fp32 - self.accuracy_val

    @property
    def passes(self) -> bool:
        return self.within_bound and self.faster

    @property
    def speedup(self) -> float:
        return self.latency_ms_p50_fp32 / max(self.latency_ms_p50, 1e-9)


class Quantizer:
    """Quantize one prepared graph with different nodes excluded (besides `fixed`, the nodes
    always kept in float: a detector's head and NMS), diagnose each result and judge it on the
    validation split against fp32 (timed in turns at --batch_size)."""

    def __init__(self, prepared: Path, mode: str, op_types: Sequence[str], feeds: Sequence[dict],
                 config: Config, val: Split | None, tag: str = "",
                 scorer: ProbabilityScorer | None = None, fixed: Sequence[str] = (),
                 reduce_range: bool = False) -> None:
        self.prepared, self.mode, self.op_types, self.feeds = prepared, mode, op_types, feeds
        self.reduce_range = reduce_range
        self.config, self.val, self.tag = config, val, tag
        self.scorer, self.fixed = scorer or ProbabilityScorer(), list(fixed)
        self._fp32 = None
        self._fp32_val: float | None = None
        self._tries = 0

    def quantize(self, exclude: Sequence[str]) -> Path:
        self._tries += 1
        dst = self.prepared.with_name(f"int8{self.tag}_{self._tries}.onnx")
        return quantize_prepared(self.prepared, dst, self.mode, self.op_types,
                                 [*self.fixed, *exclude], self.feeds, self.config,
                                 self.reduce_range)

    def diagnose(self, int8: Path) -> list[LayerError]:
        """The layers, worst first; none (and a WARNING) where the diagnosis itself fails: it
        explains int8, and must not cost the run its int8 graph."""
        try:
            return diagnose(self.prepared, int8, self.feeds[:DIAGNOSIS_BATCHES], self.op_types)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's helpers fail in many ways
            LOG.warning("could not diagnose the int8 layers: %s", first_line(err))
            return []

    def val_score(self, session) -> float:
        assert self.val is not None
        x, y = self.val
        found = self.scorer.predict(session, x, self.config.batch_size)
        return self.scorer.evaluate(found, y)[self.scorer.name]

    def judge_step(self, int8: Path, excluded: Sequence[str]) -> ExclusionStep:
        """Validation score and p50 at --batch_size against fp32 (the prepared graph)."""
        assert self.val is not None
        if self._fp32 is None:
            self._fp32 = create_session(str(self.prepared), self.config.cpu_runtime())
            self._fp32_val = self.val_score(self._fp32)
        session = create_session(str(int8), self.config.cpu_runtime())
        score = self.val_score(session)
        fp32_ms, int8_ms = interleaved_p50_ms([self._fp32, session], self.val[0],
                                              self.config.batch_size, self.scorer.runner)
        return ExclusionStep(list(excluded), score, self._fp32_val, int8_ms, fp32_ms,
                             within_bound=self._fp32_val - score <= self.config.max_accuracy_drop,
                             faster=int8_ms * MIN_SPEEDUP <= fp32_ms)


def search_exclusions(quantizer: Quantizer, int8: Path, layers: list[LayerError]
                      ) -> tuple[Path, list[LayerError], dict]:
    """--quantize_exclude auto: until int8 is within --max_accuracy_drop on the validation split
    and faster than fp32, keep the node adding the most noise (with any node measured at the same
    tensor) in fp32, quantize again, diagnose again and re-judge; stop when nothing is left to
    exclude or after MAX_EXCLUSION_STEPS. Returns the last graph, its diagnosis and the report's
    exclusion section."""
    excluded: list[str] = []
    steps = [quantizer.judge_step(int8, excluded)]
    tried = [(int8, layers)]
    while not (steps[-1].within_bound and steps[-1].faster) and len(steps) <= MAX_EXCLUSION_STEPS:
        left = [row for row in layers if row.node not in excluded]
        worst = [row.node for row in left if row.output == left[0].output] if left else []
        if len(worst) == len(left):  # excluding them would leave nothing in int8
            break
        excluded = [*excluded, *worst]
        LOG.info("int8 %s: quantizing again with %s in fp32", "is no faster than fp32"
                 if steps[-1].within_bound else f"loses {steps[-1].accuracy_drop:.4f} "
                 "validation accuracy", ", ".join(worst))
        int8 = quantizer.quantize(excluded)
        layers = quantizer.diagnose(int8)
        steps.append(quantizer.judge_step(int8, excluded))
        tried.append((int8, layers))
    kept = kept_step(steps)
    return *tried[kept], {"requested": "auto", "excluded": steps[kept].excluded,
                          "outcome": search_outcome(steps, steps[-1].excluded), "kept_step": kept,
                          "steps": [asdict(s) for s in steps]}


def kept_step(steps: Sequence[ExclusionStep]) -> int:
    """The step whose graph is written: the last when it succeeded; otherwise the fastest of
    those within the bound (the nearest to usable), or else the most accurate."""
    if steps[-1].within_bound and steps[-1].faster:
        return len(steps) - 1
    within = [k for k, step in enumerate(steps) if step.within_bound]
    if within:
        return min(within, key=lambda k: steps[k].latency_ms_p50 / steps[k].latency_ms_p50_fp32)
    return min(range(len(steps)), key=lambda k: steps[k].accuracy_drop)


def search_outcome(steps: Sequence[ExclusionStep], excluded: Sequence[str]) -> str:
    last, tried = steps[-1], f"{len(excluded)} node(s) excluded in {len(steps) - 1} step(s)"
    if last.within_bound and last.faster:
        return (f"within the bound and faster than fp32 with {tried}" if excluded else
                "within the bound and faster than fp32 with no node excluded")
    if last.within_bound and len(steps) == 1:
        return ("within the bound but not faster than fp32, and leaving out its one quantized "
                "node (or group) would leave nothing in int8")
    if last.within_bound:
        return (f"within the bound but not faster than fp32 with {tried}: no set of excluded "
                "nodes found that is both")
    return (f"still loses {last.accuracy_drop:.4f} validation accuracy with {tried}: no set of "
            "excluded nodes found within the bound")


def interleaved_p50_ms(sessions: Sequence, x: np.ndarray, batch_size: int,
                       runner: Callable = session_runner) -> list[float]:
    """p50 ms per batch of `batch_size` for each session (run by `runner(session)`), timed in
    turns on the same (whole) batches."""
    batches = whole_batches(batches_of(x, batch_size, graph_padding_id(sessions[0])), batch_size)
    timings = time_runners([runner(s) for s in sessions], batches, TIMED_RUNS)
    return [timings.percentile_ms(k, 50) for k in range(len(sessions))]


def judge(result: VariantResult, max_drop: float, force: bool, problems: Sequence[str] = ()
          ) -> None:
    """Fill problems, verdict and used_for_inference; say plainly what the variant did."""
    label = variant_label(result.mode)
    result.problems.extend(problems)
    on_val = result.accuracy_val is not None and result.accuracy_val_fp32 is not None
    drop = (result.accuracy_val_fp32 - result.accuracy_val if on_val
            else result.accuracy_fp32 - result.accuracy)
    metric = METRIC_WORDS.get(result.metric, result.metric)
    if drop > max_drop:
        score, fp32 = ((result.accuracy_val, result.accuracy_val_fp32) if on_val
                       else (result.accuracy, result.accuracy_fp32))
        result.problems.append(f"{label} loses {drop:.3f} {'validation' if on_val else 'test'} "
                               f"{metric} ({score:.4f} vs {fp32:.4f} for fp32; more than "
                               f"--max_accuracy_drop {max_drop:g}){saturation_note(result)}")
    if result.latency_ms_p50 > result.latency_ms_p50_fp32:
        result.problems.append(f"{label} is slower than fp32 at batch {result.batch_size} "
                               f"({result.latency_ms_p50:.3g} vs {result.latency_ms_p50_fp32:.3g} "
                               f"ms{grown_note(result)}){cpu_note(result)}")
    elif result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.problems.append(f"{label} is no faster than fp32 at batch {result.batch_size} "
                               f"({result.latency_ms_p50:.3g} vs {result.latency_ms_p50_fp32:.3g} "
                               f"ms; within the {MIN_SPEEDUP - 1:.0%} that timing noise can "
                               f"explain{grown_note(result)}){cpu_note(result)}")
    speedup = result.latency_ms_p50_fp32 / max(result.latency_ms_p50, 1e-9)
    note = ""
    if result.latency_ms_p50_batch1 > result.latency_ms_p50_batch1_fp32:
        note = (f" (at batch 1 {label} is slower: {result.latency_ms_p50_batch1:.3g} vs "
                f"{result.latency_ms_p50_batch1_fp32:.3g} ms)")
    if not result.problems:
        result.used_for_inference = True
        result.verdict = (f"{label}: {speedup:.2f}x the speed of fp32 at batch "
                          f"{result.batch_size}, test {metric} {result.accuracy:.4f} vs "
                          f"{result.accuracy_fp32:.4f}{other_metrics_note(result)}; inference "
                          f"uses {label}{note}")
    elif force:
        result.used_for_inference = True
        result.verdict = f"{'; '.join(result.problems)}; inference uses {label} (--force_quantized)"
    else:
        outcome = (f"inference does not use {label}" if result.mode not in ("static", "dynamic")
                   else "inference uses fp32 (--force_quantized true to use int8 anyway)")
        result.verdict = f"{'; '.join(result.problems)}; {outcome}"


def other_metrics_note(result: VariantResult) -> str:
    """' (mAP@.5 0.9312 vs 0.9355)': the variant's other test figures beside fp32's, or ''."""
    others = result.test_metrics or {}
    pairs = [f"{METRIC_WORDS.get(name, name)} {value:.4f} vs {others[name + '_fp32']:.4f}"
             for name, value in others.items() if name + "_fp32" in others]
    return f" ({', '.join(pairs)})" if pairs else ""


def variant_label(mode: str) -> str:
    """How a verdict names a variant: "int8 static", "fp16", "pruned", "qat int8", ..."""
    if mode in ("static", "dynamic"):
        return f"int8 {mode}"
    return f"{mode} int8" if mode in ("qat", "pruned_qat") else mode


def grown_note(result: VariantResult) -> str:
    """'; time grew in ConvInteger (+0.41 ms/run), ...' from --profile, else ''."""
    if not result.slower_op_types:
        return ""
    return "; time grew in " + ", ".join(f"{g['op_type']} (+{g['grew_ms']:.3g} ms/run)"
                                         for g in result.slower_op_types)


def cpu_section() -> dict:
    """The report's quantize.cpu: runtime.CpuInfo's fields and its one-line description."""
    info = cpu_info()
    return {**asdict(info), "description": info.describe()}


def saturation_note(result: VariantResult) -> str:
    """Why a full-range int8 graph may have lost its accuracy on this CPU, or ''."""
    if result.reduce_range is not False or not (result.cpu or {}).get("int8_saturates"):
        return ""
    return (f"; its full-range (8-bit) weights saturate on this CPU ({result.cpu['name']}: no "
            "VNNI or AMX), which --int8_range reduced (or auto) avoids")


def cpu_note(result: VariantResult) -> str:
    """Why int8 may not be faster here, where the CPU is known to lack int8 dot-product
    instructions (a fact about the machine, not a guess about the graph)."""
    lacks_dot_product = bool(result.cpu) and result.cpu["int8_dot_product"] == []  # None: unknown
    if result.mode == "fp16" or not lacks_dot_product:
        return ""
    return (f"; this CPU ({result.cpu['name']}) has no int8 dot-product instructions (VNNI, "
            "AMX), where ONNX Runtime's int8 matrix kernels can be no faster than fp32: "
            "bench/int8_gemm.py measures them on a machine")


def measure_against_fp32(fp32_path: Path, variant: bytes, runtime: RuntimeOptions,
                         x: np.ndarray, y: np.ndarray, batch_size: int,
                         val: Split | None = None, scorer: ProbabilityScorer | None = None,
                         **fields) -> VariantResult:
    """Test score, agreement, difference, size and interleaved p50 latency vs fp32, and the
    validation scores the verdict judges (`scorer`: what "accuracy" is, by name, and how the
    graphs' outputs are computed, scored and compared: variant_scorer; accuracy by default)."""
    scorer = scorer or ProbabilityScorer()
    sessions = [create_session(str(fp32_path), runtime), create_session(variant, runtime)]
    if val is not None and len(val[0]):
        fields["accuracy_val_fp32"], fields["accuracy_val"] = (
            scorer.evaluate(scorer.predict(s, val[0], batch_size), val[1])[scorer.name]
            for s in sessions)
    outputs_fp32, outputs = (scorer.predict(s, x, batch_size) for s in sessions)
    scores_fp32, scores = (scorer.evaluate(o, y) for o in (outputs_fp32, outputs))
    others = {f"{name}{suffix}": figures[name] for name in scores if name != scorer.name
              for suffix, figures in (("", scores), ("_fp32", scores_fp32))}
    agreement, difference = scorer.compare(outputs, outputs_fp32)
    p50_batch = interleaved_p50_ms(sessions, x, batch_size, scorer.runner)
    p50_one = interleaved_p50_ms(sessions, x, 1, scorer.runner)
    return VariantResult(
        provider=sessions[1].get_providers()[0], size_bytes_fp32=fp32_path.stat().st_size,
        cpu=(cpu_section() if sessions[1].get_providers()[0] == "CPUExecutionProvider" else None),
        size_bytes=len(variant), accuracy=scores[scorer.name], metric=scorer.name,
        accuracy_fp32=scores_fp32[scorer.name], top1_agreement=agreement,
        max_abs_diff=difference, batch_size=batch_size,
        latency_ms_p50=p50_batch[1], latency_ms_p50_fp32=p50_batch[0],
        latency_ms_p50_batch1=p50_one[1], latency_ms_p50_batch1_fp32=p50_one[0],
        used_for_inference=False, verdict="", test_metrics=others or None, **fields)


def quantize_bundle(config: Config, paths: BundlePaths, train_x: np.ndarray, val: Split | None,
                    test: Split) -> VariantResult:
    """Quantize (excluding nodes as --quantize_exclude says; a detector's head and NMS always),
    diagnose the layers, judge on the validation split, report the test score, time against
    fp32, write model.int8.onnx."""
    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    source = onnx.load(str(paths.onnx))
    mode = choose_mode(config.quantize, source)
    weights = choose_int8_range(config.int8_range, cpu_info())
    LOG.info("quantizing %s to int8 (%s%s, %s-range weights: %s)", paths.onnx.name, mode,
             ", auto" if config.quantize == "auto" else "",
             "reduced" if weights.reduce_range else "full", weights.reason)
    scorer = variant_scorer(manifest)
    with scratch_folder(paths.onnx.parent) as tmp:
        prepared = quantizer_step(mode, lambda: prepare_graph(paths.onnx, Path(tmp), mode))
        feeds = calibration_feeds(source, train_x, config.calibration_size, config.seed,
                                  calibration_batch(manifest))
        trials, chosen = quantize_trials(config, prepared, mode, feeds, val, scorer,
                                         manifest.preprocessing.kind == "detection",
                                         weights.reduce_range)
        trial = trials[chosen]
        int8_bytes = stamp_contract(onnx.load(str(trial.int8)), manifest).SerializeToString()
    section = trial.exclusion
    result = measure_against_fp32(
        paths.onnx, int8_bytes, config.cpu_runtime(), *test, config.batch_size, val,
        scorer=scorer, mode=mode,
        requested=config.quantize, path=str(paths.int8), op_types=trial.op_types,
        layers=[row.report_row() for row in trial.layers[:SHOWN_LAYERS]], exclusion=section,
        op_sets=op_sets_section(trials, chosen), reduce_range=weights.reduce_range,
        reduce_range_reason=weights.reason,
        calibration=None if mode == "dynamic" else {
            "method": config.calibration_method, "source": "train split",
            "samples": min(config.calibration_size, len(train_x))})
    int8_graph = onnx.load_from_string(int8_bytes)
    problems = [] if any(n.op_type in QUANTIZED_OPS for n in int8_graph.graph.node) else [
        f"{mode} quantization found nothing to quantize in this graph"]
    problems += head_problems(int8_graph, section.get("kept_float"))
    steps = section.get("steps") or []
    if len(steps) > 1 and not (steps[-1]["within_bound"] and steps[-1]["faster"]):
        problems.append(f"auto exclusion {section['outcome']}")
    if config.profile and result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.slower_op_types = grown_time(paths.onnx, int8_bytes, config.cpu_runtime(),
                                            config.batch_size, test[0])
    judge(result, config.max_accuracy_drop, config.force_quantized, problems)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "int8", int8_bytes, result.report_section())
    return result


def quantize_trials(config: Config, prepared: Path, mode: str, feeds: Sequence[dict],
                    val: Split | None, scorer: ProbabilityScorer, detector: bool,
                    reduce_range: bool = False) -> tuple[list[OpSetTrial], int]:
    """Each op set of --quantize_ops quantized (with the nodes of --quantize_exclude, or those
    it searches for, kept fp32; a detector's head and NMS kept float besides: see
    ttc/tasks/detect/quantize.py), diagnosed and, where there is a choice, judged. Returns the
    trials and the index of the chosen one."""
    exclusion = config.exclusion()
    on_val = val is not None and len(val[0]) > 0
    graph = onnx.load(str(prepared))
    candidates = op_set_candidates(config.op_set(), mode, {n.op_type for n in graph.graph.node})
    candidates = candidates if on_val else candidates[:1]  # nothing to judge them on
    manual = [] if exclusion == "auto" else list(exclusion)
    require_known_nodes(manual, graph, sorted({t for c in candidates for t in c}))
    parts = None
    if detector:
        from ttc.tasks.detect.quantize import graph_parts, kept_float_section

        parts = graph_parts(graph)
    trials = []
    for k, op_types in enumerate(candidates):
        quantizer = Quantizer(prepared, mode, op_types, feeds, config, val, tag=f"_{k}",
                              scorer=scorer, fixed=parts.kept_float() if parts else (),
                              reduce_range=reduce_range)
        trial = quantizer_step(mode, lambda: try_op_set(
            quantizer, manual, auto=exclusion == "auto" and on_val, judge=len(candidates) > 1))
        if parts is not None:
            kept = kept_float_section(parts, graph, op_types)
            trial.exclusion.update(kept_float=kept,
                                   excluded=[*kept["quantizable"], *trial.exclusion["excluded"]])
        trials.append(trial)
    return trials, choose_op_set(trials)


def head_problems(int8: onnx.ModelProto, kept_float: dict | None) -> list[str]:
    """A detector's: the nodes meant to stay float (head, NMS) that int8 quantized anyway."""
    if not kept_float:
        return []
    from ttc.tasks.detect.quantize import float_violations

    wrong = float_violations(int8, [*kept_float["head"], *kept_float["postprocessing"]])
    return [f"int8 quantized {len(wrong)} node(s) of the head or NMS meant to stay float: "
            f"{', '.join(wrong[:5])}"] if wrong else []


@dataclass
class OpSetTrial:
    """One op set quantized (its nodes excluded as asked), diagnosed and, where there is a
    choice to make, judged on the validation split."""

    op_types: list[str]
    int8: Path
    layers: list[LayerError]
    exclusion: dict
    judged: ExclusionStep | None


def try_op_set(quantizer: Quantizer, manual: Sequence[str], auto: bool, judge: bool
               ) -> OpSetTrial:
    """Quantize with the nodes in `manual` kept fp32, or search for them (`auto`)."""
    int8 = quantizer.quantize(manual)
    layers = quantizer.diagnose(int8)
    op_types = list(quantizer.op_types)
    if auto and op_types:
        int8, layers, section = search_exclusions(quantizer, int8, layers)
        kept = ExclusionStep(**section["steps"][section["kept_step"]])
        return OpSetTrial(op_types, int8, layers, section, kept)
    judged = quantizer.judge_step(int8, manual) if judge else None
    return OpSetTrial(op_types, int8, layers, {"requested": list(manual),
                                               "excluded": list(manual)}, judged)


def choose_op_set(trials: Sequence[OpSetTrial]) -> int:
    """--quantize_ops auto: the default set (the first trial) unless the validation judge
    prefers the wider one: it passes (within the bound and 5% faster than fp32) where the
    default does not, or both pass and it is 5% faster still. Returns the trial's index."""
    if len(trials) == 1:
        return 0
    default, wider = trials[0].judged, trials[1].judged
    assert default is not None and wider is not None
    if wider.passes and (not default.passes or wider.speedup >= default.speedup * MIN_SPEEDUP):
        LOG.info("int8 keeps every quantizable op type (%.2fx fp32's speed on validation, "
                 "against %.2fx with %s)", wider.speedup, default.speedup,
                 ", ".join(trials[0].op_types))
        return 1
    return 0


def op_sets_section(trials: Sequence[OpSetTrial], chosen: int) -> list[dict] | None:
    """The report's quantize.op_sets: each set tried, as judged, and which was kept."""
    if len(trials) < 2:
        return None
    return [{"op_types": t.op_types, **asdict(t.judged), "kept": k == chosen}
            for k, t in enumerate(trials) if t.judged is not None]


def quantizer_step(mode: str, step: Callable[[], T]) -> T:
    """Run a step of ONNX Runtime's quantizer; its many failures become one ExportError line
    (a ConfigError from our own checks passes through)."""
    try:
        return step()
    except (ConfigError, ExportError):
        raise
    except Exception as err:  # noqa: BLE001 - the quantizer fails in many ways
        other = "static" if mode == "dynamic" else "dynamic"
        raise ExportError(f"{mode} quantization failed: {first_line(err)}",
                          f"try --quantize {other}, or --quantize none") from None


def grown_time(fp32_path: Path, variant: bytes, runtime: RuntimeOptions, batch_size: int,
               x: np.ndarray) -> list[dict]:
    """--profile: both graphs through ONNX Runtime's profiler on the same batches; the op types
    whose time per run grew in the variant, most first."""
    from ttc.serving.profiling import grown_op_types, profile_runs, profiled_batches

    batches = profiled_batches(batches_of(x, batch_size,
                                          graph_padding_id(onnx.load(str(fp32_path)))))
    return grown_op_types(profile_runs(str(fp32_path), runtime, batches, None),
                          profile_runs(variant, runtime, batches, None))


def diagnose_bundle(config: Config, paths: BundlePaths, train_x: np.ndarray) -> dict:
    """quantize.py --diagnose: the bundle's existing int8 graph against its fp32 graph, every
    changed node ranked, without quantizing again."""
    manifest = read_manifest(paths)
    int8_path = require_onnx_in_bundle(paths, manifest, "int8")
    recorded = manifest.quantization
    mode = (recorded.mode if recorded else None) or "static"
    source = onnx.load(str(require_onnx_in_bundle(paths, manifest)))
    with scratch_folder(paths.onnx.parent) as tmp:
        prepared = quantizer_step(mode, lambda: prepare_graph(paths.onnx, Path(tmp), mode))
        feeds = calibration_feeds(source, train_x, config.calibration_size, config.seed,
                                  calibration_batch(manifest))
        layers = diagnose(prepared, int8_path, feeds[:DIAGNOSIS_BATCHES],
                          quantizable_op_types(mode) | {"Gemm"})
    LOG.info("diagnosed %d quantized node(s) of %s; the worst: %s", len(layers), int8_path.name,
             layers[0].node if layers else "none")
    return {"mode": mode, "path": str(int8_path), "diagnosis_only": True,
            "verdict": recorded.verdict if recorded else None,
            "layers": [row.report_row() for row in layers[:SHOWN_LAYERS]]}


def fp16_bundle(config: Config, paths: BundlePaths, val: Split | None, test: Split
                ) -> VariantResult:
    """An fp16 graph (inputs and outputs stay fp32) for GPU providers, validated and timed
    against fp32 on the requested providers; used only where a GPU provider runs it faster."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    with stdout_to_stderr():
        half = convert_float_to_float16(onnx.load(str(paths.onnx)), keep_io_types=True)
    data = stamp_contract(half, manifest).SerializeToString()
    result = measure_against_fp32(paths.onnx, data, config.runtime(), *test, config.batch_size,
                                  val, scorer=variant_scorer(manifest), mode="fp16",
                                  requested="fp16", path=str(paths.fp16))
    cpu_only = [] if result.provider != "CPUExecutionProvider" else [
        "fp16 is for GPU providers and only CPUExecutionProvider is active here (timings above "
        "are CPU timings)"]
    if config.profile and result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.slower_op_types = grown_time(paths.onnx, data, config.runtime(),
                                            config.batch_size, test[0])
    judge(result, config.max_accuracy_drop, False, cpu_only)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "fp16", data, result.report_section())
    return result


# ----------------------------------------------------------------------------- compression

def judge_compressed(config: Config, paths: BundlePaths, val: Split | None, test: Split,
                     int8: VariantResult | dict | None = None) -> dict:
    """Each compressed variant of the bundle (--prune, --qat) through the gate int8 passes:
    validation accuracy within --max_accuracy_drop of fp32 and faster at --batch_size, timed
    against fp32 in turns. The served graph is the fastest that passes (int8 among them where it
    passed), else fp32; the manifest records the verdicts and the choice. Returns the report's
    compression section."""
    manifest = read_manifest(paths)
    record = manifest.to_json_dict()["compression"]
    results: dict[str, VariantResult] = {}
    for entry in record["variants"]:
        name = entry["name"]
        require_onnx_in_bundle(paths, manifest, name)
        data = paths.variant(name).read_bytes()
        result = measure_against_fp32(paths.onnx, data, config.cpu_runtime(), *test,
                                      config.batch_size, val, mode=name, requested=name,
                                      path=str(paths.variant(name)))
        judge(result, config.max_accuracy_drop, False)
        (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
        entry.update(verdict=result.verdict, used_for_inference=result.used_for_inference,
                     speedup=round(speedup_of(result), 4))
        results[name] = result
    int8 = int8.report_section() if isinstance(int8, VariantResult) else int8
    record["served"] = served_choice(record["variants"], int8)
    write_manifest_section(paths, manifest, "compression", record)
    LOG.info("compression: inference uses %s", SERVED_WORDS.get(record["served"],
                                                                  record["served"]))
    return compression_section(record, results, int8)


SERVED_WORDS = {"onnx": "fp32 (model.onnx)", "int8": "int8 (model.int8.onnx)"}


def speedup_of(result: VariantResult | dict) -> float:
    row = result if isinstance(result, dict) else asdict(result)
    return row["latency_ms_p50_fp32"] / max(row["latency_ms_p50"], 1e-9)


def served_choice(entries: Sequence[dict], int8: dict | None) -> str:
    """The fastest graph that passed its gate (highest speed-up over fp32), else fp32."""
    passed = [(entry["speedup"], entry["name"]) for entry in entries
              if entry.get("used_for_inference")]
    if int8 and int8.get("used_for_inference"):
        passed.append((speedup_of(int8), "int8"))
    return max(passed)[1] if passed else "onnx"


def compression_section(record: dict, results: dict[str, VariantResult], int8: dict | None
                        ) -> dict:
    """The report's compression table: fp32 first, then post-training int8 where it ran, then
    each compressed variant; one row each with the figures the gate judged."""
    fp32 = record.get("fp32") or {}
    first = next(iter(results.values()), None)
    rows = [{"name": "fp32", "recipe": None, "params": fp32.get("params"),
             "macs": fp32.get("macs"), "size_bytes": first.size_bytes_fp32 if first else None,
             "val_accuracy": first.accuracy_val_fp32 if first else None,
             "test_accuracy": first.accuracy_fp32 if first else None,
             "latency_ms": first.latency_ms_p50_fp32 if first else None, "speedup": 1.0,
             "verdict": "the trained network", "served": record["served"] == "onnx"}]
    if int8:
        rows.append({"name": f"int8 {int8['mode']} (post-training)",
                     "recipe": {"quantize": int8["mode"]}, "params": fp32.get("params"),
                     "macs": fp32.get("macs"), "size_bytes": int8["size_bytes"],
                     "val_accuracy": int8.get("accuracy_val"), "test_accuracy": int8["accuracy"],
                     "latency_ms": int8["latency_ms_p50"], "speedup": round(speedup_of(int8), 4),
                     "verdict": int8["verdict"], "served": record["served"] == "int8"})
    for entry in record["variants"]:
        result = results[entry["name"]]
        rows.append({"name": entry["name"], "recipe": entry["recipe"], "params": entry["params"],
                     "macs": entry["macs"], "size_bytes": result.size_bytes,
                     "val_accuracy": result.accuracy_val, "test_accuracy": result.accuracy,
                     "latency_ms": result.latency_ms_p50, "speedup": entry["speedup"],
                     "verdict": result.verdict, "served": record["served"] == entry["name"],
                     "top1_agreement_torch": entry.get("top1_agreement"),
                     "qdq": entry.get("qdq")})
    return {"batch_size": first.batch_size if first else None, "served": record["served"],
            "cpu": first.cpu if first else None, "variants": rows}


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "quantize", "Quantize an exported bundle to int8 (model.int8.onnx), diagnose its layers, "
        "judge it on the validation split, report its test accuracy and time it against fp32.",
        required=["output_model"],
        epilog="examples:\n  python quantize.py --output_model runs/digits/model.onnx "
               "--quantize static --calibration_size 256\n"
               "  python quantize.py --output_model runs/sms/model.onnx --quantize static "
               "--quantize_ops all --quantize_exclude auto\n"
               "  python quantize.py --output_model runs/sms/model.onnx --diagnose true")
    config = start_cli(parser, argv)

    def stages(report: dict) -> None:
        from ttc.inputs.data import load_bundle_dataset, split_paths_of

        paths = BundlePaths.from_model_path(config.output_model)
        manifest = read_manifest(paths)

        def named_data(splits: tuple[str, ...]):  # the data the flags name, never the bundle
            return load_bundle_dataset(manifest, config.dataset_path, splits,
                                       not config.no_progress, split_paths_of(config))

        if config.diagnose:
            require_onnx_in_bundle(paths, manifest, "int8")  # before any data is read
            require_onnx_in_bundle(paths, manifest)  # and the fp32 graph it is compared with
            data = named_data(("train",))
            report["dataset"] = data.report_section()
            report["quantize"] = diagnose_bundle(config, paths, data.train.x)
            return
        data = named_data(("train", "val", "test"))
        report["dataset"] = data.report_section()
        val, test = (data.val.x, data.val.y), (data.test.x, data.test.y)
        if config.quantize == "none" and not config.fp16:
            config.quantize = "auto"
        if config.quantize != "none":
            report["quantize"] = quantize_bundle(config, paths, data.train.x, val,
                                                 test).report_section()
        if config.fp16:
            report["fp16"] = fp16_bundle(config, paths, val, test).report_section()

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
