"""Test-time training's flags: bn or tent, episodic or online, and their step sizes; and which
networks have no BatchNorm for `--ttt_method bn` to re-estimate."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, parse_bool, positive
from ttc.options.training import is_hf_arch
from utils import ConfigError

# Networks without BatchNorm, and what they normalise with instead: `--ttt_method bn`
# (BatchNorm statistics) has nothing to adapt in them; tent adapts that normalisation's affine
# parameters (ttt.py), on model.onnx itself.
ARCHS_WITHOUT_BATCHNORM = {"transformer": "LayerNorm"}


def norm_without_batchnorm(arch: str | None) -> str | None:
    """What an --arch normalises with when it has no BatchNorm (None: it has BatchNorm, or is
    not known here)."""
    return "LayerNorm" if is_hf_arch(arch) else ARCHS_WITHOUT_BATCHNORM.get(arch or "")


def no_batchnorm_error(arch: str) -> ConfigError:
    norm = norm_without_batchnorm(arch)
    return ConfigError(f"--ttt_method bn re-estimates BatchNorm statistics, and --arch {arch} "
                       f"has none (its normalisation is {norm})",
                       f"use --ttt_method tent, which adapts the {norm} affine parameters")


@dataclass
class TTTFlags:
    ttt: bool = opt(False, "test-time training on the ONNX model: adapt its normalisation "
                    "layers (BatchNorm; LayerNorm for tent) to each test batch of --batch_size "
                    "samples", "ttc", type=parse_bool, metavar="BOOL",
                        scripts="PIS")
    ttt_method: str = opt("bn", "bn: re-estimate BatchNorm statistics (ONNX Runtime only); "
                          "tent: also minimise prediction entropy over the BatchNorm affine "
                          "parameters, or LayerNorm/GroupNorm's in a network without BatchNorm "
                          "(PyTorch); all: both, side by side", "ttc",
                          choices=("bn", "tent", "all"), scripts="PIS")
    ttt_mode: str = opt("episodic", "episodic: every batch starts from the bundle's parameters; "
                        "online: adaptation carries over from batch to batch", "ttc",
                        choices=("episodic", "online"), scripts="PIS")
    ttt_reset_every: int = opt(0, "online mode: back to the bundle's parameters every N batches "
                               "(0: only when the collapse guard fires)", "ttc", type=int,
                               metavar="N", scripts="PIS")
    ttt_bn_prior: float = opt(0.0, "bn: weight of the stored statistics, in samples: a batch of "
                              "n uses n/(n+N) of its own statistics (0: batch statistics only)",
                              "ttc", type=float, metavar="N", scripts="PIS")
    ttt_iterations: int = opt(1, "tent: Adam steps per test batch", "ttc", type=int, metavar="N",
        scripts="PIS")
    ttt_learning_rate: float = opt(1e-3, "tent: Adam learning rate", "ttc", type=float,
                                   metavar="LR", scripts="PIS")
    ttt_guard: str = opt("filter", "a label-free test on each batch's class mix (the unadapted "
                         "model's predictions) that catches correlated batches (label-sorted "
                         "streams, one customer's or camera's rows) and collapse. reset: such a "
                         "batch is predicted by the unadapted model and online adaptation "
                         "restarts from the bundle's parameters; filter: such a batch is not "
                         "adapted to and online adaptation keeps what it had (tent also leaves "
                         "high-entropy samples out of its loss); none: no test",
                         "ttc", choices=("none", "reset", "filter"), scripts="PIS")
    ttt_predict: str = opt("after", "tent: after: predict with the parameters after the batch's "
                           "steps (one more forward pass); before: predict from the forward pass "
                           "of the last step, before its update, as tent.py returns it (no extra "
                           "pass)", "ttc", choices=("after", "before"), scripts="PIS")

    def check_steps(self) -> None:
        """tent's step count and learning rate (checked with --iterative's counts)."""
        for name in ("ttt_iterations", "ttt_learning_rate"):
            positive(name, getattr(self, name))

    def check_ttt(self) -> None:
        if self.ttt_bn_prior < 0:
            bad("ttt_bn_prior", self.ttt_bn_prior, "use 0 (batch statistics only) or a sample "
                "count such as 16")
        if self.ttt_reset_every < 0:
            bad("ttt_reset_every", self.ttt_reset_every, "use 0 (never) or a batch count")

    def check_network(self, arch: str | None, batch_size: int) -> None:
        """bn needs BatchNorm in --arch; adapting needs batches of two samples or more."""
        if self.ttt and self.ttt_method == "bn" and norm_without_batchnorm(arch):
            raise no_batchnorm_error(arch or "")
        if self.ttt and batch_size < 2:
            bad("batch_size", batch_size, "test-time training adapts to batches: use 2 or "
                "more (64 is the default)")

    def adapts_online(self) -> bool:
        """--ttt with --ttt_mode online: adaptation carried over in input order."""
        return self.ttt and self.ttt_mode == "online"
