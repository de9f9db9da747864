"""Test-time augmentation on the ONNX model: small composable transforms (after ttach), views
stacked into one session.run, merge rules, adaptive triggering. numpy only: inference stays lean.

A transform turns a batch into extra views; every view keeps the index of the sample it came
from (`owner`), so a transform may give several views per sample (rotate:DEG gives ±DEG,
shift:PX four shifts, window:N one view per window of a long text). The plain view is always
included. Each transform also has a `random` form, used to train on the same distortions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from preprocess import PAD_ID, trim_padding
from utils import ConfigError

MERGE_MODES = ("mean", "gmean", "max", "vote", "tsharpen")
DEFAULT_TRANSFORMS = {"image": "shift:1", "text": "token_dropout:0.1", "tabular": "jitter:0.1"}


# ----------------------------------------------------------------------------- image geometry


@lru_cache(maxsize=64)
def _sampling_grid(height: int, width: int, matrix: tuple[float, ...]) -> tuple:
    """Integer corners and bilinear weights for an affine resampling (cached: TTA reuses them)."""
    ys, xs = np.meshgrid(np.arange(height) - (height - 1) / 2, np.arange(width) - (width - 1) / 2,
                         indexing="ij")
    src_y = np.clip(matrix[0] * ys + matrix[1] * xs + (height - 1) / 2, 0, height - 1)
    src_x = np.clip(matrix[2] * ys + matrix[3] * xs + (width - 1) / 2, 0, width - 1)
    y0, x0 = np.floor(src_y).astype(int), np.floor(src_x).astype(int)
    y1, x1 = np.minimum(y0 + 1, height - 1), np.minimum(x0 + 1, width - 1)
    return y0, x0, y1, x1, (src_y - y0).astype(np.float32), (src_x - x0).astype(np.float32)


def _affine(x: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Resample NCHW images: output pixel p (centred coordinates) reads input matrix @ p,
    bilinear, with the border replicated."""
    _, _, height, width = x.shape
    key = tuple(round(float(v), 9) for v in np.asarray(matrix).ravel())
    y0, x0, y1, x1, wy, wx = _sampling_grid(height, width, key)
    top = x[..., y0, x0] * (1 - wx) + x[..., y0, x1] * wx
    bottom = x[..., y1, x0] * (1 - wx) + x[..., y1, x1] * wx
    return (top * (1 - wy) + bottom * wy).astype(x.dtype)


def _rotate(x: np.ndarray, degrees: float) -> np.ndarray:
    angle = np.deg2rad(degrees)
    cos, sin = np.cos(angle), np.sin(angle)
    return _affine(x, np.array([[cos, -sin], [sin, cos]]))


def _zoom(x: np.ndarray, factor: float) -> np.ndarray:
    """factor > 1 zooms in (a centre crop of 1/factor resized back)."""
    return _affine(x, np.eye(2) / factor)


def _shift(x: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Move the content dy pixels down and dx right, replicating the border."""
    _, _, height, width = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (abs(dy),) * 2, (abs(dx),) * 2), mode="edge")
    top, left = abs(dy) - dy, abs(dx) - dx
    return np.ascontiguousarray(padded[..., top:top + height, left:left + width])


# ----------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class Transform:
    """One entry of --tta_transforms: `views` for test time, `random` for training."""

    name: str
    param: float | None
    views: Callable[[np.ndarray, np.random.Generator], list[np.ndarray]]
    random: Callable[[np.ndarray, np.random.Generator], np.ndarray]
    count: int = 1  # views per sample (window: one per window of a long text, at least 0)
    seeded: bool = False  # its views draw random numbers

    @property
    def spec(self) -> str:
        return self.name if self.param is None else f"{self.name}:{self.param:g}"


def _image_transform(name: str, param: float | None, preprocessing: dict) -> Transform:
    square = preprocessing["image_size"][0] == preprocessing["image_size"][1]
    if name in ("rot90", "rot270") and not square:
        raise ConfigError(f"TTA transform {name} needs square images, these are "
                          f"{preprocessing['image_size']}", "use rot180 or rotate:DEG")
    fixed: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "hflip": lambda x: x[..., ::-1].copy(), "vflip": lambda x: x[..., ::-1, :].copy(),
        "rot90": lambda x: np.rot90(x, 1, axes=(2, 3)).copy(),
        "rot180": lambda x: np.rot90(x, 2, axes=(2, 3)).copy(),
        "rot270": lambda x: np.rot90(x, 3, axes=(2, 3)).copy()}
    if name in fixed:
        fn = fixed[name]
        return Transform(name, None, lambda x, rng: [fn(x)], _maybe(fn))
    value = float(param)  # type: ignore[arg-type]
    if name == "rotate":
        return Transform(name, value, lambda x, rng: [_rotate(x, value), _rotate(x, -value)],
                         lambda x, rng: _rotate(x, rng.uniform(-value, value)), count=2)
    if name == "shift":
        step = int(value)
        moves = [(step, 0), (-step, 0), (0, step), (0, -step)]
        return Transform(name, value, lambda x, rng: [_shift(x, dy, dx) for dy, dx in moves],
                         lambda x, rng: _shift(x, *moves[rng.integers(4)]), count=4)
    if name in ("crop", "scale"):
        factor = 1 / value if name == "crop" else value
        return Transform(name, value, lambda x, rng: [_zoom(x, factor)],
                         lambda x, rng: _zoom(x, rng.uniform(min(1, factor), max(1, factor))))
    if name == "brightness":
        shifted = lambda x, d: np.clip(x + d, 0, 1).astype(x.dtype)  # noqa: E731
        return Transform(name, value, lambda x, rng: [shifted(x, value), shifted(x, -value)],
                         lambda x, rng: shifted(x, rng.uniform(-value, value)), count=2)
    # contrast: scale each image's deviation from its own mean
    def contrast(x: np.ndarray, f: float) -> np.ndarray:
        mean = x.mean(axis=(1, 2, 3), keepdims=True)
        return np.clip((x - mean) * f + mean, 0, 1).astype(x.dtype)

    return Transform(name, value, lambda x, rng: [contrast(x, value)],
                     lambda x, rng: contrast(x, rng.uniform(min(1, value), max(1, value))))


def _maybe(fn: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """Random form of a fixed transform: applied to each sample with probability 1/2."""
    def apply(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        chosen = rng.random(len(x)) < 0.5
        out = x.copy()
        out[chosen] = fn(x[chosen])
        return out
    return apply


def _drop_tokens(ids: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Drop each real token with probability p (at least one kept), re-packed to the left."""
    real = ids != PAD_ID
    keep = real & (rng.random(ids.shape) >= p)
    none_left = ~keep.any(axis=1)
    keep[none_left] = real[none_left] & (np.cumsum(real[none_left], axis=1) == 1)
    order = np.argsort(~keep, axis=1, kind="stable")  # kept tokens first, in their order
    return np.take_along_axis(np.where(keep, ids, PAD_ID), order, axis=1)


def _windows(ids: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping windows (stride size/2) over each sequence longer than `size`: the views and
    the row each came from. Shorter sequences have no extra view."""
    views, owners = [], []
    stride = max(1, size // 2)
    for i, row in enumerate(ids):
        length = int((row != PAD_ID).sum())
        for start in (range(0, length - size + 1, stride) if length > size else ()):
            window = np.zeros(size, dtype=ids.dtype)
            window[:] = row[start:start + size]
            views.append(window)
            owners.append(i)
    if not views:
        return np.zeros((0, 1), dtype=ids.dtype), np.zeros(0, dtype=np.int64)
    return np.stack(views), np.array(owners)


def _text_transform(name: str, param: float | None) -> Transform:
    value = float(param)  # type: ignore[arg-type]
    if name == "token_dropout":
        return Transform(name, value, lambda x, rng: [_drop_tokens(x, value, rng)],
                         lambda x, rng: _drop_tokens(x, value, rng), seeded=True)

    def random_window(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        size, out = int(value), np.zeros_like(x)
        for i, row in enumerate(x):
            tokens = row[row != PAD_ID]
            start = rng.integers(0, max(1, len(tokens) - size + 1))
            piece = tokens[start:start + size]
            out[i, : len(piece)] = piece
        return out

    return Transform(name, value, lambda x, rng: [], random_window, count=0)


def _tabular_transform(name: str, param: float | None, preprocessing: dict) -> Transform:
    sigma = float(param)  # type: ignore[arg-type]
    names = preprocessing["feature_names"]
    numeric = {c["name"] for c in preprocessing["columns"] if c["type"] == "numeric"}
    scale = np.array([s if n in numeric else 0.0 for n, s in zip(names, preprocessing["std"])],
                     dtype=np.float32) * sigma

    def jitter(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return (x + rng.standard_normal(x.shape).astype(np.float32) * scale).astype(np.float32)

    return Transform(name, sigma, lambda x, rng: [jitter(x, rng)], jitter, seeded=True)


# name → (needs a parameter, valid range check, what the parameter means)
REGISTRY: dict[str, dict[str, tuple[bool, Callable[[float], bool], str]]] = {
    "image": {"identity": (False, None, ""), "hflip": (False, None, ""),
              "vflip": (False, None, ""), "rot90": (False, None, ""), "rot180": (False, None, ""),
              "rot270": (False, None, ""),
              "rotate": (True, lambda v: 0 < v < 180, "degrees in (0, 180)"),
              "shift": (True, lambda v: v >= 1 and v == int(v), "whole pixels ≥ 1"),
              "crop": (True, lambda v: 0 < v < 1, "a fraction in (0, 1)"),
              "scale": (True, lambda v: 0.25 <= v <= 4 and v != 1, "a factor in [0.25, 4], not 1"),
              "brightness": (True, lambda v: 0 < v < 1, "a delta in (0, 1)"),
              "contrast": (True, lambda v: 0 < v <= 4 and v != 1, "a factor in (0, 4], not 1")},
    "text": {"identity": (False, None, ""),
             "token_dropout": (True, lambda v: 0 < v < 1, "a probability in (0, 1)"),
             "window": (True, lambda v: v >= 2 and v == int(v), "a whole number of tokens ≥ 2")},
    "tabular": {"identity": (False, None, ""),
                "jitter": (True, lambda v: 0 < v <= 5, "a standard deviation in (0, 5]")},
}
ALIASES = {"flip": "hflip"}


def parse_transform_specs(text: str, kind: str) -> list[tuple[str, float | None]]:
    """'hflip,rotate:10' → [('hflip', None), ('rotate', 10.0)]; exit 2 on anything invalid."""
    registry = REGISTRY[kind]
    valid = ", ".join(n + (":X" if registry[n][0] else "") for n in registry)
    parsed = []
    for item in filter(None, (p.strip() for p in (text or DEFAULT_TRANSFORMS[kind]).split(","))):
        name, _, raw = item.partition(":")
        name = ALIASES.get(name.strip().lower(), name.strip().lower())
        if name not in registry:
            raise ConfigError(f"unknown TTA transform {item!r} for {kind} models",
                              f"valid: {valid}")
        needs, check, meaning = registry[name]
        if needs != bool(raw):
            raise ConfigError(f"TTA transform {item!r} " + ("needs a parameter" if needs else
                              "takes no parameter"), f"valid: {valid}")
        value = None
        if needs:
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if not check(value):
                raise ConfigError(f"TTA transform {item!r}: the parameter must be {meaning}",
                                  f"e.g. {name}:{'0.1' if '(0, 1)' in meaning else '2'}")
        if name != "identity":
            parsed.append((name, value))
    return parsed


def build_transforms(text: str, preprocessing: dict) -> list[Transform]:
    kind = preprocessing["kind"]
    transforms = []
    for name, value in parse_transform_specs(text, kind):
        if kind == "image":
            transforms.append(_image_transform(name, value, preprocessing))
        elif kind == "text":
            transforms.append(_text_transform(name, value))
        else:
            transforms.append(_tabular_transform(name, value, preprocessing))
    return transforms


def expand(x: np.ndarray, transforms: Sequence[Transform],
           seed: int | np.random.Generator | None = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """The plain view plus every transform's views of a batch: (views, owner row of each), the
    owners None when every view covers the whole batch in order (the common, fast case)."""
    rng = seed if isinstance(seed, np.random.Generator) or seed is None else (
        np.random.default_rng(seed) if any(t.seeded for t in transforms) else None)
    views, owners, regular = [x], [np.arange(len(x))], True
    for transform in transforms:
        if transform.name == "window":
            windowed, rows = _windows(x, int(transform.param))
            if len(rows):
                views.append(windowed)
                owners.append(rows)
                regular = False
            continue
        for view in transform.views(x, rng):
            views.append(view)
            owners.append(np.arange(len(x)))
    return _stack(views), None if regular else np.concatenate(owners)


def views_per_sample(transforms: Sequence[Transform]) -> int:
    """How many views a sample gets (windows counted as one)."""
    return 1 + sum(max(1, t.count) if t.name == "window" else t.count for t in transforms)


def _stack(views: list[np.ndarray]) -> np.ndarray:
    """Concatenate along the batch axis; token ids of different lengths are right-padded."""
    if views[0].dtype == np.int64 and views[0].ndim == 2:
        width = max(v.shape[1] for v in views)
        views = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=PAD_ID)
                 for v in views]
    return np.ascontiguousarray(np.concatenate(views))


def random_augment(x: np.ndarray, transforms: Sequence[Transform], rng: np.random.Generator
                   ) -> np.ndarray:
    """Training: each sample keeps its plain form or takes one transform's random form."""
    if not transforms:
        return x
    choice = rng.integers(0, len(transforms) + 1, len(x))
    out = x.copy()
    for k, transform in enumerate(transforms, start=1):
        chosen = choice == k
        if chosen.any():
            out[chosen] = _fit_width(transform.random(x[chosen], rng), x.shape)
    return out


def _fit_width(view: np.ndarray, shape: tuple) -> np.ndarray:
    return view if view.shape[1:] == shape[1:] else view[:, : shape[1]]


# ----------------------------------------------------------------------------- merging


def merge(probs: np.ndarray, owners: np.ndarray | None, n: int, mode: str) -> np.ndarray:
    """Per sample, combine its views' probabilities into one distribution (rows sum to 1).

    owners[i] is the sample of row i; None means whole-batch views stacked in order."""
    if owners is None:
        return _merge_blocks(probs.reshape(len(probs) // n, n, -1), mode)
    out = np.zeros((n, probs.shape[1]), dtype=np.float64)
    counts = np.bincount(owners, minlength=n).astype(np.float64)[:, None]
    p = probs.astype(np.float64)
    if mode == "mean":
        np.add.at(out, owners, p)
        out /= counts
    elif mode == "gmean":
        np.add.at(out, owners, np.log(np.clip(p, 1e-12, 1)))
        out = np.exp(out / counts)
    elif mode == "max":
        out[:] = -np.inf
        np.maximum.at(out, owners, p)
    elif mode == "tsharpen":  # ttach's temperature sharpening, t = 0.5
        np.add.at(out, owners, np.sqrt(p))
        out /= counts
    elif mode == "vote":
        mean = np.zeros_like(out)
        np.add.at(out, owners, np.eye(p.shape[1])[p.argmax(1)])
        np.add.at(mean, owners, p)
        out = out / counts + 1e-6 * mean / counts  # ties go to the higher mean probability
    else:
        raise ConfigError(f"unknown --tta_merge {mode!r}", f"use one of {', '.join(MERGE_MODES)}")
    return (out / out.sum(axis=1, keepdims=True)).astype(np.float32)


def _merge_blocks(p: np.ndarray, mode: str) -> np.ndarray:
    """The same rules when every sample has the same views: p is (views, n, classes)."""
    p = p.astype(np.float64)
    if mode == "mean":
        out = p.mean(0)
    elif mode == "gmean":
        out = np.exp(np.log(np.clip(p, 1e-12, 1)).mean(0))
    elif mode == "max":
        out = p.max(0)
    elif mode == "tsharpen":
        out = np.sqrt(p).mean(0)
    elif mode == "vote":
        out = np.eye(p.shape[2])[p.argmax(2)].mean(0) + 1e-6 * p.mean(0)
    else:
        raise ConfigError(f"unknown --tta_merge {mode!r}", f"use one of {', '.join(MERGE_MODES)}")
    return (out / out.sum(axis=1, keepdims=True)).astype(np.float32)


# ----------------------------------------------------------------------------- running


@dataclass
class TTAOutcome:
    probabilities: np.ndarray
    plain: np.ndarray
    triggered: np.ndarray  # bool per sample: did it get the extra views
    seconds: float
    seconds_plain: float
    views: int  # views per sample (plain included), as run


def tta_predict(predict: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
                transforms: Sequence[Transform], merge_mode: str, batch_size: int,
                seed: int = 0) -> np.ndarray:
    """Merged probabilities over all views. Views are stacked: each run takes batch_size
    samples with all their views (at most batch_size × views rows; never one run per view)."""
    per_run = batch_size
    rng = np.random.default_rng(seed) if any(t.seeded for t in transforms) else None
    merged = []
    for start in range(0, len(x), per_run):
        chunk = x[start:start + per_run]
        stacked, owners = expand(chunk, transforms, rng)
        if stacked.dtype == np.int64 and stacked.ndim == 2:  # token ids: drop unused padding
            stacked = np.ascontiguousarray(trim_padding(stacked))
        merged.append(merge(predict(stacked), owners, len(chunk), merge_mode))
    return np.concatenate(merged) if merged else np.zeros((0, 0), np.float32)


def run_tta(predict: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
            transforms: Sequence[Transform], merge_mode: str, batch_size: int,
            threshold: float | None = None, seed: int = 0) -> TTAOutcome:
    """Plain predictions (timed), then TTA (timed): on every sample, or with `threshold` only on
    samples whose plain top probability is below it (then TTA time includes the plain pass)."""
    from inference import batches_of

    started = time.perf_counter()
    plain = np.concatenate([predict(b) for b in batches_of(x, batch_size)])
    seconds_plain = time.perf_counter() - started
    triggered = (plain.max(1) < threshold) if threshold is not None else np.ones(len(x), bool)
    merged = plain.copy()
    rows = np.flatnonzero(triggered)
    started = time.perf_counter()
    if len(rows):
        merged[rows] = tta_predict(predict, x[rows], transforms, merge_mode, batch_size, seed)
    seconds = time.perf_counter() - started + (seconds_plain if threshold is not None else 0.0)
    return TTAOutcome(merged, plain, triggered, seconds, seconds_plain,
                      views_per_sample(transforms))


def cost_ratio(predict: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
               transforms: Sequence[Transform], merge_mode: str, batch_size: int,
               threshold: float | None, seed: int, repeats: int = 3) -> float:
    """TTA time / plain time over the split, each the best of `repeats` alternating passes
    (the outcome above already warmed both paths up)."""
    tta, plain = [], []
    for _ in range(repeats):
        outcome = run_tta(predict, x, transforms, merge_mode, batch_size, threshold, seed)
        tta.append(outcome.seconds)
        plain.append(outcome.seconds_plain)
    return round(min(tta) / max(min(plain), 1e-9), 3)


@dataclass
class TTAResult:
    transforms: list[str]
    merge: str
    views: int
    accuracy: float
    accuracy_plain: float
    fixed: int
    broken: int
    cost_ratio: float
    triggered_fraction: float
    threshold: float | None
    accuracy_val: float | None = None
    accuracy_val_plain: float | None = None
    verdict: str = ""

    def report_section(self) -> dict:
        return dict(vars(self))

    def judged(self) -> tuple[str, float, float]:
        """The split TTA is judged on (validation when there is one), TTA and plain accuracy."""
        if self.accuracy_val is not None and self.accuracy_val_plain is not None:
            return "validation", self.accuracy_val, self.accuracy_val_plain
        return "test", self.accuracy, self.accuracy_plain

    @property
    def lowers(self) -> bool:
        _, with_tta, plain = self.judged()
        return with_tta < plain


def evaluate_tta(predict: Callable[[np.ndarray], np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 val: tuple[np.ndarray, np.ndarray] | None, transforms: Sequence[Transform],
                 merge_mode: str, batch_size: int, threshold: float | None, seed: int
                 ) -> TTAResult:
    """TTA vs plain on the test split (and the validation split, to judge it honestly)."""
    x, y = test
    outcome = run_tta(predict, x, transforms, merge_mode, batch_size, threshold, seed)
    cost = cost_ratio(predict, x, transforms, merge_mode, batch_size, threshold, seed)
    right_tta = outcome.probabilities.argmax(1) == y
    right_plain = outcome.plain.argmax(1) == y
    result = TTAResult(
        transforms=[t.spec for t in transforms], merge=merge_mode, views=outcome.views,
        accuracy=float(right_tta.mean()), accuracy_plain=float(right_plain.mean()),
        fixed=int((right_tta & ~right_plain).sum()), broken=int((~right_tta & right_plain).sum()),
        cost_ratio=cost,
        triggered_fraction=float(outcome.triggered.mean()), threshold=threshold)
    if val is not None and len(val[1]):
        checked = run_tta(predict, val[0], transforms, merge_mode, batch_size, threshold, seed)
        result.accuracy_val = float((checked.probabilities.argmax(1) == val[1]).mean())
        result.accuracy_val_plain = float((checked.plain.argmax(1) == val[1]).mean())
    split, judged, plain = result.judged()
    if result.lowers:
        result.verdict = (f"TTA lowers {split} accuracy ({judged:.4f} vs {plain:.4f} without); "
                          "try other --tta_transforms (flips and rotations change what digits "
                          "and text mean), another --tta_merge, or --tta false")
    else:
        result.verdict = (f"TTA {'raises' if judged > plain else 'keeps'} {split} accuracy "
                          f"({judged:.4f} vs {plain:.4f} without) at {result.cost_ratio:.2f}x the "
                          "time")
    return result
