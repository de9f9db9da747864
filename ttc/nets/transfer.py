"""Start a network from weights it did not train: `--init_weights PATH` (a state dict from a
.safetensors file or a torch file read with weights_only=True) and `--pretrained` (torchvision's
ImageNet weights from the local torch hub cache; this tool never downloads).

Tensors load where name and shape match. Names are aligned first: the file's keys and the
network's may differ by one leading prefix (`module.` from DataParallel, `body.` around a
torchvision network, `net.`, `model.`), and the alignment that matches the most tensors wins.
A classifier head for another class count does not match by shape and keeps its fresh
initialisation. The data statistics a network normalises with (`mean`, `std`, `median`) always
come from this run's data. Importing this module imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ttc.nets.models import IDENTITY_STATISTICS, TorchFileError, load_torch_file, weights_error
from utils import ConfigError, DataError, sha256_of

# Buffers that hold this run's data statistics, not learned weights: never overwritten.
DATA_STATISTICS = tuple(IDENTITY_STATISTICS)
PREFIXES = ("", "module.", "body.", "net.", "model.", "module.body.")
SHOWN = 10  # keys listed per kind in the report


@dataclass
class Transfer:
    """What loading a weight file did: the report's `train.init_weights` section."""

    source: str
    sha256: str
    tensors_in_file: int
    loaded: list[str] = field(default_factory=list)  # the network's keys that took a tensor
    skipped: list[str] = field(default_factory=list)  # file keys not used (name or shape)
    missing: list[str] = field(default_factory=list)  # network keys left as initialised
    notes: list[str] = field(default_factory=list)

    def report_section(self) -> dict:
        return {"source": self.source, "sha256": self.sha256,
                "tensors_in_file": self.tensors_in_file, "loaded": len(self.loaded),
                "skipped": len(self.skipped), "missing": len(self.missing),
                "skipped_keys": self.skipped[:SHOWN], "missing_keys": self.missing[:SHOWN],
                "notes": self.notes}


def read_state_dict(path: Path, hint: str = "pass a .safetensors file or a torch state dict "
                    "(torch.save(model.state_dict(), PATH))") -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, or of a torch file (a state dict, or a checkpoint
    holding one under `state_dict`/`model`), never unpickling code; `hint` says what to do
    when the file cannot be read."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = load_torch_file(path)
    except TorchFileError as err:
        raise DataError(f"cannot read weights {path}: {err}", hint) from None
    except Exception as err:  # noqa: BLE001 - any failure: not a weight file we can read
        raise DataError(f"cannot read weights {path}: {weights_error(err)}", hint) from None
    if isinstance(state, dict):
        for key in ("state_dict", "model"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and torch.is_tensor(v)} \
        if isinstance(state, dict) else {}
    if not tensors:
        raise DataError(f"{path} holds no tensors by name (a state dict is expected)",
                        "save the weights with torch.save(model.state_dict(), PATH) or as "
                        ".safetensors")
    return tensors


def _aligned(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
             strip: str, add: str) -> dict[str, str]:
    """file key → network key for one prefix alignment, where name and shape match."""
    pairs = {}
    for key, tensor in source.items():
        if not key.startswith(strip):
            continue
        name = add + key[len(strip):]
        if name in target and target[name].shape == tensor.shape:
            pairs[key] = name
    return pairs


def match_tensors(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]
                  ) -> dict[str, str]:
    """The prefix alignment that matches the most tensors by name and shape."""
    best: dict[str, str] = {}
    for strip in PREFIXES:
        for add in PREFIXES:
            pairs = _aligned(source, target, strip, add)
            if len(pairs) > len(best):
                best = pairs
    return best


def learned_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """The network's state without its data-statistics buffers."""
    return {k: v for k, v in net.state_dict().items() if k not in DATA_STATISTICS}


def load_matching(net: nn.Module, source: dict[str, torch.Tensor], origin: str,
                  digest: str) -> Transfer:
    """Copy every tensor of `source` that matches `net` by name and shape into it."""
    target = learned_state(net)
    pairs = match_tensors(source, target)
    transfer = Transfer(origin, digest, len(source))
    if not pairs:
        raise DataError(f"none of the {len(source)} tensors in {origin} matches the network by "
                        f"name and shape (the file's keys look like {_examples(source)}; the "
                        f"network's like {_examples(target)})",
                        "pass weights saved from the same architecture (--arch, --model_def)")
    with torch.no_grad():
        for key, name in pairs.items():
            target[name].copy_(source[key].to(target[name].dtype))
    transfer.loaded = sorted(pairs.values())
    transfer.skipped = sorted(set(source) - set(pairs))
    transfer.missing = sorted(set(target) - set(pairs.values()))
    return transfer


def _examples(state: dict[str, torch.Tensor]) -> str:
    keys = list(state)[:3]
    return ", ".join(f"{k} {list(state[k].shape)}" for k in keys) + (" ..." if len(state) > 3
                                                                     else "")


def init_from_file(net: nn.Module, path: Path) -> Transfer:
    """--init_weights PATH."""
    transfer = load_matching(net, read_state_dict(path), str(path), sha256_of(path))
    _note_head(transfer, net)
    return transfer


def _note_head(transfer: Transfer, net: nn.Module) -> None:
    """Say so when the classifier head kept its fresh initialisation."""
    head = head_name(net)
    if head is not None and f"{head}.weight" in transfer.missing:
        transfer.notes.append(f"the classifier head ({head}) did not match (another class "
                              "count?) and keeps its fresh initialisation")


# ----------------------------------------------------------------------------- --pretrained


def pretrained_file(arch: str) -> tuple[Path, str]:
    """Where torch hub keeps the ImageNet weights of a torchvision `arch`, and their URL."""
    from torchvision.models import get_model_weights

    weights = get_model_weights(arch).IMAGENET1K_V1
    checkpoints = Path(torch.hub.get_dir()) / "checkpoints"
    return checkpoints / Path(weights.url).name, weights.url


def require_hub_file(path: Path, url: str, arch: str, what: str) -> Path:
    """`path` (a file of the torch hub cache), or one DataError line (exit 3) naming `what` it
    holds, the file, and where to put it: this tool never downloads. Checked before training."""
    if not path.is_file():
        raise DataError(f"--pretrained {arch}: {what} not in the torch hub cache ({path}); "
                        "this tool does not download",
                        f"put {url} there (or set TORCH_HOME to the folder whose "
                        "hub/checkpoints holds it)")
    return path


def require_pretrained_file(arch: str) -> Path:
    return require_hub_file(*pretrained_file(arch), arch, "the ImageNet weights are")


def init_from_pretrained(net: nn.Module, arch: str) -> Transfer:
    """--pretrained: torchvision's ImageNet weights into the network's `body`. A grayscale
    network takes the first conv's weights summed over the RGB channels (gray = R = G = B)."""
    path = require_pretrained_file(arch)
    source = read_state_dict(path, f"the torch hub cache's copy is damaged: delete {path} and "
                             f"put the file from {pretrained_file(arch)[1]} there again")
    target = learned_state(net)
    notes = []
    for key, tensor in source.items():
        name = "body." + key
        if name in target and tensor.dim() == 4 and tensor.shape[1] == 3 and \
                target[name].shape[1] == 1 and target[name].shape[2:] == tensor.shape[2:]:
            source[key] = tensor.sum(dim=1, keepdim=True)
            notes.append(f"{key}: the RGB filters summed for one input channel")
    transfer = load_matching(net, source, f"torchvision {arch} IMAGENET1K_V1 ({path})",
                             sha256_of(path))
    transfer.notes += notes
    _note_head(transfer, net)
    return transfer


def head_name(net: nn.Module) -> str | None:
    """The classifier head: the network's last nn.Linear by registration order (every
    architecture here, and torchvision's, ends in one); None without any."""
    names = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    return names[-1] if names else None


def head_parameters(net: nn.Module) -> list[nn.Parameter]:
    """The parameters --freeze_epochs trains alone."""
    name = head_name(net)
    if name is None:
        raise ConfigError("--freeze_epochs trains the classifier head alone, and this network "
                          "has no nn.Linear layer to take as the head",
                          "end the network in an nn.Linear, or drop --freeze_epochs")
    return list(net.get_submodule(name).parameters())
