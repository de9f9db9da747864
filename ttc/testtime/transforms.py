"""The one TTA vocabulary (issue #63): every name --tta_transforms takes is one class in
TRANSFORMS, for every model type.

As in ttach, a transform gives one or more views (rotate:DEG gives ±DEG, shift:PX four shifts);
for each view it augments an image batch (NCHW, numpy or torch: a segmenter's and a detector's
views run inside their exported torch graph) and de-augments what the model said about the view
back onto the original image:
- `class`: a class vector (N, K); no transform here moves a class, so it comes back as it is;
- `mask`: per-pixel logits or probabilities (N, C, h, w) of the view → (N, C, H, W);
- `boxes`: (..., 4) x1, y1, x2, y2 in the view's pixels (h, w) → the original's (H, W).
A transform that cannot map an output kind back says why (`cannot`), and a model type takes
exactly the transforms of its input kind that can map its output back (`accepted`).

A classifier's graph takes one image size, so its views also exist as ONNX nodes and a numpy
twin (`compile`: tta.py runs them), and there `scale:F` zooms on the same canvas; a segmenter's
and a detector's graphs take any height and width, so their `scale:F` resizes the image by F and
a quarter turn of a non-square image is simply a view of the other shape.

No torch or onnx at import: config.py validates the flags with this module before any heavy
import.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import numpy as np

from ttc.inputs.preprocess import PAD_ID, real_tokens
from utils import ConfigError

if TYPE_CHECKING:
    from ttc.testtime.tta_graph import GraphNodes, ViewBuilder

Array = Any  # a numpy array or a torch tensor, NCHW for images
IMAGE, TEXT, TABULAR = ("image",), ("text",), ("tabular",)
OUTPUTS = ("class", "mask", "boxes")
# the model kinds (preprocessing.kind) whose output is not a class vector, and their input
_DENSE_KINDS = {"segmentation": ("image", "mask"), "detection": ("image", "boxes")}


def input_of(kind: str) -> str:
    """What a model of this kind takes: image, text or tabular (a kind of its own, a
    regressor's, takes its model type's input: Task.input_role)."""
    if kind in _DENSE_KINDS or kind in ("image", "text", "tabular"):
        return _DENSE_KINDS.get(kind, (kind, "class"))[0]
    from ttc.tasks.registry import task_of_kind

    try:
        role = task_of_kind(kind).input_role
    except KeyError:
        return kind
    return "tabular" if role == "feature" else role


def output_of(kind: str) -> str:
    """What a model of this kind gives, as a transform de-augments it: class, mask or boxes."""
    return _DENSE_KINDS.get(kind, (kind, "class"))[1]


# ----------------------------------------------------------------------------- array helpers


def _numpy(x: Array) -> bool:
    return isinstance(x, np.ndarray)


def _flip(x: Array, axis: int) -> Array:
    return np.flip(x, axis).copy() if _numpy(x) else x.flip(axis)


def _turn(x: Array, turns: int) -> Array:
    """`turns` quarter turns (counter-clockwise as shown, rows first) of the last two axes."""
    if _numpy(x):
        return np.rot90(x, turns, axes=(-2, -1)).copy()
    return x.rot90(turns, (-2, -1))


def _corners(boxes: Array, x1: Array, y1: Array, x2: Array, y2: Array) -> Array:
    if _numpy(boxes):
        return np.stack([x1, y1, x2, y2], axis=-1)
    import torch

    return torch.stack([x1, y1, x2, y2], dim=-1)


def _unpack(boxes: Array) -> tuple[Array, Array, Array, Array]:
    return boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]


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


def _shift(x: Array, dy: int, dx: int) -> Array:
    """Move the content dy pixels down and dx right, replicating the border."""
    height, width = x.shape[-2], x.shape[-1]
    top, left = abs(dy) - dy, abs(dx) - dx
    if _numpy(x):
        padded = np.pad(x, ((0, 0), (0, 0), (abs(dy),) * 2, (abs(dx),) * 2), mode="edge")
        return np.ascontiguousarray(padded[..., top:top + height, left:left + width])
    import torch.nn.functional as F

    padded = F.pad(x, (abs(dx), abs(dx), abs(dy), abs(dy)), mode="replicate")
    return padded[..., top:top + height, left:left + width]


def _rotation(degrees: float) -> np.ndarray:
    angle = np.deg2rad(degrees)
    return np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])


def _zoom(factor: float, rng: np.random.Generator) -> np.ndarray:
    """A random zoom between none and `factor` (> 1 zooms in: a centre crop of 1/factor)."""
    return np.eye(2) / rng.uniform(min(1, factor), max(1, factor))


def _brighten(x: Array, delta: float) -> Array:
    if _numpy(x):
        return np.clip(x + np.float32(delta), 0, 1).astype(x.dtype)
    return (x + delta).clamp(0, 1)


def _contrast(x: Array, factor: float) -> Array:
    """Scale each image's deviation from its own mean."""
    if _numpy(x):
        mean = x.mean(axis=(1, 2, 3), keepdims=True)
        return np.clip((x - mean) * np.float32(factor) + mean, 0, 1).astype(x.dtype)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return ((x - mean) * factor + mean).clamp(0, 1)


def _resize(x: Array, size: Sequence[int] | None = None, factor: float | None = None,
            real_grid: bool = False) -> Array:
    """Bilinear resize to `size`, or by `factor`: with `real_grid` on the pixel grid of the real
    size it gives (recompute_scale_factor: ONNX Resize with sizes), so that the view's pixel u
    is the input's u × H / h exactly."""
    import torch
    import torch.nn.functional as F

    tensor = torch.from_numpy(np.ascontiguousarray(x)) if _numpy(x) else x
    if size is not None:
        out = F.interpolate(tensor, size=list(size), mode="bilinear",
                            align_corners=False)
    else:
        out = F.interpolate(tensor, scale_factor=factor, mode="bilinear", align_corners=False,
                            recompute_scale_factor=real_grid or None)
    return out.numpy() if _numpy(x) else out


def _maybe(fn: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """Random form of a fixed transform: applied to each sample with probability 1/2."""
    def apply(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        chosen = rng.random(len(x)) < 0.5
        out = x.copy()
        out[chosen] = fn(x[chosen])
        return out
    return apply


# ----------------------------------------------------------------------------- token helpers


def pad_id(pre: dict) -> int:
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
    return np.where(drop, pad_id(pre), ids).astype(ids.dtype)


def _split_row(row: np.ndarray, pre: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A text's ids as (leading special tokens, its own tokens, trailing special tokens), the
    padding left out: [CLS] … [SEP] for a BERT tokenizer, ([], tokens, []) for ours."""
    real = np.flatnonzero(real_tokens(row[None], pre)[0])
    used = np.flatnonzero(row != pad_id(pre))
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
    padded = np.full((len(views), width), pad_id(pre), dtype=ids.dtype)
    for k, view in enumerate(views):
        padded[k, : len(view)] = view
    return padded, np.array(owners)


def _random_window(x: np.ndarray, size: int, rng: np.random.Generator, pre: dict
                   ) -> np.ndarray:
    """Each text cut to `size` of its own tokens from a random start, its special tokens kept
    (training's form of window:N; same width as x)."""
    out = np.full_like(x, pad_id(pre))
    for i, row in enumerate(x):
        head, tokens, tail = _split_row(row, pre)
        start = rng.integers(0, max(1, len(tokens) - size + 1))
        piece = np.concatenate([head, tokens[start:start + size], tail])
        out[i, : len(piece)] = piece
    return out


def _special_ids(pre: dict) -> tuple[int, ...]:
    """The ids token-level views never drop besides padding (preprocess.real_tokens' rule)."""
    return tuple(sorted({int(i) for i in pre.get("special_ids", ())
                         if i != pre.get("unk_id") and i != pad_id(pre)}))


# ----------------------------------------------------------------------------- the classifier's form


@dataclass(frozen=True)
class Transform:
    """A classifier's compiled transform (TTATransform.compile; tta.py runs it).

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


# ----------------------------------------------------------------------------- the transforms


class TTATransform:
    """One --tta_transforms entry (`name` or `name:param`). Subclasses override what differs:
    `settings` (one per view), `augment`, the three de-augmentations, and the classifier's
    `graph` and `random` forms (or `compile` whole)."""

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[str, ...]] = IMAGE  # the inputs it applies to
    meaning: ClassVar[str] = ""  # its parameter's valid range ("": it takes none)
    aliases: ClassVar[tuple[str, ...]] = ()
    cannot: ClassVar[dict[str, str]] = {}  # output kind → why its views cannot be mapped back

    def __init__(self, param: float | None = None) -> None:
        self.param = param

    @staticmethod
    def valid(value: float) -> bool:
        return True

    @property
    def spec(self) -> str:
        return self.name if self.param is None else f"{self.name}:{self.param:g}"

    def settings(self) -> list[Any]:
        """Each view's own setting (a turn, an angle, a shift), one per view."""
        return [None]

    def augment(self, x: Array, setting: Any = None) -> Array:
        return x

    def deaugment_class(self, probabilities: Array, setting: Any = None) -> Array:
        return probabilities

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        """Per-pixel planes (N, C, h, w) of the view → the original's (N, C, H, W) = `size`."""
        return planes

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        """Boxes found in the view of spatial size `seen` (h, w) → on the original (H, W)."""
        return boxes

    def views(self, output: str = "class") -> list[View]:
        """Its views for a model whose output is `output` (class, mask or boxes)."""
        return [View(self, setting) for setting in self.settings()]

    # the classifier's form: numpy views, ONNX nodes and the training-time random form

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        settings = self.settings()
        return Transform(self.name, self.param, lambda x: [self.augment(x, s) for s in settings],
                         self.random, lambda g, x: [self.graph(g, x, s, pre) for s in settings],
                         count=len(settings))

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        raise NotImplementedError(self.name)

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _maybe(self.augment)(x, rng)


@dataclass(frozen=True)
class View:
    """One view of a transform: how its image is made and how the model's output comes back."""

    transform: TTATransform
    setting: Any = None

    def augment(self, x: Array) -> Array:
        return self.transform.augment(x, self.setting)

    def deaugment_class(self, probabilities: Array) -> Array:
        return self.transform.deaugment_class(probabilities, self.setting)

    def deaugment_mask(self, planes: Array, size: Sequence) -> Array:
        return self.transform.deaugment_mask(planes, size, self.setting)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence) -> Array:
        return self.transform.deaugment_boxes(boxes, seen, size, self.setting)


class Identity(TTATransform):
    """The plain view (always included; naming it adds nothing)."""

    name = "identity"
    kinds = IMAGE + TEXT + TABULAR


class HorizontalFlip(TTATransform):
    name, aliases = "hflip", ("flip",)

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _flip(x, -1)

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _flip(planes, -1)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        x1, y1, x2, y2 = _unpack(boxes)
        return _corners(boxes, size[1] - x2, y1, size[1] - x1, y2)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.flip(nodes, x, [3])


class VerticalFlip(TTATransform):
    name = "vflip"

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _flip(x, -2)

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _flip(planes, -2)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        x1, y1, x2, y2 = _unpack(boxes)
        return _corners(boxes, x1, size[0] - y2, x2, size[0] - y1)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.flip(nodes, x, [2])


class QuarterTurns(TTATransform):
    """`turns` quarter turns, counter-clockwise (np.rot90). A non-square image's view has the
    other shape: a classifier's graph (one size) refuses it, a segmenter's or a detector's
    (any size) runs it as it is."""

    turns: ClassVar[int] = 1

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _turn(x, self.turns)

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _turn(planes, -self.turns)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        x1, y1, x2, y2 = _unpack(boxes)
        height, width = size[0], size[1]
        if self.turns == 1:  # the view's point (x, y) is the original's (W - y, x)
            return _corners(boxes, width - y2, x1, width - y1, x2)
        if self.turns == 2:
            return _corners(boxes, width - x2, height - y2, width - x1, height - y1)
        return _corners(boxes, y1, height - x2, y2, height - x1)

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        height, width = pre["image_size"]
        if self.turns % 2 and height != width:
            raise ConfigError(f"TTA transform {self.name} needs square images, these are "
                              f"{pre['image_size']}", "use rot180 or rotate:DEG")
        return super().compile(pre, seeded)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.rot90(nodes, x, self.turns)


class Rot90(QuarterTurns):
    name, turns = "rot90", 1


class Rot180(QuarterTurns):
    name, turns = "rot180", 2


class Rot270(QuarterTurns):
    name, turns = "rot270", 3


class Resampled(TTATransform):
    """A view resampled on the same canvas by a 2x2 matrix per view (rotate, crop; a
    classifier's scale): numpy views only, so classifier views."""

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _affine(x, setting)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        return _resample_nodes(nodes, x, setting, pre)


def _resample_nodes(nodes: GraphNodes, x: str, matrix: np.ndarray, pre: dict) -> str:
    from ttc.testtime import tta_graph

    return tta_graph.resample(nodes, x, tta_graph.affine_grid(*pre["image_size"], matrix))


class Rotate(Resampled):
    name, meaning = "rotate", "degrees in (0, 180)"
    cannot = {"mask": "rotating the logits back leaves the corners with no prediction of the view",
              "boxes": "a rotated box's axis-aligned hull is larger than the object, so its "
                       "boxes do not map back"}

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value < 180

    def settings(self) -> list[Any]:
        return [_rotation(self.param), _rotation(-self.param)]

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _affine(x, _rotation(rng.uniform(-self.param, self.param)))


class Crop(Resampled):
    name, meaning = "crop", "a fraction in (0, 1)"
    cannot = {"mask": "its view sees only the centre, so the pixels outside get no logits",
              "boxes": "its view sees only the centre, and the fusion counts a view that misses "
                       "an object against it"}

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value < 1

    def settings(self) -> list[Any]:
        return [np.eye(2) * self.param]

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _affine(x, _zoom(1 / self.param, rng))


class Scale(TTATransform):
    """The image resized by F (bilinear); logits resized back to the input's size, boxes scaled
    by the real size ratio (a box view's setting True: resized on its real size's pixel grid,
    so that the ratio is exact; a mask view resizes by F as given, which keeps a segmenter's
    exported height and width dynamic). A classifier (one input size) zooms by F on the same
    canvas instead: a centre crop of 1/F for F > 1, the border replicated for F < 1."""

    name, meaning = "scale", "a factor in (0, 4], not 1"

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value <= 4 and value != 1

    def views(self, output: str = "class") -> list[View]:
        return [View(self, output == "boxes")]

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _resize(x, factor=self.param, real_grid=bool(setting))

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _resize(planes, size=size)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        x1, y1, x2, y2 = _unpack(boxes)
        sx, sy = size[1] / seen[1], size[0] / seen[0]
        return _corners(boxes, x1 * sx, y1 * sy, x2 * sx, y2 * sy)

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        matrix = np.eye(2) * (1 / self.param)
        return Transform(self.name, self.param, lambda x: [_affine(x, matrix)],
                         lambda x, rng: _affine(x, _zoom(self.param, rng)),
                         lambda g, x: [_resample_nodes(g, x, matrix, pre)])


class Shift(TTATransform):
    """Four views: the content moved PX pixels down, up, right and left (the border
    replicated); a mask is moved back, boxes moved back by the same pixels."""

    name, meaning = "shift", "whole pixels ≥ 1"

    @staticmethod
    def valid(value: float) -> bool:
        return value >= 1 and value == int(value)

    def settings(self) -> list[Any]:
        step = int(self.param)
        return [(step, 0), (-step, 0), (0, step), (0, -step)]

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _shift(x, *setting)

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _shift(planes, -setting[0], -setting[1])

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        dy, dx = setting
        x1, y1, x2, y2 = _unpack(boxes)
        return _corners(boxes, x1 - dx, y1 - dy, x2 - dx, y2 - dy)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.shift(nodes, x, *setting, *pre["image_size"])

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _shift(x, *self.settings()[rng.integers(4)])


class Brightness(TTATransform):
    """Two views, DELTA brighter and darker (clipped to [0, 1]); nothing moves, so every output
    comes back as it is."""

    name, meaning = "brightness", "a delta in (0, 1)"

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value < 1

    def settings(self) -> list[Any]:
        return [self.param, -self.param]

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _brighten(x, setting)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.brighten(nodes, x, setting)

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _brighten(x, rng.uniform(-self.param, self.param))


class Contrast(TTATransform):
    """Each image's deviation from its own mean scaled by FACTOR; nothing moves."""

    name, meaning = "contrast", "a factor in (0, 4], not 1"

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value <= 4 and value != 1

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _contrast(x, self.param)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.contrast(nodes, x, self.param)

    def random(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _contrast(x, rng.uniform(min(1, self.param), max(1, self.param)))


class TokenDropout(TTATransform):
    """One view with a share P of each text's real tokens dropped (one mask drawn from --seed)."""

    name, kinds, meaning = "token_dropout", TEXT, "a probability in (0, 1)"

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value < 1

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        from ttc.testtime import tta_graph

        value = self.param
        keep = seeded.random(int(pre.get("max_length", 512))) >= value
        tokens = tta_graph.TokenIds(pad_id(pre), _special_ids(pre))

        def stacked(g: GraphNodes, x: str, keeps: np.ndarray) -> str:
            return tta_graph.mask_tokens(g, x, keeps, tokens)

        return Transform(self.name, value, lambda x: [_drop_tokens(x, keep, pre)],
                         lambda x, rng: _drop_tokens(x, rng.random(x.shape) >= value, pre),
                         lambda g, x: [stacked(g, x, keep[None])],
                         constant=keep, stacked_graph=stacked, pad_id=pad_id(pre))


class Window(TTATransform):
    """A view per window of N tokens (stride N/2) of each longer text."""

    name, kinds, meaning = "window", TEXT, "a whole number of tokens ≥ 2"

    @staticmethod
    def valid(value: float) -> bool:
        return value >= 2 and value == int(value)

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        size = int(self.param)
        return Transform(self.name, self.param, lambda x: [],
                         lambda x, rng: _random_window(x, size, rng, pre), None,
                         ragged=lambda x: _windows(x, size, pre), pad_id=pad_id(pre))


class Jitter(TTATransform):
    """Noise of SIGMA training standard deviations on numeric features (one fixed draw per
    view); one-hot columns stay as they are."""

    name, kinds, meaning = "jitter", TABULAR, "a standard deviation in (0, 5]"

    @staticmethod
    def valid(value: float) -> bool:
        return 0 < value <= 5

    def compile(self, pre: dict, seeded: np.random.Generator) -> Transform:
        from ttc.testtime import tta_graph

        names = pre["feature_names"]
        numeric = {c["name"] for c in pre["columns"] if c["type"] == "numeric"}
        scale = np.array([s if n in numeric else 0.0 for n, s in zip(names, pre["std"])],
                         dtype=np.float32) * self.param
        noise = (seeded.standard_normal(len(names)).astype(np.float32) * scale).astype(np.float32)

        def jitter(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
            return (x + rng.standard_normal(x.shape).astype(np.float32) * scale).astype(np.float32)

        return Transform(self.name, self.param, lambda x: [x + noise], jitter,
                         lambda g, x: [tta_graph.add_vectors(g, x, noise[None])],
                         constant=noise, stacked_graph=tta_graph.add_vectors)


# Adding a transform is adding its class here (and naming it in ttc/options/tta.py's
# --tta_transforms help).
TRANSFORMS: tuple[type[TTATransform], ...] = (
    Identity, HorizontalFlip, VerticalFlip, Rot90, Rot180, Rot270, Rotate, Shift, Crop, Scale,
    Brightness, Contrast, TokenDropout, Window, Jitter)
ALIASES = {alias: cls.name for cls in TRANSFORMS for alias in cls.aliases}


def accepted(kind: str) -> dict[str, type[TTATransform]]:
    """The transforms a model of this kind takes: of its input, able to map its output back."""
    return {cls.name: cls for cls in TRANSFORMS
            if input_of(kind) in cls.kinds and output_of(kind) not in cls.cannot}


def _listed(kind: str) -> str:
    return ", ".join(n + (":X" if cls.meaning else "") for n, cls in accepted(kind).items())


AUTO = "auto"  # --tta_transforms auto[:POOL]: views chosen on held-out data (tta_policy.py)
# The candidate views of auto without a pool, per input (tta_policy.py searches them): the
# vocabulary's geometric and photometric views at small strengths; a type's own default among
# them. rot90/rot270 are left out of a non-square image's pool (tta_policy.candidate_pool).
AUTO_POOLS = {"image": "hflip,vflip,rot90,rot180,rot270,rotate:10,shift:1,shift:2,crop:0.9,"
                       "scale:0.9,scale:1.1,brightness:0.1,contrast:1.25",
              "text": "token_dropout:0.05,token_dropout:0.1,token_dropout:0.1,token_dropout:0.2,"
                      "window:16,window:32",
              "tabular": "jitter:0.05,jitter:0.1,jitter:0.1,jitter:0.2"}


def is_auto(text: str) -> bool:
    """Whether a --tta_transforms text asks for views chosen on held-out data: auto[:LIST]."""
    return text.strip().partition(":")[0].strip().lower() == AUTO


def training_spec(text: str) -> str:
    """The views training draws its random forms from: --tta_transforms as given, of
    `auto:LIST` its LIST, and "" (the model type's default) for a bare `auto`."""
    return text.partition(":")[2].strip() if is_auto(text) else text


def auto_pool(text: str, kind: str) -> str:
    """The candidate pool of `--tta_transforms auto[:LIST]`: LIST as given, or for a bare auto
    the AUTO_POOLS entry of the kind's input."""
    _, colon, pool = text.strip().partition(":")
    return pool.strip() if colon else AUTO_POOLS[input_of(kind)]


def parse_auto(text: str, kind: str) -> list[tuple[str, float | None]]:
    """The candidate views of `--tta_transforms auto[:LIST]` for a model of `kind`; exit 2 for
    a model whose views cannot be chosen at inference (a segmenter's and a detector's are fixed
    in its exported TTA graph), an empty pool, or an entry the kind does not take."""
    if output_of(kind) != "class":
        raise ConfigError(f"--tta_transforms {text!r}: auto chooses a classifier's views on "
                          f"held-out data at inference, and a {kind} model's views are fixed "
                          "in its exported TTA graph (model.tta.onnx)",
                          f"name the views instead (valid: {_listed(kind)})")
    pool = auto_pool(text, kind)
    entries = parse_transform_specs(pool, kind) if pool.strip(" ,") else []
    if not entries:
        raise ConfigError(f"--tta_transforms {text!r} names no candidate view",
                          f"use auto, or auto:LIST with views of {_listed(kind)}")
    return entries


def parse_transform_specs(text: str, kind: str, default: str = ""
                          ) -> list[tuple[str, float | None]]:
    """'hflip,rotate:10' → [('hflip', None), ('rotate', 10.0)], the identity left out; a bare
    number after an entry with a parameter repeats it ('scale:0.75,1.25'). An empty text is
    `default` (the model type's default_tta); `auto[:LIST]` is its candidate pool (parse_auto).
    Exit 2 on anything the kind does not take."""
    if is_auto(text):
        return parse_auto(text, kind)
    given = text or default
    if not given:
        raise ConfigError(f"TTA has no default transforms for {kind} models",
                          f"name them with --tta_transforms (valid: {_listed(kind)})")
    parsed: list[tuple[str, float | None]] = []
    previous: type[TTATransform] | None = None
    for item in filter(None, (p.strip() for p in given.split(","))):
        if previous is not None and previous.meaning and _is_number(item):
            parsed.append((previous.name, _parameter(previous, item, item)))
            continue
        name, _, raw = item.partition(":")
        previous = _known(name.strip().lower(), item, kind)
        if bool(previous.meaning) != bool(raw):
            raise ConfigError(f"TTA transform {item!r} " + ("needs a parameter" if previous.meaning
                              else "takes no parameter"), f"valid: {_listed(kind)}")
        if previous is not Identity:
            parsed.append((previous.name, _parameter(previous, item, raw) if raw else None))
    return parsed


def _known(name: str, item: str, kind: str) -> type[TTATransform]:
    """The class of a name this kind takes; else exit 2, with the reason where the transform
    exists for this input but cannot map this kind's output back."""
    cls = next((c for c in TRANSFORMS if c.name == ALIASES.get(name, name)), None)
    if cls is None or input_of(kind) not in cls.kinds:
        raise ConfigError(f"unknown TTA transform {item!r} for {kind} models",
                          f"valid: {_listed(kind)}")
    if output_of(kind) in cls.cannot:
        raise ConfigError(f"TTA transform {item!r} does not fit {kind} models: "
                          f"{cls.cannot[output_of(kind)]}", f"valid: {_listed(kind)}")
    return cls


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parameter(cls: type[TTATransform], item: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not cls.valid(value):
        raise ConfigError(f"TTA transform {item!r}: the parameter must be {cls.meaning}",
                          f"e.g. {cls.name}:{'0.1' if '(0, 1)' in cls.meaning else '2'}")
    return value


def transform(name: str, param: float | None = None) -> TTATransform:
    """The transform of a parsed entry."""
    return next(cls for cls in TRANSFORMS if cls.name == name)(param)


def image_views(entries: Sequence[tuple[str, float | None]], output: str) -> list[View]:
    """The views of parsed entries for a model whose output is `output` (mask or boxes), the
    plain view first: what a segmenter's and a detector's TTA graphs run."""
    return [View(Identity())] + [view for name, param in entries
                                 for view in transform(name, param).views(output)]
