"""The data stage's flags: what to train on, how tables are read and split, and the bounds an
input may make the tool allocate (a text row's bytes, decoded images' memory)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.inputs.formats import FORMAT_NAMES
from ttc.options.fields import bad, opt, parse_image_size, positive
from ttc.tasks.registry import TASKS, builtin_datasets, find_task, model_types
from utils import ConfigError

MODEL_TYPES = model_types()  # ttc/tasks: one entry per model type, the default first
BUILTIN_DATASETS = builtin_datasets()
TABLE_FORMAT_NAMES = FORMAT_NAMES  # --dataset_format: the formats tables.py reads


@dataclass
class DataFlags:
    model_type: str = opt(MODEL_TYPES[0], "what to train", "data", choices=MODEL_TYPES,
        scripts="PT")
    dataset_path: str | None = opt(
        None, "images: builtin:digits, a folder ROOT/<class>/*.png (optionally with train/ val/ "
        "test/ subfolders), or a table of image paths and labels; text and tabular: a "
        "CSV/TSV/JSON/JSONL file, or builtin:iris, builtin:wine, builtin:breast_cancer",
        "data", metavar="PATH", scripts="PTEQI", help_for={
            letter: "the data the bundle was trained on, split as at training: required unless "
            "it was a builtin: data set (a path the bundle records is never read)"
            for letter in "EQI"})
    dataset_format: str | None = opt(None, "table format, overriding the file extension",
                                     "data", choices=TABLE_FORMAT_NAMES, scripts="PTI")
    has_header: str = opt("auto", "whether a CSV/TSV file's first row is a header; auto "
                          "detects it", "data", type=str.lower, choices=("auto", "true", "false"),
                              scripts="PT")
    label_column: str | None = opt(None, "label column (name or 0-based position; default: "
                                   "detected)", "data", metavar="COL", scripts="PTI")
    text_column: str | None = opt(None, "text column(s) for text_classifier, joined with a space "
                                  "when several, e.g. 1,2 or title,description (default: "
                                  "detected)", "data", metavar="COLS", scripts="PTI")
    feature_columns: str | None = opt(None, "feature columns for tabular_classifier, e.g. "
                                      "0,1,2 or age,income (default: all but the label)",
                                      "data", metavar="COLS", scripts="PTI")
    image_column: str | None = opt(None, "image-path column of a table of images (name or "
                                   "0-based position; default: detected)", "data",
                                   metavar="COL", scripts="PTI")
    val_path: str | None = opt(None, "a separate validation file (same columns); default: "
                               "split from the data", "data", metavar="PATH", scripts="PTEQI",
                               help_for={letter: "the bundle's separate validation file, "
                                         "required when it was trained with one"
                                         for letter in "EQI"})
    test_path: str | None = opt(None, "a separate test file (same columns); default: split "
                                "from the data", "data", metavar="PATH", scripts="PTEQI",
                                help_for={letter: "the bundle's separate test file, required "
                                          "when it was trained with one" for letter in "EQI"})
    image_size: tuple[int, int] | None = opt(
        None, "resize images to this size, e.g. 32 or 24,32 (height,width); default: the most "
        "common size in the data, capped at 64 pixels per side", "data", type=parse_image_size,
        metavar="SIZE", scripts="PT")
    channels: int | None = opt(None, "1 (grayscale) or 3 (RGB); default: 1 if every image is "
                               "grayscale, else 3", "data", type=int, choices=(1, 3), scripts="PT")
    ignore_index: int | None = opt(None, "image_segmenter: the mask value of void pixels, "
                                   "left out of the loss and the metrics (default 255, as "
                                   "Pascal VOC)", "data", type=int, metavar="INDEX",
                                   scripts="PT")
    annotations: str | None = opt(None, "object_detector: a COCO instances JSON for the images "
                                  "in --dataset_path (default: YOLO labels, "
                                  "ROOT/labels/*.txt)", "data", metavar="PATH",
                                  scripts="PTEQI")
    max_vocab: int = opt(20000, "text: vocabulary size (word unigrams and bigrams seen at least "
                         "twice in training, most frequent first)", "data", type=int, metavar="N",
                             scripts="PT")
    max_length: int = opt(256, "text: most token ids per text (unigrams, then bigrams)", "data",
                          type=int, metavar="N", scripts="PT")
    val_fraction: float = opt(0.15, "fraction of the data held out for validation (best-epoch "
                              "selection) when the dataset has no val split", "data", type=float,
                                  scripts="PT")
    test_fraction: float = opt(0.15, "fraction of the data held out for the final test when the "
                               "dataset has no test split", "data", type=float, scripts="PT")
    calibration_fraction: float = opt(
        0.1, "fraction of the training split set aside before training as the calibration "
        "slice: never trained on nor used to pick a candidate or an epoch, the temperature is "
        "fitted on it (docs/calibration.md); 0: no slice, no temperature", "data", type=float,
        scripts="PT")
    seed: int = opt(0, "seed for the split, initialisation, augmentation and shuffling", "data",
                    type=int, scripts="PTIS")
    max_row_bytes: int = opt(1048576, "the longest row of a text input (a CSV/TSV/JSONL line, a "
                             "text cell, a line of stdin) in bytes; a longer one is refused "
                             "(exit 3) before it is parsed", "data", type=int, metavar="N",
                             scripts="PTEQIS")
    max_image_memory_mb: int = opt(4096, "the most memory (MB) images decoded at a bundle's "
                                   "image size may take at once: a split evaluated whole is "
                                   "refused beyond it (exit 4), --input chunks shrink to fit",
                                   "data", type=int, metavar="MB", scripts="EQIS")

    def check_data(self) -> None:
        """The split fractions, the text encoder's sizes and the input bounds (the token-id
        cap comes after --max_runtime_memory_mb's check: check_text_length)."""
        for name in ("val_fraction", "test_fraction"):
            if not 0 < getattr(self, name) < 1:
                bad(name, getattr(self, name), "use a fraction between 0 and 1, e.g. 0.15")
        if not 0 <= self.calibration_fraction <= 0.5:
            bad("calibration_fraction", self.calibration_fraction,
                "use a fraction of the training split between 0 (no slice) and 0.5, e.g. 0.1")
        if self.val_fraction + self.test_fraction > 0.8:
            raise ConfigError(f"--val_fraction + --test_fraction = "
                              f"{self.val_fraction + self.test_fraction:g} leaves too little to "
                              "train on", "keep their sum at 0.8 or less")
        if self.max_vocab < 3:
            bad("max_vocab", self.max_vocab, "use at least 3 (padding, unknown and one word)")
        positive("max_length", self.max_length)
        for name in ("max_row_bytes", "max_image_memory_mb"):
            positive(name, getattr(self, name))
        self._check_ignore_index()

    def _check_ignore_index(self) -> None:
        if self.ignore_index is None:
            return
        task = find_task(self.model_type)
        if task is not None and not task.masks:
            takers = " or ".join(t.name for t in TASKS if t.masks)
            raise ConfigError(f"--ignore_index marks void mask pixels, and a {self.model_type} "
                              "has no masks", f"drop --ignore_index, or use --model_type {takers}")
        if not 0 <= self.ignore_index <= 255:
            bad("ignore_index", self.ignore_index, "masks hold 8-bit indices: use 0 to 255")

    def check_text_length(self) -> None:
        from ttc.inputs.limits import MAX_TEXT_LENGTH  # numpy: not at --help

        if self.max_length > MAX_TEXT_LENGTH:
            bad("max_length", self.max_length, f"use at most {MAX_TEXT_LENGTH} token ids (a "
                "bundle's manifest may not hold more)")

    def check_builtin(self, names_model_type: bool) -> None:
        """A builtin: data set exists, and fits --model_type where the script takes one (a
        bundle's script does not: its manifest says)."""
        if not (self.dataset_path and self.dataset_path.startswith("builtin:")):
            return
        if self.dataset_path not in BUILTIN_DATASETS:
            raise ConfigError(f"unknown built-in dataset {self.dataset_path!r}",
                              f"use one of: {', '.join(BUILTIN_DATASETS)}")
        if names_model_type and BUILTIN_DATASETS[self.dataset_path] != self.model_type:
            raise ConfigError(f"{self.dataset_path} is data for "
                              f"{BUILTIN_DATASETS[self.dataset_path]}, not {self.model_type}",
                              f"use --model_type {BUILTIN_DATASETS[self.dataset_path]}")

    def check_image_splits(self, names_model_type: bool) -> None:
        """Images take their splits from folders, never from --val_path / --test_path."""
        task = find_task(self.model_type)
        if (names_model_type and task is not None and not task.split_paths
                and (self.val_path or self.test_path)):
            raise ConfigError("--val_path and --test_path are for text and tabular tables; "
                              "images take their splits from folders",
                              "lay the images out as ROOT/train/<class>/, ROOT/val/<class>/ and "
                              "ROOT/test/<class>/ and pass --dataset_path ROOT")
