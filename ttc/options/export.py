"""The export stage's flags: the ONNX opset, and how closely ONNX Runtime must match PyTorch."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, positive

# --validate_atol's default, and the networks that need a looser one: EfficientNet-B0's float32
# rounding differs between PyTorch and ONNX Runtime by 1.7e-4 on trained digits logits (top-1
# agreement 100%), above 1e-4, and every other network stays well under it.
VALIDATE_ATOL = 1e-4
VALIDATE_ATOL_FOR_ARCH = {"efficientnet_b0": 1e-3}


@dataclass
class ExportFlags:
    opset: int = opt(18, "ONNX opset version", "export", type=int, scripts="PE")
    validate_atol: float | None = opt(None, "largest allowed absolute difference between ONNX "
                                      "Runtime and PyTorch outputs on held-out samples; above "
                                      "it the export fails (exit 4) (default: 1e-4; 1e-3 for "
                                      "efficientnet_b0, whose float32 rounding over 80 layers "
                                      "passes 1e-4)", "export", type=float, metavar="ATOL",
                                      scripts="PE")

    iou_threshold: float = opt(0.5, "object_detector: NMS in the graph suppresses a box whose "
                               "IoU with a better-scored box of its class is above this",
                               "export", type=float, metavar="IOU", scripts="PTE")
    score_threshold: float = opt(0.05, "object_detector: the graph keeps only boxes scored "
                                 "above this (low, as COCO's mAP wants; filter higher in "
                                 "inference.py's output)", "export", type=float,
                                 metavar="SCORE", scripts="PTE")
    max_detections: int = opt(100, "object_detector: the graph's detections per image, padded "
                              "(the best by score)", "export", type=int, metavar="N",
                              scripts="PTE")

    def check_export(self) -> None:
        for name in ("iou_threshold", "score_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                bad(name, getattr(self, name), "use a value from 0 to 1")
        if not 1 <= self.max_detections <= 10_000:
            bad("max_detections", self.max_detections, "use 1 to 10000 (100 is COCO's)")
        if not 7 <= self.opset <= 23:
            bad("opset", self.opset, "use an opset between 7 and 23 (18 is the default)")
        if self.validate_atol is not None:
            positive("validate_atol", self.validate_atol)
