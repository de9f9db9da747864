"""The distribution-shift evaluation's flags: the corruptions of --eval_shift and their
severity (calibration, TTT and iterative inference are also measured on them)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.inputs.shifts import parse_shift_names
from ttc.options.fields import opt


@dataclass
class ShiftFlags:
    eval_shift: str | None = opt(None, "also evaluate on corrupted copies of the test split: "
                                 "calibration (accuracy, ECE, NLL) without and with the "
                                 "temperature, and with --iterative and --ttt those methods too. "
                                 "image: gaussian_noise, contrast, blur, shift, "
                                 "brightness; text: unknown_tokens, token_deletion; tabular: "
                                 "feature_noise, feature_scale", "ttc",
                                 metavar="LIST", scripts="PI")
    shift_severity: int = opt(3, "severity of the --eval_shift corruptions, 1 to 5", "ttc",
                              type=int, choices=(1, 2, 3, 4, 5), scripts="PI")

    def shift_names(self, kind: str) -> list[str]:
        """--eval_shift's corruptions for a model of preprocessing `kind` (image, text,
        tabular); ConfigError for one that kind has not."""
        return parse_shift_names(self.eval_shift, kind)
