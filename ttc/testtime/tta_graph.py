"""TTA as one ONNX graph: the views are built by nodes in front of the bundle's model and merged
by nodes behind it, so one session.run takes a batch to merged probabilities, with no numpy and
no Python between views, model and merge (what makes batch-1 TTA cheap, and what a GPU needs).

The builders here know ONNX; tta.py knows what each transform means and keeps a numpy twin of
every view, which the tests hold these nodes to.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ttc.inputs.preprocess import PADDING_ID_KEY
from ttc.serving.runtime import TEXT_COMPANIONS

MIN_OPSET = 18  # ReduceMean/ReduceMax take their axes as an input from opset 18 on
THROUGH_START = -(2**63)  # a Slice end that, with step −1, runs to the first element
PROBABILITIES = "probabilities"
VIEW_PROBABILITIES = "tta_view_probabilities"


class GraphNodes:
    """Nodes and constants being added to a graph; every name gets a prefix to stay unique."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _name(self, hint: str) -> str:
        return f"{self.prefix}_{hint}_{len(self.nodes) + len(self.initializers)}"

    def const(self, value: object, dtype: type = np.int64) -> str:
        name = self._name("const")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None,
           **attributes: object) -> str:
        output = output or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output],
                                           name=self._name(op_type), **attributes))
        return output


ViewBuilder = Callable[[GraphNodes, str], list[str]]

# ----------------------------------------------------------------------------- image views


def flip(nodes: GraphNodes, x: str, axes: Sequence[int]) -> str:
    k = len(axes)
    return nodes.op("Slice", [x, nodes.const([-1] * k), nodes.const([THROUGH_START] * k),
                              nodes.const(list(axes)), nodes.const([-1] * k)])


def rot90(nodes: GraphNodes, x: str, turns: int) -> str:
    """np.rot90(x, turns, axes=(2, 3)) for NCHW images."""
    if turns == 2:
        return flip(nodes, x, [2, 3])
    if turns == 1:
        return nodes.op("Transpose", [flip(nodes, x, [3])], perm=[0, 1, 3, 2])
    return flip(nodes, nodes.op("Transpose", [x], perm=[0, 1, 3, 2]), [3])


def shift(nodes: GraphNodes, x: str, dy: int, dx: int, height: int, width: int) -> str:
    """Content moved dy down and dx right, the border replicated (Pad edge, then Slice)."""
    pad_y, pad_x = abs(dy), abs(dx)
    padded = nodes.op("Pad", [x, nodes.const([0, 0, pad_y, pad_x, 0, 0, pad_y, pad_x])],
                      mode="edge")
    top, left = pad_y - dy, pad_x - dx
    return nodes.op("Slice", [padded, nodes.const([top, left]),
                              nodes.const([top + height, left + width]), nodes.const([2, 3])])


def affine_grid(height: int, width: int, matrix: np.ndarray) -> np.ndarray:
    """GridSample's (1, H, W, 2) grid for: output pixel p (centred) reads input matrix @ p."""
    ys, xs = np.meshgrid(np.arange(height) - (height - 1) / 2,
                         np.arange(width) - (width - 1) / 2, indexing="ij")
    src_y = matrix[0, 0] * ys + matrix[0, 1] * xs + (height - 1) / 2
    src_x = matrix[1, 0] * ys + matrix[1, 1] * xs + (width - 1) / 2
    grid = np.stack([src_x / max(width - 1, 1) * 2 - 1, src_y / max(height - 1, 1) * 2 - 1], -1)
    return grid[None].astype(np.float32)


def resample(nodes: GraphNodes, x: str, grid: np.ndarray) -> str:
    """Bilinear resampling on a fixed grid, border replicated (align_corners: pixel centres)."""
    batch = nodes.op("Shape", [x], start=0, end=1)
    size = nodes.op("Concat", [batch, nodes.const(list(grid.shape[1:]))], axis=0)
    expanded = nodes.op("Expand", [nodes.const(grid, np.float32), size])
    return nodes.op("GridSample", [x, expanded], align_corners=1, mode="bilinear",
                    padding_mode="border")


def clip01(nodes: GraphNodes, x: str) -> str:
    return nodes.op("Clip", [x, nodes.const(0.0, np.float32), nodes.const(1.0, np.float32)])


def brighten(nodes: GraphNodes, x: str, delta: float) -> str:
    return clip01(nodes, nodes.op("Add", [x, nodes.const(delta, np.float32)]))


def contrast(nodes: GraphNodes, x: str, factor: float) -> str:
    """Each image's deviation from its own mean, scaled."""
    mean = nodes.op("ReduceMean", [x, nodes.const([1, 2, 3])], keepdims=1)
    scaled = nodes.op("Mul", [nodes.op("Sub", [x, mean]), nodes.const(factor, np.float32)])
    return clip01(nodes, nodes.op("Add", [scaled, mean]))


# ----------------------------------------------------------------------------- text and tabular


@dataclass(frozen=True)
class TokenIds:
    """What token-level views must know of a tokenizer: its padding id (what a dropped token
    becomes) and the special ids besides it that are never dropped ([CLS], [SEP], ...; the
    unknown id is a real token). preprocess.real_tokens is the numpy rule."""

    pad_id: int = 0
    special_ids: tuple[int, ...] = ()


def real_token_mask(nodes: GraphNodes, ids: str, tokens: TokenIds) -> str:
    """bool, like ids: where ids holds a text's own tokens (not padding, not special)."""
    other = nodes.op("Equal", [ids, nodes.const(tokens.pad_id)])
    for special in tokens.special_ids:
        other = nodes.op("Or", [other, nodes.op("Equal", [ids, nodes.const(special)])])
    return nodes.op("Not", [other])


def mask_tokens(nodes: GraphNodes, ids: str, keeps: np.ndarray, tokens: TokenIds = TokenIds()
                ) -> str:
    """One view per row of keeps (views, max_length): token ids with the real tokens at the
    positions where the row is 0 set to padding, stacked view-major; special tokens stay, and a
    text that would lose every real token keeps its first one (tta._drop_tokens, in nodes).
    The rows cover the longest sequence the model takes."""
    length = nodes.op("Shape", [ids], start=1, end=2)
    zero, last = nodes.const([0]), nodes.const([-1])
    keep = nodes.op("Slice", [nodes.const(keeps[:, None, :].astype(bool), bool), zero, length,
                              last])  # (views, 1, L)
    real = real_token_mask(nodes, ids, tokens)  # (N, L)
    drop = nodes.op("And", [real, nodes.op("Not", [keep])])  # (views, N, L)
    left = nodes.op("Cast", [nodes.op("And", [real, keep])], to=TensorProto.INT64)
    kept_any = nodes.op("Greater", [nodes.op("ReduceMax", [left, nodes.const([2])], keepdims=1),
                                    nodes.const(0)])  # (views, N, 1)
    first = nodes.op("ArgMax", [nodes.op("Cast", [real], to=TensorProto.INT64)], axis=1,
                     keepdims=1)  # (N, 1): the first real token
    positions = nodes.op("Slice", [nodes.const(np.arange(keeps.shape[1])), zero, length, zero])
    not_first = nodes.op("Not", [nodes.op("Equal", [positions, first])])  # (N, L)
    dropped = nodes.op("And", [drop, nodes.op("Or", [kept_any, not_first])])
    views = nodes.op("Where", [dropped, nodes.const(tokens.pad_id), ids])
    return nodes.op("Flatten", [views], axis=2)


def add_vectors(nodes: GraphNodes, x: str, vectors: np.ndarray) -> str:
    """One view per row of vectors (views, features): x + row, stacked view-major."""
    views = nodes.op("Add", [x, nodes.const(vectors[:, None, :], np.float32)])
    return nodes.op("Flatten", [views], axis=2)


# ----------------------------------------------------------------------------- merging


# (nodes, view probabilities (views, N, classes), classes, output name) → merged (N, classes)
# with rows summing to 1; tta.MERGES pairs each with its numpy twin
GraphMerge = Callable[[GraphNodes, str, int, str], str]


def _mean_over_views(nodes: GraphNodes, tensor: str, output: str | None = None) -> str:
    return nodes.op("ReduceMean", [tensor, nodes.const([0])], output, keepdims=0)


def _normalized(nodes: GraphNodes, merged: str, output: str) -> str:
    total = nodes.op("ReduceSum", [merged, nodes.const([1])], keepdims=1)
    return nodes.op("Div", [merged, total], output=output)


def merge_mean(nodes: GraphNodes, p: str, classes: int, output: str) -> str:
    return _mean_over_views(nodes, p, output)  # a mean of distributions sums to 1 already


def merge_gmean(nodes: GraphNodes, p: str, classes: int, output: str) -> str:
    clipped = nodes.op("Clip", [p, nodes.const(1e-12, np.float32), nodes.const(1.0, np.float32)])
    log_mean = _mean_over_views(nodes, nodes.op("Log", [clipped]))
    return _normalized(nodes, nodes.op("Exp", [log_mean]), output)


def merge_max(nodes: GraphNodes, p: str, classes: int, output: str) -> str:
    return _normalized(nodes, nodes.op("ReduceMax", [p, nodes.const([0])], keepdims=0), output)


def merge_vote(nodes: GraphNodes, p: str, classes: int, output: str) -> str:
    """The share of views voting each class; ties go to the higher mean."""
    winners = nodes.op("ArgMax", [p], axis=2, keepdims=0)
    votes = nodes.op("OneHot", [winners, nodes.const([classes]),
                                nodes.const([0.0, 1.0], np.float32)], axis=-1)
    tie_break = nodes.op("Mul", [_mean_over_views(nodes, p), nodes.const(1e-6, np.float32)])
    return _normalized(nodes, nodes.op("Add", [_mean_over_views(nodes, votes), tie_break]), output)


def merge_tsharpen(nodes: GraphNodes, p: str, classes: int, output: str) -> str:
    return _normalized(nodes, _mean_over_views(nodes, nodes.op("Sqrt", [p])), output)


def merge_views(nodes: GraphNodes, probabilities: str, views: int, classes: int,
                rule: GraphMerge, output: str) -> str:
    """(views × N, classes) stacked view-major → (N, classes) by `rule`."""
    p = nodes.op("Reshape", [probabilities, nodes.const([views, -1, classes])])
    return rule(nodes, p, classes, output)


# ----------------------------------------------------------------------------- assembly


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def text_companions(nodes: GraphNodes, model: onnx.ModelProto, ids: str) -> dict[str, str]:
    """An hf graph's attention_mask and token_type_ids as nodes over the stacked views' ids
    (mask 1 where the id is not the padding id its metadata records, types 0: the rule of
    preprocess.text_graph_feed), so that the views' masks follow their own padding and the TTA
    graph takes the ids alone. {} for a graph that takes no such input."""
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    wanted = [name for name in TEXT_COMPANIONS if name in inputs]
    if not wanted:
        return {}
    metadata = {p.key: p.value for p in model.metadata_props}
    if PADDING_ID_KEY not in metadata:
        raise ValueError(f"the graph takes {', '.join(wanted)} but records no {PADDING_ID_KEY}")
    derived = {}
    if "attention_mask" in wanted:
        padding = nodes.op("Equal", [ids, nodes.const(int(metadata[PADDING_ID_KEY]))])
        derived["attention_mask"] = nodes.op("Cast", [nodes.op("Not", [padding])],
                                             to=inputs["attention_mask"])
    if "token_type_ids" in wanted:
        zeros = nodes.op("Mul", [ids, nodes.const(0)])
        derived["token_type_ids"] = nodes.op("Cast", [zeros], to=inputs["token_type_ids"])
    return derived


def with_tta(model: onnx.ModelProto, view_builders: Sequence[ViewBuilder], views: int,
             classes: int, merge: GraphMerge) -> onnx.ModelProto:
    """A copy of `model` that takes the same input and returns merged TTA probabilities: the
    plain input and every builder's views concatenated along the batch axis, the model run once
    on them, and the views merged per sample. An hf graph's attention mask and token types are
    computed from the views' ids inside (text_companions): it takes the ids alone. Raises
    ValueError if the graph cannot host it."""
    if default_opset(model) < MIN_OPSET:
        raise ValueError(f"the graph's opset is {default_opset(model)}, in-graph TTA needs "
                         f"{MIN_OPSET}")
    out = copy.deepcopy(model)
    graph = out.graph
    source = graph.input[0].name
    if PROBABILITIES not in {o.name for o in graph.output}:
        raise ValueError(f"the graph has no {PROBABILITIES!r} output")
    front, back = GraphNodes("tta_view"), GraphNodes("tta_merge")
    names = [source] + [name for build in view_builders for name in build(front, source)]
    stacked = front.op("Concat", names, axis=0)
    companions = text_companions(front, out, stacked)
    renamed = {source: stacked, PROBABILITIES: VIEW_PROBABILITIES, **companions}
    kept_inputs = [i for i in graph.input if i.name not in companions]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    merge_views(back, VIEW_PROBABILITIES, views, classes, merge, PROBABILITIES)
    model_nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(front.nodes + model_nodes + back.nodes)
    graph.initializer.extend(front.initializers + back.initializers)
    del graph.value_info[:]  # shapes inside now hold views × batch rows
    batch = graph.input[0].type.tensor_type.shape.dim[0]
    batch_dim = batch.dim_param or (batch.dim_value if batch.HasField("dim_value") else "batch")
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(PROBABILITIES, TensorProto.FLOAT,
                                                      [batch_dim, classes]))
    onnx.checker.check_model(out)
    return out
