"""Structured channel pruning with Torch-Pruning (DepGraph): a smaller dense network, not masks.

Torch-Pruning traces the network once on an example input and groups the layers whose channels
are coupled (a convolution's filters, the BatchNorm after it, the next layer's input channels,
every layer a residual sum ties to them); each group loses the same fraction of its channels,
ranked by L2 magnitude or by first-order Taylor importance (|weight × gradient| of the
cross-entropy on a few training batches), and keeps a multiple of CHANNEL_MULTIPLE channels
where it is wide enough (ONNX Runtime's fast convolutions need it). Never pruned: the
classifier head's outputs (the classes), embeddings (the vocabulary and what every residual
stream adds to it), attention and recurrent layers (their widths are tied to heads and gates),
and the input (the stem's in_channels follow the data).

A bundle rebuilds a pruned network without running any code of its own: the manifest's
architecture builds the unpruned network, `resized_to` swaps each layer whose recorded shape
differs for one of that size, and the weights load strictly.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ttc.nets.models import count_parameters
from ttc.nets.transfer import head_name
from utils import first_line, stdout_to_stderr

IMPORTANCES = ("l2", "taylor")
# The ratio the dry run of prune_unsupported_reason prunes at: any ratio that changes widths
# shows whether the network's forward and its rebuild follow them.
PROBE_RATIO = 0.5
# Layers whose widths are tied to something channel pruning does not see: kept whole.
KEPT_TYPES = (nn.Embedding, nn.EmbeddingBag, nn.MultiheadAttention, nn.RNNBase)
# The channel count each pruned layer keeps is rounded to a multiple of this: ONNX Runtime's
# blocked (NCHWc) convolutions, its fast path on CPUs, take only channel counts that are
# multiples of the block, 16 with AVX-512 (8 with AVX2); other counts fall back to im2col + GEMM.
# Measured (ORT 1.31, 1 thread, AVX-512, batch 64 of 28x28): small_cnn widths [16, 32, 64]
# 8.5 ms, [19, 38, 76] 20.5 ms, [24, 48, 96] 23.4 ms, unpruned [32, 64, 128] 32.4 ms.
CHANNEL_MULTIPLE = 16

FineTune = Callable[[nn.Module, int], nn.Module]
LossBatches = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class PruneResult:
    """A pruned network and what pruning did to it."""

    net: nn.Module
    ratio: float
    steps: int
    importance: str
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int
    multiple: int = 1  # the channel counts kept were rounded to multiples of this
    # per pruned Conv/Linear layer (by state-dict name): [output channels before, after]
    channels: dict[str, list[int]] = field(default_factory=dict)

    @property
    def removed(self) -> float:
        """The fraction of the pruned layers' output channels removed, all layers together."""
        before = sum(b for b, _ in self.channels.values())
        return 1.0 - sum(a for _, a in self.channels.values()) / before if before else 0.0

    def report_section(self) -> dict:
        return {"ratio": self.ratio, "steps": self.steps, "importance": self.importance,
                "multiple": self.multiple, "channels_removed": round(self.removed, 4),
                "params": [self.params_before, self.params_after],
                "macs": [self.macs_before, self.macs_after], "channels": self.channels}


# ----------------------------------------------------------------------------- counting


def count_macs(net: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of the network on one input (the first row of `example`: for text,
    at the example's padded length), counted by Torch-Pruning's op counter (hooks on the layers:
    functional ops in a forward are not counted) on a copy in eval mode. Gradients stay on
    while it runs, so that nn.TransformerEncoderLayer takes the path whose layers it sees."""
    import torch_pruning as tp

    with stdout_to_stderr(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        macs, _ = tp.utils.count_ops_and_params(net, _on_device(example[:1], net))
    return int(macs)


def count_params(net: nn.Module) -> int:
    return count_parameters(net)


def _on_device(x: torch.Tensor, net: nn.Module) -> torch.Tensor:
    parameter = next(net.parameters(), None)
    return x if parameter is None else x.to(parameter.device)


# ----------------------------------------------------------------------------- pruning


def kept_layers(net: nn.Module) -> list[nn.Module]:
    """The layers whose output channels are never pruned: the head and KEPT_TYPES."""
    head = head_name(net)
    kept = [net.get_submodule(head)] if head is not None else []
    return kept + [m for m in net.modules() if isinstance(m, KEPT_TYPES)]


def _importance(name: str):
    import torch_pruning as tp

    if name == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if name == "taylor":
        return tp.importance.GroupTaylorImportance()
    raise ValueError(f"unknown pruning importance {name!r}: one of {', '.join(IMPORTANCES)}")


def kept_channels(channels: int, ratio: float, multiple: int = 1) -> int:
    """The channels a layer of `channels` keeps when `ratio` of them are pruned: the nearest
    multiple of `multiple` to channels × (1 − ratio), or, where that would be none or all of
    them, floor(channels × (1 − ratio)) (at least 1)."""
    exact = max(1, int(channels * (1.0 - ratio)))
    aligned = round(channels * (1.0 - ratio) / multiple) * multiple
    return aligned if multiple > 1 and 0 < aligned < channels else exact


def _pruner(net: nn.Module, example: torch.Tensor, ratio: float, steps: int, importance: str,
            multiple: int = 1):
    """Torch-Pruning's BasePruner: local pruning (each group ranked alone) in `steps` linear
    steps to kept_channels of each layer; the network traced in eval mode (BatchNorm statistics
    untouched). Each Conv/Linear gets its own ratio (pruning_ratio_dict), chosen so that
    Torch-Pruning's floor(channels × (1 − ratio)) at the last step is exactly kept_channels."""
    import torch_pruning as tp

    net.eval()
    kept = kept_layers(net)
    inside_kept = {id(m) for layer in kept for m in layer.modules()}
    ratios = {}
    for module in net.modules():
        if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)) and \
                id(module) not in inside_kept:
            channels = module.weight.shape[1 if getattr(module, "transposed", False) else 0]
            ratios[module] = 1.0 - (kept_channels(channels, ratio, multiple) + 0.5) / channels
    with stdout_to_stderr(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unwrapped parameters detected": the rebuild refuses
        return tp.pruner.BasePruner(net, _on_device(example, net), _importance(importance),
                                    pruning_ratio=ratio, pruning_ratio_dict=ratios,
                                    iterative_steps=steps, ignored_layers=kept)


def _accumulate_gradients(net: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
                          ) -> None:
    """The cross-entropy's gradients over `batches`, summed in each parameter's .grad, in eval
    mode (no dropout, BatchNorm statistics untouched): what Taylor importance reads."""
    net.eval()
    net.zero_grad(set_to_none=True)
    seen = 0
    with torch.enable_grad():
        for x, y in batches:
            x, y = _on_device(x, net), _on_device(y, net)
            F.cross_entropy(net(x), y.long()).backward()
            seen += 1
    if not seen:
        raise ValueError("Taylor importance needs at least one (inputs, labels) batch")


def prune_channels(net: nn.Module, example: torch.Tensor, ratio: float, steps: int,
                   importance: str, fine_tune: FineTune,
                   loss_batches: LossBatches | None = None,
                   multiple: int = CHANNEL_MULTIPLE) -> PruneResult:
    """A copy of `net` with `ratio` of the channels of every prunable group removed, in `steps`
    equal steps (Torch-Pruning's iterative_steps: ratio/steps, 2·ratio/steps, … of the original
    channels), each followed by `fine_tune(pruned, step_index)` (step_index from 0), which
    returns the fine-tuned network the next step continues from (the same object or a copy of
    the same shapes: its weights are loaded back into the network the pruner holds).
    `importance`: "l2" (filter magnitude) or "taylor" (needs `loss_batches`, a few (inputs,
    labels) batches whose cross-entropy gradients rank the channels before each step).
    Each layer keeps kept_channels(channels, ratio, multiple): the nearest multiple of
    `multiple` (1: floor(channels × (1 − ratio))). `net` is left as it was."""
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"the pruning ratio must be between 0 and 1 (exclusive), not {ratio}")
    if steps < 1 or multiple < 1:
        raise ValueError(f"pruning takes at least one step and a channel multiple of at least "
                         f"1, not {steps} and {multiple}")
    if importance == "taylor" and loss_batches is None:
        raise ValueError("Taylor importance needs loss_batches (training batches for gradients)")
    work = copy.deepcopy(net).eval()
    before = shapes_of(work)
    params_before, macs_before = count_params(work), count_macs(work, example)
    classes = _output_shape(work, example)
    pruner = _pruner(work, example, ratio, steps, importance, multiple)
    for step in range(steps):
        if importance == "taylor":
            _accumulate_gradients(work, loss_batches())
        pruner.step()
        work.zero_grad(set_to_none=True)
        _require_output(work, example, classes, step)
        tuned = fine_tune(work, step)
        if tuned is not work:
            work.load_state_dict(tuned.state_dict())
        work.eval()
    return PruneResult(net=work, ratio=ratio, steps=steps, importance=importance,
                       params_before=params_before, params_after=count_params(work),
                       macs_before=macs_before, macs_after=count_macs(work, example),
                       multiple=multiple, channels=pruned_channels(before, shapes_of(work), work))


def _require_output(net: nn.Module, example: torch.Tensor, shape: tuple[int, ...],
                    step: int) -> None:
    """The pruned network still runs and gives outputs of `shape` (prune_unsupported_reason's
    dry run checks this before any training; this is the guard on what training made)."""
    try:
        now = _output_shape(net, example)
    except Exception as err:  # noqa: BLE001 - a forward that depended on a pruned width
        raise ValueError(f"the network's forward fails after pruning step {step + 1}: "
                         f"{_error_line(err)}") from None
    if now != shape:
        raise ValueError(f"pruning step {step + 1} changed the network's output shape from "
                         f"{list(shape)} to {list(now)}: its output layer is not an nn.Linear "
                         "that pruning keeps")


def _output_shape(net: nn.Module, example: torch.Tensor) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(net(_on_device(example, net)).shape)


def pruned_channels(before: dict[str, list[int]], after: dict[str, list[int]],
                    net: nn.Module) -> dict[str, list[int]]:
    """layer name → [output channels before, after], for each Conv/Linear whose count fell."""
    changed = {}
    for name, module in net.named_modules():
        if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)):
            key = f"{name}.weight"
            if key in before and before[key][0] != after[key][0]:
                changed[name] = [before[key][0], after[key][0]]
    return changed


# ----------------------------------------------------------------------------- where it applies


def prune_unsupported_reason(net: nn.Module, example: torch.Tensor) -> str | None:
    """None where this network can be pruned and rebuilt from a bundle; otherwise why not, in
    one line. Besides the networks refused by type, a dry run on a copy proves it: trace and
    prune at PROBE_RATIO, run the pruned copy on `example`, then rebuild it from a fresh copy
    with resized_to and its state dict, which must give the same outputs."""
    from ttc.nets.hf import HFTextNet

    if isinstance(net, HFTextNet):
        return ("an hf: transformer's attention projections are reshaped into heads × head size "
                "inside transformers' code, which the tracer does not see (pruning them breaks "
                "that reshape), and the bundle rebuilds it from its transformers config, whose "
                "widths pruning would have to rewrite")
    try:
        fresh, probe = copy.deepcopy(net).eval(), copy.deepcopy(net).eval()
    except Exception as err:  # noqa: BLE001 - a module that cannot be copied
        return f"the network cannot be copied for pruning: {_error_line(err)}"
    try:
        classes = _output_shape(probe, example)
    except Exception as err:  # noqa: BLE001 - the network's own forward
        return f"its forward fails on the example input: {_error_line(err)}"
    try:
        _pruner(probe, example, PROBE_RATIO, 1, "l2").step()
    except Exception as err:  # noqa: BLE001 - the tracer's failures are many
        return f"Torch-Pruning cannot trace or prune its graph: {_error_line(err)}"
    shapes = shapes_of(probe)
    if shapes == shapes_of(fresh):
        return ("Torch-Pruning finds no channels to prune in its traced graph (no Conv or "
                "Linear whose outputs feed another layer, or a forward it cannot follow: "
                "torch.no_grad, detach, NumPy)")
    return _dry_run_problem(fresh, probe, shapes, example, classes)


def _dry_run_problem(fresh: nn.Module, probe: nn.Module, shapes: dict[str, list[int]],
                     example: torch.Tensor, classes: tuple[int, ...]) -> str | None:
    try:
        with torch.no_grad():
            pruned_out = probe(_on_device(example, probe))
    except Exception as err:  # noqa: BLE001 - the user's forward on narrower layers
        return f"its forward fails once channels are pruned: {_error_line(err)}"
    if tuple(pruned_out.shape) != classes:
        return (f"pruning changes its output's shape from {list(classes)} to "
                f"{list(pruned_out.shape)}: its output layer is not an nn.Linear that pruning "
                "keeps")
    try:
        rebuilt = resized_to(fresh, shapes)
        rebuilt.load_state_dict(probe.state_dict())
        with torch.no_grad():
            rebuilt_out = rebuilt.eval()(_on_device(example, rebuilt))
    except Exception as err:  # noqa: BLE001 - resized_to's ValueError and load failures
        return f"the pruned network cannot be rebuilt from its shapes: {_error_line(err)}"
    if not torch.allclose(rebuilt_out, pruned_out, rtol=1e-4, atol=1e-5, equal_nan=True):
        return ("the pruned network rebuilt from its shapes computes other outputs (its forward "
                "depends on a width that is not a layer's)")
    return None


def _error_line(err: BaseException) -> str:
    return first_line(err, 200)


# ----------------------------------------------------------------------------- rebuilding


def shapes_of(net: nn.Module) -> dict[str, list[int]]:
    """Every state-dict tensor's shape, by key (plain JSON): what resized_to rebuilds from."""
    return {key: list(value.shape) for key, value in net.state_dict().items()}


def resized_to(net: nn.Module, shapes: dict[str, list[int]]) -> nn.Module:
    """`net` (a freshly built, unpruned network of the same architecture) with each layer whose
    tensors differ from `shapes` replaced by one of that size, so that the pruned state dict
    loads strictly. Layers it can resize: Conv1d/2d (groups kept, or a depthwise conv staying
    depthwise), Linear, BatchNorm1d/2d, LayerNorm, Embedding. Any other difference, or keys
    that differ, is a ValueError, and so is any size above the unpruned network's (pruning
    only removes: a bundle's record cannot make this allocate more than its architecture).
    `net` itself is modified and returned."""
    _require_within(shapes_of(net), shapes)
    replacements = []
    for name, module in net.named_modules():
        own = _own_shapes(module, name, shapes)
        if own != {k: list(v.shape) for k, v in _own_tensors(module).items()}:
            replacements.append((name, _resized_module(module, name, own)))
    for name, module in replacements:
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, child, module)
    wrong = {k: (v, shapes[k]) for k, v in shapes_of(net).items() if v != shapes[k]}
    if wrong:
        key, (have, want) = next(iter(wrong.items()))
        raise ValueError(f"{key}: resizing gave {have}, the recorded shape is {want}")
    return net


def _require_within(current: dict[str, list[int]], shapes: object) -> None:
    """`shapes` names the network's tensors, each with as many dimensions, each size an integer
    from 1 to the unpruned network's."""
    if not isinstance(shapes, dict):
        raise ValueError(f"the recorded shapes are a {type(shapes).__name__}, not an object")
    if set(current) != set(shapes):
        missing, extra = sorted(set(current) - set(shapes)), sorted(set(shapes) - set(current))
        raise ValueError(f"the recorded shapes do not name the network's tensors (missing "
                         f"{missing[:3]}, unknown {[str(k)[:40] for k in extra[:3]]})")
    for key, have in current.items():
        want = shapes[key]
        if not (isinstance(want, list) and len(want) == len(have) and
                all(type(size) is int and 1 <= size <= full for size, full in zip(want, have))):
            raise ValueError(f"{key}: the recorded shape {str(want)[:60]} is not a pruned "
                             f"shape of the network's {have}")


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters and persistent buffers (not its children's), as its state
    dict names them."""
    tensors = {k: v for k, v in module._parameters.items() if v is not None}
    tensors.update({k: v for k, v in module._buffers.items()
                    if v is not None and k not in module._non_persistent_buffers_set})
    return tensors


def _own_shapes(module: nn.Module, name: str, shapes: dict[str, list[int]]
                ) -> dict[str, list[int]]:
    prefix = f"{name}." if name else ""
    return {key: shapes[prefix + key] for key in _own_tensors(module)}


def _resized_module(module: nn.Module, name: str, shapes: dict[str, list[int]]) -> nn.Module:
    """A module like `module` (its settings, device, dtype and mode) for the tensors `shapes`."""
    label = name or "the network"
    resize = RESIZERS.get(type(module))
    if resize is None:
        have = {k: list(v.shape) for k, v in _own_tensors(module).items()}
        key = next(k for k in shapes if shapes[k] != have[k])
        raise ValueError(f"{label} ({type(module).__name__}) holds {key} of shape {have[key]}, "
                         f"recorded as {shapes[key]}: only {RESIZABLE} layers can be resized")
    weight = next(iter(_own_tensors(module).values()))
    with torch.device(weight.device):
        resized = resize(module, label, shapes, weight.dtype)
    return resized.train(module.training)


def _conv(module: nn.Module, label: str, shapes: dict[str, list[int]],
          dtype: torch.dtype) -> nn.Module:
    out_channels, per_group, *kernel = shapes["weight"]
    if tuple(kernel) != tuple(module.kernel_size):
        raise ValueError(f"{label}: the recorded kernel {kernel} is not the network's "
                         f"{list(module.kernel_size)}")
    depthwise = module.groups > 1 and module.groups == module.in_channels == module.out_channels
    if depthwise:
        if per_group != 1:
            raise ValueError(f"{label}: a depthwise convolution recorded with {per_group} input "
                             "channels per group")
        groups = in_channels = out_channels
    else:
        groups, in_channels = module.groups, per_group * module.groups
        if out_channels % groups:
            raise ValueError(f"{label}: {out_channels} output channels do not split into its "
                             f"{groups} groups")
    return type(module)(in_channels, out_channels, module.kernel_size, module.stride,
                        module.padding, module.dilation, groups, module.bias is not None,
                        module.padding_mode, dtype=dtype)


def _linear(module: nn.Module, label: str, shapes: dict[str, list[int]],
            dtype: torch.dtype) -> nn.Module:
    out_features, in_features = shapes["weight"]
    return type(module)(in_features, out_features, module.bias is not None, dtype=dtype)


def _batch_norm(module: nn.Module, label: str, shapes: dict[str, list[int]],
                dtype: torch.dtype) -> nn.Module:
    widths = {tuple(shape) for key, shape in shapes.items() if key != "num_batches_tracked"}
    if len(widths) != 1 or len(next(iter(widths))) != 1:
        raise ValueError(f"{label}: the recorded BatchNorm tensors disagree: {shapes}")
    (features,), = widths
    return type(module)(features, module.eps, module.momentum, module.affine,
                        module.track_running_stats, dtype=dtype)


def _layer_norm(module: nn.Module, label: str, shapes: dict[str, list[int]],
                dtype: torch.dtype) -> nn.Module:
    return nn.LayerNorm(shapes["weight"], module.eps, module.elementwise_affine,
                        module.bias is not None, dtype=dtype)


def _embedding(module: nn.Module, label: str, shapes: dict[str, list[int]],
               dtype: torch.dtype) -> nn.Module:
    rows, width = shapes["weight"]
    if rows != module.num_embeddings:
        raise ValueError(f"{label}: the recorded vocabulary of {rows} is not the network's "
                         f"{module.num_embeddings}")
    return nn.Embedding(rows, width, module.padding_idx, module.max_norm, module.norm_type,
                        module.scale_grad_by_freq, module.sparse, dtype=dtype)


# The layer types resized_to rebuilds at another width: exact types, since a subclass may take
# other arguments or hold widths of its own (attention's out_proj is a plain Linear's twin).
RESIZERS = {nn.Conv1d: _conv, nn.Conv2d: _conv, nn.Linear: _linear,
            nn.modules.linear.NonDynamicallyQuantizableLinear: _linear,
            nn.BatchNorm1d: _batch_norm, nn.BatchNorm2d: _batch_norm,
            nn.LayerNorm: _layer_norm, nn.Embedding: _embedding}
RESIZABLE = "Conv1d, Conv2d, Linear, BatchNorm1d, BatchNorm2d, LayerNorm and Embedding"
