"""How the weights are fitted, beyond the learning rate: each network's regularisation defaults
(its paper's, or ours where measured: ttc/tasks holds them, docs/networks.md says where each
comes from) and the flags that override them, early stopping, and the learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ttc.options.fields import bad, opt
from ttc.tasks.base import Regularisation
from ttc.tasks.registry import TASKS, find_task
from utils import ConfigError

# A --model_def network: its dropout is its own; the weight decay the tool always used.
USER_NETWORK = Regularisation(None, 1e-4, source="your module's own dropout")
REGULARISED = ("dropout", "weight_decay", "label_smoothing", "max_norm")
# Early stopping's default, measured (docs/benchmarks.md, bench/regularisation.py).
PATIENCE = 5


def _defaults_text(name: str) -> str:
    """'bag 0.3, cnn 0.5, the others 0.2': each network's default for one setting, for --help
    (a value three or more networks share said once)."""
    seen = {}
    for task in TASKS:
        for arch, values in task.regularisation.items():
            value = getattr(values, name)
            if value is not None:
                seen[f"{arch}:" if arch == "hf" else arch] = f"{value:g}"
    common = max(set(seen.values()), key=list(seen.values()).count, default=None)
    if list(seen.values()).count(common) < 3:
        return ", ".join(f"{arch} {value}" for arch, value in seen.items())
    return ", ".join([f"{arch} {value}" for arch, value in seen.items() if value != common]
                     + [f"the others {common}"])


@dataclass(frozen=True)
class Recipe:
    """What the trainer needs of these flags (it never sees the config)."""

    weight_decay: float
    label_smoothing: float = 0.0
    max_norm: float | None = None
    patience: int = 0
    lr_schedule: str = "auto"


@dataclass
class FittingFlags:
    dropout: float | None = opt(
        None, "dropout rate of the network's Dropout layers (default: the network's: "
        f"{_defaults_text('dropout')}); torchvision, hf: and --model_def networks keep their "
        "own", "training", type=float, metavar="P", scripts="PT")
    weight_decay: float | None = opt(
        None, f"AdamW weight decay (default: the network's: {_defaults_text('weight_decay')}; "
        f"--model_def {USER_NETWORK.weight_decay:g})", "training", type=float, metavar="WD",
        scripts="PT")
    label_smoothing: float | None = opt(
        None, "label smoothing of the training loss, in [0, 1) (default: 0)", "training",
        type=float, metavar="EPS", scripts="PT")
    max_norm: float | None = opt(
        None, "bound on the L2 norm of each row of the output layer's weights (the last "
        "nn.Linear), restored after every step as in Kim 2014; 0: none (default: the "
        f"network's: {_defaults_text('max_norm')}; none for the others)", "training",
        type=float, metavar="C", scripts="PT")
    patience: int = opt(
        PATIENCE, "early stopping: stop when neither the validation loss nor the validation "
        "accuracy has improved for N epochs; the best epoch (validation accuracy) is kept "
        "either way; 0: train every epoch", "training", type=int, metavar="N", scripts="PT")
    lr_schedule: str = opt(
        "auto", "auto: linear warm-up over the first 5 percent of the optimizer steps (the first "
        "step at the peak over that many), the peak, then linear decay to 0 over the last 20 "
        "percent; for "
        "hf: archs linear warm-up over a tenth, then decay; one_cycle: PyTorch's OneCycleLR "
        "(30 percent warm-up from peak/25, cosine decay to peak/2.5e5), the earlier default",
        "training", choices=("auto", "one_cycle"), scripts="PT")

    def check_fitting(self, model_type: str, arch: str | None, model_def: str | None) -> None:
        """The regularisation flags not given take the network's defaults; given ones must be
        in range and must apply to the network."""
        defaults = network_regularisation(model_type, arch, model_def)
        if self.dropout is not None and defaults.dropout is None:
            raise ConfigError(f"--dropout sets the dropout of the tool's own networks, and "
                              f"{_network_name(arch, model_def)} keeps its own",
                              "drop --dropout (set it in the network itself)")
        filled = {name: getattr(defaults, name) for name in REGULARISED
                  if getattr(self, name) is None}
        for name, value in filled.items():
            setattr(self, name, value)
        self.network_defaults = filled  # shown without a * in the configuration summary
        if self.dropout is not None and not 0 <= self.dropout < 1:
            bad("dropout", self.dropout, "use a rate in [0, 1), e.g. 0.5")
        if self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, "use 0 or a small positive number like 1e-4")
        if not 0 <= self.label_smoothing < 1:
            bad("label_smoothing", self.label_smoothing, "use a value in [0, 1), e.g. 0.1")
        if self.max_norm is not None and self.max_norm < 0:
            bad("max_norm", self.max_norm, "use a positive bound like 3, or 0 for none")
        if self.patience < 0:
            bad("patience", self.patience, "use 0 (train every epoch) or a number of epochs")

    def regularisation(self, model_type: str, arch: str | None,
                       model_def: str | None) -> Regularisation:
        """The network's defaults with the flags given over them (check_fitting has filled
        the rest; a Config built in code and never validated gets the defaults here)."""
        defaults = network_regularisation(model_type, arch, model_def)
        given = {name: getattr(self, name) for name in REGULARISED
                 if getattr(self, name) is not None}
        return replace(defaults, **given)

    def recipe(self, model_type: str, arch: str | None, model_def: str | None) -> Recipe:
        chosen = self.regularisation(model_type, arch, model_def)
        return Recipe(weight_decay=chosen.weight_decay, label_smoothing=chosen.label_smoothing,
                      max_norm=chosen.max_norm or None, patience=self.patience,
                      lr_schedule=self.lr_schedule)


def network_regularisation(model_type: str, arch: str | None,
                           model_def: str | None) -> Regularisation:
    """The defaults of the network these flags name (--arch's, its type's default, or yours)."""
    task = find_task(model_type)
    if model_def or task is None:
        return USER_NETWORK
    chosen = arch or task.default_arch
    from ttc.inputs.preprocess import hf_source  # numpy: not at --help

    return task.regularisation.get("hf" if hf_source(chosen) else chosen, USER_NETWORK)


def _network_name(arch: str | None, model_def: str | None) -> str:
    return f"--model_def {model_def}" if model_def else f"--arch {arch}"
