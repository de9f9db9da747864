"""Test-time augmentation's flags: the views, how their probabilities merge, and the adaptive
threshold. (Parsing --tta_transforms needs ttc/testtime/tta.py: Config.validate_tta.)"""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, parse_bool


@dataclass
class TTAFlags:
    tta: bool = opt(False, "test-time augmentation on the ONNX model (and, unless "
                    "--train_augment false, training on the same transforms); for an "
                    "image_segmenter, export.py and pipeline.py write its TTA graph "
                    "(model.tta.onnx) and inference compares it with the plain one", "ttc",
                    type=parse_bool, metavar="BOOL", scripts="PTEIS")
    tta_transforms: str = opt("", "comma-separated TTA transforms, name or name:param. image: "
                              "identity, hflip (flip), vflip, rot90, rot180, rot270, rotate:DEG, "
                              "shift:PX, crop:FRACTION, scale:FACTOR, brightness:DELTA, "
                              "contrast:FACTOR; text: token_dropout:P, window:N; tabular: "
                              "jitter:SIGMA (default: shift:1, token_dropout:0.1, jitter:0.1); "
                              "segmenters and detectors: identity, hflip, vflip, rot90, rot180, "
                              "rot270, shift:PX, scale:F[,F...], brightness:DELTA, "
                              "contrast:FACTOR (default hflip). Classifiers: auto chooses the "
                              "views and the merge on the calibration slice (greedy policy "
                              "search; the report's tta.policy), auto:LIST only among LIST",
                              "ttc", metavar="LIST", scripts="PTEIS")
    tta_merge: str = opt("mean", "how the views' probabilities are combined (with "
                         "--tta_transforms auto, mean lets the search also try gmean and "
                         "tsharpen; another merge is kept)", "ttc",
                         choices=("mean", "gmean", "max", "vote", "tsharpen"), scripts="PIS")
    tta_plan: str = opt("auto", "how the views run: graph (every view of a batch in one "
                        "session.run, views and merge inside the ONNX graph where the transforms "
                        "allow), loop (one session.run per view, merged by numpy), or auto (both "
                        "timed on one batch at load, the faster kept; the report's tta.plan)",
                        "ttc", choices=("auto", "graph", "loop"), scripts="PIS")
    tta_threshold: float | None = opt(None, "adaptive TTA: extra views only for samples whose "
                                      "plain top probability is below this", "ttc", type=float,
                                      metavar="P", scripts="PI")

    def check_tta(self) -> None:
        if self.tta_threshold is not None and not 0 < self.tta_threshold <= 1:
            bad("tta_threshold", self.tta_threshold, "use a probability in (0, 1]")
