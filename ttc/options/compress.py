"""The compression stage's flags: structured channel pruning (--prune) and quantization-aware
training (--qat), run on the trained network before export. Each compressed variant is judged
by the same gate as int8 (--max_accuracy_drop, speed at --batch_size)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, parse_bool
from ttc.options.training import is_hf_arch

IMPORTANCES = ("l2", "taylor")
# Fine-tuning after a pruning step or under fake quantization runs at this fraction of the
# training learning rate: the weights are already trained, a full rate undoes them.
FINE_TUNE_RATE = 0.1


@dataclass
class CompressFlags:
    qat: bool = opt(False, "quantization-aware training: after training, fine-tune with fake "
                    "quantization (int8 per-channel weights, uint8 activations) and export a "
                    "QDQ int8 graph (model.qat.onnx; with --prune also model.pruned_qat.onnx), "
                    "judged like int8", "compression", type=parse_bool, metavar="BOOL",
                    scripts="PT")
    qat_epochs: int = opt(3, "epochs of quantization-aware fine-tuning", "compression",
                          type=int, metavar="N", scripts="PT")
    prune: float = opt(0.0, "structured pruning: remove this fraction of the prunable channels "
                       "(0 < RATIO < 1; 0: off) with Torch-Pruning, so the exported graph "
                       "(model.pruned.onnx) is a smaller dense network", "compression",
                       type=float, metavar="RATIO", scripts="PT")
    prune_steps: int = opt(2, "pruning steps, each followed by --prune_epochs of fine-tuning",
                           "compression", type=int, metavar="N", scripts="PT")
    prune_epochs: int = opt(1, "fine-tuning epochs after each pruning step", "compression",
                            type=int, metavar="N", scripts="PT")
    prune_importance: str = opt("l2", "which channels go first: l2 (smallest weight norm) or "
                                "taylor (smallest first-order loss change, from gradients on "
                                "training batches)", "compression", choices=IMPORTANCES,
                                scripts="PT")

    def check_compress(self, arch: str | None) -> None:
        """Values, and the networks with no path (before any data is read)."""
        if not 0 <= self.prune < 1:
            bad("prune", self.prune, "use a fraction of the channels between 0 and 1, e.g. 0.4 "
                "(0: no pruning)")
        if self.prune_steps < 1:
            bad("prune_steps", self.prune_steps, "use 1 or more steps")
        if self.prune_epochs < 0:
            bad("prune_epochs", self.prune_epochs, "use 0 or more epochs")
        if self.qat_epochs < 1:
            bad("qat_epochs", self.qat_epochs, "use 1 or more epochs")
        if self.qat and is_hf_arch(arch):
            bad("qat", "true", "a Hugging Face transformer (--arch hf:...) has no "
                "quantization-aware training path here; use post-training --quantize dynamic "
                "(its MatMul and Attention in int8)")
        if self.prune and is_hf_arch(arch):
            bad("prune", self.prune, "a Hugging Face transformer (--arch hf:...) is not pruned "
                "here (its attention heads are not channels); drop --prune, or use --quantize "
                "dynamic")

    def compresses(self) -> bool:
        return self.qat or self.prune > 0

    def compress_recipes(self) -> list[tuple[str, dict]]:
        """(variant name, its recipe), in the order they are made: pruned, qat, pruned_qat."""
        pruning = {"prune_ratio": self.prune, "prune_steps": self.prune_steps,
                   "prune_epochs": self.prune_epochs, "importance": self.prune_importance}
        qat = {"qat_epochs": self.qat_epochs}
        recipes = []
        if self.prune:
            recipes.append(("pruned", pruning))
        if self.qat:
            recipes.append(("qat", qat))
        if self.prune and self.qat:
            recipes.append(("pruned_qat", {**pruning, **qat}))
        return recipes
