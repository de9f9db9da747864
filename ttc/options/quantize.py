"""The quantization stage's flags: int8 (dynamic, static, auto), its calibration and accuracy
bound, the op types it may quantize and the nodes it keeps in fp32, fp16, and which variant
inference runs."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, parse_bool, positive

QUANTIZE_MODES = ("none", "dynamic", "static", "auto")
INT8_RANGES = ("auto", "full", "reduced")


@dataclass
class QuantizeFlags:
    quantize: str = opt("none", "int8 quantization of the exported graph: dynamic (MatMul/Gemm), "
                        "static (QDQ, per-channel, calibrated on training data), auto (static "
                        "for convolutional models, else dynamic)", "quantization",
                        choices=QUANTIZE_MODES, scripts="PQ")
    int8_range: str = opt(
        "auto", "int8 weight range: full (8 bits), reduced (7 bits: ONNX Runtime's "
        "reduce_range), auto (reduced where this CPU's int8 kernels saturate: x86 without VNNI "
        "or AMX, or an unknown CPU; else full); recorded in the report and manifest",
        "quantization", choices=INT8_RANGES, scripts="PQ")
    calibration_size: int = opt(256, "training samples used to calibrate static quantization",
                                "quantization", type=int, metavar="N", scripts="PQ")
    calibration_method: str = opt("minmax", "static calibration method", "quantization",
                                  choices=("minmax", "entropy", "percentile"), scripts="PQ")
    max_accuracy_drop: float = opt(0.01, "largest validation-accuracy loss allowed for int8 "
                                   "and the compressed variants (--prune, --qat); "
                                   "beyond it (or if the variant is slower) inference uses "
                                   "fp32", "quantization", type=float, metavar="FRACTION",
                                   scripts="PQE")
    quantize_ops: str | None = opt(
        None, "op types int8 may quantize: default (static: Conv, MatMul, Gemm; dynamic: "
        "MatMul, Attention), all (every op type ONNX Runtime's quantizer handles), auto (try "
        "both, keep all only where the validation judge prefers it), or a list, e.g. "
        "Conv,MatMul,Add (default: auto for --quantize auto, else default)", "quantization",
        metavar="OPS", scripts="PQ")
    quantize_exclude: str | None = opt(
        None, "nodes kept in fp32: auto (when int8 loses more than --max_accuracy_drop on the "
        "validation split, leave out the worst nodes of the per-layer diagnosis one step at a "
        "time until it is within the bound and faster than fp32), none, or node names, e.g. "
        "node_softmax,node_div (default: auto for --quantize auto, else none)", "quantization",
        metavar="NODES", scripts="PQ")
    diagnose: bool = opt(False, "quantize.py: diagnose the bundle's existing int8 graph (per-"
                         "layer error against fp32 on calibration samples) without quantizing "
                         "again", "quantization", type=parse_bool, metavar="BOOL", scripts="Q")
    fp16: bool = opt(False, "also write an fp16 graph (inputs and outputs stay fp32) for GPU "
                     "providers, validated and timed against fp32; inference.py: run it",
                     "quantization", type=parse_bool, metavar="BOOL", scripts="PQI")
    quantized: bool = opt(False, "inference.py: run the bundle's int8 graph (model.int8.onnx) "
                          "instead of fp32", "quantization", type=parse_bool, metavar="BOOL",
                              scripts="I")
    force_quantized: bool = opt(False, "use the int8 graph for inference even when it is slower "
                                "or less accurate", "quantization", type=parse_bool,
                                metavar="BOOL", scripts="PQ")

    def check_quantize(self) -> None:
        positive("calibration_size", self.calibration_size)
        if not 0 <= self.max_accuracy_drop <= 1:
            bad("max_accuracy_drop", self.max_accuracy_drop, "use a fraction between 0 and 1")
        if self.quantize_exclude is not None and not self.quantize_exclude.strip(" ,"):
            bad("quantize_exclude", self.quantize_exclude, "use auto, none or node names")
        if self.quantize_ops is not None and not self.quantize_ops.strip(" ,"):
            bad("quantize_ops", self.quantize_ops, "use default, all, auto or op types, e.g. "
                "Conv,MatMul")

    def op_set(self) -> str:
        """--quantize_ops resolved: "default", "all", "auto" or a comma-separated list."""
        value = self.quantize_ops or ("auto" if self.quantize == "auto" else "default")
        word = value.strip().lower()
        return word if word in ("default", "all", "auto") else value

    def exclusion(self) -> str | list[str]:
        """--quantize_exclude resolved: "auto", or the node names to keep in fp32 (none: [])."""
        value = self.quantize_exclude or ("auto" if self.quantize == "auto" else "none")
        if value.strip().lower() in ("auto", "none"):
            return "auto" if value.strip().lower() == "auto" else []
        return [name.strip() for name in value.split(",") if name.strip()]
