"""How inputs become model input, fit on the training split, stored in the bundle manifest, and
re-applied by this same code at inference: image decoding, the text tokenizer and the tabular
encoder. No torch here.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from ttc.inputs.tables import (IMAGE_EXTENSIONS, category_cells, category_texts, frame_columns,
                               numeric_cells, numeric_share)
from utils import LOG, STDERR_FD_LOCK, ExportError, first_line

if TYPE_CHECKING:
    from PIL import Image

PAD_ID, UNK_ID = 0, 1
T = TypeVar("T")
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_LONG_NUMBER = re.compile(r"^\d{5,}$")


# ----------------------------------------------------------------------------- images

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F", "P;L"}
# Decoded as numbers and scaled by the mode's range (docs/data.md#pixel-values-per-image-mode);
# every other mode is 8-bit per channel and goes through Pillow's convert("L" | "RGB") and /255.
HIGH_BIT_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
_INT_FULL_SCALES = (255, 65535, 2**31 - 1)  # 8-, 16- and (signed) 32-bit


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
    channels = preprocessing["channels"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as img:
            high_bit = img.mode in HIGH_BIT_MODES
            declared = _declared_full_scale(img) if high_bit else None  # before the tags go
            img = ImageOps.exif_transpose(img) or img
            if high_bit:
                pixels = _high_bit_pixels(img, declared, (width, height))
            else:
                pixels = _eight_bit_pixels(img, channels, (width, height))
    if pixels.ndim == 3:
        return pixels.transpose(2, 0, 1)
    return np.repeat(pixels[None], channels, axis=0)


def _eight_bit_pixels(img: Image.Image, channels: int, size: tuple[int, int]) -> np.ndarray:
    """(H, W) or (H, W, 3) in [0, 1]: Pillow's convert (ITU-R 601-2 luma to gray), resize, /255."""
    from PIL import Image

    img = img.convert("L" if channels == 1 else "RGB")
    if img.size != size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.float32) / 255.0


def _high_bit_pixels(img: Image.Image, full_scale: float | None,
                     size: tuple[int, int]) -> np.ndarray:
    """(H, W) in [0, 1] from a 16-bit, 32-bit or float gray image, resized as floats so no
    precision is lost to an 8-bit intermediate."""
    from PIL import Image

    values = np.asarray(img, dtype=np.float32)
    scale = full_scale or _full_scale_by_max(values)
    pixels = np.nan_to_num(values / np.float32(scale), nan=0.0, posinf=1.0, neginf=0.0)
    if img.size != size:
        pixels = np.asarray(Image.fromarray(pixels).resize(size, Image.Resampling.BILINEAR))
    return np.clip(pixels, 0.0, 1.0, dtype=np.float32)


def _declared_full_scale(img: Image.Image) -> float | None:
    """The value that means white in a high-bit-depth image, when its mode or file says so."""
    if img.mode.startswith("I;16"):
        return 65535.0
    if img.mode == "F":
        return 1.0  # floats carry no integer range: taken as [0, 1] already
    if img.format == "TIFF" and img.tag_v2.get(258):  # BitsPerSample, SampleFormat (2: signed)
        bits, signed = _first(img.tag_v2[258]), _first(img.tag_v2.get(339)) == 2
        return float(2 ** (bits - 1) - 1 if signed else 2**bits - 1)
    if img.format in ("PNG", "PPM"):  # older Pillow opens 16-bit PNG gray as "I"; PPM rescales
        return 65535.0
    return None


def _full_scale_by_max(values: np.ndarray) -> int:
    """An "I" image whose file declares no depth: the smallest of 8-, 16- and 32-bit full scale
    that holds its brightest pixel (a fixed ladder, not a per-image stretch)."""
    brightest = float(values.max(initial=0.0))
    return next((s for s in _INT_FULL_SCALES if brightest <= s), _INT_FULL_SCALES[-1])


def _first(value):
    """A TIFF tag's first value (Pillow gives some as tuples)."""
    return value[0] if isinstance(value, tuple) and value else value


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


HF_PREFIX = "hf:"  # --arch hf:NAME_OR_PATH: a Hugging Face model and its tokenizer
HF_TOKENIZER = "huggingface"  # preprocessing["tokenizer"] of an --arch hf:... bundle


def hf_source(arch: str | None) -> str | None:
    """NAME_OR_PATH of an `hf:NAME_OR_PATH` arch, else None."""
    return arch[len(HF_PREFIX):] if arch and arch.startswith(HF_PREFIX) else None


_HF_TOKENIZERS: dict[str, str] = {}  # sha256 → tokenizer.json text, registered in this process
_HF_TOKENIZER_FILES: dict[str, str] = {}  # sha256 → the bundle file it was read from


def register_hf_tokenizer(text: str, expected: str | None = None,
                          origin: str | None = None) -> str:
    """Keep a tokenizer.json text under its sha256 (what the manifest names it by); a text whose
    hash is not `expected` is refused. `origin`: the file it was read from (errors name it)."""
    import hashlib

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if expected and digest != expected:
        raise ExportError("the bundle's tokenizer does not match its manifest (sha256 differs)",
                          "restore the tokenizer.json written with the bundle, or re-create the "
                          "bundle with pipeline.py")
    _HF_TOKENIZERS[digest] = text
    if origin:
        _HF_TOKENIZER_FILES[digest] = origin
    return digest


def hf_tokenizer_text(preprocessing: dict) -> str:
    """The registered tokenizer.json of an hf preprocessing spec."""
    digest = preprocessing["sha256"]
    if digest not in _HF_TOKENIZERS:
        raise ExportError("the bundle's tokenizer was not found",
                          "keep the .tokenizer.json written with the bundle next to its "
                          "model.json")
    return _HF_TOKENIZERS[digest]


@dataclass
class HFTokenizer:
    """A Hugging Face fast tokenizer (the Rust `tokenizers` library, no torch, no transformers):
    truncation at `max_length` and right padding with `pad_id` are part of its tokenizer.json, so
    a deployment that loads that file alone tokenizes the same way. Special tokens written in a
    text ("[SEP]") are tokenized as text, so the padding id only ever means padding."""

    backend: object  # tokenizers.Tokenizer
    spec: dict

    @classmethod
    def from_manifest(cls, spec: dict) -> "HFTokenizer":
        from tokenizers import Tokenizer as RustTokenizer

        text = hf_tokenizer_text(spec)

        def load() -> object:
            backend = RustTokenizer.from_str(text)
            configure_hf_backend(backend, spec)
            return backend

        return cls(rust_tokenizer_call(load, spec, "cannot be loaded"), spec)

    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        """int64 (N, longest) input ids, right-padded with the pad id; batch encoding in Rust."""
        if not len(texts):
            return np.zeros((0, 1), dtype=np.int64)
        encodings = rust_tokenizer_call(lambda: self.backend.encode_batch_fast(list(texts)),
                                        self.spec, "failed on the texts")
        return np.array([e.ids for e in encodings], dtype=np.int64)


def rust_tokenizer_call(call: Callable[[], T], spec: dict, failing: str) -> T:
    """call() into the Rust tokenizers library on a tokenizer.json (which a bundle brings, so it
    may be hostile). Any failure is one ExportError (exit 4) naming the file: a malformed file,
    or a regular expression that hits the regex engine's retry limit, which the library raises
    as pyo3's PanicException (a BaseException) after printing Rust's panic report and backtrace
    on stderr. What the library writes to stderr is held meanwhile, and all but a panic's report
    is passed on."""
    with STDERR_FD_LOCK, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        failure: BaseException | None = None
        try:
            return call()
        except BaseException as err:
            if isinstance(err, ExportError) or not (isinstance(err, Exception) or
                                                    type(err).__name__ == "PanicException"):
                raise  # Ctrl-C, SystemExit, our own errors
            failure = err
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            sys.stderr.write(_without_panic_report(held.read().decode("utf-8", "replace")))
    file = _HF_TOKENIZER_FILES.get(spec.get("sha256", ""))
    what = f"the bundle's tokenizer {file}" if file else \
        f"the tokenizer of hf:{str(spec.get('source'))[:200]}"
    panicked = "" if isinstance(failure, Exception) else "the tokenizers library panicked: "
    raise ExportError(f"{what} {failing}: {panicked}{first_line(failure, 200)}",
                      "restore the tokenizer.json written with the bundle, or re-create the "
                      "bundle with pipeline.py") from None


def _without_panic_report(text: str) -> str:
    """stderr output without a Rust panic's report ("thread '…' panicked at …" and on)."""
    start = re.search(r"^thread '.*' .*panicked at ", text, re.M)
    return text[: start.start()] if start else text


def configure_hf_backend(backend, spec: dict) -> None:
    """Truncation, padding and the literal reading of special-token text, as the spec says."""
    backend.enable_truncation(spec["max_length"])
    backend.enable_padding(pad_id=spec["pad_id"], pad_token=spec["pad_token"])
    backend.encode_special_tokens = True


def text_tokenizer(preprocessing: dict) -> "Tokenizer | HFTokenizer":
    """The tokenizer a text bundle was trained with: ours, or a Hugging Face one."""
    if preprocessing.get("tokenizer") == HF_TOKENIZER:
        return HFTokenizer.from_manifest(preprocessing)
    return Tokenizer.from_manifest(preprocessing)


PADDING_ID_KEY = "padding_id"  # graph metadata: the pad id an hf graph's attention mask follows


def text_graph_feed(ids: np.ndarray, input_names: Sequence[str], pad_id: int
                    ) -> dict[str, np.ndarray]:
    """An hf graph's inputs from right-padded token ids: attention_mask 1 where the id is not
    padding, token_type_ids 0 (one segment). The rule HFTextNet applies in PyTorch."""
    feed = {input_names[0]: ids}
    if "attention_mask" in input_names:
        feed["attention_mask"] = (ids != pad_id).astype(np.int64)
    if "token_type_ids" in input_names:
        feed["token_type_ids"] = np.zeros_like(ids)
    return feed


def real_tokens(ids: np.ndarray, preprocessing: dict) -> np.ndarray:
    """Where `ids` holds a text's own tokens: not padding, and not the [CLS]/[SEP]-like special
    tokens a Hugging Face tokenizer adds (which token-level TTA and corruptions leave alone)."""
    real = ids != preprocessing.get("pad_id", PAD_ID)
    special = [i for i in preprocessing.get("special_ids", ()) if i != preprocessing.get("unk_id")]
    return real & ~np.isin(ids, special) if special else real


def trim_padding(ids: np.ndarray, pad_id: int = PAD_ID) -> np.ndarray:
    """Drop the all-padding columns at the right of a batch of token ids (at least one kept)."""
    used = np.flatnonzero((ids != pad_id).any(axis=0))
    return ids[:, : (used[-1] + 1 if len(used) else 1)]


# ----------------------------------------------------------------------------- tabular

MAX_CATEGORIES = 50
# The farthest a value may lie from its column's training mean, in training standard deviations.
# The graph standardises in float32 and, with test-time training, squares the batch's
# activations in BatchNorm: a value far beyond this overflows there (NaN probabilities, and with
# --ttt the NaN statistics of a whole batch), and no real row lies a million deviations out.
MAX_STANDARDISED = 1e6


@dataclass
class TabularEncoder:
    """Numeric columns pass through (missing → NaN, imputed inside the graph with training
    medians); string columns are one-hot encoded with the training categories (an unseen or
    missing category → all zeros)."""

    columns: list[dict] = field(default_factory=list)  # {"name", "type", "categories"?}
    # per numeric column, the training (mean, std) the graph standardises it by; empty while
    # fitting, or for a manifest without them
    statistics: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def fit(cls, frame) -> "TabularEncoder":
        """Each column numeric or categorical, by _fit_column's rule."""
        return cls([_fit_column(str(name), frame[name]) for name in frame.columns])

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
        cells = frame_columns(frame, [c["name"] for c in self.columns])
        reasons: list[str | None] = [None] * len(frame)
        numeric = [c["name"] for c in self.columns if c["type"] == "numeric"]
        numbers, wrong = numeric_block(cells, numeric)
        as_float32 = float32_features(numbers)
        beyond = self._beyond(as_float32, numeric)
        for i, j in zip(*np.nonzero(wrong | beyond)):  # row by row, the first column first
            name = numeric[j]
            reasons[i] = reasons[i] or (
                f"non-numeric value {str(cells[name][i]).strip()[:40]!r} in column {name!r}"
                if wrong[i, j] else self._range_reason(numbers[i, j], name))
        if numeric and len(numeric) == len(self.columns):  # all numeric: x is the numbers
            return as_float32, reasons
        parts, at = [], 0
        for col in self.columns:
            if col["type"] == "numeric":
                parts.append(as_float32[:, at:at + 1])
                at += 1
                continue
            text = category_texts(cells[col["name"]])
            parts.append(np.stack([text == c for c in col["categories"]], axis=1)
                         .astype(np.float32))
        x = np.concatenate(parts, axis=1) if parts else np.zeros((len(frame), 0), np.float32)
        return x, reasons

    def _beyond(self, x: np.ndarray, names: list[str]) -> np.ndarray:
        """_out_of_range of each column of x (rows, len(names)), all columns in one pass."""
        beyond = np.isinf(x)
        known, mean, std = self._bounds(tuple(names))
        if len(known) == x.shape[1]:  # every column: no columns to pick
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # NaN: False
                beyond |= np.abs((x.astype(np.float64) - mean) / std) > MAX_STANDARDISED
        elif known:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                beyond[:, known] |= np.abs((x[:, known].astype(np.float64) - mean) / std) \
                    > MAX_STANDARDISED
        return beyond

    def _bounds(self, names: tuple[str, ...]) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Which of `names` have training statistics, and their means and stds: worked out
        once per list of names (the statistics are fixed once the encoder is built)."""
        cache = self.__dict__.setdefault("_bounds_cache", {})
        key = (names, id(self.statistics))
        if key not in cache:
            known = [j for j, name in enumerate(names) if name in self.statistics]
            pairs = np.array([self.statistics[names[j]] for j in known], dtype=np.float64)
            mean, std = pairs.T if known else (np.zeros(0), np.zeros(0))
            cache[key] = (known, mean, std)
        return cache[key]

    @property
    def all_numeric(self) -> bool:
        """Every column numeric: encode_numbers can encode its rows."""
        return bool(self.columns) and all(c["type"] == "numeric" for c in self.columns)

    def encode_numbers(self, numbers: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
        """encode's rule over a whole block of an all-numeric encoder's rows, vectorised: its
        columns' numbers (rows, columns; float64, or float32 read as such; NaN where missing,
        imputed inside the graph) → float32 (rows, features), and why each row that cannot be
        trusted cannot (by row index): the first column holding a number out of range."""
        x = float32_features(numbers)
        names = [c["name"] for c in self.columns]
        beyond = self._beyond(x, names)
        reasons = {}
        for i in np.flatnonzero(beyond.any(axis=1)):
            j = int(np.flatnonzero(beyond[i])[0])
            reasons[int(i)] = self._range_reason(numbers[i, j], names[j])
        return x, reasons

    def _out_of_range(self, values: np.ndarray, column: str) -> np.ndarray:
        """Which float32 values of a numeric column the graph cannot take: infinite (a number
        beyond float32), or more than MAX_STANDARDISED training deviations from the mean."""
        return self._beyond(np.asarray(values)[:, None], [column])[:, 0]

    def _standardised(self, values: np.ndarray | float, column: str) -> np.ndarray:
        mean, std = self.statistics[column]
        with np.errstate(over="ignore"):  # a std near 0: inf, refused
            return (np.asarray(values, dtype=np.float64) - mean) / std

    def _range_reason(self, value: float, column: str) -> str:
        if column not in self.statistics or np.isinf(float32_features(np.float64(value))):
            return out_of_range(value, column)
        deviations = abs(float(self._standardised(value, column)))
        return (f"{out_of_range(value, column)} ({deviations:.2g} training standard deviations "
                f"from its mean; the model takes at most {MAX_STANDARDISED:g})")

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
        return cls(columns=spec["columns"], statistics=numeric_statistics(spec))


def numeric_statistics(spec: dict) -> dict[str, tuple[float, float]]:
    """Each numeric column's training (mean, std) in a tabular manifest section: its feature's
    (a categorical column spans one feature per category). Empty without both lists."""
    mean, std = spec.get("mean"), spec.get("std")
    out, feature = {}, 0
    for col in spec["columns"]:
        if col["type"] == "numeric":
            if mean is None or std is None or feature >= min(len(mean), len(std)):
                return {}
            out[col["name"]] = (float(mean[feature]), float(std[feature]))
            feature += 1
        else:
            feature += len(col.get("categories", ()))
    return out


def float32_features(numbers: np.ndarray) -> np.ndarray:
    """Feature numbers as the float32 the graph takes (a new array); a number beyond float32
    becomes inf (the row is then refused: out_of_range)."""
    with np.errstate(over="ignore"):
        return numbers.astype(np.float32)


def out_of_range(value: float, column: str) -> str:
    """Why a row whose `column` holds a number beyond float32 cannot be predicted."""
    return f"value {value:g} in column {column!r} is out of range"


def numeric_block(cells: Mapping[str, np.ndarray], names: list[str]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """tables.numeric_cells of the `names` columns, as (rows, columns) float64 numbers and the
    mask of the cells that are not numbers; the columns of text cells parsed in one pass."""
    rows = len(next(iter(cells.values()))) if cells else 0
    numbers = np.empty((rows, len(names)), dtype=np.float64)
    wrong = np.zeros((rows, len(names)), dtype=bool)
    text = []
    for j, name in enumerate(names):
        if cells[name].dtype.kind == "O":
            text.append(j)
        else:
            numbers[:, j], wrong[:, j] = numeric_cells(cells[name])
    if text:
        parsed, bad = numeric_cells(np.concatenate([cells[names[j]] for j in text]))
        where = slice(None) if len(text) == len(names) else text
        numbers[:, where] = parsed.reshape(len(text), rows).T
        wrong[:, where] = bad.reshape(len(text), rows).T
    return numbers, wrong


NUMERIC_SHARE = 0.95  # a column with at least this share of numbers is numeric


def _fit_column(name: str, values) -> dict:
    """Numeric when nearly every present cell is a number, or when most are and their distinct
    values are too many for a one-hot encoding; else categorical. A mostly-numeric column never
    changes type silently: a WARNING names it, the count of non-numbers and what was done."""
    share, not_numbers = numeric_share(values)
    examples = ", ".join(repr(e[:20]) for e in sorted(set(not_numbers))[:3])
    numbers = numeric_cells(values)[0]
    distinct_numbers = np.unique(numbers[~np.isnan(numbers)]).size
    if share >= NUMERIC_SHARE or (share >= 0.5 and distinct_numbers > MAX_CATEGORIES):
        if not_numbers:
            LOG.warning("feature column %r: %d training cells are not numbers (e.g. %s); it is "
                        "numeric and they count as missing; fix or empty them", name,
                        len(not_numbers), examples)
        return {"name": name, "type": "numeric"}
    if share >= 0.5:
        LOG.warning("feature column %r: %.0f%% of its cells are numbers, %d are not (e.g. %s); "
                    "it is encoded as categories (one-hot, %d most frequent values); if it is "
                    "numeric, fix or empty those cells", name, 100 * share, len(not_numbers),
                    examples, MAX_CATEGORIES)
    counts = category_cells(values).dropna().value_counts()
    return {"name": name, "type": "categorical",
            "categories": sorted(counts.index[:MAX_CATEGORIES])}
