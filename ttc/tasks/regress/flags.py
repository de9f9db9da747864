"""What a regressor's test-time flags may ask for, checked before any work (exit 2). No torch.
A regressor takes --iterative mc_dropout or ensemble (the passes' or the --ensemble_size
members' spread as a nominal interval), --ttt with --ttt_method bn (BatchNorm statistics
re-estimated per batch) and, for a table, --tta (feature noise views, their predictions
averaged); not the rest (testtime.py says why each is)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from utils import ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import FlagCheckOptions

HINT = "docs/regression.md lists the test-time methods a regressor takes"


def check_tabular_regressor_flags(options: FlagCheckOptions) -> None:
    _check_common(options)


def check_text_regressor_flags(options: FlagCheckOptions) -> None:
    if getattr(options, "tta", False):
        raise ConfigError("--tta does not apply to a text_regressor yet: its views (token "
                          "dropout) are a text classifier's and were not measured on a number",
                          f"drop --tta ({HINT})")
    _check_common(options)


def _check_common(options: FlagCheckOptions) -> None:
    if getattr(options, "eval_shift", None):
        raise ConfigError("--eval_shift does not apply to a regressor yet: its corruptions are "
                          "scored by classification calibration", f"drop --eval_shift ({HINT})")
    iterative = getattr(options, "iterative", "none")
    if iterative not in ("none", "mc_dropout", "ensemble"):
        raise ConfigError(f"--iterative {iterative} does not apply to a regressor: only "
                          "mc_dropout and ensemble (their spread) are measured on a number",
                          f"use --iterative mc_dropout or ensemble ({HINT})")
    if getattr(options, "ttt", False) and getattr(options, "ttt_method", "bn") != "bn":
        raise ConfigError(f"--ttt_method {options.ttt_method} does not apply to a regressor: "
                          "tent minimises the entropy of class probabilities, and a regressor "
                          "predicts a number", f"use --ttt_method bn ({HINT})")
    if getattr(options, "ttt", False) and getattr(options, "ttt_mode", "episodic") != "episodic":
        raise ConfigError("--ttt_mode online does not apply to a regressor yet: its batches "
                          "are adapted one at a time (episodic)", f"drop --ttt_mode ({HINT})")
