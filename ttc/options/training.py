"""The training stage's flags: the network and where its starting weights come from, the
optimiser, the candidate search and the calibration fitted after training; and what config.py
must know of the networks without importing torch."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ttc.options.fields import bad, opt, parse_bool, positive
from ttc.tasks.base import resolve
from ttc.tasks.registry import TASKS, archs, find_task
from utils import ConfigError



def type_flag_groups() -> tuple[type, ...]:
    """The flag groups the model types own (Task.flags), each once, in the registry's order."""
    groups: list[type] = []
    for task in TASKS:
        if task.flags and resolve(task.flags) not in groups:
            groups.append(resolve(task.flags))
    return tuple(groups)


# Each composed into the Config and the training view after TrainingFlags; its
# check_own_flags() runs with the training checks.
TYPE_FLAGS = type_flag_groups()
# --arch names per model type, the default first, from the entries in ttc/tasks
# (each type's parts.networks builds them; a test keeps the two in step, since config.py must not
# import torch).
ARCHS = archs()
# torchvision networks: --pretrained loads their ImageNet weights.
TORCHVISION_ARCHS = ARCHS["image_classifier"][1:]
# a segmenter's and a detector's torchvision networks: --pretrained loads their ImageNet backbone.
BACKBONE_ARCHS = {"image_segmenter": ARCHS["image_segmenter"][1:],
                  "object_detector": ARCHS["object_detector"][1:]}
AMP_MODES = ("auto", "bf16", "fp16", "off")  # ttc/nets/device.py's (config imports no torch)
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")
# The peak learning rate when --learning_rate is not given: fine-tuning a pretrained transformer
# takes the usual 2e-5, training from scratch a hundred times more.
LEARNING_RATE = 3e-3
HF_LEARNING_RATE = 2e-5


def is_hf_arch(arch: str | None) -> bool:
    """--arch hf:NAME_OR_PATH: a Hugging Face model (text); transformers' encoders use LayerNorm."""
    from ttc.inputs.preprocess import hf_source  # numpy: not at --help

    return hf_source(arch) is not None


def default_learning_rate(arch: str | None, model_type: str | None = None) -> float:
    """--learning_rate when not given: an hf arch's, else its model type's (Task.learning_rate:
    a segmenter's), else LEARNING_RATE."""
    if is_hf_arch(arch):
        return HF_LEARNING_RATE
    task = find_task(model_type) if model_type else None
    return task.learning_rate if task is not None and task.learning_rate else LEARNING_RATE


@dataclass
class TrainingFlags:
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
                           "tabular mlp, resmlp (residual MLP); segmenter unet, "
                           "lraspp_mobilenet_v3_large, deeplabv3_mobilenet_v3_large; detector "
                           "centernet, mobilenet_v3_large (our heads on its features), "
                           "ssdlite320_mobilenet_v3_large (torchvision's) (default: the first of "
                           "the model type)", "training",
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
                                 scripts="EIS")
    init_weights: str | None = opt(None, "start from these weights (.safetensors, or a torch "
                                   "state dict, read with weights_only): tensors load where "
                                   "name and shape match; the report counts loaded, skipped "
                                   "and missing", "training", metavar="PATH", scripts="PT")
    pretrained: bool = opt(False, "torchvision archs: start from torchvision's ImageNet weights "
                           "(a segmenter's and the detector's mobilenet_v3_large: the "
                           "MobileNetV3-Large backbone; ssdlite320_mobilenet_v3_large: its COCO "
                           "detector), read from the torch hub cache "
                           "($TORCH_HOME/hub/checkpoints; never downloaded)",
                           "training", type=parse_bool, metavar="BOOL",
                           scripts="PT")
    freeze_epochs: int = opt(0, "train only the classifier head (the last nn.Linear) for the "
                             "first N epochs, then the whole network", "training", type=int,
                             metavar="N", scripts="PT")
    learning_rate: float | None = opt(
        None, "AdamW peak learning rate of the schedule (--lr_schedule), default 3e-3 "
        "(image_segmenter 1e-2, object_detector 4e-3); for hf: archs of linear warm-up (a "
        "tenth of the steps) and decay, default 2e-5", "training", type=float, metavar="LR", scripts="PT")
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
    calibrate: str = opt("temperature", "temperature: fit one temperature T on the "
                         "calibration slice (--calibration_fraction; minimum NLL) and bake "
                         "softmax(logits / T) into every exported graph, so the probabilities a "
                         "deployment reads are calibrated, but only on evidence: T stays 1 when "
                         "the 90 percent bootstrap interval of T contains 1 or that of its NLL "
                         "or Brier gain on the slice does not lie above 0 (the report says why); temperature_always: apply the fitted T "
                         "whatever the intervals say; none: softmax(logits)", "training",
                         choices=("temperature", "temperature_always", "none"), scripts="PT")
    device: str = opt("auto", "where the network trains: auto (the first GPU when torch sees "
                      "one, else the CPU), cpu, cuda or cuda:N; export, quantization and "
                      "inference read the trained weights on the CPU, so the bundle is the same "
                      "in form (--engine ray: --use_gpu instead)", "training", metavar="DEVICE",
                      scripts="PT")
    amp: str = opt("auto", "mixed-precision training: auto (bf16 on a GPU that has it, else "
                   "fp16; off on the CPU), bf16 (autocast), fp16 (autocast with loss scaling), "
                   "off (float32)", "training", choices=AMP_MODES, scripts="PT")

    def check_rates(self) -> None:
        """--learning_rate takes its arch's default when not given; the counts are positive."""
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(self.arch,
                                                       getattr(self, "model_type", None))
        for name in ("epochs", "batch_size", "learning_rate", "num_candidates"):
            positive(name, getattr(self, name))

    def check_training(self, model_type: str) -> None:
        """--lr_candidates, --device, and the network: --arch for `model_type`, or --model_def,
        and its starting weights."""
        self.learning_rates()
        self.check_device()
        names = ARCHS.get(model_type, ())
        if is_hf_arch(self.arch):
            from ttc.inputs.preprocess import HF_PREFIX

            task = find_task(model_type)
            if task is None or not task.hf_archs:
                bad("arch", self.arch, "hf:NAME_OR_PATH is a Hugging Face text model: use it "
                    "with --model_type text_classifier")
            if not self.arch[len(HF_PREFIX):].strip():
                bad("arch", self.arch, "give a hub name or a save_pretrained directory, e.g. "
                    "hf:distilbert-base-uncased")
        elif self.arch is not None and self.arch not in names:
            bad("arch", self.arch, f"a {model_type} takes one of: {', '.join(names)}, "
                "or for text hf:NAME_OR_PATH")
        self._check_network_source(model_type)

    def check_device(self) -> None:
        """--device's form (whether the GPU is there is the training stage's check, which
        imports torch: ttc/nets/device.py)."""
        if not DEVICE_FORM.fullmatch(self.device):
            bad("device", self.device, "use auto, cpu, cuda or cuda:N (e.g. cuda:1)")

    def _check_network_source(self, model_type: str | None = None) -> None:
        """--model_def, --init_weights, --pretrained and --freeze_epochs."""
        if self.model_def is not None:
            self.model_def_parts()
            if self.arch is not None:
                raise ConfigError("--model_def and --arch both name the network",
                                  "drop one of them")
        if self.pretrained:
            if model_type in BACKBONE_ARCHS:
                self._check_pretrained_backbone(model_type)
            elif self.arch not in TORCHVISION_ARCHS:
                raise ConfigError("--pretrained loads torchvision's ImageNet weights, for "
                                  f"--arch {', '.join(TORCHVISION_ARCHS)}",
                                  "add one of those archs, or use --init_weights PATH")
            if self.init_weights:
                raise ConfigError("--pretrained and --init_weights both name starting weights",
                                  "drop one of them")
        if self.freeze_epochs < 0:
            bad("freeze_epochs", self.freeze_epochs, "use 0 (off) or an epoch count")

    def _check_pretrained_backbone(self, model_type: str) -> None:
        """A segmenter's or detector's --pretrained loads the ImageNet backbone of a torchvision
        arch; our own networks (the default) and a --model_def module have none."""
        if self.arch not in BACKBONE_ARCHS[model_type]:
            network = (f"--model_def {self.model_def}" if self.model_def
                       else f"--arch {self.arch or ARCHS[model_type][0]}")
            raise ConfigError(f"--pretrained loads an ImageNet backbone, for --arch "
                              f"{', '.join(BACKBONE_ARCHS[model_type])}; {network} has none",
                              "add one of those archs, or drop --pretrained")

    def model_def_parts(self) -> tuple[Path, str]:
        """--model_def FILE.py:FACTORY as (file, factory name)."""
        path, _, factory = (self.model_def or "").rpartition(":")
        if not path or not factory.isidentifier():
            bad("model_def", self.model_def, "expected FILE.py:FACTORY, e.g. mynet.py:build")
        if Path(path).is_dir():
            raise ConfigError(f"--model_def {path} is a folder, not a Python file",
                              "name the .py file that defines the factory, e.g. "
                              f"{Path(path) / 'mynet.py'}:{factory}")
        if Path(path).suffix != ".py":
            raise ConfigError(f"--model_def {path} is not a Python file (.py)",
                              "name the .py file that defines the factory, e.g. mynet.py:build")
        return Path(path), factory

    def learning_rates(self) -> list[float]:
        """--lr_candidates as floats (default: [--learning_rate], or its default for the arch)."""
        if not self.lr_candidates:
            return [self.learning_rate if self.learning_rate is not None else
                    default_learning_rate(self.arch, getattr(self, "model_type", None))]
        rates = []
        for item in filter(None, (p.strip() for p in self.lr_candidates.split(","))):
            try:
                rate = float(item)
            except ValueError:
                rate = -1.0
            if not rate > 0:
                bad("lr_candidates", self.lr_candidates, "give positive learning rates, "
                    "comma-separated, e.g. 1e-3,3e-3,1e-2")
            rates.append(rate)
        if not rates:
            bad("lr_candidates", self.lr_candidates, "give at least one learning rate")
        return list(dict.fromkeys(rates))
