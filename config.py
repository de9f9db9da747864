"""Every setting of the tool in one dataclass: its flag, default, help text, group and check.

All four entry points (pipeline.py, train.py, export.py, inference.py) build their argument
parsers from these fields, so a flag means the same thing everywhere.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ttc.inputs.preprocess import HF_PREFIX, hf_source
from ttc.serving.runtime import RuntimeOptions, parse_ep_options, parse_providers, usable_cpus
from ttc.inputs.limits import MAX_TEXT_LENGTH
from utils import ConfigError, DataError, check_paths, quoted

if TYPE_CHECKING:
    from ttc.testtime.tta import TTAOptions
    from ttc.testtime.ttt import TTTSettings

MODEL_TYPES = ("image_classifier", "text_classifier", "tabular_classifier")
QUANTIZE_MODES = ("none", "dynamic", "static", "auto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BUILTIN_DATASETS = {"builtin:digits": "image_classifier", "builtin:iris": "tabular_classifier",
                    "builtin:wine": "tabular_classifier",
                    "builtin:breast_cancer": "tabular_classifier"}
TABLE_FORMAT_NAMES = ("csv", "tsv", "json", "jsonl", "parquet")
ENGINES = ("local", "ray")
OUTPUT_FORMATS = (".csv", ".jsonl", ".parquet")
RAY_FLAGS = ("ray_address", "num_workers", "worker_batch_size")
# --arch names per model type, the default first (models.ARCHITECTURES builds each; a test keeps
# the two in step, since config.py must not import torch).
ARCHS = {"image_classifier": ("small_cnn", "resnet18", "resnet34", "mobilenet_v3_small",
                              "efficientnet_b0"),
         "text_classifier": ("bag", "cnn", "transformer"),
         "tabular_classifier": ("mlp", "resmlp")}
# torchvision networks: --pretrained loads their ImageNet weights.
TORCHVISION_ARCHS = ARCHS["image_classifier"][1:]
# --validate_atol's default, and the networks that need a looser one: EfficientNet-B0's float32
# rounding differs between PyTorch and ONNX Runtime by 1.7e-4 on trained digits logits (top-1
# agreement 100%), above 1e-4, and every other network stays well under it.
VALIDATE_ATOL = 1e-4
VALIDATE_ATOL_FOR_ARCH = {"efficientnet_b0": 1e-3}
# Networks without a Dropout layer: MC-dropout has no masks to sample in them.
ARCHS_WITHOUT_DROPOUT = ("resnet18", "resnet34")
# Networks without BatchNorm, and what they normalise with instead: `--ttt_method bn`
# (BatchNorm statistics) has nothing to adapt in them; tent adapts that normalisation's affine
# parameters (ttt.py), on model.onnx itself.
ARCHS_WITHOUT_BATCHNORM = {"transformer": "LayerNorm"}
# The peak learning rate when --learning_rate is not given: fine-tuning a pretrained transformer
# takes the usual 2e-5, training from scratch a hundred times more.
LEARNING_RATE = 3e-3
HF_LEARNING_RATE = 2e-5


def is_hf_arch(arch: str | None) -> bool:
    """--arch hf:NAME_OR_PATH: a Hugging Face model (text); transformers' encoders use LayerNorm."""
    return hf_source(arch) is not None


def default_learning_rate(arch: str | None) -> float:
    return HF_LEARNING_RATE if is_hf_arch(arch) else LEARNING_RATE


def norm_without_batchnorm(arch: str | None) -> str | None:
    """What an --arch normalises with when it has no BatchNorm (None: it has BatchNorm, or is
    not known here)."""
    return "LayerNorm" if is_hf_arch(arch) else ARCHS_WITHOUT_BATCHNORM.get(arch or "")


def no_batchnorm_error(arch: str) -> ConfigError:
    norm = norm_without_batchnorm(arch)
    return ConfigError(f"--ttt_method bn re-estimates BatchNorm statistics, and --arch {arch} "
                       f"has none (its normalisation is {norm})",
                       f"use --ttt_method tent, which adapts the {norm} affine parameters")

GROUPS = {
    "data": "data",
    "training": "training",
    "export": "export and validation",
    "quantization": "quantization",
    "teacher": "LM teacher (text models)",
    "ttc": "test-time compute",
    "batch": "batch inference (inference.py --input)",
    "runtime": "runtime",
    "output": "output",
}

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def parse_bool(text: str | bool) -> bool:
    """'true/false', '1/0', 'yes/no', 'on/off' in any case."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (also 1/0, yes/no), got {text!r}")


def parse_image_size(text: str) -> tuple[int, int]:
    """'32' -> (32, 32); '24,32' or '24x32' -> (height 24, width 32)."""
    parts = [p for p in str(text).lower().replace("x", ",").split(",") if p.strip()]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2 or min(numbers) < 1 or max(numbers) > 4096:
        raise argparse.ArgumentTypeError(
            f"expected a size like 32 or 24,32 (height,width, 1..4096), got {text!r}")
    return numbers[0], numbers[1]


SCRIPTS = {"P": "pipeline", "T": "train", "E": "export", "Q": "quantize", "I": "inference"}


def opt(default: Any, help: str, group: str, *, type: Any = None, choices: Sequence | None = None,
        metavar: str | None = None, scripts: str, help_for: dict[str, str] | None = None) -> Any:
    """A Config field with everything argparse needs in its metadata, and the scripts that take
    it (letters of SCRIPTS: "PTI" = pipeline.py, train.py and inference.py); `help_for` words
    the help differently for some scripts (by letter)."""
    meta = {"help": help, "group": group, "type": type, "choices": choices, "metavar": metavar,
            "scripts": tuple(SCRIPTS[letter] for letter in scripts),
            "help_for": {SCRIPTS[letter]: text for letter, text in (help_for or {}).items()}}
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # data
    model_type: str = opt("image_classifier", "what to train", "data", choices=MODEL_TYPES,
        scripts="PT")
    dataset_path: str | None = opt(
        None, "images: builtin:digits, a folder ROOT/<class>/*.png (optionally with train/ val/ "
        "test/ subfolders), or a table of image paths and labels; text and tabular: a "
        "CSV/TSV/JSON/JSONL file, or builtin:iris, builtin:wine, builtin:breast_cancer",
        "data", metavar="PATH", scripts="PTEQI", help_for={
            letter: "the data the bundle was trained on, split as at training: required unless "
            "it was a builtin: data set (a path the bundle records is never read)"
            for letter in "EQI"})
    dataset_format: str | None = opt(None, "table format, overriding the file extension",
                                     "data", choices=TABLE_FORMAT_NAMES, scripts="PTI")
    has_header: str = opt("auto", "whether a CSV/TSV file's first row is a header; auto "
                          "detects it", "data", type=str.lower, choices=("auto", "true", "false"),
                              scripts="PT")
    label_column: str | None = opt(None, "label column (name or 0-based position; default: "
                                   "detected)", "data", metavar="COL", scripts="PTI")
    text_column: str | None = opt(None, "text column(s) for text_classifier, joined with a space "
                                  "when several, e.g. 1,2 or title,description (default: "
                                  "detected)", "data", metavar="COLS", scripts="PTI")
    feature_columns: str | None = opt(None, "feature columns for tabular_classifier, e.g. "
                                      "0,1,2 or age,income (default: all but the label)",
                                      "data", metavar="COLS", scripts="PTI")
    image_column: str | None = opt(None, "image-path column of a table of images (name or "
                                   "0-based position; default: detected)", "data",
                                   metavar="COL", scripts="PTI")
    val_path: str | None = opt(None, "a separate validation file (same columns); default: "
                               "split from the data", "data", metavar="PATH", scripts="PTEQI",
                               help_for={letter: "the bundle's separate validation file, "
                                         "required when it was trained with one"
                                         for letter in "EQI"})
    test_path: str | None = opt(None, "a separate test file (same columns); default: split "
                                "from the data", "data", metavar="PATH", scripts="PTEQI",
                                help_for={letter: "the bundle's separate test file, required "
                                          "when it was trained with one" for letter in "EQI"})
    image_size: tuple[int, int] | None = opt(
        None, "resize images to this size, e.g. 32 or 24,32 (height,width); default: the most "
        "common size in the data, capped at 64 pixels per side", "data", type=parse_image_size,
        metavar="SIZE", scripts="PT")
    channels: int | None = opt(None, "1 (grayscale) or 3 (RGB); default: 1 if every image is "
                               "grayscale, else 3", "data", type=int, choices=(1, 3), scripts="PT")
    max_vocab: int = opt(20000, "text: vocabulary size (word unigrams and bigrams seen at least "
                         "twice in training, most frequent first)", "data", type=int, metavar="N",
                             scripts="PT")
    max_length: int = opt(256, "text: most token ids per text (unigrams, then bigrams)", "data",
                          type=int, metavar="N", scripts="PT")
    val_fraction: float = opt(0.15, "fraction of the data held out for validation (best-epoch "
                              "selection) when the dataset has no val split", "data", type=float,
                                  scripts="PT")
    test_fraction: float = opt(0.15, "fraction of the data held out for the final test when the "
                               "dataset has no test split", "data", type=float, scripts="PT")
    seed: int = opt(0, "seed for the split, initialisation, augmentation and shuffling", "data",
                    type=int, scripts="PTI")
    max_row_bytes: int = opt(1048576, "the longest row of a text input (a CSV/TSV/JSONL line, a "
                             "text cell, a line of stdin) in bytes; a longer one is refused "
                             "(exit 3) before it is parsed", "data", type=int, metavar="N",
                             scripts="PTEQI")
    max_image_memory_mb: int = opt(4096, "the most memory (MB) images decoded at a bundle's "
                                   "image size may take at once: a split evaluated whole is "
                                   "refused beyond it (exit 4), --input chunks shrink to fit",
                                   "data", type=int, metavar="MB", scripts="EQI")
    # training
    epochs: int = opt(20, "training epochs (the best epoch on the validation split is kept)",
                      "training", type=int, scripts="PT")
    batch_size: int = opt(64, "batch size for training, validation and inference", "training",
                          type=int, scripts="PTEQI")
    arch: str | None = opt(None, "the network: images small_cnn, or torchvision's resnet18, "
                           "resnet34, mobilenet_v3_small, efficientnet_b0 (a stride-1 stem for "
                           "images of 64 pixels or less); text bag (mean/max-pooled "
                           "embeddings), cnn (1-D convolutions, Kim 2014), transformer (a small "
                           "encoder with a padding mask), or hf:NAME_OR_PATH (a Hugging Face "
                           "model to fine-tune: a hub name or a save_pretrained directory); "
                           "tabular mlp, resmlp (residual MLP) (default: the first of the model "
                           "type)", "training",
                           metavar="NAME", scripts="PT")
    model_def: str | None = opt(None, "your own network: FILE.py:FACTORY, where FACTORY("
                                "num_classes=..., input_spec=...) returns an nn.Module. This "
                                "imports FILE.py, running its code; the bundle keeps a copy",
                                "training", metavar="FILE:FN", scripts="PT")
    trust_model_code: bool = opt(False, "let a --model_def bundle's own Python file "
                                 "(model.def.py) run: export.py and --ttt_method tent import "
                                 "it to rebuild the network. Only for a bundle whose maker you "
                                 "trust; without it such a bundle is refused (exit 2) before "
                                 "anything runs", "training", type=parse_bool, metavar="BOOL",
                                 scripts="EI")
    init_weights: str | None = opt(None, "start from these weights (.safetensors, or a torch "
                                   "state dict, read with weights_only): tensors load where "
                                   "name and shape match; the report counts loaded, skipped "
                                   "and missing", "training", metavar="PATH", scripts="PT")
    pretrained: bool = opt(False, "torchvision archs: start from torchvision's ImageNet weights, "
                           "read from the torch hub cache ($TORCH_HOME/hub/checkpoints; never "
                           "downloaded)", "training", type=parse_bool, metavar="BOOL",
                           scripts="PT")
    freeze_epochs: int = opt(0, "train only the classifier head (the last nn.Linear) for the "
                             "first N epochs, then the whole network", "training", type=int,
                             metavar="N", scripts="PT")
    learning_rate: float | None = opt(
        None, "AdamW peak learning rate: of the one-cycle schedule (warm-up, then cosine decay), "
        "default 3e-3; for hf: archs of linear warm-up (a tenth of the steps) and decay, default "
        "2e-5", "training", type=float, metavar="LR", scripts="PT")
    weight_decay: float = opt(1e-4, "AdamW weight decay", "training", type=float, scripts="PT")
    train_augment: bool = opt(True, "light random shifts of training images (images only)",
                              "training", type=parse_bool, metavar="BOOL", scripts="PT")
    lr_candidates: str | None = opt(None, "candidate search: comma-separated peak learning "
                                    "rates to train, e.g. 1e-3,3e-3,1e-2; the candidate with the "
                                    "best validation score (dspy.Evaluate) is kept (default: "
                                    "--learning_rate only)", "training", metavar="LIST",
                                        scripts="PT")
    num_candidates: int = opt(1, "candidate search: seeds per learning rate (--seed, --seed+1, "
                              "...), each a fresh initialisation and data order", "training",
                              type=int, metavar="N", scripts="PT")
    calibrate: str = opt("temperature", "temperature: fit one temperature T on the validation "
                         "split (minimum NLL) and bake softmax(logits / T) into every exported "
                         "graph, so the probabilities a deployment reads are calibrated; none: "
                         "softmax(logits)", "training", choices=("temperature", "none"),
                         scripts="PT")
    # LM teacher (text)
    teacher_lm: str | None = opt(None, "text: a language model that labels --unlabeled_path for "
                                 "the student to learn from; any model string dspy.LM accepts, "
                                 "e.g. openai/gpt-4o-mini or, for a local OpenAI-compatible "
                                 "server, openai/MODEL with --teacher_api_base", "teacher",
                                 metavar="MODEL", scripts="PT")
    teacher_api_base: str | None = opt(None, "the teacher's endpoint, e.g. "
                                       "http://localhost:8000/v1 (API keys come from the "
                                       "provider's usual variable, e.g. OPENAI_API_KEY)",
                                       "teacher", metavar="URL", scripts="PT")
    unlabeled_path: str | None = opt(None, "texts for the teacher to label: a .txt file (one "
                                     "text per line) or a CSV/TSV/JSON/JSONL table with the "
                                     "training data's text column(s)", "teacher", metavar="PATH",
                                         scripts="PT")
    teacher_program: str = opt("predict", "the DSPy program over text -> label: predict "
                               "(dspy.Predict) or cot (dspy.ChainOfThought)", "teacher",
                               choices=("predict", "cot"), scripts="PT")
    teacher_demos: int = opt(4, "few-shot demonstrations BootstrapFewShot compiles into the "
                             "teacher's prompt from the labelled training split (0: zero-shot)",
                             "teacher", type=int, metavar="N", scripts="PT")
    teacher_threads: int = opt(4, "teacher calls in flight at once", "teacher", type=int,
                               metavar="N", scripts="PT")
    teacher_timeout: float = opt(60.0, "seconds one teacher call may take before it fails",
                                 "teacher", type=float, metavar="S", scripts="PT")
    teacher_retries: int = opt(3, "retries of a failed teacher call (with backoff) before the "
                               "run stops with exit 5", "teacher", type=int, metavar="N",
                                   scripts="PT")
    teacher_val_limit: int = opt(500, "validation texts the teacher labels to measure its "
                                 "accuracy (0: all)", "teacher", type=int, metavar="N",
                                     scripts="PT")
    teacher_cache: bool = opt(True, "cache teacher answers on disk (DSPy's cache: "
                              "$DSPY_CACHEDIR, else ~/.dspy_cache), so a rerun costs no calls",
                              "teacher", type=parse_bool, metavar="BOOL", scripts="PT")
    # export
    opset: int = opt(18, "ONNX opset version", "export", type=int, scripts="PE")
    validate_atol: float | None = opt(None, "largest allowed absolute difference between ONNX "
                                      "Runtime and PyTorch outputs on held-out samples; above "
                                      "it the export fails (exit 4) (default: 1e-4; 1e-3 for "
                                      "efficientnet_b0, whose float32 rounding over 80 layers "
                                      "passes 1e-4)", "export", type=float, metavar="ATOL",
                                      scripts="PE")
    # quantization
    quantize: str = opt("none", "int8 quantization of the exported graph: dynamic (MatMul/Gemm), "
                        "static (QDQ, per-channel, calibrated on training data), auto (static "
                        "for convolutional models, else dynamic)", "quantization",
                        choices=QUANTIZE_MODES, scripts="PQ")
    calibration_size: int = opt(256, "training samples used to calibrate static quantization",
                                "quantization", type=int, metavar="N", scripts="PQ")
    calibration_method: str = opt("minmax", "static calibration method", "quantization",
                                  choices=("minmax", "entropy", "percentile"), scripts="PQ")
    max_accuracy_drop: float = opt(0.01, "largest validation-accuracy loss allowed for int8; "
                                   "beyond it (or if int8 is slower) inference uses fp32",
                                   "quantization", type=float, metavar="FRACTION", scripts="PQ")
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
    # test-time compute
    tta: bool = opt(False, "test-time augmentation on the ONNX model (and, unless "
                    "--train_augment false, training on the same transforms)", "ttc",
                    type=parse_bool, metavar="BOOL", scripts="PTI")
    tta_transforms: str = opt("", "comma-separated TTA transforms, name or name:param. image: "
                              "identity, hflip (flip), vflip, rot90, rot180, rot270, rotate:DEG, "
                              "shift:PX, crop:FRACTION, scale:FACTOR, brightness:DELTA, "
                              "contrast:FACTOR; text: token_dropout:P, window:N; tabular: "
                              "jitter:SIGMA (default: shift:1, token_dropout:0.1, jitter:0.1)",
                              "ttc", metavar="LIST", scripts="PTI")
    tta_merge: str = opt("mean", "how the views' probabilities are combined", "ttc",
                         choices=("mean", "gmean", "max", "vote", "tsharpen"), scripts="PI")
    tta_threshold: float | None = opt(None, "adaptive TTA: extra views only for samples whose "
                                      "plain top probability is below this", "ttc", type=float,
                                      metavar="P", scripts="PI")
    ttt: bool = opt(False, "test-time training on the ONNX model: adapt its normalisation "
                    "layers (BatchNorm; LayerNorm for tent) to each test batch of --batch_size "
                    "samples", "ttc", type=parse_bool, metavar="BOOL",
                        scripts="PI")
    ttt_method: str = opt("bn", "bn: re-estimate BatchNorm statistics (ONNX Runtime only); "
                          "tent: also minimise prediction entropy over the BatchNorm affine "
                          "parameters, or LayerNorm/GroupNorm's in a network without BatchNorm "
                          "(PyTorch); all: both, side by side", "ttc",
                          choices=("bn", "tent", "all"), scripts="PI")
    ttt_mode: str = opt("episodic", "episodic: every batch starts from the bundle's parameters; "
                        "online: adaptation carries over from batch to batch", "ttc",
                        choices=("episodic", "online"), scripts="PI")
    ttt_reset_every: int = opt(0, "online mode: back to the bundle's parameters every N batches "
                               "(0: only when the collapse guard fires)", "ttc", type=int,
                               metavar="N", scripts="PI")
    ttt_bn_prior: float = opt(0.0, "bn: weight of the stored statistics, in samples: a batch of "
                              "n uses n/(n+N) of its own statistics (0: batch statistics only)",
                              "ttc", type=float, metavar="N", scripts="PI")
    ttt_iterations: int = opt(1, "tent: Adam steps per test batch", "ttc", type=int, metavar="N",
        scripts="PI")
    ttt_learning_rate: float = opt(1e-3, "tent: Adam learning rate", "ttc", type=float,
                                   metavar="LR", scripts="PI")
    eval_shift: str | None = opt(None, "also evaluate on corrupted copies of the test split: "
                                 "calibration (accuracy, ECE, NLL) without and with the "
                                 "temperature, and with --iterative and --ttt those methods too. "
                                 "image: gaussian_noise, contrast, blur, shift, "
                                 "brightness; text: unknown_tokens, token_deletion; tabular: "
                                 "feature_noise, feature_scale", "ttc",
                                 metavar="LIST", scripts="PI")
    shift_severity: int = opt(3, "severity of the --eval_shift corruptions, 1 to 5", "ttc",
                              type=int, choices=(1, 2, 3, 4, 5), scripts="PI")
    iterative: str = opt("none", "iterative inference, reported with calibration (NLL, ECE, "
                         "accuracy when abstaining on the 10 percent most uncertain) next to a single pass: mc_dropout (K passes "
                         "with dropout on), ensemble (the bundle's ensemble graph, or the "
                         "bundles of --ensemble), state (feed a graph's state_out back into its "
                         "state input K times)", "ttc",
                         choices=("none", "mc_dropout", "ensemble", "state"), scripts="PI")
    iterations: int = opt(16, "passes K for --iterative mc_dropout and state", "ttc", type=int,
                          metavar="K", scripts="PI")
    iterative_backend: str = opt("batched", "how the K passes run: python (a loop of "
                                 "session.run; the only one that stops early), batched (K copies "
                                 "stacked in one run), loop (an ONNX Loop, one run)", "ttc",
                                 choices=("python", "batched", "loop"), scripts="PI")
    iterative_tol: float | None = opt(None, "python backend: stop once the running mean's top-1 "
                                      "is unchanged and its largest change is below this for "
                                      "--iterative_patience passes", "ttc", type=float,
                                      metavar="EPS", scripts="PI")
    iterative_patience: int = opt(2, "passes the early-stopping test must hold in a row", "ttc",
                                  type=int, metavar="N", scripts="PI")
    ensemble: str | None = opt(None, "inference.py: more bundles (model.onnx paths, comma-"
                               "separated) to average with --model; same labels and "
                               "preprocessing", "ttc", metavar="LIST", scripts="I")
    ensemble_size: int = opt(1, "pipeline.py: train N models (seeds --seed, --seed+1, ...) and "
                             "write them as one ensemble graph, model.ensemble.onnx", "ttc",
                             type=int, metavar="N", scripts="P")
    # runtime
    ep: str = opt("cpu", "ONNX Runtime execution providers, highest priority first, e.g. "
                  "cuda,cpu; CPU is always the last fallback. Aliases: cpu, cuda, tensorrt, dml, "
                  "openvino, coreml, rocm", "runtime", metavar="LIST", scripts="PQI")
    benchmark: bool = opt(False, "add a benchmark table: PyTorch eager fp32 (pipeline.py), ONNX "
                          "Runtime fp32 and int8 (when quantized), with size, accuracy, latency "
                          "at batch 1 and throughput; always on when an int8 graph exists",
                          "runtime", type=parse_bool, metavar="BOOL", scripts="PI")
    profile: bool = opt(False, "profile the graph inference runs with ONNX Runtime's profiler: "
                        "the ten most expensive operators in the report, the raw trace (Chrome "
                        "tracing JSON) beside the report as NAME.profile.json (without a report "
                        "file, beside the model); an int8 or fp16 variant no faster than fp32 "
                        "has its verdict name the op types whose time grew", "runtime",
                        type=parse_bool, metavar="BOOL", scripts="PQI")
    max_runtime_memory_mb: int = opt(4096, "the most CPU memory (MB) ONNX Runtime may take for "
                                     "a graph's tensors (weights aside): a graph with a tensor "
                                     "of fixed size beyond it is refused before running (exit "
                                     "4), an allocation beyond it at run time fails the run "
                                     "(exit 5)", "runtime", type=int, metavar="MB",
                                     scripts="PEQI")
    strict_ep: bool = opt(False, "fail (exit 5) instead of falling back when a requested "
                          "execution provider cannot run", "runtime", type=parse_bool,
                          metavar="BOOL", scripts="PI")
    ep_options: str | None = opt(None, "provider options as JSON or key=value list, e.g. "
                                 "cuda.device_id=0,cuda.gpu_mem_limit=2000000000 or "
                                 "tensorrt.trt_fp16_enable=true,tensorrt.trt_engine_cache_path="
                                 "trt_cache (engines then persist between runs)", "runtime",
                                 metavar="OPTIONS", scripts="PQI")
    intra_op_threads: int | None = opt(None, "ONNX Runtime threads within an operator "
                                       "(default: --num_threads)", "runtime", type=int,
                                       metavar="N", scripts="PI")
    inter_op_threads: int = opt(1, "ONNX Runtime threads across operators (parallel execution "
                                "mode only)", "runtime", type=int, metavar="N", scripts="PI")
    execution_mode: str = opt("sequential", "ONNX Runtime execution mode", "runtime",
                              choices=("sequential", "parallel"), scripts="PI")
    num_threads: int = opt(1, "threads for PyTorch and ONNX Runtime; 0 lets each library decide "
                           "(1 is fastest for small models on busy machines)", "runtime",
                           type=int, metavar="N", scripts="PTEQI")
    timeout_s: float = opt(0.0, "end the run after this many seconds of wall-clock time, also "
                           "inside ONNX Runtime (a graph that loops for ever): exit 124, "
                           "nothing half-written; 0: no limit", "runtime", type=float,
                           metavar="SECONDS", scripts="PTEQI")
    # batch inference (inference.py)
    input: str | None = opt(None, "inference.py: predict new data instead of evaluating the test "
                            "split: an image file, a folder of images (recursive), a "
                            "CSV/TSV/JSON/JSONL/Parquet table, or - for one text per line on "
                            "stdin",
                            "batch", metavar="INPUT", scripts="I")
    output: str | None = opt(None, "where --input's predictions go: .csv, .jsonl or .parquet "
                             "(written to a temporary file, moved into place at the end)",
                             "batch",
                             metavar="PATH", scripts="I")
    errors: str | None = opt(None, "list the rows that could not be predicted (id, reason) in "
                             "this CSV", "batch", metavar="PATH", scripts="I")
    allow_errors: bool = opt(False, "exit 0 even when some rows could not be predicted",
                             "batch", type=parse_bool, metavar="BOOL", scripts="I")
    top_k: int = opt(1, "how many top classes (label, probability) each prediction row lists",
                     "batch", type=int, metavar="K", scripts="I")
    chunk_rows: int = opt(4096, "rows read, encoded and predicted at a time (memory stays flat "
                          "whatever the input's size)", "batch", type=int, metavar="N",
                              scripts="I")
    engine: str = opt("local", "where --input is predicted: local (this process) or ray (Ray "
                      "Data workers on a cluster; docs/deploy.md, Ray)", "batch",
                      choices=ENGINES, scripts="I")
    ray_address: str | None = opt(None, "--engine ray: the cluster to join (host:port of its "
                                  "head node; auto: the one `ray start` runs here); default (or "
                                  "local): start a local one of this machine's CPUs for the run",
                                  "batch", metavar="ADDRESS", scripts="I")
    num_workers: int | None = opt(None, "--engine ray: workers, each one ONNX Runtime session "
                                  "with --num_threads threads, which are the CPUs it reserves "
                                  "(default 2, or 1 where a local cluster cannot hold 2)",
                                  "batch", type=int, metavar="N", scripts="I")
    worker_batch_size: int | None = opt(None, "--engine ray: rows a worker reads, encodes and "
                                        "predicts at a time (default: --chunk_rows)", "batch",
                                        type=int, metavar="N", scripts="I")
    json: bool = opt(False, "print the run's report as JSON on stdout instead of the summary",
                     "batch", type=parse_bool, metavar="BOOL", scripts="I")
    quiet: bool = opt(False, "print nothing but errors", "batch", type=parse_bool,
                      metavar="BOOL", scripts="I")
    # output
    output_model: str | None = opt(None, "where to write the model bundle: PATH.onnx plus "
                                   "PATH.json (manifest) and PATH.pt (weights)", "output",
                                   metavar="PATH.onnx", scripts="PTEQI", help_for={
        "E": "the bundle to export: reads PATH.json and PATH.pt, writes PATH.onnx and its "
             "extra graphs",
        "Q": "the bundle to quantize: reads PATH.onnx, adds PATH.int8.onnx / PATH.fp16.onnx",
        "I": "the bundle to read: PATH.onnx with its manifest PATH.json beside it"})
    report_json: str | None = opt(None, "write the final report as JSON to PATH ('-' prints it "
                                  "on stdout instead of the summary)", "output", metavar="PATH",
                                      scripts="PTEQI")
    plots: str | None = opt(None, "write the run's plots (PNG) to DIR, or 'none' (default: a "
                            "plots/ folder beside --report_json; for pipeline.py without a "
                            "report file, beside the model)", "output", metavar="DIR",
                            scripts="PI")
    log_level: str = opt("INFO", "log verbosity on stderr; DEBUG also shows library logs and "
                         "tracebacks", "output", type=str.upper, choices=LOG_LEVELS,
                             scripts="PTEQI")
    no_progress: bool = opt(False, "hide progress bars (they only show when stderr is a "
                            "terminal anyway)", "output", type=parse_bool, metavar="BOOL",
                                scripts="PTEQI")

    # ------------------------------------------------------------------ checks

    def validate(self) -> "Config":
        """Check every value, group by group; raise ConfigError (exit 2) naming the flag and
        the fix."""
        self._validate_data()
        self._validate_training()
        self._validate_teacher()
        self._validate_export_and_quantization()
        self._validate_test_time_compute()
        self._validate_batch()
        self._validate_runtime()
        self._validate_paths()
        return self

    def _validate_data(self) -> None:
        for name in ("val_fraction", "test_fraction"):
            if not 0 < getattr(self, name) < 1:
                _bad(name, getattr(self, name), "use a fraction between 0 and 1, e.g. 0.15")
        if self.val_fraction + self.test_fraction > 0.8:
            raise ConfigError(f"--val_fraction + --test_fraction = "
                              f"{self.val_fraction + self.test_fraction:g} leaves too little to "
                              "train on", "keep their sum at 0.8 or less")
        if self.max_vocab < 3:
            _bad("max_vocab", self.max_vocab, "use at least 3 (padding, unknown and one word)")
        _positive("max_length", self.max_length)
        for name in ("max_row_bytes", "max_image_memory_mb", "max_runtime_memory_mb"):
            _positive(name, getattr(self, name))
        if self.max_length > MAX_TEXT_LENGTH:
            _bad("max_length", self.max_length, f"use at most {MAX_TEXT_LENGTH} token ids (a "
                 "bundle's manifest may not hold more)")

    def _validate_training(self) -> None:
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(self.arch)
        for name in ("epochs", "batch_size", "learning_rate", "num_candidates", "ensemble_size"):
            _positive(name, getattr(self, name))
        if self.weight_decay < 0:
            _bad("weight_decay", self.weight_decay, "use 0 or a small positive number like 1e-4")
        self.learning_rates()
        names = ARCHS.get(self.model_type, ())
        if is_hf_arch(self.arch):
            if self.model_type != "text_classifier":
                _bad("arch", self.arch, "hf:NAME_OR_PATH is a Hugging Face text model: use it "
                     "with --model_type text_classifier")
            if not self.arch[len(HF_PREFIX):].strip():
                _bad("arch", self.arch, "give a hub name or a save_pretrained directory, e.g. "
                     "hf:distilbert-base-uncased")
        elif self.arch is not None and self.arch not in names:
            _bad("arch", self.arch, f"a {self.model_type} takes one of: {', '.join(names)}, "
                 "or for text hf:NAME_OR_PATH")
        self._validate_network_source()

    def _validate_network_source(self) -> None:
        """--model_def, --init_weights, --pretrained and --freeze_epochs."""
        if self.model_def is not None:
            self.model_def_parts()
            if self.arch is not None:
                raise ConfigError("--model_def and --arch both name the network",
                                  "drop one of them")
        if self.pretrained:
            if self.arch not in TORCHVISION_ARCHS:
                raise ConfigError("--pretrained loads torchvision's ImageNet weights, for "
                                  f"--arch {', '.join(TORCHVISION_ARCHS)}",
                                  "add one of those archs, or use --init_weights PATH")
            if self.init_weights:
                raise ConfigError("--pretrained and --init_weights both name starting weights",
                                  "drop one of them")
        if self.freeze_epochs < 0:
            _bad("freeze_epochs", self.freeze_epochs, "use 0 (off) or an epoch count")
        if self.iterative == "mc_dropout" and self.arch in ARCHS_WITHOUT_DROPOUT:
            raise ConfigError(f"--iterative mc_dropout samples dropout masks, and --arch "
                              f"{self.arch} has no Dropout layer",
                              "use --iterative ensemble --ensemble_size 3, or an arch with "
                              "dropout (small_cnn, mobilenet_v3_small, efficientnet_b0)")

    def ensemble_members(self) -> list[str]:
        """--ensemble's bundle paths, blanks dropped."""
        return [item for item in (p.strip() for p in (self.ensemble or "").split(",")) if item]

    def model_def_parts(self) -> tuple[Path, str]:
        """--model_def FILE.py:FACTORY as (file, factory name)."""
        path, _, factory = (self.model_def or "").rpartition(":")
        if not path or not factory.isidentifier():
            _bad("model_def", self.model_def, "expected FILE.py:FACTORY, e.g. mynet.py:build")
        if Path(path).is_dir():
            raise ConfigError(f"--model_def {path} is a folder, not a Python file",
                              "name the .py file that defines the factory, e.g. "
                              f"{Path(path) / 'mynet.py'}:{factory}")
        if Path(path).suffix != ".py":
            raise ConfigError(f"--model_def {path} is not a Python file (.py)",
                              "name the .py file that defines the factory, e.g. mynet.py:build")
        return Path(path), factory

    def _validate_export_and_quantization(self) -> None:
        if not 7 <= self.opset <= 23:
            _bad("opset", self.opset, "use an opset between 7 and 23 (18 is the default)")
        if self.validate_atol is not None:
            _positive("validate_atol", self.validate_atol)
        _positive("calibration_size", self.calibration_size)
        if not 0 <= self.max_accuracy_drop <= 1:
            _bad("max_accuracy_drop", self.max_accuracy_drop, "use a fraction between 0 and 1")
        if self.quantize_exclude is not None and not self.quantize_exclude.strip(" ,"):
            _bad("quantize_exclude", self.quantize_exclude, "use auto, none or node names")
        if self.quantize_ops is not None and not self.quantize_ops.strip(" ,"):
            _bad("quantize_ops", self.quantize_ops, "use default, all, auto or op types, e.g. "
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

    def _validate_test_time_compute(self) -> None:
        for name in ("ttt_iterations", "ttt_learning_rate", "iterations", "iterative_patience"):
            _positive(name, getattr(self, name))
        if self.tta_threshold is not None and not 0 < self.tta_threshold <= 1:
            _bad("tta_threshold", self.tta_threshold, "use a probability in (0, 1]")
        if self.ttt_bn_prior < 0:
            _bad("ttt_bn_prior", self.ttt_bn_prior, "use 0 (batch statistics only) or a sample "
                 "count such as 16")
        if self.ttt_reset_every < 0:
            _bad("ttt_reset_every", self.ttt_reset_every, "use 0 (never) or a batch count")
        if self.ttt and self.ttt_method == "bn" and norm_without_batchnorm(self.arch):
            raise no_batchnorm_error(self.arch)
        if self.ttt and self.batch_size < 2:
            _bad("batch_size", self.batch_size, "test-time training adapts to batches: use 2 or "
                 "more (64 is the default)")
        if self.ensemble_size > 1 and self.iterative == "none":
            self.iterative = "ensemble"  # a trained ensemble is measured against one model
        if self.ensemble is not None and not self.ensemble_members():
            _bad("ensemble", self.ensemble, "name one or more bundles, e.g. "
                 "runs/b/model.onnx,runs/c/model.onnx")
        if self.iterative_tol is not None and self.iterative_tol <= 0:
            _bad("iterative_tol", self.iterative_tol, "use a small positive number like 1e-3")
        if self.iterative_tol is not None and self.iterative_backend != "python":
            raise ConfigError("--iterative_tol needs --iterative_backend python (the batched "
                              "and loop backends run all passes at once)",
                              "add --iterative_backend python, or drop --iterative_tol")

    def _validate_batch(self) -> None:
        _positive("top_k", self.top_k)
        _positive("chunk_rows", self.chunk_rows)
        if self.output and Path(self.output).suffix.lower() not in OUTPUT_FORMATS:
            _bad("output", self.output, "give a path ending in .csv, .jsonl or .parquet")
        if self.input and not self.output:
            raise ConfigError("--input needs --output", "add --output preds.csv")
        self._validate_engine()

    def _validate_engine(self) -> None:
        given = [f"--{name}" for name in RAY_FLAGS if getattr(self, name) is not None]
        if self.engine == "local" and given:
            raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                              "only to --engine ray",
                              "add --engine ray, or drop them")
        if self.engine != "ray":
            return
        if not self.input:
            raise ConfigError("--engine ray predicts --input on a cluster; the test split's "
                              "evaluation runs in this process", "add --input and --output, or "
                              "drop --engine ray")
        for name in ("num_workers", "worker_batch_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _check_ray_address(self.ray_address)
        if self.local_ray():
            self._require_local_cpus()
        if self.profile:
            raise ConfigError("--profile profiles the ONNX Runtime session in this process, and "
                              "--engine ray predicts on worker processes",
                              "profile with --engine local on a sample of the input")
        if self.ttt and self.ttt_mode == "online":
            raise ConfigError("--ttt_mode online carries the adaptation from one batch to the "
                              "next in input order, and Ray workers predict batches in "
                              "parallel", "use --ttt_mode episodic on Ray, or --engine local")

    def local_ray(self) -> bool:
        """--engine ray on a cluster started for the run (no --ray_address, or `local`)."""
        return self.ray_address in (None, "local")

    def ray_threads(self) -> int:
        """ONNX Runtime intra-op threads per Ray worker, which are also the CPUs it reserves."""
        return max(1, self.runtime().intra_op_threads)

    def ray_workers(self) -> int:
        """--num_workers; by default 2, or 1 where a local cluster cannot hold two."""
        if self.num_workers is not None:
            return self.num_workers
        return max(1, min(2, usable_cpus() // self.ray_threads())) if self.local_ray() else 2

    def _require_local_cpus(self) -> None:
        """A local cluster has this machine's CPUs: more workers than they hold would never be
        placed (sizing the cluster to the request instead started them all, and hung)."""
        workers, threads, cpus = self.ray_workers(), self.ray_threads(), usable_cpus()
        if workers * threads > cpus:
            asked = (f"--num_workers {workers} with {threads} thread(s) each needs"
                     if self.num_workers is not None else
                     f"one Ray worker with {threads} threads needs")
            raise ConfigError(f"{asked} {workers * threads} CPUs, and a local Ray cluster has "
                              f"this machine's {cpus}", "lower --num_workers or --num_threads, "
                              "or join a larger cluster with --ray_address")

    def _validate_runtime(self) -> None:
        if not 0 <= self.timeout_s < 1e9:  # also NaN; setitimer takes no more
            _bad("timeout_s", self.timeout_s, "use a number of seconds, or 0 for no limit")
        if self.num_threads < 0:
            _bad("num_threads", self.num_threads, "use 0 (library default) or a positive count")
        parse_ep_options(self.ep_options, parse_providers(self.ep))
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if value is not None and value < 0:
                _bad(name, value, "use 0 (library default) or a positive count")

    def learning_rates(self) -> list[float]:
        """--lr_candidates as floats (default: [--learning_rate], or its default for the arch)."""
        if not self.lr_candidates:
            return [self.learning_rate if self.learning_rate is not None
                    else default_learning_rate(self.arch)]
        rates = []
        for item in filter(None, (p.strip() for p in self.lr_candidates.split(","))):
            try:
                rate = float(item)
            except ValueError:
                rate = -1.0
            if not rate > 0:
                _bad("lr_candidates", self.lr_candidates, "give positive learning rates, "
                     "comma-separated, e.g. 1e-3,3e-3,1e-2")
            rates.append(rate)
        if not rates:
            _bad("lr_candidates", self.lr_candidates, "give at least one learning rate")
        return list(dict.fromkeys(rates))

    def _validate_teacher(self) -> None:
        if not self.teacher_lm and not self.unlabeled_path:
            return
        if not (self.teacher_lm and self.unlabeled_path):
            raise ConfigError("--teacher_lm and --unlabeled_path go together: the teacher "
                              "labels the unlabeled texts", "give both, or neither")
        if self.model_type != "text_classifier":
            raise ConfigError(f"--teacher_lm labels texts; this is a {self.model_type}",
                              "use it with --model_type text_classifier")
        if self.teacher_demos < 0:
            _bad("teacher_demos", self.teacher_demos, "use 0 (zero-shot) or a small count like 4")
        if not 1 <= self.teacher_threads <= 64:
            _bad("teacher_threads", self.teacher_threads, "use 1 to 64 threads")
        _positive("teacher_timeout", self.teacher_timeout)
        if self.teacher_retries < 0:
            _bad("teacher_retries", self.teacher_retries, "use 0 or a small count like 3")
        if self.teacher_val_limit < 0:
            _bad("teacher_val_limit", self.teacher_val_limit, "use 0 (all) or a count")

    def _validate_paths(self) -> None:
        if self.dataset_path and self.dataset_path.startswith("builtin:"):
            if self.dataset_path not in BUILTIN_DATASETS:
                raise ConfigError(f"unknown built-in dataset {self.dataset_path!r}",
                                  f"use one of: {', '.join(BUILTIN_DATASETS)}")
            if ("model_type" in self.names()  # a bundle's script: its manifest says
                    and BUILTIN_DATASETS[self.dataset_path] != self.model_type):
                raise ConfigError(f"{self.dataset_path} is data for "
                                  f"{BUILTIN_DATASETS[self.dataset_path]}, not {self.model_type}",
                                  f"use --model_type {BUILTIN_DATASETS[self.dataset_path]}")
        if self.output_model is not None:
            out = Path(self.output_model)
            if out.suffix != ".onnx":
                _bad("output_model", self.output_model, "give a path ending in .onnx, e.g. "
                     "runs/digits/model.onnx")
            if out.exists() and out.is_dir():
                _bad("output_model", self.output_model, "it is a folder; give a file path "
                     "ending in .onnx")
        if self.report_json and self.report_json != "-" and Path(self.report_json).is_dir():
            _bad("report_json", self.report_json, "it is a folder; give a file path")
        folder = self.plots_folder()
        refuse_linked_plots_folder(folder, named=bool(self.plots))
        if folder is not None and folder.exists() and not folder.is_dir():
            _bad("plots", str(folder), "it is a file; give a folder, or 'none'")
        reads, writes = self.files_read_and_written()
        for flag in self.READ_FLAGS:
            path = reads.get(f"--{flag}")
            if path is not None and not path.exists():
                raise DataError(f"--{flag} {path} does not exist", "check the path")
        if ("model_type" in self.names() and self.model_type == "image_classifier"
                and (self.val_path or self.test_path)):
            raise ConfigError("--val_path and --test_path are for text and tabular tables; "
                              "images take their splits from folders",
                              "lay the images out as ROOT/train/<class>/, ROOT/val/<class>/ and "
                              "ROOT/test/<class>/ and pass --dataset_path ROOT")
        check_paths(reads, writes)

    def plots_folder(self) -> Path | None:
        """Where the plots go: --plots DIR, else beside the report file, else for pipeline.py
        beside the model (visuals_beside); None for none, and for a script without --plots."""
        if "plots" not in self.names():
            return None
        if self.plots:
            return None if self.plots.lower() == "none" else Path(self.plots)
        if self.report_json and self.report_json != "-":
            return visuals_beside(Path(self.report_json))
        if getattr(self, "script", None) == "pipeline" and self.output_model:
            return visuals_beside(Path(self.output_model))
        return None

    def page_path(self) -> Path | None:
        """The HTML page: beside the report file, with its name (report.json → report.html);
        None for a script without --plots."""
        if "plots" not in self.names() or not self.report_json or self.report_json == "-":
            return None
        return page_beside(Path(self.report_json))

    def profile_path(self) -> Path | None:
        """Where --profile's raw trace goes: beside the report file (report.json →
        report.profile.json), else beside the model (model.profile.json); None without
        --profile."""
        if ("profile" not in self.names() or not self.profile
                or getattr(self, "script", None) == "quantize"):  # quantize.py writes no trace
            return None
        if self.report_json and self.report_json != "-":
            report = Path(self.report_json)
            return report.with_name(f"{report.stem}.profile.json")
        return Path(self.output_model).with_suffix(".profile.json") if self.output_model else None

    def visual_outputs(self) -> dict[str, Path]:
        """Every plot and page path this run may write, for the path checks."""
        folder, page = self.plots_folder(), self.page_path()
        outputs = {f"--plots ({name}.png)": folder / f"{name}.png" for name in PLOT_NAMES
                   } if folder else {}
        if page:
            outputs["the report page (--report_json's .html)"] = page
        return outputs

    READ_FLAGS = ("dataset_path", "val_path", "test_path", "unlabeled_path", "input",
                  "init_weights", "model_def")
    WRITE_FLAGS = ("output", "errors", "report_json")

    def files_read_and_written(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """Every file this script reads and every file it writes, keyed by the flag that names
        it: pipeline.py and train.py write the --output_model bundle, export.py and quantize.py
        add to it, inference.py reads it (and the --ensemble bundles)."""
        from ttc.serving.bundle import BundlePaths

        reads = {f"--{flag}": Path(value) for flag in self.READ_FLAGS
                 if (value := getattr(self, flag)) and value != "-"
                 and not value.startswith("builtin:")}
        if self.model_def:
            reads["--model_def"] = self.model_def_parts()[0]
        writes = {f"--{flag}": Path(value) for flag in self.WRITE_FLAGS
                  if (value := getattr(self, flag)) and value != "-"}
        if self.output_model:
            bundle = {f"--output_model (the bundle's {what})": path for what, path in
                      BundlePaths.from_model_path(self.output_model).files().items()}
            (reads if getattr(self, "script", None) == "inference" else writes).update(bundle)
        writes.update(self.visual_outputs())
        if self.profile_path() is not None:
            writes["--profile (the ONNX Runtime trace)"] = self.profile_path()
        for i, member in enumerate(self.ensemble_members()):
            reads[f"--ensemble (bundle {i + 1})"] = Path(member)
        return reads, writes

    def validate_tta(self, model_type: str) -> None:
        """--tta_transforms and --eval_shift against the model type (known from the flags, or
        from a bundle)."""
        if self.tta or self.tta_transforms:
            from ttc.testtime.tta import parse_transform_specs

            parse_transform_specs(self.tta_transforms, model_type.split("_")[0])
        if self.eval_shift:
            from ttc.inputs.shifts import parse_shift_names

            parse_shift_names(self.eval_shift, model_type.split("_")[0])

    def tta_options(self) -> "TTAOptions":
        """What test-time augmentation takes from the flags."""
        from ttc.testtime.tta import TTAOptions

        return TTAOptions(self.tta_transforms, self.tta_merge, self.tta_threshold,
                          self.batch_size, self.seed)

    def ttt_settings(self, kind: str) -> "TTTSettings":
        """What test-time training takes from the flags, for a model of preprocessing `kind`."""
        from ttc.inputs.shifts import parse_shift_names
        from ttc.testtime.ttt import TTTSettings

        return TTTSettings(self.ttt_method, self.ttt_mode, self.ttt_iterations,
                           self.ttt_learning_rate, self.ttt_bn_prior, self.ttt_reset_every,
                           self.batch_size, parse_shift_names(self.eval_shift, kind),
                           self.shift_severity, self.seed, self.num_threads,
                           self.trust_model_code)

    def providers(self) -> list[str]:
        return parse_providers(self.ep)

    def runtime(self) -> RuntimeOptions:
        """The session settings for the inference stage (--ep, --ep_options, threads)."""
        providers = self.providers()
        return RuntimeOptions(providers=providers,
                              provider_options=parse_ep_options(self.ep_options, providers),
                              intra_op_threads=self.num_threads if self.intra_op_threads is None
                              else self.intra_op_threads,
                              inter_op_threads=self.inter_op_threads,
                              execution_mode=self.execution_mode, strict=self.strict_ep)

    def cpu_runtime(self) -> RuntimeOptions:
        """The session settings for validation and quantization, which compare on the CPU."""
        return RuntimeOptions(intra_op_threads=self.runtime().intra_op_threads)

    def names(self) -> list[str]:
        """The flags of the script that parsed this Config (every field when none did)."""
        script = getattr(self, "script", None)
        return flags_for(script) if script else [f.name for f in fields(self)]

    def as_dict(self) -> dict:
        """The resolved settings of this script's flags (the report's config section)."""
        data = asdict(self)
        if self.image_size is not None:
            data["image_size"] = list(self.image_size)
        return {name: data[name] for name in self.names()}

    def summary_lines(self) -> list[str]:
        data = self.as_dict()
        width = max(len(n) for n in data)
        return [f"  {'*' if value != _default(name) else ' '} {name:<{width}} = {value!r}"
                for name, value in data.items()]


def _default(name: str) -> Any:
    default = FIELDS[name].default
    return list(default) if isinstance(default, tuple) else default


def _positive(name: str, value: float) -> None:
    if not value > 0:
        _bad(name, value, "it must be greater than 0")


def _bad(name: str, value: Any, hint: str) -> None:
    raise ConfigError(f"invalid --{name} {value!r}", hint)


RAY_ADDRESS_HINT = "expected host:port, auto or local (e.g. 10.0.0.5:6379, the head node's port)"


def _check_ray_address(address: str | None) -> None:
    """--ray_address's form, before any work: auto, local, or HOST:PORT ([IPv6]:PORT). Ray
    Client addresses (ray://) need Ray's client extra, which the tool does not install."""
    if address is None or address in ("auto", "local"):
        return
    if address.startswith("ray://"):
        raise ConfigError(f"invalid --ray_address {address!r}: a Ray Client address, which "
                          "this tool does not use", f"{RAY_ADDRESS_HINT}; run on a node of the "
                          "cluster with auto, or give the head node's host:port")
    host, colon, port = address.rpartition(":")
    if not (colon and _valid_host(host) and re.fullmatch(r"[0-9]{1,5}", port)
            and 1 <= int(port) <= 65535):
        _bad("ray_address", address, RAY_ADDRESS_HINT)


def _valid_host(host: str) -> bool:
    """A host name or IPv4 address, or an IPv6 address in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return True
        except ValueError:
            return False
    return re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?", host) is not None


# ----------------------------------------------------------------------------- argument parsing


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


FIELDS = {f.name: f for f in fields(Config)}


PLOT_NAMES = ("training_curves", "confusion_matrix", "reliability", "calibration_shift",
              "ttt_shifts", "benchmark", "tta")


def visuals_beside(path: Path) -> Path:
    """The plots folder beside a report or model file: `plots/` for report.json or model.onnx,
    `NAME_plots/` for other names."""
    return path.parent / ("plots" if path.stem in ("report", "model") else f"{path.stem}_plots")


def refuse_linked_plots_folder(folder: Path | None, named: bool) -> None:
    """A plots folder the tool chose (beside the report or the model, not named with --plots)
    must be a real folder, never a symbolic link: one placed there (in a shared or downloaded
    folder) would send the PNGs wherever it points. ConfigError (exit 2), before any work."""
    if folder is None or named or not folder.is_symlink():
        return
    raise ConfigError(f"the plots folder {folder} is a symbolic link (to "
                      f"{quoted(os.readlink(folder), 80)}), and plots are written only into a "
                      "real folder", "remove the link, or name the folder with --plots DIR")


def page_beside(report_json: Path) -> Path:
    """The HTML page beside a report file: its name with .html (a report named *.html gets
    .report.html, so the page never replaces it)."""
    if report_json.suffix.lower() in (".html", ".htm"):
        return report_json.with_name(report_json.name + ".report.html")
    return report_json.with_suffix(".html")


def flags_for(script: str) -> list[str]:
    """The Config fields a script takes ("pipeline", "train", ...), in declaration order."""
    return [f.name for f in fields(Config) if script in f.metadata["scripts"]]


def build_parser(script: str, description: str, *, required: Sequence[str] = (),
                 epilog: str = "", aliases: dict[str, Sequence[str]] | None = None
                 ) -> OneLineParser:
    """An argparse parser for `script` ("pipeline", ...) exposing its Config fields, grouped as
    in GROUPS."""
    names = flags_for(script)
    parser = OneLineParser(prog=f"{script}.py", description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, title in GROUPS.items():
        if any(FIELDS[n].metadata["group"] == key for n in names):
            groups[key] = parser.add_argument_group(title)
    for name in names:
        meta = FIELDS[name].metadata
        default = FIELDS[name].default
        flags = [f"--{name}", *((aliases or {}).get(name, ()))]
        text = meta["help_for"].get(script, meta["help"])
        kwargs: dict[str, Any] = {"dest": name, "help": _help_with_default(text, default),
                                  "required": name in required}
        if meta["type"] is not None:
            kwargs["type"] = meta["type"]
        if meta["type"] is parse_bool:  # --tta alone means --tta true
            kwargs.update(nargs="?", const=True)
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        if not kwargs["required"]:
            kwargs["default"] = argparse.SUPPRESS
        groups[meta["group"]].add_argument(*flags, **kwargs)
    return parser


def _help_with_default(text: str, default: Any) -> str:
    if default is None or default == "":
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def parse_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Config:
    """Parse argv into a Config; flags not given keep the dataclass defaults. The Config
    remembers which script's flags it holds (its summary and report list only those)."""
    namespace = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    config = Config(**vars(namespace))
    config.script = parser.prog.removesuffix(".py")
    return config


def start_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Config:
    """Parse, set up logging, validate, and log the configuration summary (stderr)."""
    from utils import LOG, setup_logging, stop_after

    config = parse_config(parser, argv)
    if config.quiet:  # nothing but errors
        config.log_level, config.no_progress = "ERROR", True
    setup_logging(config.log_level)
    config.validate()
    stop_after(config.timeout_s)  # the run's clock starts once its flags are read
    from ttc.inputs.limits import configure

    configure(config)
    LOG.info("configuration (* = not the default):\n%s", "\n".join(config.summary_lines()))
    return config


def markdown_reference() -> str:
    """docs/cli.md's flag tables, one per group, from the same metadata argparse uses (a test
    keeps docs/cli.md in step: python -c "import config; print(config.markdown_reference())")."""
    out = []
    letters = {name: letter for letter, name in SCRIPTS.items()}
    for group, title in GROUPS.items():
        out += [f"**{title}**", "", "| flag | default | scripts | meaning |", "|---|---|---|---|"]
        for f in fields(Config):
            meta = f.metadata
            if meta.get("group") != group:
                continue
            default = "—" if f.default in (None, "") else (
                str(f.default).lower() if isinstance(f.default, bool) else f.default)
            if isinstance(default, tuple):
                default = ",".join(map(str, default))
            meaning = meta["help"] + (f"; one of: {', '.join(map(str, meta['choices']))}"
                                      if meta.get("choices") else "")
            scripts = "".join(letters[s] for s in meta["scripts"])
            out.append(f"| `--{f.name}` | `{default}` | {scripts} | {meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
