"""The shape of one model type's entry: plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One model type. The stages read it instead of testing the type's name. It also knows its
    preprocessing record (the manifest's `preprocessing`, plain data): what graph input that
    record implies, and which of its sizes the report and a --model_def factory are given. The
    functions that do its work on data (data reader, row encoder, network builders) stay in
    their modules, in tables keyed by `kind`, so that this package imports nothing of theirs."""

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

    def graph_input(self, preprocessing: dict) -> dict:
        """The graph input the manifest promises (its `input`), with the axes that are dynamic."""
        raise NotImplementedError(self.name)

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        """The input's dimensions after the batch that the record fixes, which a bundle's graph
        must have (checked when it loads); none where they vary (a text's length)."""
        return []

    def report_sizes(self, preprocessing: dict) -> dict:
        """The input's sizes the report's data section shows."""
        raise NotImplementedError(self.name)

    def factory_sizes(self, preprocessing: dict) -> dict:
        """The sizes a --model_def factory builds its network from (beside the graph input)."""
        raise NotImplementedError(self.name)
