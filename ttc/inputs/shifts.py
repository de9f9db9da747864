"""A shift suite: corrupted copies of a test split, to measure test-time training under
distribution shift (after Hendrycks & Dietterich's common corruptions). numpy only.

Images are NCHW in [0, 1]; tabular rows are raw features (NaN stays NaN); texts are token ids,
right-padded (the tokenizer's padding and unknown ids come from the manifest). Every corruption
takes a severity 1-5 and is seeded, so a run is reproducible.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ttc.inputs.preprocess import PAD_ID, UNK_ID, real_tokens
from utils import ConfigError

Corruption = Callable[[np.ndarray, int, dict, np.random.Generator], np.ndarray]


def gaussian_noise(x: np.ndarray, severity: int, _: dict, rng: np.random.Generator) -> np.ndarray:
    sigma = [0.08, 0.12, 0.18, 0.26, 0.38][severity - 1]
    return np.clip(x + rng.normal(0, sigma, x.shape), 0, 1).astype(np.float32)


def contrast(x: np.ndarray, severity: int, _: dict, rng: np.random.Generator) -> np.ndarray:
    factor = [0.4, 0.3, 0.2, 0.1, 0.05][severity - 1]
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    return ((x - mean) * factor + mean).astype(np.float32)


def blur(x: np.ndarray, severity: int, _: dict, rng: np.random.Generator) -> np.ndarray:
    """Separable Gaussian blur, edges reflected; sigma in pixels of a 32-pixel-wide image,
    scaled to the real width (so digits' 8 pixels blur as much as a 32-pixel image would)."""
    sigma = [0.6, 0.9, 1.3, 1.8, 2.4][severity - 1] * x.shape[-1] / 32 * 2
    radius = max(1, int(np.ceil(2 * sigma)))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    out = x
    for axis in (2, 3):
        pad = [(0, 0)] * 4
        pad[axis] = (radius, radius)
        padded = np.pad(out, pad, mode="reflect" if out.shape[axis] > radius else "edge")
        out = sum(w * np.take(padded, np.arange(k, k + out.shape[axis]), axis=axis)
                  for k, w in enumerate(taps))
    return np.clip(out, 0, 1).astype(np.float32)


def shift(x: np.ndarray, severity: int, _: dict, rng: np.random.Generator) -> np.ndarray:
    """Each image moved by a random offset of up to a fraction of its size, zeros filling in."""
    fraction = [0.06, 0.1, 0.15, 0.2, 0.25][severity - 1]
    height, width = x.shape[2:]
    most = np.maximum(1, np.round(np.array([height, width]) * fraction)).astype(int)
    out = np.zeros_like(x)
    for i, (dy, dx) in enumerate(zip(rng.integers(-most[0], most[0] + 1, len(x)),
                                     rng.integers(-most[1], most[1] + 1, len(x)))):
        src = x[i, :, max(0, -dy):height - max(0, dy), max(0, -dx):width - max(0, dx)]
        out[i, :, max(0, dy):max(0, dy) + src.shape[1], max(0, dx):max(0, dx) + src.shape[2]] = src
    return out


def brightness(x: np.ndarray, severity: int, _: dict, rng: np.random.Generator) -> np.ndarray:
    return np.clip(x + [0.1, 0.2, 0.3, 0.4, 0.5][severity - 1], 0, 1).astype(np.float32)


def _numeric_std(preprocessing: dict) -> np.ndarray:
    """Training standard deviation of each numeric feature; 0 for one-hot columns."""
    numeric = {c["name"] for c in preprocessing["columns"] if c["type"] == "numeric"}
    return np.array([s if n in numeric else 0.0
                     for n, s in zip(preprocessing["feature_names"], preprocessing["std"])])


def feature_noise(x: np.ndarray, severity: int, pre: dict, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise of a fraction of each numeric feature's training standard deviation."""
    scale = [0.25, 0.5, 0.75, 1.0, 1.5][severity - 1] * _numeric_std(pre)
    return (x + rng.standard_normal(x.shape) * scale).astype(np.float32)


def feature_scale(x: np.ndarray, severity: int, pre: dict, rng: np.random.Generator) -> np.ndarray:
    """Each numeric feature multiplied by one random factor (a miscalibrated sensor, a unit
    change), the same for every row."""
    spread = [0.1, 0.2, 0.35, 0.5, 0.75][severity - 1]
    numeric = _numeric_std(pre) > 0
    factors = np.where(numeric, np.exp(rng.normal(0, spread, x.shape[1])), 1.0)
    return (x * factors).astype(np.float32)


TOKEN_RATES = [0.1, 0.2, 0.3, 0.45, 0.6]  # the share of a text's tokens hit, per severity


def unknown_tokens(x: np.ndarray, severity: int, pre: dict, rng: np.random.Generator
                   ) -> np.ndarray:
    """Each real token (preprocess.real_tokens: not padding, not a [CLS]/[SEP]-like special
    token) becomes the bundle's unknown id with a probability: typos, slang and new words the
    training vocabulary does not cover."""
    unk = pre.get("unk_id", UNK_ID)
    if unk is None:
        raise ConfigError("--eval_shift unknown_tokens replaces tokens by the unknown-token id, "
                          "and this bundle's tokenizer has none", "use token_deletion")
    hit = real_tokens(x, pre) & (rng.random(x.shape) < TOKEN_RATES[severity - 1])
    return np.where(hit, unk, x).astype(x.dtype)


def token_deletion(x: np.ndarray, severity: int, pre: dict, rng: np.random.Generator
                   ) -> np.ndarray:
    """Each real token deleted with a probability and the rest (special tokens included, so a
    BERT text still ends with [SEP]) closing up, every text keeping its first real token:
    terser texts, words missing. The freed places become the bundle's padding."""
    pad = pre.get("pad_id", PAD_ID)
    real = real_tokens(x, pre)
    keep = real & (rng.random(x.shape) >= TOKEN_RATES[severity - 1])
    texts = np.flatnonzero(real.any(axis=1))
    keep[texts, real[texts].argmax(axis=1)] = True
    keep |= (x != pad) & ~real  # special tokens stay
    order = np.argsort(~keep, axis=1, kind="stable")  # kept tokens first, in their order
    out = np.take_along_axis(x, order, axis=1)
    out[~np.take_along_axis(keep, order, axis=1)] = pad
    return out


CORRUPTIONS: dict[str, dict[str, Corruption]] = {
    "image": {"gaussian_noise": gaussian_noise, "contrast": contrast, "blur": blur,
              "shift": shift, "brightness": brightness},
    # a segmenter's: the photometric ones (a geometric shift would move pixels off their masks)
    "segmentation": {"gaussian_noise": gaussian_noise, "contrast": contrast, "blur": blur,
                     "brightness": brightness},
    # a detector's: the photometric ones too (a geometric shift would move objects off their boxes)
    "detection": {"gaussian_noise": gaussian_noise, "contrast": contrast, "blur": blur,
                  "brightness": brightness},
    "tabular": {"feature_noise": feature_noise, "feature_scale": feature_scale},
    "text": {"unknown_tokens": unknown_tokens, "token_deletion": token_deletion},
}


def parse_shift_names(text: str | None, kind: str) -> list[str]:
    """'gaussian_noise,blur' → the names, checked against the model type (exit 2 otherwise)."""
    names = [n.strip().lower() for n in (text or "").split(",") if n.strip()]
    if not names:
        return []
    if kind not in CORRUPTIONS:
        raise ConfigError(f"--eval_shift has no corruptions for {kind} models",
                          "use it with image or tabular models, or leave it out")
    valid = CORRUPTIONS[kind]
    for name in names:
        if name not in valid:
            raise ConfigError(f"unknown --eval_shift corruption {name!r} for {kind} models",
                              f"valid: {', '.join(valid)}")
    return list(dict.fromkeys(names))


def corrupt(x: np.ndarray, name: str, severity: int, preprocessing: dict, seed: int
            ) -> np.ndarray:
    rng = np.random.default_rng([seed, severity, sum(map(ord, name))])
    return CORRUPTIONS[preprocessing["kind"]][name](x, severity, preprocessing, rng)


# ----------------------------------------------------------------------------- stream orders

STREAM_ORDERS = ("shuffled", "label_sorted", "dirichlet:ALPHA")


def parse_stream_order(text: str) -> tuple[str, float | None]:
    """(order, Dirichlet concentration or None); ConfigError (exit 2) for anything else."""
    name, _, value = text.partition(":")
    if name in ("shuffled", "label_sorted") and not value:
        return name, None
    if name == "dirichlet":
        try:
            alpha = float(value)
        except ValueError:
            alpha = -1.0
        if alpha > 0 and np.isfinite(alpha):
            return name, alpha
    raise ConfigError(f"--eval_stream {text!r} is not an order this tool knows",
                      f"use one of {', '.join(STREAM_ORDERS)} (e.g. dirichlet:0.1)")
