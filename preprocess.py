"""How inputs become model input, fit on the training split, stored in the bundle manifest, and
re-applied by this same code at inference: image decoding, the text tokenizer and the tabular
encoder. No torch here.
"""
from __future__ import annotations

import itertools
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from tables import IMAGE_EXTENSIONS, category_cells, numeric_cells

PAD_ID, UNK_ID = 0, 1
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_LONG_NUMBER = re.compile(r"^\d{5,}$")


# ----------------------------------------------------------------------------- images

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F", "P;L"}


def image_files(root: Path) -> Iterator[Path]:
    """The image files under `root` (or `root` itself), sorted, hidden files and folders left
    out: what training lists in a class folder and what inference reads from an input folder."""
    if root.is_file():
        yield root
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not any(
                part.startswith(".") for part in path.relative_to(root).parts):
            yield path


def decode_image_file(path: Path, preprocessing: dict) -> np.ndarray:
    """One image file → float32 (C, H, W) in [0, 1], exactly as the model was trained."""
    from PIL import Image, ImageOps

    height, width = preprocessing["image_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img) or img
            img = img.convert("L" if preprocessing["channels"] == 1 else "RGB")
            if img.size != (width, height):
                img = img.resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float32) / 255.0
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


# ----------------------------------------------------------------------------- text


@dataclass
class Tokenizer:
    """Lower-cased words and single symbols, plus word bigrams; ids 0 = padding, 1 = unknown.

    Numbers of 5+ digits (phone numbers, codes) share one token, since each is rare but together
    they carry signal. A text becomes its unigram ids followed by its known bigram ids, cut at
    `max_length`; an empty text becomes [UNK].
    """

    vocabulary: dict[str, int] = field(default_factory=dict)
    max_length: int = 256
    bigrams: bool = True
    min_count: int = 2

    @staticmethod
    def words(text: str) -> list[str]:
        tokens = _TOKEN.findall(text.lower())
        # len + isdecimal is _LONG_NUMBER (^\d{5,}$) without a regex call per token
        return ["<longnum>" if len(t) >= 5 and t.isdecimal() else t for t in tokens]

    def _grams(self, text: str) -> list[str]:
        words = self.words(text)
        if not self.bigrams:
            return words
        return words + [f"{a} {b}" for a, b in zip(words, words[1:])]

    @classmethod
    def fit(cls, texts: Iterable[str], max_vocab: int, max_length: int,
            bigrams: bool = True, min_count: int = 2) -> "Tokenizer":
        tokenizer = cls(max_length=max_length, bigrams=bigrams, min_count=min_count)
        counts = Counter(g for text in texts for g in tokenizer._grams(text))
        kept = sorted((g for g, c in counts.items() if c >= min_count),
                      key=lambda g: (-counts[g], g))[: max(0, max_vocab - 2)]
        tokenizer.vocabulary = {g: i + 2 for i, g in enumerate(kept)}
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary) + 2

    def encode(self, text: str) -> list[int]:
        words = self.words(text)
        get = self.vocabulary.get
        ids = [get(w, UNK_ID) for w in words]
        if self.bigrams:
            ids += [i for i in map(get, [a + " " + b for a, b in zip(words, words[1:])])
                    if i is not None]
        return ids[: self.max_length] or [UNK_ID]

    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        """int64 (N, longest) token ids, right-padded with 0."""
        rows = [self.encode(t) for t in texts]
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        out = np.zeros((len(rows), int(lengths.max(initial=1))), dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                           count=int(lengths.sum()))
        out[np.arange(out.shape[1]) < lengths[:, None]] = flat  # row-major, as the rows run
        return out

    def to_manifest(self) -> dict:
        return {"kind": "text", "lowercase": True, "tokens": _TOKEN.pattern,
                "long_numbers": "<longnum>", "bigrams": self.bigrams,
                "min_count": self.min_count, "max_length": self.max_length,
                "pad_id": PAD_ID, "unk_id": UNK_ID, "vocab_size": self.vocab_size,
                "vocabulary": sorted(self.vocabulary, key=self.vocabulary.get)}

    @classmethod
    def from_manifest(cls, spec: dict) -> "Tokenizer":
        return cls(vocabulary={g: i + 2 for i, g in enumerate(spec["vocabulary"])},
                   max_length=spec["max_length"], bigrams=spec["bigrams"],
                   min_count=spec["min_count"])


def trim_padding(ids: np.ndarray) -> np.ndarray:
    """Drop the all-padding columns at the right of a batch of token ids (at least one kept)."""
    used = np.flatnonzero((ids != PAD_ID).any(axis=0))
    return ids[:, : (used[-1] + 1 if len(used) else 1)]


# ----------------------------------------------------------------------------- tabular

MAX_CATEGORIES = 50


@dataclass
class TabularEncoder:
    """Numeric columns pass through (missing → NaN, imputed inside the graph with training
    medians); string columns are one-hot encoded with the training categories (an unseen or
    missing category → all zeros)."""

    columns: list[dict] = field(default_factory=list)  # {"name", "type", "categories"?}

    @classmethod
    def fit(cls, frame) -> "TabularEncoder":
        import pandas as pd

        columns = []
        for name in frame.columns:
            values = frame[name]
            present = values[values.notna() & (values.astype(str).str.strip() != "")]
            numeric = pd.to_numeric(present, errors="coerce")
            if len(present) == 0 or numeric.notna().mean() >= 0.95:
                columns.append({"name": str(name), "type": "numeric"})
            else:
                counts = present.astype(str).str.strip().value_counts()
                top = sorted(counts.index[:MAX_CATEGORIES])
                columns.append({"name": str(name), "type": "categorical", "categories": top})
        return cls(columns)

    @property
    def feature_names(self) -> list[str]:
        names = []
        for col in self.columns:
            if col["type"] == "numeric":
                names.append(col["name"])
            else:
                names += [f"{col['name']}={c}" for c in col["categories"]]
        return names

    def encode(self, frame) -> tuple[np.ndarray, list[str | None]]:
        """float32 (N, features) and, per row, why it cannot be trusted (None when it can): a
        numeric cell that is not a number (NaN in x) or a number beyond float32 (inf in x)."""
        parts: list[np.ndarray] = []
        reasons: list[str | None] = [None] * len(frame)
        for col in self.columns:
            values = frame[col["name"]]
            if col["type"] != "numeric":
                text = category_cells(values)
                parts.append(np.stack([(text == c).to_numpy(np.float32)
                                       for c in col["categories"]], axis=1))
                continue
            numbers, wrong = numeric_cells(values)
            with np.errstate(over="ignore"):
                as_float32 = numbers.astype(np.float32)
            for i in np.flatnonzero(wrong):
                reasons[i] = reasons[i] or (f"non-numeric value {str(values.iloc[i]).strip()[:40]!r}"
                                            f" in column {col['name']!r}")
            for i in np.flatnonzero(np.isinf(as_float32)):
                reasons[i] = reasons[i] or (f"value {numbers[i]:g} in column {col['name']!r} is "
                                            "out of range")
            parts.append(as_float32[:, None])
        x = np.concatenate(parts, axis=1) if parts else np.zeros((len(frame), 0), np.float32)
        return x, reasons

    def transform(self, frame) -> tuple[np.ndarray, int]:
        """Training: float32 (N, features), non-numbers left as missing (imputed in the graph),
        and how many rows had one."""
        x, reasons = self.encode(frame)
        return x, sum(r is not None for r in reasons)

    def to_manifest(self, x_train: np.ndarray) -> dict:
        """Columns plus the training statistics the graph uses (medians, mean, std)."""
        with warnings.catch_warnings():  # an all-missing column has no median: use 0
            warnings.simplefilter("ignore", RuntimeWarning)
            median = np.nan_to_num(np.nanmedian(x_train, axis=0))
        filled = np.where(np.isnan(x_train), median, x_train)
        std = filled.std(axis=0)
        return {"kind": "tabular", "columns": self.columns, "feature_names": self.feature_names,
                "median": median.tolist(), "mean": filled.mean(axis=0).tolist(),
                "std": np.where(std < 1e-8, 1.0, std).tolist(), "normalization": "in_graph",
                "missing": "NaN in the input, replaced by the training median inside the graph"}

    @classmethod
    def from_manifest(cls, spec: dict) -> "TabularEncoder":
        return cls(columns=spec["columns"])
