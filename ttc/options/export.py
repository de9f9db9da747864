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

    def check_export(self) -> None:
        if not 7 <= self.opset <= 23:
            bad("opset", self.opset, "use an opset between 7 and 23 (18 is the default)")
        if self.validate_atol is not None:
            positive("validate_atol", self.validate_atol)
