"""The bundle manifest's one schema: the type and range of every field a stage reads, checked
when bundle.read_manifest reads a manifest, before anything in it is used.

A manifest is written by whoever made the bundle (its hashes catch accidents, not an attacker),
so a field of another type, a number out of range or JSON nested deeper than any manifest is
exit 4 naming the field, never a crash in the stage that reads it. The fields no stage reads
(training and export figures) need only be JSON objects. No torch here: inference reads
bundles.
"""
from __future__ import annotations

import json
import math
import reprlib
from typing import Any, Callable

from ttc.inputs.limits import MAX_IMAGE_SIDE, MAX_LABELS, MAX_TEXT_LENGTH
from ttc.inputs.preprocess import HF_TOKENIZER, PAD_ID, UNK_ID
from ttc.inputs.tables import FORMAT_NAMES
from ttc.tasks.registry import TASKS, task_for

# (value, its place in the manifest such as "preprocessing.vocabulary") → the problem, or None
Check = Callable[[Any, str], "str | None"]

MAX_DEPTH = 32  # a manifest nests about 5 levels (architecture.hf_config.id2label)
MAX_INT = 2**31 - 1  # sizes and ids: what the Rust tokenizer and ONNX Runtime take as int32
MODEL_KINDS = {task.name: task.kind for task in TASKS}  # model_type → preprocessing.kind
# every graph's outputs, (batch, classes) float32; a segmenter's are (batch, classes, height,
# width), with the mask (batch, height, width) int64 beside them; a detector's are its padded
# detections (ttc/tasks/detect: DETECTION_OUTPUTS)
OUTPUT_NAMES = ("logits", "probabilities", "mask", "boxes", "scores", "labels", "num_detections",
                "prediction")  # a regressor's: (batch,) float32 in the target's units
HF_GRAPH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # hf.GRAPH_INPUTS (torch)
TORCHVISION_ARCHS = task_for("image_classifier").archs[1:]  # the image networks but small_cnn
SEGMENTER_ARCHS = task_for("image_segmenter").archs[1:]  # torchvision's, beside our unet
TABLE_FORMATS = FORMAT_NAMES  # a recorded --dataset_format


# ----------------------------------------------------------------------------- field checks

_SHORT = reprlib.Repr()  # a few bytes of a value the user did not give
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlist = _SHORT.maxdict = 3
_SHORT.maxlevel = 2


def _shown(value: Any) -> str:
    """A few bytes of a value, spelt as in JSON where Python spells it otherwise."""
    return json.dumps(value) if value is None or isinstance(value, bool) else _SHORT.repr(value)


def _must(what: str, accept: Callable[[Any], bool]) -> Check:
    def check(value: Any, name: str) -> str | None:
        return None if accept(value) else f"{name} must be {what}, not {_shown(value)}"
    return check


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef"
                                                               for c in value)


def _is_file_name(value: Any) -> bool:
    """A bare file name: a file in the bundle's own folder, never a path out of it."""
    return isinstance(value, str) and value not in ("", ".", "..") and not any(
        c in value for c in "/\\\0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int = 0, high: int = MAX_INT) -> Check:
    return _must(f"an integer from {low} to {high}",
                 lambda v: _is_int(v) and low <= v <= high)


def number(low: float = -math.inf, high: float = math.inf, *, above: bool = False) -> Check:
    """A finite number in [low, high] (above: in (low, high])."""
    what = "a finite number" if low == -math.inf else (
        f"a number {'above' if above else 'from'} {low:g}" +
        (f" to {high:g}" if high < math.inf else ""))
    return _must(what, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v) and (v > low if above else v >= low) and v <= high)


def text(choices: tuple | None = None) -> Check:
    if choices is None:
        return _must("a string", lambda v: isinstance(v, str))
    return _must(f"one of {list(choices)}", lambda v: isinstance(v, str) and v in choices)


def either(*accepted: object) -> Check:
    """One of a few JSON scalars (numbers, true/false)."""
    return _must(" or ".join(map(_shown, accepted)), lambda v: any(
        v == a and type(v) is type(a) for a in accepted))


def optional(check: Check) -> Check:
    """`check`, or null."""
    return lambda value, name: None if value is None else check(value, name)


def list_of(item: Check, min_length: int = 0, length: int | None = None) -> Check:
    def check(value: Any, name: str) -> str | None:
        if not isinstance(value, list) or len(value) < min_length or (
                length is not None and len(value) != length):
            size = (f" of {length} entries" if length is not None else
                    f" of {min_length} or more entries" if min_length else "")
            return f"{name} must be a list{size}, not {_shown(value)}"
        for position, entry in enumerate(value):
            problem = item(entry, f"{name}[{position}]")
            if problem:
                return problem
        return None
    return check


def record(fields: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A JSON object whose `fields` (those present) pass their checks; other keys are free."""
    def check(value: Any, name: str) -> str | None:
        if not isinstance(value, dict):
            return f"{name} must be an object, not {_shown(value)}"
        for key in required:
            if key not in value:
                return f"{name}.{key} is missing"
        for key, field_check in fields.items():
            if key in value:
                problem = field_check(value[key], f"{name}.{key}")
                if problem:
                    return problem
        return None
    return check


def mapping(values: Check) -> Check:
    """A JSON object whose every value passes `values`."""
    def check(value: Any, name: str) -> str | None:
        if not isinstance(value, dict):
            return f"{name} must be an object, not {_shown(value)}"
        return next((p for key, v in value.items() if (p := values(v, f"{name}.{key[:40]}"))),
                    None)
    return check


ANY_OBJECT = optional(record({}))
STRING, NAMES = text(), list_of(text())
SIZE, COUNT = integer(1), integer(0)
TEXT_LENGTH = integer(1, MAX_TEXT_LENGTH)  # token ids a text may become (limits.py)
DROPOUT = number(0, 1)
FINITE, POSITIVE = number(), number(0, above=True)
FRACTION = number(0, 1)
MAX_DETECTIONS = 10_000  # a detector's padded rows per image (--max_detections)
SHA256 = _must("a sha256 hex digest", _is_sha256)
IDENTIFIER = _must("a Python name", lambda v: isinstance(v, str) and v.isidentifier())
AXIS = _must("a size (an integer from 1) or an axis name",
             lambda v: (_is_int(v) and 1 <= v <= MAX_INT) or
             (isinstance(v, str) and v.isidentifier()))

# ----------------------------------------------------------------------------- the sections

INPUT = record({"name": STRING, "dtype": text(("float32", "int64")),
                "shape": list_of(AXIS, min_length=2), "padding_id": COUNT,
                "max_length": TEXT_LENGTH,
                "extra_inputs": list_of(record({"name": text(HF_GRAPH_INPUTS[1:])},
                                               required=("name",)))},
               required=("name", "shape"))
OUTPUTS = list_of(record({"name": text(OUTPUT_NAMES)}, required=("name",)), min_length=1)

_TABLE_FIELDS = {"columns": list_of(record({"name": STRING, "type": text(("numeric", "categorical")),
                                             "categories": NAMES}, required=("name", "type")),
                                     min_length=1),
                 "feature_names": list_of(STRING, min_length=1), "median": list_of(FINITE),
                 "mean": list_of(FINITE), "std": list_of(POSITIVE)}
_WORDS_FIELDS = {"vocabulary": NAMES, "vocab_size": SIZE, "max_length": TEXT_LENGTH,
                 "bigrams": either(True, False), "min_count": COUNT, "pad_id": either(PAD_ID),
                 "unk_id": either(UNK_ID)}
# a regressor's target: its column, the training split's mean and standard deviation (the graph
# undoes the standardisation), and a conformal interval's level and radius (ttc/tasks/regress)
_REGRESSION_FIELDS = {
    "target": record({"name": STRING, "mean": FINITE, "std": POSITIVE},
                     required=("name", "mean", "std")),
    "interval": optional(record({"level": number(0, 1, above=True), "radius": number(0),
                                 "method": STRING, "calibration_rows": SIZE},
                                required=("level", "radius")))}
_HF_FIELDS = {"sha256": SHA256, "source": STRING, "max_length": TEXT_LENGTH, "pad_id": COUNT,
              "pad_token": STRING, "unk_id": optional(COUNT), "special_ids": list_of(COUNT),
              "vocab_size": SIZE, "graph_inputs": list_of(text(HF_GRAPH_INPUTS), min_length=1)}
_HF_REQUIRED = ("sha256", "max_length", "pad_id", "pad_token", "vocab_size", "graph_inputs")


def _by_tokenizer(words: Check, hf: Check) -> Check:
    """A text kind's check by its tokenizer: ours (`words`) or a Hugging Face one (`hf`)."""
    return lambda value, name: (hf if isinstance(value, dict) and
                                value.get("tokenizer") == HF_TOKENIZER else words)(value, name)


PREPROCESSING = {  # by kind; the text kind by tokenizer ("words": ours)
    "image": record({"image_size": list_of(integer(1, MAX_IMAGE_SIDE), length=2),
                     "channels": either(1, 3),
                     "mean": list_of(FINITE), "std": list_of(POSITIVE)},
                    required=("image_size", "channels")),
    "words": record({"vocabulary": NAMES, "vocab_size": SIZE, "max_length": TEXT_LENGTH,
                     "bigrams": either(True, False), "min_count": COUNT,
                     "pad_id": either(PAD_ID), "unk_id": either(UNK_ID)},
                    required=("vocabulary", "vocab_size", "max_length", "bigrams",
                              "min_count")),
    HF_TOKENIZER: record(_HF_FIELDS, required=_HF_REQUIRED),
    "segmentation": record({"image_size": list_of(integer(1, MAX_IMAGE_SIDE), length=2),
                            "channels": either(1, 3), "ignore_index": integer(0, 255),
                            "mean": list_of(FINITE), "std": list_of(POSITIVE)},
                           required=("image_size", "channels", "ignore_index")),
    "detection": record({"image_size": list_of(integer(1, MAX_IMAGE_SIDE), length=2),
                         "channels": either(1, 3), "mean": list_of(FINITE),
                         "std": list_of(POSITIVE),
                         "nms": record({"iou_threshold": FRACTION, "score_threshold": FRACTION,
                                        "max_detections": integer(1, MAX_DETECTIONS)},
                                       required=("iou_threshold", "score_threshold",
                                                 "max_detections"))},
                        required=("image_size", "channels")),
    "tabular_regression": record({**_TABLE_FIELDS, **_REGRESSION_FIELDS},
                                 required=("columns", "feature_names", "target")),
    "text_regression": _by_tokenizer(  # our words, or an hf tokenizer (--arch hf:)
        record({**_WORDS_FIELDS, **_REGRESSION_FIELDS},
               required=("vocabulary", "vocab_size", "max_length", "bigrams", "min_count",
                         "target")),
        record({**_HF_FIELDS, **_REGRESSION_FIELDS}, required=(*_HF_REQUIRED, "target"))),
    "tabular": record({"columns": list_of(record(
                           {"name": STRING, "type": text(("numeric", "categorical")),
                            "categories": NAMES}, required=("name", "type")), min_length=1),
                       "feature_names": list_of(STRING, min_length=1), "median": list_of(FINITE),
                       "mean": list_of(FINITE), "std": list_of(POSITIVE)},
                      required=("columns", "feature_names")),
}

# The networks models.NETWORKS builds (their constructors' arguments); every one takes
# num_classes, and build_model passes the preprocessing's mean, std and median itself.
NETWORKS = {
    "SmallCNN": record({"in_channels": either(1, 3), "widths": list_of(SIZE, min_length=1),
                        "convs_per_stage": SIZE, "dropout": DROPOUT},
                       required=("in_channels", "widths")),
    "TextClassifier": record({"vocab_size": SIZE, "embedding_dim": SIZE, "hidden": SIZE,
                              "dropout": DROPOUT}, required=("vocab_size",)),
    "TextCNN": record({"vocab_size": SIZE, "embedding_dim": SIZE, "filters": SIZE,
                       "kernel_sizes": list_of(SIZE, min_length=1), "dropout": DROPOUT},
                      required=("vocab_size",)),
    "TextTransformer": record({"vocab_size": SIZE, "max_positions": SIZE, "d_model": SIZE,
                               "heads": SIZE, "layers": SIZE, "feedforward": SIZE,
                               "dropout": DROPOUT}, required=("vocab_size",)),
    "TabularMLP": record({"num_features": SIZE, "hidden": list_of(SIZE), "dropout": DROPOUT},
                         required=("num_features", "hidden")),
    "TabularResMLP": record({"num_features": SIZE, "width": SIZE, "blocks": COUNT,
                             "dropout": DROPOUT}, required=("num_features",)),
    "TorchvisionNet": record({"torchvision": text(TORCHVISION_ARCHS), "in_channels": either(1, 3),
                              "small_stem": either(True, False),
                              "normalization": text(("data", "imagenet"))},
                             required=("torchvision", "in_channels", "small_stem")),
    "UNet": record({"in_channels": either(1, 3), "widths": list_of(SIZE, min_length=2),
                    "dropout": DROPOUT}, required=("in_channels", "widths")),
    "TorchvisionSegmenter": record({"arch": text(SEGMENTER_ARCHS), "in_channels": either(1, 3),
                                    "small_stem": either(True, False),
                                    "normalization": text(("data", "imagenet"))},
                                   required=("arch", "in_channels", "small_stem")),
    "CenterNet": record({"in_channels": either(1, 3), "widths": list_of(SIZE, min_length=2),
                         "head_width": SIZE, "dropout": DROPOUT},
                        required=("in_channels", "widths")),
    "MobileNetCenterNet": record({"in_channels": either(1, 3), "decoder_width": SIZE,
                                  "head_width": SIZE, "dropout": DROPOUT,
                                  "normalization": text(("data", "imagenet"))},
                                 required=("in_channels",)),
    "TorchvisionSSD": record({"arch": text(("ssdlite320_mobilenet_v3_large",)),
                              "in_channels": either(1, 3)}, required=("arch", "in_channels")),
    "UserNetwork": record({"model_def": record({"file": STRING, "factory": IDENTIFIER,
                                                "sha256": SHA256},
                                               required=("file", "factory", "sha256")),
                           "input_spec": record({"kind": text(tuple(MODEL_KINDS.values()))},
                                                required=("kind",))},
                          required=("model_def", "input_spec")),
    **{name: record({"num_features": SIZE, "vocab_size": SIZE, "dropout": DROPOUT,
                     "num_classes": either(1)}) for name in (
        "TabularMLPRegressor", "TabularResMLPRegressor", "TextBagRegressor", "TextCNNRegressor",
        "TextTransformerRegressor")},
    "HFTextNet": record({"source": STRING, "pad_id": COUNT,
                         "graph_inputs": list_of(text(HF_GRAPH_INPUTS), min_length=1),
                         "hf_config": record({"model_type": STRING}, required=("model_type",))},
                        required=("source", "hf_config", "pad_id", "graph_inputs")),
    "HFTextRegressor": record({"source": STRING, "pad_id": COUNT, "num_classes": either(1),
                               "graph_inputs": list_of(text(HF_GRAPH_INPUTS), min_length=1),
                               "hf_config": record({"model_type": STRING},
                                                   required=("model_type",))},
                              required=("source", "hf_config", "pad_id", "graph_inputs")),
}
ARCHITECTURE = record({"name": text(tuple(NETWORKS)), "arch": STRING, "num_classes": SIZE},
                      required=("name", "num_classes"))
NOT_ARCHITECTURE = ("mean", "std", "median", "pretrained")  # build_model's own arguments

DATASET = record({
    "path": optional(STRING), "model_type": text(tuple(MODEL_KINDS)),
    **{key: optional(STRING) for key in ("image_column", "text_column", "feature_columns",
                                         "label_column", "val_path", "test_path",
                                         "annotations")},
    "dataset_format": optional(text(TABLE_FORMATS)),
    "has_header": optional(text(("auto", "true", "false"))),
    "val_fraction": number(0, 1), "test_fraction": number(0, 1), "seed": integer(0, 2**64 - 1),
    "calibration_fraction": number(0, 1),
    "given_splits": either(True, False), "counts": mapping(COUNT),
    "skipped_images": optional(COUNT), "train_class_counts": optional(list_of(COUNT)),
    "columns": optional(record({"label": optional(STRING), "inputs": NAMES},
                               required=("label", "inputs")))})
CALIBRATION = record({"temperature": POSITIVE, "method": STRING, "fitted_on": STRING,
                      "samples": optional(COUNT), "errors": optional(COUNT),
                      "nll_before": optional(FINITE), "nll_after": optional(FINITE),
                      "temperature_interval_90": optional(list_of(FINITE, length=2)),
                      "note": optional(STRING), "applied": optional(either(True, False)),
                      "fitted_temperature": optional(POSITIVE), "reason": optional(STRING),
                      "nll_gain_interval_90": optional(list_of(FINITE, length=2)),
                      "brier_before": optional(FINITE), "brier_after": optional(FINITE),
                      "brier_gain_interval_90": optional(list_of(FINITE, length=2)),
                      "rule": optional(STRING)}, required=("temperature", "method"))
VARIANT = record({"mode": optional(STRING), "verdict": optional(STRING),
                  "used_for_inference": optional(either(True, False)),
                  "reduce_range": optional(either(True, False)),
                  "reduce_range_reason": optional(STRING)})
COMPRESSED = record({
    "name": text(("pruned", "qat", "pruned_qat")), "quantized": either(True, False),
    "weights": optional(_must("a bare file name", _is_file_name)),
    "shapes": optional(mapping(list_of(COUNT))),  # a scalar buffer's shape is []
    "verdict": optional(STRING), "used_for_inference": optional(either(True, False)),
    "speedup": optional(FINITE)}, required=("name", "quantized"))
COMPRESSION = record({"variants": list_of(COMPRESSED),
                      "served": optional(text(("onnx", "int8", "pruned", "qat", "pruned_qat")))})
EXTRA_GRAPHS = record({
    "bn": record({"file": STRING}),
    "mc": record({"temperature": optional(POSITIVE),
                  "temperature_fit": optional(record({"passes": optional(SIZE)}))}),
    "ensemble": record({"members": SIZE, "temperature": optional(POSITIVE)},
                       required=("members",)),
    "tta": record({"views": STRING}, required=("views",))})
# The shift score's reference (ttc/testtime/shift_score.py): at most 256 scaled entropies
SHIFT_REFERENCE = record({"statistic": text(("scaled_entropy",)), "floor": number(0, 1),
                         "samples": SIZE,
                         "values": _must("a list of 8 to 256 numbers in [0, 1]", lambda v: (
                             isinstance(v, list) and 8 <= len(v) <= 256 and all(
                                 isinstance(x, (int, float)) and not isinstance(x, bool)
                                 and 0 <= x <= 1 for x in v)))},
                        required=("statistic", "samples", "values"))


def _files_problem(files: Any, name: str) -> str | None:
    """files: the bundle's file names by key (bare names), and their sha256 by key."""
    if not isinstance(files, dict) or not isinstance(files.get("sha256", {}), dict):
        return "files must map names and sha256 hashes"
    for key, value in files.items():
        if key != "sha256" and value is not None and not _is_file_name(value):
            return f"{name}.{key[:40]} must be a bare file name, not {_SHORT.repr(value)}"
    for key, digest in files.get("sha256", {}).items():
        if not _is_sha256(digest):
            return f"{name}.sha256.{key[:40]} is not a sha256 hex digest"
    return None


# Every top-level key: its check, and whether a manifest must have it.
SECTIONS: dict[str, tuple[Check, bool]] = {
    "format": (STRING, True), "format_version": (integer(), True), "created": (STRING, False),
    "model_type": (text(tuple(MODEL_KINDS)), True), "labels": (NAMES, True),
    "input": (INPUT, True), "outputs": (OUTPUTS, True), "preprocessing": (record({}), True),
    "architecture": (ARCHITECTURE, True), "dataset": (DATASET, True),
    "training": (ANY_OBJECT, False), "calibration": (optional(CALIBRATION), False),
    "exported": (either(True, False), False),  # false: weights not exported (yet)
    "export": (ANY_OBJECT, False), "quantization": (optional(VARIANT), False),
    "fp16": (optional(VARIANT), False), "compression": (optional(COMPRESSION), False),
    "extra_graphs": (optional(EXTRA_GRAPHS), False),
    "shift_reference": (optional(SHIFT_REFERENCE), False),
    "files": (optional(_files_problem), False)}


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a parsed manifest's shape (keys, types, ranges), section by section;
    None when every field a stage reads is of its type and in its range."""
    unknown = sorted(set(manifest) - set(SECTIONS))
    if unknown:
        return f"unknown keys {[key[:40] for key in unknown[:5]]}"
    missing = [key for key, (_, required) in SECTIONS.items() if required and key not in manifest]
    if missing:
        return f"the key {missing[0]!r} is missing"
    if not isinstance(manifest["model_type"], str) or manifest["model_type"] not in MODEL_KINDS:
        return (f"model_type {_SHORT.repr(manifest['model_type'])} is not one of "
                f"{sorted(MODEL_KINDS)}")
    labels = manifest["labels"]
    least = task_for(manifest["model_type"]).min_labels  # a regressor's: its one target
    if not (isinstance(labels, list) and len(labels) >= least and
            all(isinstance(v, str) for v in labels) and len(set(labels)) == len(labels)):
        return f"labels must be a list of {least} or more distinct strings"
    if len(labels) > MAX_LABELS:  # limits.py: the classes a report's figures stay small for
        return f"labels lists {len(labels):,} classes; this tool takes at most {MAX_LABELS:,}"
    for key, (check, _) in SECTIONS.items():
        problem = check(manifest[key], key) if key in manifest else None
        if problem:
            return problem
    return (_outputs_problem(manifest) or _preprocessing_problem(manifest)
            or _architecture_problem(manifest["architecture"]))


# The graph outputs each model type's graphs may have (a classifier's are logits and
# probabilities; a segmenter's add the mask; a detector's are its padded detections).
TYPE_OUTPUTS = {task.name: tuple(o["name"] for o in task.graph_outputs(2)) for task in TASKS}


def _outputs_problem(manifest: dict) -> str | None:
    """An output name of another model type's graphs (a classifier's manifest naming `scores`)."""
    names = TYPE_OUTPUTS[manifest["model_type"]]
    for index, output in enumerate(manifest["outputs"]):
        if output["name"] not in names:
            model_type = manifest["model_type"]
            article = "an" if model_type[0] in "aeiou" else "a"
            return (f"outputs[{index}].name must be one of {list(names)} for {article} "
                    f"{model_type}, not {_shown(output['name'])}")
    return None


def _preprocessing_problem(manifest: dict) -> str | None:
    kind = MODEL_KINDS[manifest["model_type"]]
    pre = manifest["preprocessing"]
    if pre.get("kind") != kind:
        return f"preprocessing must be a {kind} preprocessing for a {manifest['model_type']}"
    return PREPROCESSING[_preprocessing_form(pre)](pre, "preprocessing")


def _preprocessing_form(pre: dict) -> str:
    """Which PREPROCESSING entry a (kind-checked) preprocessing is checked by."""
    if pre["kind"] != "text":
        return pre["kind"]
    return HF_TOKENIZER if pre.get("tokenizer") == HF_TOKENIZER else "words"


def _hf_tokens(pre: dict) -> bool:
    """Whether a text preprocessing (a classifier's or a regressor's) is an hf tokenizer's."""
    return _preprocessing_form(pre) in (HF_TOKENIZER, "text_regression") and \
        pre.get("tokenizer") == HF_TOKENIZER


def _architecture_problem(architecture: dict) -> str | None:
    reserved = [key for key in NOT_ARCHITECTURE if key in architecture]
    if reserved:
        return f"architecture.{reserved[0]} is not a field of a network's architecture"
    problem = NETWORKS[architecture["name"]](architecture, "architecture")
    if problem is None and architecture["name"] == "TextTransformer" and \
            architecture.get("d_model", 64) % architecture.get("heads", 4):
        return "architecture.d_model must be a multiple of architecture.heads"
    return problem


# ----------------------------------------------------------------------------- agreement


def agreement_problem(manifest: dict) -> str | None:
    """Which sizes of a (schema-checked) manifest disagree between its sections: the labels and
    the class counts, the preprocessing and the input or the network. An edited manifest
    usually: bundle.read_manifest lets the graph's own check speak first."""
    return next((problem for check in (_counts_agree, _input_agrees, _network_agrees,
                                       _tokens_agree, _features_agree, _graphs_agree,
                                       _calibration_agrees, _export_agrees)
                 if (problem := check(manifest))), None)


def _counts_agree(manifest: dict) -> str | None:
    labels, dataset = len(manifest["labels"]), manifest["dataset"]
    counts = dataset.get("train_class_counts")
    if counts is not None and len(counts) != labels:
        return f"dataset.train_class_counts has {len(counts)} entries for {labels} labels"
    if dataset.get("model_type", manifest["model_type"]) != manifest["model_type"]:
        return f"dataset.model_type {dataset['model_type']!r} is not {manifest['model_type']!r}"
    if manifest["architecture"]["num_classes"] != labels:
        return (f"architecture.num_classes is {manifest['architecture']['num_classes']} for "
                f"{labels} labels")
    return None


INPUT_FORMS = {"image": ("float32", 4), "text": ("int64", 2), "tabular": ("float32", 2),
               "tabular_regression": ("float32", 2), "text_regression": ("int64", 2),
               "segmentation": ("float32", 4), "detection": ("float32", 4)}


def _input_agrees(manifest: dict) -> str | None:
    pre, spec = manifest["preprocessing"], manifest["input"]
    dtype, rank = INPUT_FORMS[pre["kind"]]
    if spec.get("dtype", dtype) != dtype or len(spec["shape"]) != rank:
        return (f"input must be a {dtype} input of {rank} dimensions for {pre['kind']} "
                f"preprocessing")
    if pre["kind"] in ("image", "segmentation", "detection") and any(
            len(pre.get(key, ())) not in (0, pre["channels"]) for key in ("mean", "std")):
        return f"preprocessing.mean and std must have one value per channel ({pre['channels']})"
    if not _hf_tokens(pre):
        return None
    names = [spec["name"], *(e["name"] for e in spec.get("extra_inputs", ()))]
    if names != pre["graph_inputs"] or spec.get("padding_id") != pre["pad_id"] or \
            spec.get("max_length", pre["max_length"]) != pre["max_length"]:
        return ("input (its names, padding_id and max_length) must be the preprocessing's "
                f"graph_inputs {pre['graph_inputs'][:3]}, pad_id and max_length")
    return None


# The preprocessing (_preprocessing_form) each network takes; a UserNetwork takes any.
NETWORK_FORMS = {"SmallCNN": "image", "TorchvisionNet": "image", "TextClassifier": "words",
                 "TextCNN": "words", "TextTransformer": "words", "HFTextNet": HF_TOKENIZER,
                 "TabularMLP": "tabular", "TabularResMLP": "tabular", "UNet": "segmentation",
                 "TorchvisionSegmenter": "segmentation", "CenterNet": "detection",
                 "MobileNetCenterNet": "detection", "TorchvisionSSD": "detection",
                 "TabularMLPRegressor": "tabular_regression",
                 "TabularResMLPRegressor": "tabular_regression",
                 "TextBagRegressor": "text_regression", "TextCNNRegressor": "text_regression",
                 "TextTransformerRegressor": "text_regression",
                 "HFTextRegressor": "text_regression"}


def _network_agrees(manifest: dict) -> str | None:
    """The network's sizes that the preprocessing fixes (a mismatch would fail in PyTorch)."""
    pre, architecture = manifest["preprocessing"], manifest["architecture"]
    form = NETWORK_FORMS.get(architecture["name"], _preprocessing_form(pre))
    hf_regressor = form == "text_regression" and (  # its tokenizer and its network agree
        (architecture["name"] == "HFTextRegressor") != _hf_tokens(pre))
    if form != _preprocessing_form(pre) or hf_regressor:
        return (f"architecture.name {architecture['name']!r} is not a network for this "
                "preprocessing")
    sizes = {"in_channels": pre.get("channels"), "vocab_size": pre.get("vocab_size"),
             "num_features": len(pre.get("feature_names", ())) or None,
             "pad_id": pre.get("pad_id") if _hf_tokens(pre) else None}
    for key, size in sizes.items():
        if size is not None and architecture.get(key, size) != size:
            return f"architecture.{key} is {architecture[key]} and the preprocessing's {size}"
    spec = architecture.get("input_spec")
    if isinstance(spec, dict) and spec["kind"] != pre["kind"]:
        return f"architecture.input_spec.kind must be {pre['kind']!r}"
    return None


def _tokens_agree(manifest: dict) -> str | None:
    pre = manifest["preprocessing"]
    if _preprocessing_form(pre) in ("words", "text_regression") and not _hf_tokens(pre) and \
            pre["vocab_size"] != len(pre["vocabulary"]) + 2:
        return (f"preprocessing.vocab_size is {pre['vocab_size']} for a vocabulary of "
                f"{len(pre['vocabulary'])} (plus padding and unknown)")
    return None


def _features_agree(manifest: dict) -> str | None:
    pre = manifest["preprocessing"]
    if pre["kind"] not in ("tabular", "tabular_regression"):
        return None
    names: list[str] = []
    for column in pre["columns"]:
        if column["type"] == "numeric":
            names.append(column["name"])
        elif "categories" not in column:
            return f"preprocessing.columns: the categorical column {column['name'][:40]!r} " \
                   "lists no categories"
        else:
            names += [f"{column['name']}={c}" for c in column["categories"]]
    if names != pre["feature_names"]:
        return "preprocessing.feature_names are not those its columns encode to"
    wrong = next((key for key in ("median", "mean", "std")
                  if len(pre.get(key, names)) != len(names)), None)
    if wrong:
        return f"preprocessing.{wrong} has {len(pre[wrong])} values for {len(names)} features"
    return None


def _calibration_agrees(manifest: dict) -> str | None:
    """A temperature not applied is kept at 1: the graphs bake `temperature`."""
    calibration = manifest.get("calibration") or {}
    if calibration.get("applied") is False and calibration["temperature"] != 1:
        return (f"calibration.applied is false but calibration.temperature is "
                f"{calibration['temperature']:g}, not 1")
    return None


def _graphs_agree(manifest: dict) -> str | None:
    files, extra = manifest.get("files") or {}, manifest.get("extra_graphs") or {}
    if files.get("ensemble") and "ensemble" not in extra:
        return "files.ensemble names a graph that extra_graphs.ensemble does not describe"
    return None


def _export_agrees(manifest: dict) -> str | None:
    """`exported` (bundles from before it lack it) as the graph files say: false for the
    weights train.py or a failed export kept, true once export.py named model.onnx."""
    exported, graph = manifest.get("exported"), (manifest.get("files") or {}).get("onnx")
    if exported is False and graph:
        return "exported is false, yet files.onnx names a graph"
    if exported is True and not graph:
        return "exported is true, yet files.onnx names no graph"
    return None
