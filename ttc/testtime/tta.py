"""Test-time augmentation on the ONNX model: small composable transforms (after ttach), merge
rules, adaptive triggering. No torch: inference stays lean.

A transform turns a batch into extra views, as ONNX nodes (tta_graph.py puts them in front of the
model and the merge behind it: one session.run per chunk, the `graph` plan) and as a numpy twin
(the reference the tests hold the graph to, the path for window:N, and the `loop` plan: one
session.run per view); tta_runner times both plans at load and keeps the faster (--tta_plan).
A transform may give several views per sample (rotate:DEG gives ±DEG, shift:PX four shifts,
window:N one per window of a long text); numpy views keep the index of the sample each came
from (`owner`). The plain view is always
included. Each transform also has a `random` form, used to train on the same distortions.
Each transform name is one TransformSpec in TRANSFORMS; each merge rule, in numpy and as graph
nodes, one entry of MERGES.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import onnx

from ttc.testtime import tta_graph
from ttc.inputs.preprocess import PAD_ID, real_tokens, trim_padding
from ttc.serving.runtime import batches_of, best_of, create_session, session_runner
from ttc.tasks.registry import TASKS, task_of_kind
from ttc.testtime.tta_graph import GraphNodes, ViewBuilder
from utils import LOG, ConfigError

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.manifest import Manifest
    from ttc.serving.runtime import RuntimeOptions



# ----------------------------------------------------------------------------- numpy views


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


def _shift(x: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Move the content dy pixels down and dx right, replicating the border."""
    _, _, height, width = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (abs(dy),) * 2, (abs(dx),) * 2), mode="edge")
    top, left = abs(dy) - dy, abs(dx) - dx
    return np.ascontiguousarray(padded[..., top:top + height, left:left + width])


def _rotation(degrees: float) -> np.ndarray:
    angle = np.deg2rad(degrees)
    return np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])


def _zoom(factor: float, rng: np.random.Generator) -> np.ndarray:
    """A random zoom between none and `factor` (> 1 zooms in: a centre crop of 1/factor)."""
    return np.eye(2) / rng.uniform(min(1, factor), max(1, factor))


def _brighten(x: np.ndarray, delta: float) -> np.ndarray:
    return np.clip(x + np.float32(delta), 0, 1).astype(x.dtype)


def _contrast(x: np.ndarray, factor: float) -> np.ndarray:
    """Scale each image's deviation from its own mean."""
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    return np.clip((x - mean) * np.float32(factor) + mean, 0, 1).astype(x.dtype)


def _maybe(fn: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """Random form of a fixed transform: applied to each sample with probability 1/2."""
    def apply(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        chosen = rng.random(len(x)) < 0.5
        out = x.copy()
        out[chosen] = fn(x[chosen])
        return out
    return apply

def _pad(pre: dict) -> int:
    """The padding id of a text bundle's tokenizer (0 for ours; a Hugging Face one says)."""
    return int(pre.get("pad_id", PAD_ID))


def _drop_tokens(ids: np.ndarray, keep: np.ndarray, pre: dict) -> np.ndarray:
    """Token ids with the unkept real tokens (preprocess.real_tokens: never padding, never a
    [CLS]/[SEP]-like special token) set to the bundle's padding id, in place: the networks pool
    over non-padding tokens, and an hf graph's attention mask is 0 at padding, so a dropped
    token is simply gone. A text that would lose every real token keeps its first one. `keep`
    is per position (L,) or per token (N, L)."""
    real = real_tokens(ids, pre)
    drop = real & ~keep[..., : ids.shape[1]].astype(bool)
    emptied = np.flatnonzero(real.any(axis=1) & ~(real & ~drop).any(axis=1))
    drop[emptied, real[emptied].argmax(axis=1)] = False
    return np.where(drop, _pad(pre), ids).astype(ids.dtype)


def _split_row(row: np.ndarray, pre: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A text's ids as (leading special tokens, its own tokens, trailing special tokens), the
    padding left out: [CLS] … [SEP] for a BERT tokenizer, ([], tokens, []) for ours."""
    real = np.flatnonzero(real_tokens(row[None], pre)[0])
    used = np.flatnonzero(row != _pad(pre))
    if not len(real):
        return row[used], row[:0], row[:0]
    end = used[-1] + 1
    return row[:real[0]], row[real[0]:real[-1] + 1], row[real[-1] + 1:end]


def _windows(ids: np.ndarray, size: int, pre: dict) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping windows (stride size/2) over each text of more than `size` own tokens, each
    wrapped in the text's special tokens (a window of a BERT text still starts with [CLS] and
    ends with [SEP]): the views, right-padded, and the row each came from. Shorter texts have
    no extra view."""
    views, owners = [], []
    stride = max(1, size // 2)
    for i, row in enumerate(ids):
        head, tokens, tail = _split_row(row, pre)
        for start in (range(0, len(tokens) - size + 1, stride) if len(tokens) > size else ()):
            views.append(np.concatenate([head, tokens[start:start + size], tail]))
            owners.append(i)
    if not views:
        return np.zeros((0, 1), dtype=ids.dtype), np.zeros(0, dtype=np.int64)
    width = max(len(v) for v in views)
    padded = np.full((len(views), width), _pad(pre), dtype=ids.dtype)
    for k, view in enumerate(views):
        padded[k, : len(view)] = view
    return padded, np.array(owners)


def _random_window(x: np.ndarray, size: int, rng: np.random.Generator, pre: dict
                   ) -> np.ndarray:
    """Each text cut to `size` of its own tokens from a random start, its special tokens kept
    (training's form of window:N; same width as x)."""
    out = np.full_like(x, _pad(pre))
    for i, row in enumerate(x):
        head, tokens, tail = _split_row(row, pre)
        start = rng.integers(0, max(1, len(tokens) - size + 1))
        piece = np.concatenate([head, tokens[start:start + size], tail])
        out[i, : len(piece)] = piece
    return out


# ----------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class Transform:
    """One entry of --tta_transforms, built by its TransformSpec.

    `views` (numpy) and `graph` (ONNX nodes, see tta_graph.py) give the same deterministic test
    views: seeded transforms draw their noise or token mask once, from --seed, so a sample's TTA
    result does not depend on the batch it comes in. `random` is the training-time form.
    """

    name: str
    param: float | None
    views: Callable[[np.ndarray], list[np.ndarray]]
    random: Callable[[np.ndarray, np.random.Generator], np.ndarray]
    graph: ViewBuilder | None  # None: no graph form (window: its view count depends on length)
    count: int = 1  # views per sample (window: counted as one)
    # seeded transforms: the drawn mask or noise, and the graph form of several stacked ones
    constant: np.ndarray | None = None
    stacked_graph: Callable[[GraphNodes, str, np.ndarray], str] | None = None
    # views whose number depends on the sample (window), in place of `views`: (views, owners)
    ragged: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
    pad_id: int = PAD_ID  # token views: the padding id of the bundle's tokenizer

    @property
    def spec(self) -> str:
        return self.name if self.param is None else f"{self.name}:{self.param:g}"


# (name, parameter (None where it takes none), preprocessing, a generator seeded for this entry)
Builder = Callable[[str, float, dict, np.random.Generator], Transform]


def _fixed(view: Callable[[np.ndarray], np.ndarray], graph: Callable[[GraphNodes, str], str],
           square: bool = False) -> Builder:
    """A flip or turn: one view; `square`: only for square images."""
    def build(name: str, value: float | None, pre: dict, seeded: np.random.Generator
              ) -> Transform:
        height, width = pre["image_size"]
        if square and height != width:
            raise ConfigError(f"TTA transform {name} needs square images, these are "
                              f"{pre['image_size']}", "use rot180 or rotate:DEG")
        return Transform(name, None, lambda x: [view(x)], _maybe(view), lambda g, x: [graph(g, x)])
    return build


def _turn(turns: int) -> Builder:
    return _fixed(lambda x: np.rot90(x, turns, axes=(2, 3)).copy(),
                  lambda g, x: tta_graph.rot90(g, x, turns), square=turns % 2 == 1)


def _resampled(matrices: Callable[[float], list[np.ndarray]],
               drawn: Callable[[float, np.random.Generator], np.ndarray]) -> Builder:
    """rotate, crop, scale: one view per matrix; in training, one drawn matrix per batch."""
    def build(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
        fixed = matrices(value)
        grids = [tta_graph.affine_grid(*pre["image_size"], m) for m in fixed]
        return Transform(name, value, lambda x: [_affine(x, m) for m in fixed],
                         lambda x, rng: _affine(x, drawn(value, rng)),
                         lambda g, x: [tta_graph.resample(g, x, grid) for grid in grids],
                         count=len(fixed))
    return build


def _shifted(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    """Four views: the content moved `value` pixels down, up, right and left."""
    height, width = pre["image_size"]
    step = int(value)
    moves = [(step, 0), (-step, 0), (0, step), (0, -step)]
    return Transform(name, value, lambda x: [_shift(x, dy, dx) for dy, dx in moves],
                     lambda x, rng: _shift(x, *moves[rng.integers(4)]),
                     lambda g, x: [tta_graph.shift(g, x, dy, dx, height, width)
                                   for dy, dx in moves], count=4)


def _brightened(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    return Transform(name, value, lambda x: [_brighten(x, value), _brighten(x, -value)],
                     lambda x, rng: _brighten(x, rng.uniform(-value, value)),
                     lambda g, x: [tta_graph.brighten(g, x, value),
                                   tta_graph.brighten(g, x, -value)], count=2)


def _contrasted(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    return Transform(name, value, lambda x: [_contrast(x, value)],
                     lambda x, rng: _contrast(x, rng.uniform(min(1, value), max(1, value))),
                     lambda g, x: [tta_graph.contrast(g, x, value)])


def _token_dropout(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    keep = seeded.random(int(pre.get("max_length", 512))) >= value
    tokens = tta_graph.TokenIds(_pad(pre), _special_ids(pre))

    def stacked(g: GraphNodes, x: str, keeps: np.ndarray) -> str:
        return tta_graph.mask_tokens(g, x, keeps, tokens)

    return Transform(name, value, lambda x: [_drop_tokens(x, keep, pre)],
                     lambda x, rng: _drop_tokens(x, rng.random(x.shape) >= value, pre),
                     lambda g, x: [stacked(g, x, keep[None])],
                     constant=keep, stacked_graph=stacked, pad_id=_pad(pre))


def _special_ids(pre: dict) -> tuple[int, ...]:
    """The ids token-level views never drop besides padding (preprocess.real_tokens' rule)."""
    return tuple(sorted({int(i) for i in pre.get("special_ids", ())
                         if i != pre.get("unk_id") and i != _pad(pre)}))


def _windowed(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    size = int(value)
    return Transform(name, value, lambda x: [],
                     lambda x, rng: _random_window(x, size, rng, pre), None,
                     ragged=lambda x: _windows(x, size, pre), pad_id=_pad(pre))


def _jitter(name: str, value: float, pre: dict, seeded: np.random.Generator) -> Transform:
    """Noise of `value` training standard deviations on numeric features (one fixed draw per
    view); one-hot columns stay as they are."""
    names = pre["feature_names"]
    numeric = {c["name"] for c in pre["columns"] if c["type"] == "numeric"}
    scale = np.array([s if n in numeric else 0.0 for n, s in zip(names, pre["std"])],
                     dtype=np.float32) * value
    noise = (seeded.standard_normal(len(names)).astype(np.float32) * scale).astype(np.float32)

    def jitter(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return (x + rng.standard_normal(x.shape).astype(np.float32) * scale).astype(np.float32)

    return Transform(name, value, lambda x: [x + noise], jitter,
                     lambda g, x: [tta_graph.add_vectors(g, x, noise[None])],
                     constant=noise, stacked_graph=tta_graph.add_vectors)


@dataclass(frozen=True)
class TransformSpec:
    """A name --tta_transforms takes: the model kinds it is for, its parameter's valid range and
    meaning (check None: it takes none), and its builder (None: identity, the plain view)."""

    name: str
    kinds: tuple[str, ...]
    build: Builder | None
    check: Callable[[float], bool] | None = None
    meaning: str = ""
    aliases: tuple[str, ...] = ()


IMAGE, TEXT, TABULAR = ("image",), ("text",), ("tabular",)
# Adding a transform is adding its entry here (and naming it in ttc/options/tta.py's --tta_transforms help).
TRANSFORMS: tuple[TransformSpec, ...] = (
    TransformSpec("identity", IMAGE + TEXT + TABULAR, None),
    TransformSpec("hflip", IMAGE, _fixed(lambda x: x[..., ::-1].copy(),
                                         lambda g, x: tta_graph.flip(g, x, [3])),
                  aliases=("flip",)),
    TransformSpec("vflip", IMAGE, _fixed(lambda x: x[..., ::-1, :].copy(),
                                         lambda g, x: tta_graph.flip(g, x, [2]))),
    TransformSpec("rot90", IMAGE, _turn(1)),
    TransformSpec("rot180", IMAGE, _turn(2)),
    TransformSpec("rot270", IMAGE, _turn(3)),
    TransformSpec("rotate", IMAGE, _resampled(lambda v: [_rotation(v), _rotation(-v)],
                                              lambda v, rng: _rotation(rng.uniform(-v, v))),
                  lambda v: 0 < v < 180, "degrees in (0, 180)"),
    TransformSpec("shift", IMAGE, _shifted, lambda v: v >= 1 and v == int(v), "whole pixels ≥ 1"),
    TransformSpec("crop", IMAGE, _resampled(lambda v: [np.eye(2) * v],
                                            lambda v, rng: _zoom(1 / v, rng)),
                  lambda v: 0 < v < 1, "a fraction in (0, 1)"),
    TransformSpec("scale", IMAGE, _resampled(lambda v: [np.eye(2) * (1 / v)], _zoom),
                  lambda v: 0.25 <= v <= 4 and v != 1, "a factor in [0.25, 4], not 1"),
    TransformSpec("brightness", IMAGE, _brightened, lambda v: 0 < v < 1, "a delta in (0, 1)"),
    TransformSpec("contrast", IMAGE, _contrasted, lambda v: 0 < v <= 4 and v != 1,
                  "a factor in (0, 4], not 1"),
    TransformSpec("token_dropout", TEXT, _token_dropout, lambda v: 0 < v < 1,
                  "a probability in (0, 1)"),
    TransformSpec("window", TEXT, _windowed, lambda v: v >= 2 and v == int(v),
                  "a whole number of tokens ≥ 2"),
    TransformSpec("jitter", TABULAR, _jitter, lambda v: 0 < v <= 5,
                  "a standard deviation in (0, 5]"),
)
REGISTRY: dict[str, dict[str, TransformSpec]] = {
    kind: {spec.name: spec for spec in TRANSFORMS if kind in spec.kinds}
    for kind in (task.kind for task in TASKS)}
ALIASES = {alias: spec.name for spec in TRANSFORMS for alias in spec.aliases}


def parse_transform_specs(text: str, kind: str) -> list[tuple[str, float | None]]:
    """'hflip,rotate:10' → [('hflip', None), ('rotate', 10.0)]; exit 2 on anything invalid."""
    registry = REGISTRY[kind]
    valid = ", ".join(n + (":X" if spec.check else "") for n, spec in registry.items())
    given = text or task_of_kind(kind).default_tta
    if not given:
        raise ConfigError(f"TTA has no default transforms for {kind} models",
                          f"name them with --tta_transforms (valid: {valid})")
    parsed = []
    for item in filter(None, (p.strip() for p in given.split(","))):
        name, _, raw = item.partition(":")
        name = ALIASES.get(name.strip().lower(), name.strip().lower())
        if name not in registry:
            raise ConfigError(f"unknown TTA transform {item!r} for {kind} models",
                              f"valid: {valid}")
        spec = registry[name]
        if (spec.check is not None) != bool(raw):
            raise ConfigError(f"TTA transform {item!r} " + ("needs a parameter" if spec.check
                              else "takes no parameter"), f"valid: {valid}")
        if spec.build is not None:
            parsed.append((name, None if spec.check is None else _parameter(spec, item, raw)))
    return parsed


def _parameter(spec: TransformSpec, item: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not spec.check(value):  # type: ignore[misc]
        raise ConfigError(f"TTA transform {item!r}: the parameter must be {spec.meaning}",
                          f"e.g. {spec.name}:{'0.1' if '(0, 1)' in spec.meaning else '2'}")
    return value


def build_transforms(text: str, preprocessing: dict, seed: int = 0) -> list[Transform]:
    """The transforms of a --tta_transforms list; seeded ones draw from `seed`, each its own."""
    kind = preprocessing["kind"]
    transforms = []
    for k, (name, value) in enumerate(parse_transform_specs(text, kind)):
        build: Builder = REGISTRY[kind][name].build  # type: ignore[assignment]
        transforms.append(build(name, value, preprocessing, np.random.default_rng([seed, k])))
    return transforms


def view_sets(x: np.ndarray, transforms: Sequence[Transform]
              ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """The plain view, then every transform's views of a batch, one array at a time: (view, the
    owner row of each of its rows), the owners None where the view covers the whole batch in
    order. What `expand` stacks and the loop plan runs one at a time."""
    yield x, None
    for transform in transforms:
        if transform.ragged is not None:
            windowed, rows = transform.ragged(x)
            if len(rows):
                yield windowed, rows
            continue
        for view in transform.views(x):
            yield view, None


def expand(x: np.ndarray, transforms: Sequence[Transform]
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """The plain view plus every transform's views of a batch: (views, owner row of each), the
    owners None when every view covers the whole batch in order (the common, fast case)."""
    views, owners = zip(*view_sets(x, transforms))
    return _stack(list(views), pad_id_of(transforms)), _owners(owners, len(x))


def _owners(owners: Sequence[np.ndarray | None], n: int) -> np.ndarray | None:
    """The owner row of every stacked view row (view_sets' owners joined), or None where every
    view covers the whole batch in order."""
    if all(o is None for o in owners):
        return None
    return np.concatenate([np.arange(n) if o is None else o for o in owners])


def tta_model(model: onnx.ModelProto, transforms: Sequence[Transform], merge_mode: str,
              classes: int) -> onnx.ModelProto | None:
    """The bundle's graph with the views in front and the merge behind (tta_graph.with_tta), or
    None where the views cannot live in the graph (window:N, whose view count depends on each
    text's length, or a graph older than opset 18): then numpy builds the views."""
    if any(t.graph is None for t in transforms):
        return None
    try:
        return tta_graph.with_tta(model, _graph_builders(transforms),
                                  views_per_sample(transforms), classes,
                                  _merge_rule(merge_mode).graph)
    except ValueError as err:
        LOG.info("TTA views built in numpy: %s", err)
        return None


def _graph_builders(transforms: Sequence[Transform]) -> list[ViewBuilder]:
    """Each transform's nodes, except that a run of seeded ones of one kind (token_dropout,
    jitter) shares one set of nodes over its stacked masks or noise: at batch 1 a graph's time
    is mostly per-node overhead."""
    builders: list[ViewBuilder] = []
    for _, run in itertools.groupby(transforms, key=lambda t: (t.name, t.stacked_graph is None)):
        run = list(run)
        if run[0].stacked_graph is None:
            builders += [t.graph for t in run]  # type: ignore[misc]
        else:
            stack, build = np.stack([t.constant for t in run]), run[0].stacked_graph
            builders.append(lambda g, x, stack=stack, build=build: [build(g, x, stack)])
    return builders


def views_per_sample(transforms: Sequence[Transform]) -> int:
    """How many views a sample gets (windows counted as one)."""
    return 1 + sum(t.count for t in transforms)


def pad_id_of(transforms: Sequence[Transform]) -> int:
    """The padding id the token views were built for (the bundle's; 0 for other kinds)."""
    return next((t.pad_id for t in transforms), PAD_ID)


def _stack(views: list[np.ndarray], pad_id: int = PAD_ID) -> np.ndarray:
    """Concatenate along the batch axis; token ids of different lengths are right-padded."""
    if views[0].dtype == np.int64 and views[0].ndim == 2:
        width = max(v.shape[1] for v in views)
        views = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=pad_id)
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


@dataclass(frozen=True)
class _Views:
    """A batch's view rows, reduced to one row per sample: `owners[i]` is the sample of row i;
    None means whole-batch views stacked in order (blocks of n rows, the fast path)."""

    n: int
    owners: np.ndarray | None

    def mean(self, values: np.ndarray) -> np.ndarray:
        if self.owners is None:
            return values.reshape(-1, self.n, values.shape[1]).mean(0)
        total = np.zeros((self.n, values.shape[1]))
        np.add.at(total, self.owners, values)
        return total / np.bincount(self.owners, minlength=self.n).astype(np.float64)[:, None]

    def max(self, values: np.ndarray) -> np.ndarray:
        if self.owners is None:
            return values.reshape(-1, self.n, values.shape[1]).max(0)
        out = np.full((self.n, values.shape[1]), -np.inf)
        np.maximum.at(out, self.owners, values)
        return out


@dataclass(frozen=True)
class Merge:
    """A --tta_merge rule: `numpy` turns the view rows (float64) into per-sample scores (merge
    normalises them), `graph` builds the same rule as ONNX nodes."""

    numpy: Callable[[np.ndarray, _Views], np.ndarray]
    graph: tta_graph.GraphMerge


def _vote(p: np.ndarray, views: _Views) -> np.ndarray:
    """The share of views voting each class; ties go to the higher mean probability."""
    return views.mean(np.eye(p.shape[1])[p.argmax(1)]) + 1e-6 * views.mean(p)


MERGES: dict[str, Merge] = {
    "mean": Merge(lambda p, views: views.mean(p), tta_graph.merge_mean),
    "gmean": Merge(lambda p, views: np.exp(views.mean(np.log(np.clip(p, 1e-12, 1)))),
                   tta_graph.merge_gmean),
    "max": Merge(lambda p, views: views.max(p), tta_graph.merge_max),
    "vote": Merge(_vote, tta_graph.merge_vote),
    # ttach's temperature sharpening, t = 0.5
    "tsharpen": Merge(lambda p, views: views.mean(np.sqrt(p)), tta_graph.merge_tsharpen),
}
MERGE_MODES = tuple(MERGES)


def _merge_rule(mode: str) -> Merge:
    if mode not in MERGES:
        raise ConfigError(f"unknown --tta_merge {mode!r}", f"use one of {', '.join(MERGE_MODES)}")
    return MERGES[mode]


def merge(probs: np.ndarray, owners: np.ndarray | None, n: int, mode: str) -> np.ndarray:
    """Per sample, combine its views' probabilities into one distribution (rows sum to 1).

    owners[i] is the sample of row i; None means whole-batch views stacked in order."""
    out = _merge_rule(mode).numpy(probs.astype(np.float64), _Views(n, owners))
    return (out / out.sum(axis=1, keepdims=True)).astype(np.float32)


# ----------------------------------------------------------------------------- running


Predict = Callable[[np.ndarray], np.ndarray]


@dataclass
class TTAOutcome:
    probabilities: np.ndarray
    plain: np.ndarray
    triggered: np.ndarray  # bool per sample: did it get the extra views
    seconds: float
    seconds_plain: float
    views: int  # views per sample (plain included), as run


@dataclass(frozen=True)
class TTAOptions:
    """What TTA takes from the flags (Config.tta_options)."""

    transforms: str
    merge: str
    threshold: float | None
    batch_size: int
    seed: int
    plan: str = "auto"  # --tta_plan: auto (timed at load), graph or loop


PLANS = ("graph", "loop")  # how the views run: all in one session.run, or one run per view
PLAN_CHOICES = ("auto", *PLANS)
PLAN_TIMED_RUNS = 3  # timed turns per plan at load (after one untimed turn), best of


@dataclass(frozen=True)
class PlanTimings:
    """The two plans timed at load on one batch of the run's batch size, best of a few turns."""

    graph_ms: float
    loop_ms: float
    batch_size: int
    clock: str = "wall"  # cpu: this process's CPU time (one CPU thread); wall: elapsed time

    @property
    def faster(self) -> str:
        return "loop" if self.loop_ms < self.graph_ms else "graph"

    def report(self) -> dict:
        return {"graph_ms": round(self.graph_ms, 4), "loop_ms": round(self.loop_ms, 4),
                "batch_size": self.batch_size, "clock": self.clock}


@dataclass
class TTARunner:
    """How TTA runs. Plan `graph`: every view of a chunk in one session.run: `merged` runs the
    TTA graph (views, model and merge in one graph); without it numpy stacks the views for
    `predict` (the plain graph) and merges its output. Plan `loop`: numpy builds one view at a
    time, `predict` runs each (batch_size rows), numpy merges (what ttach does in PyTorch). Both
    give the same probabilities; which is faster depends on the model and the batch size
    (choose_plan times them)."""

    predict: Predict
    transforms: Sequence[Transform]
    merge_mode: str
    batch_size: int
    merged: Predict | None = None
    plan: str = "graph"
    plan_timings: PlanTimings | None = None  # None: the plan was not timed (--tta_plan given)

    @property
    def backend(self) -> str:
        """Where the graph plan builds the views: in the TTA graph, or numpy."""
        return "onnx_graph" if self.merged is not None else "numpy"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Merged probabilities, chunk by chunk. A chunk is batch_size samples, except for token
        ids under the graph plan: batch_size / views texts, so that its one run of all the views
        pads only to the chunk's own longest text (SMS, 4 views, batch 64: TTA cost 4.6x plain
        with 64-text chunks, 3.0x with 16)."""
        out = []
        step = self.batch_size
        if x.dtype == np.int64 and x.ndim == 2 and self.plan == "graph":
            step = max(1, self.batch_size // views_per_sample(self.transforms))
        for start in range(0, len(x), step):
            chunk = x[start:start + step]
            if chunk.dtype == np.int64 and chunk.ndim == 2:  # token ids: drop unused padding
                chunk = trim_padding(chunk, pad_id_of(self.transforms))
            chunk = np.ascontiguousarray(chunk)
            out.append(self._loop(chunk) if self.plan == "loop" else self._run_chunk(chunk))
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def _run_chunk(self, chunk: np.ndarray) -> np.ndarray:
        if self.merged is not None:
            return self.merged(chunk)
        stacked, owners = expand(chunk, self.transforms)
        return merge(self.predict(self._fed(stacked)), owners, len(chunk), self.merge_mode)

    def _loop(self, chunk: np.ndarray) -> np.ndarray:
        """One session.run per view (window:N's views of a chunk: one run), merged by numpy."""
        probs, owners = [], []
        for view, rows in view_sets(chunk, self.transforms):
            probs.append(self.predict(self._fed(view)))
            owners.append(rows)
        return merge(np.concatenate(probs), _owners(owners, len(chunk)), len(chunk),
                     self.merge_mode)

    def _fed(self, views: np.ndarray) -> np.ndarray:
        """Views as a session takes them: contiguous, token ids without unused padding."""
        if views.dtype == np.int64 and views.ndim == 2:
            views = trim_padding(views, pad_id_of(self.transforms))
        return np.ascontiguousarray(views)

    def with_plan(self, plan: str, timings: PlanTimings | None = None) -> TTARunner:
        """The same runner (sessions shared) running `plan`."""
        if plan not in PLANS:
            raise ConfigError(f"unknown --tta_plan {plan!r}",
                              f"use one of {', '.join(PLAN_CHOICES)}")
        return replace(self, plan=plan, plan_timings=timings)

    def run(self, x: np.ndarray, threshold: float | None = None) -> TTAOutcome:
        """Plain predictions (timed), then TTA (timed): on every sample, or with `threshold`
        only on samples whose plain top probability is below it (TTA time then includes the
        plain pass)."""
        seconds_plain, plain = best_of(1, lambda: np.concatenate(
            [self.predict(b) for b in batches_of(x, self.batch_size, pad_id_of(self.transforms))]))
        triggered = (plain.max(1) < threshold) if threshold is not None else np.ones(len(x), bool)
        merged = plain.copy()
        rows = np.flatnonzero(triggered)

        def augment_triggered() -> None:
            if len(rows):
                merged[rows] = self(x[rows])

        seconds, _ = best_of(1, augment_triggered)
        seconds += seconds_plain if threshold is not None else 0
        return TTAOutcome(merged, plain, triggered, seconds, seconds_plain,
                          views_per_sample(self.transforms))

    def cost_ratio(self, x: np.ndarray, threshold: float | None, repeats: int = 3) -> float:
        """TTA time / plain time over the split, each the best of `repeats` alternating passes
        (the first outcome already warmed both paths up)."""
        outcomes = [self.run(x, threshold) for _ in range(repeats)]
        plain = min(o.seconds_plain for o in outcomes)
        return round(min(o.seconds for o in outcomes) / max(plain, 1e-9), 3)


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
    backend: str = "numpy"  # onnx_graph: the graph plan's views and merge are ONNX nodes
    plan: str = "graph"  # graph: all views in one session.run; loop: one run per view
    plan_timings: dict | None = None  # both plans timed at load (None: --tta_plan chose)
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


def evaluate_tta(runner: TTARunner, test: tuple[np.ndarray, np.ndarray],
                 val: tuple[np.ndarray, np.ndarray] | None, threshold: float | None
                 ) -> TTAResult:
    """TTA vs plain on the test split (and the validation split, to judge it honestly)."""
    x, y = test
    outcome = runner.run(x, threshold)
    right_tta = outcome.probabilities.argmax(1) == y
    right_plain = outcome.plain.argmax(1) == y
    result = TTAResult(
        transforms=[t.spec for t in runner.transforms], merge=runner.merge_mode,
        views=outcome.views, accuracy=float(right_tta.mean()),
        accuracy_plain=float(right_plain.mean()), fixed=int((right_tta & ~right_plain).sum()),
        broken=int((~right_tta & right_plain).sum()), cost_ratio=runner.cost_ratio(x, threshold),
        triggered_fraction=float(outcome.triggered.mean()), threshold=threshold,
        backend=runner.backend, plan=runner.plan,
        plan_timings=runner.plan_timings.report() if runner.plan_timings else None)
    if val is not None and len(val[1]):
        checked = runner.run(val[0], threshold)
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


def tta_runner(session: ort.InferenceSession, model_path: Path, manifest: Manifest,
               options: TTAOptions, runtime: RuntimeOptions, rows: np.ndarray | None = None
               ) -> TTARunner:
    """TTA on the chosen graph: in one ONNX graph with the views and the merge (a second session
    on the same providers) where the transforms allow, else numpy views around `session`; run
    by the plan --tta_plan names, or with auto the faster one on a batch of `rows` (the first
    batch_size of them, repeated where fewer; None: rows made up from the manifest)."""
    transforms = build_transforms(options.transforms, manifest.preprocessing.spec, options.seed)
    model = tta_model(onnx.load(str(model_path)), transforms, options.merge, manifest.classes)
    merged = None
    if model is not None:
        merged = session_runner(create_session(model.SerializeToString(), runtime,
                                               classes=manifest.classes, source=model_path))
    runner = TTARunner(session_runner(session), transforms, options.merge, options.batch_size,
                       merged)
    if options.plan != "auto":
        LOG.info("TTA plan: %s (--tta_plan)", options.plan)
        return runner.with_plan(options.plan)
    probe = probe_rows(rows, manifest, options.batch_size, options.seed)
    return choose_plan(runner, probe, plan_clock(session, runtime))


def choose_plan(runner: TTARunner, probe: np.ndarray, clock: str = "wall") -> TTARunner:
    """The runner with the faster plan on `probe` (one batch), both timed by `clock` and
    recorded; a runner without extra views keeps the graph plan (one run either way)."""
    if views_per_sample(runner.transforms) == 1:
        return runner
    timings = time_plans(runner, probe, clock)
    LOG.info("TTA plan: %s (batch of %d, %s time: all views in one session.run %.3f ms, one "
             "run per view %.3f ms)", timings.faster, timings.batch_size, timings.clock,
             timings.graph_ms, timings.loop_ms)
    return runner.with_plan(timings.faster, timings)


def plan_clock(session: ort.InferenceSession, runtime: RuntimeOptions) -> str:
    """What the plans are timed by: "cpu", this process's CPU time, where ONNX Runtime runs on
    one CPU thread (what a run costs however busy the machine is: elapsed time then also counts
    the waits for other processes, which hit a long run more often than a short one); else
    "wall", elapsed time (a GPU, several threads)."""
    cpu_only = list(session.get_providers()) == ["CPUExecutionProvider"]
    return "cpu" if cpu_only and runtime.intra_op_threads == 1 else "wall"


def time_plans(runner: TTARunner, probe: np.ndarray, clock: str = "wall",
               runs: int = PLAN_TIMED_RUNS) -> PlanTimings:
    """Both plans on the same batch in turns, each turn in the other order, after one untimed
    turn (ONNX Runtime sizes its buffers for the batch): the best of `runs` turns each."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    plans = [runner.with_plan(plan) for plan in PLANS]
    best = [math.inf] * len(plans)
    for turn in range(1 + runs):
        for k in (range(len(plans)) if turn % 2 else reversed(range(len(plans)))):
            start = now()
            plans[k](probe)
            if turn:
                best[k] = min(best[k], now() - start)
    return PlanTimings(best[0] * 1e3, best[1] * 1e3, len(probe), clock)


def probe_rows(rows: np.ndarray | None, manifest: Manifest, batch_size: int, seed: int = 0
               ) -> np.ndarray:
    """A batch of batch_size rows to time the plans on: the first of `rows` (repeated where
    there are fewer), else made up from the manifest: pixels in [0, 1), standard normal
    features, or 32 token ids drawn from the vocabulary (no padding or special id)."""
    if rows is not None and len(rows):
        picked = rows[np.arange(batch_size) % len(rows)]
        if picked.dtype == np.int64 and picked.ndim == 2:
            picked = trim_padding(picked, manifest.input.pad_id)
        return np.ascontiguousarray(picked)
    rng = np.random.default_rng(seed)
    pre = manifest.preprocessing.spec
    if pre["kind"] == "image":
        shape = (int(pre["channels"]), *map(int, pre["image_size"]))
        return rng.random((batch_size, *shape), dtype=np.float32)
    if pre["kind"] == "text":
        return _probe_ids(pre, batch_size, rng)
    features = len(pre.get("feature_names", ())) or int(manifest.input.shape[-1])
    return rng.standard_normal((batch_size, features)).astype(np.float32)


def _probe_ids(pre: dict, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    length = min(32, int(pre.get("max_length", 32)))
    vocab = int(pre.get("vocab_size", 2))
    ids = rng.integers(0, vocab, (batch_size, length))
    reserved = [_pad(pre), *pre.get("special_ids", ())]
    return np.where(np.isin(ids, reserved), int(pre.get("unk_id", 1)), ids).astype(np.int64)
