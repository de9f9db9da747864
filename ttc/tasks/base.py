"""The shape of one model type's entry: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One model type. The stages read it instead of testing the type's name; the functions
    that do its work (data reader, row encoder, network builders) stay in their modules, in
    tables keyed by `kind`, so that this package imports nothing of theirs."""

    name: str  # --model_type, the manifest's model_type
    kind: str  # the manifest's preprocessing.kind
    archs: tuple[str, ...]  # --arch names, the default first (models.ARCHITECTURES builds each)
    builtins: tuple[str, ...] = ()  # builtin: data sets of this type
    input_role: str = "feature"  # what its table inputs are: "image", "text" or "feature" columns
    input_field: str = "features"  # the DSPy program's input field (text programs take the text)
    image_files: bool = False  # inputs are image files: read from folders (which give the splits,
    # never --val_path/--test_path), decoded within --max_image_memory_mb
    reads_lines: bool = False  # --input - (one input per line of stdin)
    augments: bool = False  # --train_augment applies
    hf_archs: bool = False  # --arch hf:NAME (a Hugging Face model) is one of its networks
    teacher: bool = False  # --teacher (an LLM labelling its texts) applies
    missing_values: bool = False  # NaN is a value (a missing feature), not a bad input

    @property
    def default_arch(self) -> str:
        return self.archs[0]
