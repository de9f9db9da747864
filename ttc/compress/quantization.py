"""The int8 and fp16 variants of a bundle's fp32 graph, made, validated and timed against fp32
in the same process, and the gate of the compressed variants (--prune, --qat) that chooses the
served graph (`judge_compressed`). What differs by model type (the scorer, the calibration
batch, the nodes kept float) comes from its `Parts.quantizing` (ttc/compress/quantizing.py);
ONNX Runtime's quantizer steps are in int8.py, the exclusion search and op-set trials in
exclusion.py, the measurement and verdicts in judging.py. quantize.py and pipeline.py call the
three entry points: quantize_bundle, fp16_bundle, judge_compressed (and diagnose_bundle), each
given the quantization stage's options (ttc/options/stages.py: QuantizeOptions)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from ttc.compress.exclusion import (DIAGNOSIS_BATCHES, TrialOptions, op_sets_section,
                                    quantize_trials)
from ttc.compress.int8 import (QUANTIZED_OPS, calibration_feeds, choose_int8_range, choose_mode,
                               prepare_graph, quantizable_op_types, quantizer_step)
from ttc.compress.judging import (MIN_SPEEDUP, Split, VariantResult, grown_time, judge,
                                  measure_against_fp32)
from ttc.compress.quantizing import KeptFloat, Quantizing
from ttc.convert.diagnosis import SHOWN_LAYERS, diagnose
from ttc.options.stages import QuantizeOptions
from ttc.serving.bundle import (BundlePaths, read_manifest, record_variant, require_onnx_in_bundle,
                                stamp_contract, write_manifest_section)
from ttc.serving.runtime import cpu_info
from ttc.tasks.registry import task_of_kind
from utils import LOG, scratch_folder, stdout_to_stderr


def quantizing_of(manifest) -> Quantizing:
    """The bundle's model type's part in quantization (ttc/compress/quantizing.py's shape)."""
    return task_of_kind(manifest.preprocessing.kind).part("quantizing")


def trial_options(options: QuantizeOptions) -> TrialOptions:
    return TrialOptions(options.calibration_method, options.batch_size, options.max_accuracy_drop,
                        options.cpu_runtime(), options.op_set(), options.exclusion())


def quantize_bundle(options: QuantizeOptions, paths: BundlePaths, train_x: np.ndarray,
                    val: Split | None, test: Split) -> VariantResult:
    """Quantize (excluding nodes as --quantize_exclude says, and those the model type keeps
    float: a detector's head and NMS), diagnose the layers, judge on the validation split,
    report the test score, time against fp32, write model.int8.onnx."""
    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    source = onnx.load(str(paths.onnx))
    mode = choose_mode(options.quantize, source)
    weights = choose_int8_range(options.int8_range, cpu_info())
    LOG.info("quantizing %s to int8 (%s%s, %s-range weights: %s)", paths.onnx.name, mode,
             ", auto" if options.quantize == "auto" else "",
             "reduced" if weights.reduce_range else "full", weights.reason)
    quantizing = quantizing_of(manifest)
    scorer = quantizing.scorer(manifest)
    with scratch_folder(paths.onnx.parent) as tmp:
        prepared = quantizer_step(mode, lambda: prepare_graph(paths.onnx, Path(tmp), mode))
        feeds = calibration_feeds(source, train_x, options.calibration_size, options.seed,
                                  quantizing.calibration_batch)
        graph = onnx.load(str(prepared))
        kept = quantizing.kept_float(graph)
        trials, chosen = quantize_trials(trial_options(options), prepared, graph, mode, feeds, val,
                                         scorer, kept, weights.reduce_range)
        trial = trials[chosen]
        int8_bytes = stamp_contract(onnx.load(str(trial.int8)), manifest).SerializeToString()
    section = trial.exclusion
    result = measure_against_fp32(
        paths.onnx, int8_bytes, options.cpu_runtime(), *test, options.batch_size, val,
        scorer=scorer, mode=mode,
        requested=options.quantize, path=str(paths.int8), op_types=trial.op_types,
        layers=[row.report_row() for row in trial.layers[:SHOWN_LAYERS]], exclusion=section,
        op_sets=op_sets_section(trials, chosen), reduce_range=weights.reduce_range,
        reduce_range_reason=weights.reason,
        calibration=None if mode == "dynamic" else {
            "method": options.calibration_method, "source": "train split",
            "samples": min(options.calibration_size, len(train_x))})
    problems = int8_problems(onnx.load_from_string(int8_bytes), mode, section, kept)
    if options.profile and result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.slower_op_types = grown_time(paths.onnx, int8_bytes, options.cpu_runtime(),
                                            options.batch_size, test[0])
    judge(result, options.max_accuracy_drop, options.force_quantized, problems)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "int8", int8_bytes, result.report_section())
    return result


def int8_problems(int8: onnx.ModelProto, mode: str, exclusion: dict, kept: KeptFloat | None
                  ) -> list[str]:
    """What the int8 graph itself gets wrong before it is judged: nothing quantized, nodes the
    model type keeps float quantized anyway, an automatic exclusion that found no usable set."""
    problems = [] if any(n.op_type in QUANTIZED_OPS for n in int8.graph.node) else [
        f"{mode} quantization found nothing to quantize in this graph"]
    problems += kept.problems(int8) if kept is not None else []
    steps = exclusion.get("steps") or []
    if len(steps) > 1 and not (steps[-1]["within_bound"] and steps[-1]["faster"]):
        problems.append(f"auto exclusion {exclusion['outcome']}")
    return problems


def diagnose_bundle(options: QuantizeOptions, paths: BundlePaths, train_x: np.ndarray) -> dict:
    """quantize.py --diagnose: the bundle's existing int8 graph against its fp32 graph, every
    changed node ranked, without quantizing again."""
    manifest = read_manifest(paths)
    int8_path = require_onnx_in_bundle(paths, manifest, "int8")
    recorded = manifest.quantization
    mode = (recorded.mode if recorded else None) or "static"
    source = onnx.load(str(require_onnx_in_bundle(paths, manifest)))
    with scratch_folder(paths.onnx.parent) as tmp:
        prepared = quantizer_step(mode, lambda: prepare_graph(paths.onnx, Path(tmp), mode))
        feeds = calibration_feeds(source, train_x, options.calibration_size, options.seed,
                                  quantizing_of(manifest).calibration_batch)
        layers = diagnose(prepared, int8_path, feeds[:DIAGNOSIS_BATCHES],
                          quantizable_op_types(mode) | {"Gemm"})
    LOG.info("diagnosed %d quantized node(s) of %s; the worst: %s", len(layers), int8_path.name,
             layers[0].node if layers else "none")
    return {"mode": mode, "path": str(int8_path), "diagnosis_only": True,
            "verdict": recorded.verdict if recorded else None,
            "layers": [row.report_row() for row in layers[:SHOWN_LAYERS]]}


def fp16_bundle(options: QuantizeOptions, paths: BundlePaths, val: Split | None, test: Split
                ) -> VariantResult:
    """An fp16 graph (inputs and outputs stay fp32) for GPU providers, validated and timed
    against fp32 on the requested providers; used only where a GPU provider runs it faster."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    manifest = read_manifest(paths)
    require_onnx_in_bundle(paths, manifest)
    with stdout_to_stderr():
        half = convert_float_to_float16(onnx.load(str(paths.onnx)), keep_io_types=True)
    data = stamp_contract(half, manifest).SerializeToString()
    result = measure_against_fp32(paths.onnx, data, options.runtime(), *test, options.batch_size,
                                  val, scorer=quantizing_of(manifest).scorer(manifest), mode="fp16",
                                  requested="fp16", path=str(paths.fp16))
    cpu_only = [] if result.provider != "CPUExecutionProvider" else [
        "fp16 is for GPU providers and only CPUExecutionProvider is active here (timings above "
        "are CPU timings)"]
    if options.profile and result.latency_ms_p50 * MIN_SPEEDUP > result.latency_ms_p50_fp32:
        result.slower_op_types = grown_time(paths.onnx, data, options.runtime(),
                                            options.batch_size, test[0])
    judge(result, options.max_accuracy_drop, False, cpu_only)
    (LOG.info if not result.problems else LOG.warning)("%s", result.verdict)
    record_variant(paths, manifest, "fp16", data, result.report_section())
    return result


# ----------------------------------------------------------------------------- compression

def judge_compressed(options: QuantizeOptions, paths: BundlePaths, val: Split | None, test: Split,
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
        result = measure_against_fp32(paths.onnx, data, options.cpu_runtime(), *test,
                                      options.batch_size, val, mode=name, requested=name,
                                      path=str(paths.variant(name)))
        judge(result, options.max_accuracy_drop, False)
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


