"""The distribution-shift evaluation's flags: the corruptions of --eval_shift and their
severity (calibration, TTT and iterative inference are also measured on them)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt
from utils import ConfigError


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
    eval_stream: str | None = opt(None, "with --ttt: also run test-time training over the test "
                                  "split (and each --eval_shift copy) as a stream in this order, "
                                  "--stream_passes times, with and without --ttt_guard. "
                                  "shuffled; label_sorted (class by class); dirichlet:ALPHA "
                                  "(each class spread over the stream's batches in Dirichlet("
                                  "ALPHA) shares: small ALPHA, few classes per batch)", "ttc",
                                  metavar="ORDER", scripts="PI")
    stream_passes: int = opt(3, "--eval_stream: passes over the stream (online adaptation goes "
                             "on from pass to pass)", "ttc", type=int, metavar="N", scripts="PI")

    def check_stream(self, ttt: bool) -> None:
        """--eval_stream's order is known and comes with --ttt; the pass count is positive."""
        if self.eval_stream is None:
            return
        from ttc.inputs.shifts import parse_stream_order  # numpy: not at --help

        parse_stream_order(self.eval_stream)
        if not ttt:
            raise ConfigError("--eval_stream measures test-time training on a stream, and --ttt "
                              "is off", "add --ttt true, or leave out --eval_stream")
        if self.stream_passes < 1:
            bad("stream_passes", self.stream_passes, "use 1 or more (3 shows a collapse)")

    def shift_names(self, kind: str) -> list[str]:
        """--eval_shift's corruptions for a model of preprocessing `kind` (image, text,
        tabular); ConfigError for one that kind has not."""
        from ttc.inputs.shifts import parse_shift_names

        return parse_shift_names(self.eval_shift, kind)
