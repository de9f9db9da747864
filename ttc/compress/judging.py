"""A variant (int8, fp16, a compressed graph) measured against fp32 on the same data, sessions
and batches, and its verdict: within --max_accuracy_drop and faster, or not, said plainly (the
CPU's int8 instructions, --profile's grown op types). What "accuracy" is comes from the model
type's scorer (ttc/compress/quantizing.py). No torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx

from ttc.compress.quantizing import ProbabilityScorer, Scorer
from ttc.serving.runtime import (RuntimeOptions, batches_of, cpu_info, create_session,
                                graph_padding_id, session_runner, time_runners, whole_batches)

TIMED_RUNS = 40
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


# How verdicts name a metric
METRIC_WORDS = {"accuracy": "accuracy", "mean_iou": "mean IoU", "map": "mAP@[.5:.95]",
                "map50": "mAP@.5"}



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
                         val: Split | None = None, scorer: Scorer | None = None,
                         **fields) -> VariantResult:
    """Test score, agreement, difference, size and interleaved p50 latency vs fp32, and the
    validation scores the verdict judges (`scorer`: what "accuracy" is, by name, and how the
    graphs' outputs are computed, scored and compared: the model type's Parts.quantizing;
    accuracy by default)."""
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



def grown_time(fp32_path: Path, variant: bytes, runtime: RuntimeOptions, batch_size: int,
               x: np.ndarray) -> list[dict]:
    """--profile: both graphs through ONNX Runtime's profiler on the same batches; the op types
    whose time per run grew in the variant, most first."""
    from ttc.serving.profiling import grown_op_types, profile_runs, profiled_batches

    batches = profiled_batches(batches_of(x, batch_size,
                                          graph_padding_id(onnx.load(str(fp32_path)))))
    return grown_op_types(profile_runs(str(fp32_path), runtime, batches, None),
                          profile_runs(variant, runtime, batches, None))

