"""Torch architectures, described by a plain dict stored in the bundle manifest so that any stage
(export.py, test-time training) can rebuild the network and load `model.pt` into it.

Each network takes what the deployed graph takes (pixels in [0, 1], token ids, raw features with
NaN for missing) and does its own normalisation, so the .onnx is self-contained.
"""
from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from ttc.serving.bundle import BundlePaths, Manifest, bundle_file, require_trusted_model_code
from ttc.nets.hf import HFGraph, HFTextNet, hf_architecture
from ttc.inputs.limits import inflating_archive_problem, size_text
from ttc.inputs.preprocess import hf_source, hf_tokenizer_text
from ttc.tasks.registry import task_of_kind
from utils import (LOG, ConfigError, ExportError, UserCodeFailure, atomic_write, first_line,
                   register_user_code, sha256_of, stdout_to_stderr)


# The training split's statistics each network normalises with, as buffers (saved in model.pt and
# folded into the graph); before they are known, the identity.
IDENTITY_STATISTICS = {"mean": 0.0, "std": 1.0, "median": 0.0}


def register_statistics(net: nn.Module, width: int, shape: tuple[int, ...],
                        **statistics: list[float] | None) -> None:
    """Register `mean`, `std` and/or `median` buffers of `width` values, viewed as `shape`."""
    for name, values in statistics.items():
        net.register_buffer(name, torch.tensor(values or [IDENTITY_STATISTICS[name]] * width)
                            .view(*shape))


def standardised_features(net: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """A table's features with NaN (missing) imputed by the training medians, standardised."""
    x = torch.where(torch.isnan(features), net.median, features)
    return (x - net.mean) / net.std


def image_architecture(preprocessing: dict, num_classes: int) -> dict:
    """A small CNN sized from the input: one stage per halving until the side is about 4."""
    height, width = preprocessing["image_size"]
    side, pools = min(height, width), 0
    while side >= 8 and pools < 4:
        side //= 2
        pools += 1
    widths = [32, 64, 128, 128, 128][: pools + 1]
    return {"name": "SmallCNN", "in_channels": preprocessing["channels"],
            "image_size": [height, width], "num_classes": num_classes, "widths": widths,
            "convs_per_stage": 2}


class SmallCNN(nn.Module):
    """Normalise → [Conv-BN-ReLU ×2, MaxPool] per stage → global average pool → Dropout → Linear.

    The training split's mean/std are buffers, so the exported graph takes pixels in [0, 1].
    """

    def __init__(self, in_channels: int, num_classes: int, widths: list[int],
                 convs_per_stage: int = 2, dropout: float = 0.2,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        layers: list[nn.Module] = []
        channels = in_channels
        for stage, width in enumerate(widths):
            if stage > 0:
                layers.append(nn.MaxPool2d(2))
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False),
                           nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = (pixels - self.mean) / self.std
        x = self.features(x).mean(dim=(2, 3))
        return self.classifier(self.dropout(x))


def text_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TextClassifier", "vocab_size": preprocessing["vocab_size"],
            "num_classes": num_classes, "embedding_dim": 64, "hidden": 128}


class TextClassifier(nn.Module):
    """Embedding → masked mean and max pooling → BatchNorm → MLP.

    Pooling ignores padding (id 0), so padding a text never changes its prediction.
    """

    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int = 64,
                 hidden: int = 128, dropout: float = 0.3, **_: object) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.norm = nn.BatchNorm1d(2 * embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.hidden = nn.Linear(2 * embedding_dim, hidden)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mask = (token_ids != 0).unsqueeze(-1)
        vectors = self.embedding(token_ids)
        count = mask.sum(dim=1).clamp(min=1).to(vectors.dtype)
        mean = (vectors * mask).sum(dim=1) / count
        peak = vectors.masked_fill(~mask, -1e4).max(dim=1).values
        x = self.norm(torch.cat([mean, peak], dim=1))
        x = torch.relu(self.hidden(self.dropout(x)))
        return self.classifier(self.dropout(x))


def tabular_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TabularMLP", "num_features": len(preprocessing["feature_names"]),
            "num_classes": num_classes, "hidden": [128, 64]}


class TabularMLP(nn.Module):
    """Impute NaN with training medians → standardise → [Linear-BN-ReLU-Dropout] ×2 → Linear."""

    def __init__(self, num_features: int, num_classes: int, hidden: list[int],
                 dropout: float = 0.2, median: list[float] | None = None,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        register_statistics(self, num_features, (1, -1), median=median, mean=mean, std=std)
        layers: list[nn.Module] = []
        width = num_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.BatchNorm1d(size), nn.ReLU(inplace=True),
                       nn.Dropout(dropout)]
            width = size
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(standardised_features(self, features)))


# ----------------------------------------------------------------------------- more text nets


def text_cnn_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TextCNN", "vocab_size": preprocessing["vocab_size"],
            "num_classes": num_classes, "embedding_dim": 64, "kernel_sizes": [3, 4, 5],
            "filters": 64}


class TextCNN(nn.Module):
    """Kim (2014): embedding → 1-D convolutions of widths 3, 4, 5 → max over time → BatchNorm →
    Linear.

    Padding never changes a prediction: the padding embedding is exactly zero (padding_idx), the
    convolutions zero-pad by width − 1 on both sides, and the max runs only over windows that
    touch a real token, so extra padding adds windows that are masked out and nothing else."""

    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int = 64,
                 kernel_sizes: list[int] | None = None, filters: int = 64, dropout: float = 0.3,
                 **_: object) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(embedding_dim, filters, k, padding=k - 1)
                                   for k in kernel_sizes or [3, 4, 5])
        self.norm = nn.BatchNorm1d(filters * len(self.convs))
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(filters * len(self.convs), num_classes)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        real = (token_ids != 0).sum(dim=1, keepdim=True)  # (N, 1); a text has ≥ 1 real token
        x = self.embedding(token_ids).transpose(1, 2)  # (N, E, L)
        pooled = []
        for conv in self.convs:
            y = torch.relu(conv(x))  # (N, F, L + k − 1)
            width = conv.kernel_size[0]
            position = torch.arange(y.shape[-1], device=y.device).unsqueeze(0)
            touches_text = (position < real + width - 1).unsqueeze(1)
            pooled.append(y.masked_fill(~touches_text, -1e4).max(dim=-1).values)
        x = self.norm(torch.cat(pooled, dim=1))
        return self.classifier(self.dropout(x))


def text_transformer_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TextTransformer", "vocab_size": preprocessing["vocab_size"],
            "num_classes": num_classes, "max_positions": int(preprocessing["max_length"]),
            "d_model": 64, "heads": 4, "layers": 2, "feedforward": 128}


class TextTransformer(nn.Module):
    """Token and learned position embeddings → nn.TransformerEncoder (pre-norm) with a padding
    mask → mean over real tokens → LayerNorm → Linear. No BatchNorm: `--ttt_method bn` does not
    apply (the adaptation graph keeps BatchNorm nodes, and there are none)."""

    def __init__(self, vocab_size: int, num_classes: int, max_positions: int = 256,
                 d_model: int = 64, heads: int = 4, layers: int = 2, feedforward: int = 128,
                 dropout: float = 0.1, **_: object) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.positions = nn.Embedding(max_positions, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, feedforward, dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_classes)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        padding = token_ids == 0
        # Padding beyond the tokenizer's max_length (a padded batch) shares the last position:
        # it is masked anyway.
        position = torch.arange(token_ids.shape[1], device=token_ids.device).clamp(
            max=self.max_positions - 1)
        x = self.embedding(token_ids) + self.positions(position).unsqueeze(0)
        x = self.encoder(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        x = (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return self.classifier(self.dropout(self.norm(x)))


# ----------------------------------------------------------------------------- more tabular nets


def tabular_resmlp_architecture(preprocessing: dict, num_classes: int) -> dict:
    return {"name": "TabularResMLP", "num_features": len(preprocessing["feature_names"]),
            "num_classes": num_classes, "width": 128, "blocks": 2}


class TabularResMLP(nn.Module):
    """The ResNet baseline of Gorishniy et al. (2021), "Revisiting Deep Learning Models for
    Tabular Data": impute → standardise → Linear → residual blocks [BN-Linear-ReLU-Dropout-Linear]
    → BN-ReLU → Linear. The skip connections let it go deeper than the plain MLP without
    training getting harder, and it was their strongest simple baseline."""

    def __init__(self, num_features: int, num_classes: int, width: int = 128, blocks: int = 2,
                 dropout: float = 0.1, median: list[float] | None = None,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        register_statistics(self, num_features, (1, -1), median=median, mean=mean, std=std)
        self.stem = nn.Linear(num_features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.BatchNorm1d(width), nn.Linear(width, 2 * width), nn.ReLU(),
                          nn.Dropout(dropout), nn.Linear(2 * width, width), nn.Dropout(dropout))
            for _ in range(blocks))
        self.head = nn.Sequential(nn.BatchNorm1d(width), nn.ReLU())
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.stem(standardised_features(self, features))
        for block in self.blocks:
            x = x + block(x)
        return self.classifier(self.head(x))


# ----------------------------------------------------------------------------- torchvision nets

# --arch → the torchvision builder's name and the ImageNet weights enum --pretrained loads.
TORCHVISION_ARCHS = {"resnet18": "ResNet18_Weights", "resnet34": "ResNet34_Weights",
                     "mobilenet_v3_small": "MobileNet_V3_Small_Weights",
                     "efficientnet_b0": "EfficientNet_B0_Weights"}
# The ImageNet stem (a stride-2 7×7 conv and a max-pool for ResNets, a stride-2 first conv for
# the others) shrinks a 32-pixel image to 8 before the first block. At this side or below the
# first conv keeps the resolution (stride 1, ResNets: 3×3 and no max-pool), as the CIFAR
# adaptation of ResNet-18 does.
SMALL_STEM_MAX_SIDE = 64
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def torchvision_architecture(arch: str) -> Callable[[dict, int], dict]:
    def describe(preprocessing: dict, num_classes: int) -> dict:
        height, width = preprocessing["image_size"]
        return {"name": "TorchvisionNet", "torchvision": arch,
                "in_channels": preprocessing["channels"], "image_size": [height, width],
                "num_classes": num_classes,
                "small_stem": min(height, width) <= SMALL_STEM_MAX_SIDE,
                "normalization": "data"}
    return describe


def _first_conv_path(body: nn.Module) -> tuple[nn.Module, str]:
    """(parent module, attribute) of a torchvision classifier's first convolution."""
    if hasattr(body, "conv1"):  # ResNet
        return body, "conv1"
    return body.features[0], "0"  # MobileNetV3, EfficientNet: Conv2dNormActivation


def adapt_stem(body: nn.Module, in_channels: int, small: bool) -> None:
    """The first conv for `in_channels` inputs; for small images stride 1 (ResNets: a 3×3 conv
    and no max-pool)."""
    parent, name = _first_conv_path(body)
    conv: nn.Conv2d = getattr(parent, name)
    if hasattr(body, "maxpool") and small:
        setattr(parent, name, nn.Conv2d(in_channels, conv.out_channels, 3, 1, 1, bias=False))
        body.maxpool = nn.Identity()
        return
    if in_channels == conv.in_channels and not small:
        return
    setattr(parent, name, nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size,
                                    1 if small else conv.stride, conv.padding, bias=False))


class TorchvisionNet(nn.Module):
    """A torchvision classifier (weights=None) behind the same normalisation as SmallCNN:
    pixels in [0, 1] → (x − mean) / std → the torchvision network, whose state-dict keys sit
    under `body.` with torchvision's own names (so torchvision checkpoints load by name).
    `normalization`: "data" (the training split's statistics) or "imagenet" (--pretrained)."""

    def __init__(self, torchvision: str, in_channels: int, num_classes: int,
                 small_stem: bool, normalization: str = "data",
                 mean: list[float] | None = None, std: list[float] | None = None,
                 **_: object) -> None:
        super().__init__()
        import torchvision as tv  # 3 s to import: only for these networks

        if normalization == "imagenet":  # grayscale: the channel mean of ImageNet's statistics
            mean = IMAGENET_MEAN if in_channels == 3 else [sum(IMAGENET_MEAN) / 3]
            std = IMAGENET_STD if in_channels == 3 else [sum(IMAGENET_STD) / 3]
        register_statistics(self, in_channels, (1, -1, 1, 1), mean=mean, std=std)
        self.body = tv.models.get_model(torchvision, weights=None, num_classes=num_classes)
        adapt_stem(self.body, in_channels, small_stem)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.body((pixels - self.mean) / self.std)


# ----------------------------------------------------------------------------- your own module

# sha256 of a --model_def file → where this process read it (the user's file while training,
# the bundle's copy afterwards): build_model imports the factory from there.
_MODEL_SOURCES: dict[str, Path] = {}
_BUNDLE_COPIES: set[Path] = set()  # those registered from a bundle (checked against its sha256)


def register_model_source(path: Path, expected: str | None = None) -> str:
    """Remember a --model_def file by its sha256 (and refuse one whose hash is not `expected`)."""
    digest = sha256_of(path)
    if expected and digest != expected:
        raise ExportError(f"{path} does not match its manifest (sha256 differs)",
                          "restore the model definition written with the bundle, or re-create "
                          "the bundle with pipeline.py")
    _MODEL_SOURCES[digest] = path
    if expected:
        _BUNDLE_COPIES.add(path)
    return digest


def model_source(architecture: dict) -> Path:
    """The --model_def file of a UserNetwork architecture, as registered in this process."""
    digest = architecture["model_def"]["sha256"]
    if digest not in _MODEL_SOURCES:
        raise ExportError("the bundle's model definition was not found",
                          "keep the bundle's .def.py next to its model.json")
    return _MODEL_SOURCES[digest]


def factory_input_spec(preprocessing: dict) -> dict:
    """What a --model_def factory is told about its input: the graph input (models.input_spec)
    and the sizes a network is built from."""
    spec = input_spec(preprocessing)
    kind = preprocessing["kind"]
    spec.update(task_of_kind(kind).factory_sizes(preprocessing))
    return {"kind": kind, **spec}


def user_architecture(path: Path, factory: str, preprocessing: dict, num_classes: int) -> dict:
    """The manifest's description of a --model_def network (the bundle keeps the file)."""
    digest = register_model_source(path)
    return {"name": "UserNetwork", "arch": "model_def", "num_classes": num_classes,
            "model_def": {"file": path.name, "factory": factory, "sha256": digest},
            "input_spec": factory_input_spec(preprocessing)}


def import_factory(path: Path, factory: str) -> Callable:
    """Import the user's file (running its code) and return its `factory`; any failure is one
    ConfigError line. Its folder comes first while it imports, so its own modules beside it
    (a utils.py, a config.py) win over this tool's modules of the same names."""
    import importlib.util
    import sys

    label = f"--model_def {path}"
    name = f"model_def_{sha256_of(path)[:16]}"
    module = sys.modules.get(name)
    if module is None:
        register_user_code(path, label)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # checked up front (config); a bundle's copy
            raise ConfigError(f"{label} is not a Python file", "name a .py file")
        module = importlib.util.module_from_spec(spec)
        hint = f"run `python {path}` to see the traceback"
        if path in _BUNDLE_COPIES:
            hint += ("; the bundle keeps this one file: modules it imports from its own folder "
                     "go beside it")
        with siblings_first(path.parent), user_code(label, "importing it", hint):
            spec.loader.exec_module(module)
        sys.modules[name] = module
    built = getattr(module, factory, None)
    if not callable(built):
        raise ConfigError(f"{label} has no function {factory!r}",
                          f"define {factory}(num_classes, input_spec) returning an nn.Module")
    return built


@contextlib.contextmanager
def user_code(label: str, doing: str | Callable[[], str], hint: str) -> Iterator[None]:
    """Run the user's --model_def code (its import, its factory, its forward, wherever the tool
    calls it): what it prints goes to stderr (stdout carries the summary or the JSON report),
    and SystemExit or any exception it raises becomes one UserCodeFailure, exit 2, naming
    `label` and showing the user's own error. Ctrl-C (130) and running out of memory (5) stay
    the tool's."""
    try:
        with stdout_to_stderr():
            yield
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except (SystemExit, Exception) as err:  # noqa: BLE001 - the user's code: any error is theirs
        exited = isinstance(err, SystemExit)
        what = f"called sys.exit({err.code!r})" if exited else f"failed: {_one_line(err)}"
        call = doing() if callable(doing) else doing
        raise UserCodeFailure(ConfigError(f"{label}: {call} {what}", EXIT_HINT if exited
                                          else hint)) from err


EXIT_HINT = ("code this tool imports or calls must not exit: keep script code under "
             "`if __name__ == \"__main__\":` and raise an exception for an error")


# The repository root: this tool's own top-level modules (utils.py, config.py, the CLIs) and
# its package live there.
TOOL_FOLDER = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def siblings_first(folder: Path) -> Iterator[None]:
    """`folder` first on sys.path, as for `python mynet.py`, and this tool's modules named like
    a module in it out of sys.modules meanwhile, so that the user's own utils.py is the one
    imported; afterwards the tool's are back (the user's module keeps the siblings it bound)."""
    import sys

    folder = folder.resolve()
    names = {p.stem for p in folder.glob("*.py")} | {
        p.parent.name for p in folder.glob("*/__init__.py")}
    if folder == TOOL_FOLDER or not names:
        yield
        return

    def file_of(name: str) -> Path | None:
        if name.partition(".")[0] not in names:
            return None
        file = getattr(sys.modules.get(name), "__file__", None)
        return Path(file).resolve() if isinstance(file, str) else None

    tools = {name: sys.modules.pop(name) for name in list(sys.modules)
             if (file := file_of(name)) and (file.parent == TOOL_FOLDER
                                                    or file.is_relative_to(TOOL_FOLDER / "ttc"))}
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))
        for name in [n for n in list(sys.modules) if (file := file_of(n)) and
                     file.is_relative_to(folder)]:
            del sys.modules[name]  # the user's: the tool's own imports must find the tool's
        sys.modules.update(tools)


def _one_line(err: BaseException) -> str:
    """The user's exception as `Type: message` (its type alone when it has no message)."""
    text = first_line(err, 200)
    return f"{type(err).__name__}: {text}" if text != type(err).__name__ else text


class UserNetwork(nn.Module):
    """Your nn.Module behind the normalisation every network here does itself: images
    standardised by the training split's per-channel mean and std, tables imputed with the
    training medians (NaN = missing) and standardised, token ids as they are (0 = padding). Its
    state-dict keys sit under `module.`. Every call into your code (import, factory, forward)
    runs inside user_code."""

    def __init__(self, num_classes: int, model_def: dict, input_spec: dict,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 median: list[float] | None = None, **_: object) -> None:
        super().__init__()
        self.role = task_of_kind(input_spec["kind"]).input_role  # what its normalisation is
        width = (input_spec.get("channels") if self.role == "image"
                 else input_spec.get("num_features") or 0)
        shape = (1, -1, 1, 1) if self.role == "image" else (1, -1)
        register_statistics(self, width, shape, mean=mean, std=std, median=median)
        path = model_source({"model_def": model_def})
        factory = import_factory(path, model_def["factory"])
        self.label = f"--model_def {path}:{model_def['factory']}"
        with user_code(self.label, "the factory", _fix_hint(f"{model_def['factory']}()", path)):
            module = factory(num_classes=num_classes, input_spec=dict(input_spec))
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{self.label} returned a {type(module).__name__}, not a "
                              "torch.nn.Module", "return the network (an nn.Module)")
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(f"{self.label} returned a module with no trainable parameters: "
                              "there is nothing to train",
                              "give it a layer with weights (e.g. nn.Linear), requires_grad on")
        self.module = module
        self.forward_hint = _fix_hint("forward", path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.role == "image":
            x = (x - self.mean) / self.std
        elif self.role == "feature":
            x = standardised_features(self, x)
        if torch.compiler.is_dynamo_compiling():  # strict export traces no fd juggling
            return self.module(x)
        with user_code(self.label, self._forward_call(x), self.forward_hint):
            return self.module(x)

    @staticmethod
    def _forward_call(x: torch.Tensor) -> Callable[[], str]:
        """What the error line says the failed forward was given (worded only on failure)."""
        exporting = " (traced for the ONNX export)" if torch.compiler.is_exporting() else ""
        return lambda: f"its forward{exporting} on a batch of {tuple(x.shape)} {x.dtype}"


def _fix_hint(what: str, path: Path) -> str:
    if path in _BUNDLE_COPIES:
        return (f"fix {what} in the module this bundle was trained with and re-create the "
                f"bundle ({path.name} is its copy)")
    return f"fix {what} in {path}"


# ----------------------------------------------------------------------------- choosing one

# Each model type's networks (its entry's parts.networks): --arch → the function that sizes
# that network for the data. Its entry's `archs` lists the same names, default first.
IMAGE_NETWORKS = {"small_cnn": image_architecture,
                  **{arch: torchvision_architecture(arch) for arch in TORCHVISION_ARCHS}}
TEXT_NETWORKS = {"bag": text_architecture, "cnn": text_cnn_architecture,
                 "transformer": text_transformer_architecture}
TABULAR_NETWORKS = {"mlp": tabular_architecture, "resmlp": tabular_resmlp_architecture}


def architecture_for(preprocessing: dict, num_classes: int, arch: str | None = None,
                     labels: Sequence[str] | None = None, dropout: float | None = None) -> dict:
    """The manifest's description of the `arch` network (default: the kind's first) for this
    data, with its dropout (`dropout`, else the network's default from its type's entry);
    build_model turns it into a module."""
    kind = preprocessing["kind"]
    task = task_of_kind(kind)
    arch = arch or task.default_arch
    if task.hf_archs and hf_source(arch) is not None:
        return hf_architecture(hf_source(arch), preprocessing, labels or
                               [str(i) for i in range(num_classes)])
    networks = task.part("networks")
    if arch not in networks:
        raise ValueError(f"--arch {arch} is not a {kind} network")
    record = {**networks[arch](preprocessing, num_classes), "arch": arch}
    default = task.regularisation[arch].dropout
    if default is not None:  # one of our networks: its Dropout layers' rate
        record["dropout"] = default if dropout is None else dropout
    return record


def input_spec(preprocessing: dict) -> dict:
    """The graph input the manifest promises, with the axes that are dynamic."""
    return task_of_kind(preprocessing["kind"]).graph_input(preprocessing)


class WithProbabilities(nn.Module):
    """What is exported: the logits and softmax(logits / temperature), the calibrated
    probabilities (calibrate.py), so deployments need no post-processing."""

    def __init__(self, net: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.net = net
        self.temperature = float(temperature)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(pixels)
        return logits, calibrated_softmax(logits, self.temperature)


def calibrated_softmax(logits: torch.Tensor, temperature: float, dim: int = -1) -> torch.Tensor:
    """softmax(logits / T) over the classes' axis `dim` (a segmenter's: 1); at T = 1 no
    division, so an uncalibrated graph has no Div node.

    Exported over an axis that is not the last, it is written as exp(z - max) / sum: ONNX
    Runtime's CPU Softmax transposes a non-last axis to the end and back, and took 400 µs on
    (1, 11, 64, 64) logits against 95 µs for the decomposed form (1 thread, 26 November 2026);
    eager PyTorch keeps its own fused kernel."""
    scaled = logits if temperature == 1.0 else logits / temperature
    if torch.onnx.is_in_onnx_export() and dim not in (-1, logits.dim() - 1):
        exponentials = torch.exp(scaled - scaled.amax(dim=dim, keepdim=True))
        return exponentials / exponentials.sum(dim=dim, keepdim=True)
    return torch.softmax(scaled, dim=dim)


# Each model type's modules (its entry's parts.modules): a manifest's architecture["name"] → the
# nn.Module it builds (bundles written before --arch have no "arch" key, and their names are
# here too). A --model_def network (UserNetwork) is every type's.
IMAGE_MODULES = {"SmallCNN": SmallCNN, "TorchvisionNet": TorchvisionNet}
TEXT_MODULES = {"TextClassifier": TextClassifier, "TextCNN": TextCNN,
                "TextTransformer": TextTransformer, "HFTextNet": HFTextNet}
TABULAR_MODULES = {"TabularMLP": TabularMLP, "TabularResMLP": TabularResMLP}


def network_modules(kind: str) -> dict[str, type[nn.Module]]:
    """architecture["name"] → module, for the networks of a preprocessing kind."""
    return {**task_of_kind(kind).part("modules"), "UserNetwork": UserNetwork}


def build_model(architecture: dict, preprocessing: dict, pretrained: bool = False) -> nn.Module:
    """A fresh network for a manifest's architecture (load `model.pt` into it afterwards);
    `pretrained`: an hf network starts from its checkpoint's weights (training does)."""
    cls = network_modules(preprocessing["kind"])[architecture["name"]]
    stats = {k: preprocessing.get(k) for k in ("mean", "std", "median")}
    if cls is HFTextNet:
        return cls(**architecture, pretrained=pretrained)
    return cls(**architecture, **stats)


def export_wrapper(net: nn.Module, temperature: float = 1.0) -> nn.Module:
    """The module torch.onnx.export traces: the graph's inputs in, logits and probabilities
    (softmax(logits / temperature)) out."""
    return (HFGraph(net, temperature) if isinstance(net, HFTextNet)
            else WithProbabilities(net, temperature))


def users_own_model_def(architecture: dict) -> bool:
    """Whether a UserNetwork's file is one the user gave as --model_def in this process
    (pipeline.py training it, then Tent): its code is the user's, already imported."""
    digest = (architecture.get("model_def") or {}).get("sha256")
    return digest in _MODEL_SOURCES and _MODEL_SOURCES[digest] not in _BUNDLE_COPIES


def register_bundle_model_source(manifest: Manifest, folder: Path) -> None:
    """The bundle's copy of its --model_def file, checked against the manifest's sha256 (the
    user's own file when it has that hash: see users_own_model_def)."""
    if users_own_model_def(manifest.architecture.spec):
        return
    name = manifest.files.name("model_def")
    if not name:
        raise ExportError("the bundle's manifest names no model definition file",
                          "re-create the bundle with pipeline.py --model_def")
    path = folder / name
    if bundle_file(path, "model definition") is None:
        raise ExportError(f"the bundle's model definition {path} is missing",
                          "keep the .def.py written with the bundle next to its model.json")
    register_model_source(path, manifest.architecture.model_def["sha256"])


def count_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def weights_bytes(net: nn.Module) -> bytes:
    """The state_dict (tensors only, no pickled code) as a weights file's bytes, serialised in
    memory first: torch's own file writer hides a full disk's OSError."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, buffer)
    return buffer.getvalue()


def save_weights(net: nn.Module, path: Path) -> str:
    """Write the state_dict (weights_bytes) atomically; return its sha256."""
    data = weights_bytes(net)
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return sha256_of(path)


def weights_error(err: Exception) -> str:
    """Why torch or safetensors could not read a weight file, in a few words. torch's own
    message for a pickle it refuses advises loading with weights_only=False, which runs any
    code the file holds: that advice is never passed on."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return ("it is not a plain file of tensors (a corrupt file, or a pickle holding other "
                "objects, which this tool never unpickles)")
    if "zip archive" in text:
        return "it is neither a torch file (no ZIP archive) nor readable as one: a corrupt file"
    return first_line(err, 200)


class TorchFileError(Exception):
    """A torch file load_torch_file refused or could not read; its text says why in a few
    words, for the caller's error line (the caller knows what the file was for)."""


def load_torch_file(path: Path) -> object:
    """The one way this tool reads a torch file (a bundle's model.pt and its compressed
    variants' weights, a checkpoint's state.pt, --init_weights): refused before torch reads
    it where its ZIP would inflate or declares more than it holds (inflating_archive_problem),
    then torch.load with weights_only=True (never unpickling code), onto the CPU."""
    problem = inflating_archive_problem(path)
    if problem:  # a ZIP bomb: torch.load would take what the archive declares
        raise TorchFileError(problem)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure: not a torch file we can read
        raise TorchFileError(weights_error(err)) from None


def architecture_bytes(manifest: Manifest) -> int | None:
    """The bytes of the tensors the manifest's network holds, counted on torch's meta device
    (shapes without memory); None for a network whose sizes its own code decides (--model_def)
    or that cannot be built there."""
    if manifest.architecture.is_user_network:
        return None
    try:
        with torch.device("meta"):
            net = build_model(manifest.architecture.spec, manifest.preprocessing.spec)
    except Exception as err:  # noqa: BLE001 - the real build reports a bad architecture
        LOG.debug("the architecture could not be sized on the meta device: %s", first_line(err))
        return None
    tensors = [*net.parameters(), *net.buffers()]  # shared tensors once
    return sum(t.numel() * t.element_size() for t in tensors)


def require_weights_fit(manifest: Manifest, path: Path) -> None:
    """Refuse (exit 4) a manifest whose network holds more than its weights file could store,
    before the network is built: `architecture.widths` [7000, 7000] would take 5.6 GB for a
    file of 263 KB. The file holds every tensor of the network (a MB of slack for buffers it
    leaves out)."""
    need = architecture_bytes(manifest)
    have = path.stat().st_size
    if need is not None and need > have + (1 << 20):
        name = manifest.architecture.name
        raise ExportError(f"the manifest's architecture ({name}) holds {size_text(need)} of "
                          f"tensors, and its weights file {path.name} only {size_text(have)}: "
                          "the architecture was edited, or the files come from different runs",
                          "restore the manifest written with the weights, or re-create the "
                          "bundle with pipeline.py")


def load_weights(manifest: Manifest, path: Path, trust_model_code: bool = False) -> nn.Module:
    """Rebuild the manifest's network and load `model.pt` into it (weights_only: never unpickle).
    A --model_def network imports the bundle's copy of its file, which runs that code: only with
    `trust_model_code` (--trust_model_code), or when the file is the user's own --model_def."""
    expected = manifest.files.digest("weights")
    require_trusted_model_code(manifest, BundlePaths.from_model_path(path.with_suffix(".onnx")),
                               trust_model_code or users_own_model_def(manifest.architecture.spec))
    if bundle_file(path, "weights") is None:
        raise ExportError(f"weights file {path} not found", "re-run train.py or pipeline.py")
    if expected and sha256_of(path) != expected:
        raise ExportError(f"{path} does not match its manifest (sha256 differs)",
                          "re-run train.py or pipeline.py to write a consistent bundle")
    if manifest.architecture.is_user_network:
        register_bundle_model_source(manifest, path.parent)
    require_weights_fit(manifest, path)
    try:
        state = load_torch_file(path)
    except TorchFileError as err:
        raise ExportError(f"cannot load weights {path}: {err}",
                          "re-run train.py or pipeline.py") from None
    net = build_model(manifest.architecture.spec, manifest.preprocessing.spec)
    try:
        net.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - any failure here means an unusable file
        raise ExportError(f"cannot load weights {path}: {weights_error(err)}",
                          "re-run train.py or pipeline.py") from None
    return net.eval()


def side_files(manifest: Manifest) -> dict[str, bytes]:
    """The files besides weights and graphs that a manifest needs in its bundle, by key: a
    --model_def network's Python file, an hf arch's tokenizer.json."""
    files = {}
    source = model_def_source(manifest)
    if source is not None:
        files["model_def"] = source.read_bytes()
    if manifest.preprocessing.is_hf:
        files["tokenizer"] = hf_tokenizer_text(manifest.preprocessing.spec).encode("utf-8")
    return files


def model_def_source(manifest: Manifest) -> Path | None:
    """The --model_def file a UserNetwork manifest needs in its bundle (registered in
    _MODEL_SOURCES by whoever built the network), or None for the built-in networks."""
    if not manifest.architecture.is_user_network:
        return None
    return model_source(manifest.architecture.spec)
