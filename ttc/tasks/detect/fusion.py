"""The views' detections merged by box fusion inside the TTA graph (issue 44, item 5), in ONNX
ops written with onnx.helper as nms.append_nms is, and the same computation in numpy (the
export's reference and the tests').

Exact weighted box fusion (wbf.py) clusters greedily: per class, boxes by descending score each
join the cluster whose *running* fused box they overlap most (IoU > 0.55), else start one. That
loop does not vectorise, so the graph computes this form of it, per image:
1. each view's detections: its candidates through class-aware NonMaxSuppression
   (--iou_threshold, --score_threshold, at most --max_detections per class), as model.onnx's;
   boxes of zero area are left out (as WBF does);
2. the seeds: class-aware NonMaxSuppression over the union of the views' detections at the
   fusion IoU (FUSION_IOU, WBF's 0.55): every detection the seeds suppress overlaps one of
   them by more than the fusion IoU;
3. clusters: each detection joins the seed of its class it overlaps most (ties: each of them),
   when that IoU is above the fusion IoU (a seed joins its own cluster);
4. each seed's fused box is the score-weighted mean of its cluster's boxes, and its score
   WBF's: the mean of the cluster's scores × min(count, views) / views;
5. the --max_detections best fused boxes per image, sorted by score and padded as model.onnx's.

The differences from exact WBF: a cluster is matched against its seed's box, not the running
fused box, and the seeds are NMS's (a box that WBF's moving fused box would have caught, or
missed, may go the other way). inference.py --tta measures the gap: exact WBF (wbf.py) on the
same views' detections (step 1, read from the graph's inner tensors) is the report's
`map_wbf`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ttc.tasks.detect.nms import (MIN_OPSET, _constant, _nms_constants, _padded_output_nodes,
                                  declare_detection_outputs, default_opset)
from ttc.tasks.detect.wbf import weighted_box_fusion
from utils import ExportError

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)
FUSION_IOU = 0.55  # WBF's default (Solovyev et al.; ensemble_boxes' iou_thr)
FUSION_OPSET = 18  # ScatterElements' reduction "max"
# The graph's inner tensors the exact-WBF figure reads (inference.py adds them as outputs):
# the union of the views' boxes (N, A, 4), their detections' scores (N, K, A; 0 elsewhere),
# and each anchor's view (A,)
INNER_OUTPUTS = ("tta/boxes", "tta/member_scores", "tta/anchor_view")
RULE = ("per view class-aware NMS; seeds: class-aware NMS over the views' detections at the "
        "fusion IoU; each detection joins the seed of its class it overlaps most (IoU > the "
        "fusion IoU); fused box: score-weighted mean; score: mean × min(count, views) / views")


@dataclass(frozen=True)
class FusionSettings:
    """What the TTA graph bakes in: the views' count, each view's NMS (the bundle's) and the
    fusion IoU."""

    views: int
    iou_threshold: float
    score_threshold: float
    max_detections: int
    fusion_iou: float = FUSION_IOU

    def record(self) -> dict:
        return {"rule": RULE, "fusion_iou": self.fusion_iou,
                "iou_threshold": self.iou_threshold, "score_threshold": self.score_threshold,
                "max_detections": self.max_detections}


def view_output_names(views: int) -> list[str]:
    """The candidates graph's outputs per view: boxes (N, A_v, 4), scores (N, K, A_v)."""
    return [name for v in range(views)
            for name in (f"candidate_boxes_{v}", f"candidate_scores_{v}")]


# ----------------------------------------------------------------------------- the graph


def _fusion_constants(settings: FusionSettings) -> list[onnx.NodeProto]:
    f32, i64 = np.float32, np.int64
    values = {"tta/max_per_class": np.array([settings.max_detections], i64),
              "tta/seed_max": np.array([settings.views * settings.max_detections], i64),
              "tta/nms_iou": np.array([settings.iou_threshold], f32),
              "tta/fusion_iou_1": np.array([settings.fusion_iou], f32),
              "tta/fusion_iou": np.array(settings.fusion_iou, f32),
              "tta/score": np.array([settings.score_threshold], f32),
              "tta/views": np.array(settings.views, f32), "tta/zero_f": np.array(0, f32),
              "tta/minus_one_f": np.array(-1, f32), "tta/minus_inf": np.array(-np.inf, f32),
              "tta/tiny": np.array(np.finfo(np.float32).tiny, f32),
              "tta/one_f": np.array(1, f32),
              "tta/i0": np.array(0, i64), "tta/i1": np.array(1, i64),
              "tta/ax0": np.array([0], i64), "tta/ax1": np.array([1], i64),
              "tta/ax2": np.array([2], i64), "tta/ba": np.array([0, 2], i64),
              "tta/bk": np.array([0, 1], i64), "tta/zero_zero": np.array([0, 0], i64),
              "tta/start0": np.array([0], i64), "tta/c0": np.array([0], i64),
              "tta/c1": np.array([1], i64), "tta/c2": np.array([2], i64),
              "tta/c4": np.array([4], i64), "tta/ax02": np.array([0, 2], i64),
              "tta/zero_minus_one": np.array([0, -1], i64)}
    return [_constant(name, value) for name, value in values.items()]


def _view_nodes(views: int) -> list[onnx.NodeProto]:
    """Per view its NMS; the union of the views' boxes and scores, the selected rows' indices
    shifted into the union, each anchor's view."""
    node = helper.make_node
    nodes = []
    for v in range(views):
        boxes, scores = view_output_names(views)[2 * v:2 * v + 2]
        start = "tta/start0" if v == 0 else f"tta/start{v}"
        nodes += [
            node("NonMaxSuppression", [boxes, scores, "tta/max_per_class", "tta/nms_iou",
                                       "tta/score"], [f"tta/sel{v}"], center_point_box=0),
            node("Shape", [boxes], [f"tta/a{v}"], start=1, end=2),
            node("Add", [start, f"tta/a{v}"], [f"tta/start{v + 1}"]),
            node("Concat", ["tta/zero_zero", start], [f"tta/shift{v}"], axis=0),
            node("Add", [f"tta/sel{v}", f"tta/shift{v}"], [f"tta/shifted{v}"]),
            _constant(f"tta/view{v}", np.array(v, np.int64)),
            node("Expand", [f"tta/view{v}", f"tta/a{v}"], [f"tta/anchor_view{v}"])]
    names = view_output_names(views)
    nodes += [node("Concat", names[0::2], ["tta/boxes"], axis=1),
              node("Concat", names[1::2], ["tta/scores"], axis=2),
              node("Concat", [f"tta/shifted{v}" for v in range(views)], ["tta/sel"], axis=0),
              node("Concat", [f"tta/anchor_view{v}" for v in range(views)],
                   ["tta/anchor_view"], axis=0)]
    return nodes


def _member_nodes() -> list[onnx.NodeProto]:
    """The views' detections as scores over the union (N, K, A), 0 elsewhere and for boxes of
    zero area (tta/member_scores)."""
    node = helper.make_node
    return [
        node("GatherND", ["tta/scores", "tta/sel"], ["tta/sel_scores"]),
        node("Shape", ["tta/scores"], ["tta/scores_shape"]),
        node("ConstantOfShape", ["tta/scores_shape"], ["tta/empty"],
             value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])),
        node("ScatterND", ["tta/empty", "tta/sel", "tta/sel_scores"], ["tta/selected_scores"]),
        *_area_nodes("tta/box_lo", "tta/box_hi", "tta/box_area3", boxes="tta/boxes"),
        node("Greater", ["tta/box_area3", "tta/zero_f"], ["tta/has_area3"]),
        node("Cast", ["tta/has_area3"], ["tta/has_area3_f"], to=TensorProto.FLOAT),
        node("Transpose", ["tta/has_area3_f"], ["tta/has_area"], perm=[0, 2, 1]),  # (N, 1, A)
        node("Mul", ["tta/selected_scores", "tta/has_area"], ["tta/member_scores"]),
    ]


def _compact_nodes() -> list[onnx.NodeProto]:
    """Each image's detections gathered into P rows (P: the most any image has; TopK over its
    K A scores), so that the clusters cost (S, P), not (S, A): their boxes tta/top_boxes
    (N, P, 4) and scores per class tta/compact (N, K, P), 0 in the padding rows."""
    node = helper.make_node
    return [
        node("Reshape", ["tta/member_scores", "tta/zero_minus_one"], ["tta/flat"]),  # (N, K A)
        node("Greater", ["tta/flat", "tta/zero_f"], ["tta/flat_pos"]),
        node("Cast", ["tta/flat_pos"], ["tta/flat_pos_i"], to=TensorProto.INT64),
        node("ReduceSum", ["tta/flat_pos_i", "tta/ax1"], ["tta/per_image"], keepdims=0),
        node("ReduceMax", ["tta/per_image", "tta/ax0"], ["tta/p"], keepdims=1),
        node("TopK", ["tta/flat", "tta/p"], ["tta/top_scores", "tta/top_index"], axis=1,
             largest=1, sorted=1),
        node("Shape", ["tta/member_scores"], ["tta/n"], start=0, end=1),
        node("Shape", ["tta/member_scores"], ["tta/k"], start=1, end=2),
        node("Shape", ["tta/member_scores"], ["tta/a"], start=2, end=3),
        node("Squeeze", ["tta/a", "tta/ax0"], ["tta/a_scalar"]),
        node("Squeeze", ["tta/k", "tta/ax0"], ["tta/k_scalar"]),
        node("Div", ["tta/top_index", "tta/a_scalar"], ["tta/top_class"]),
        node("Mod", ["tta/top_index", "tta/a_scalar"], ["tta/top_anchor"]),
        node("Unsqueeze", ["tta/top_anchor", "tta/ax2"], ["tta/top_anchor3"]),
        node("GatherND", ["tta/boxes", "tta/top_anchor3"], ["tta/top_boxes"], batch_dims=1),
        node("Range", ["tta/i0", "tta/k_scalar", "tta/i1"], ["tta/classes"]),
        node("Unsqueeze", ["tta/classes", "tta/ax02"], ["tta/classes3"]),  # (1, K, 1)
        node("Unsqueeze", ["tta/top_class", "tta/ax1"], ["tta/top_class3"]),  # (N, 1, P)
        node("Equal", ["tta/top_class3", "tta/classes3"], ["tta/of_class"]),
        node("Unsqueeze", ["tta/top_scores", "tta/ax1"], ["tta/top_scores3"]),
        node("Where", ["tta/of_class", "tta/top_scores3", "tta/zero_f"], ["tta/compact"]),
    ]


def _seed_nodes() -> list[onnx.NodeProto]:
    """The seeds (S, 3: image, class, row): NMS over the compact detections at the fusion
    IoU; each seed's box, its class's scores over its image's rows (S, P) and those rows'
    boxes (S, P, 4)."""
    node = helper.make_node
    return [
        node("NonMaxSuppression", ["tta/top_boxes", "tta/compact", "tta/seed_max",
                                   "tta/fusion_iou_1", "tta/score"], ["tta/seeds"],
             center_point_box=0),
        node("Gather", ["tta/seeds", "tta/i0"], ["tta/seed_b"], axis=1),
        node("Gather", ["tta/seeds", "tta/i1"], ["nms/sel_label"], axis=1),
        node("Gather", ["tta/seeds", "tta/ba"], ["tta/seed_ba"], axis=1),
        node("GatherND", ["tta/top_boxes", "tta/seed_ba"], ["tta/seed_box"]),
        node("Gather", ["tta/seeds", "tta/bk"], ["tta/seed_bk"], axis=1),
        node("GatherND", ["tta/compact", "tta/seed_bk"], ["tta/weights"]),  # (S, P)
        node("Gather", ["tta/top_boxes", "tta/seed_b"], ["tta/image_boxes"], axis=0),
        node("Identity", ["tta/seeds"], ["nms/selected"]),
    ]


def _iou_nodes() -> list[onnx.NodeProto]:
    """tta/iou (S, P): each seed's box against every box of its image."""
    node = helper.make_node
    return [
        node("Unsqueeze", ["tta/seed_box", "tta/ax1"], ["tta/seed_box3"]),  # (S, 1, 4)
        node("Slice", ["tta/seed_box3", "tta/c0", "tta/c2", "tta/c2"], ["tta/seed_lo"]),
        node("Slice", ["tta/seed_box3", "tta/c2", "tta/c4", "tta/c2"], ["tta/seed_hi"]),
        node("Slice", ["tta/image_boxes", "tta/c0", "tta/c2", "tta/c2"], ["tta/other_lo"]),
        node("Slice", ["tta/image_boxes", "tta/c2", "tta/c4", "tta/c2"], ["tta/other_hi"]),
        node("Max", ["tta/seed_lo", "tta/other_lo"], ["tta/inter_lo"]),
        node("Min", ["tta/seed_hi", "tta/other_hi"], ["tta/inter_hi"]),
        *_area_nodes("tta/inter_lo", "tta/inter_hi", "tta/inter"),
        *_area_nodes("tta/seed_lo", "tta/seed_hi", "tta/seed_area"),
        *_area_nodes("tta/other_lo", "tta/other_hi", "tta/other_area"),
        node("Add", ["tta/seed_area", "tta/other_area"], ["tta/areas"]),
        node("Sub", ["tta/areas", "tta/inter"], ["tta/union"]),
        node("Max", ["tta/union", "tta/tiny"], ["tta/union_pos"]),
        node("Div", ["tta/inter", "tta/union_pos"], ["tta/iou3"]),
        node("Squeeze", ["tta/iou3", "tta/ax2"], ["tta/iou"]),
    ]


def _area_nodes(lo: str, hi: str, out: str, boxes: str | None = None
                ) -> list[onnx.NodeProto]:
    """(..., 1) areas of the boxes whose corners are (..., 2) `lo` and `hi` (0 when empty);
    with `boxes` (..., 4), `lo` and `hi` sliced from them first."""
    node = helper.make_node
    sliced = [node("Slice", [boxes, "tta/c0", "tta/c2", "tta/c2"], [lo]),
              node("Slice", [boxes, "tta/c2", "tta/c4", "tta/c2"], [hi])] if boxes else []
    return [*sliced, node("Sub", [hi, lo], [f"{out}_wh"]),
            node("Relu", [f"{out}_wh"], [f"{out}_whp"]),
            node("Slice", [f"{out}_whp", "tta/c0", "tta/c1", "tta/c2"], [f"{out}_w"]),
            node("Slice", [f"{out}_whp", "tta/c1", "tta/c2", "tta/c2"], [f"{out}_h"]),
            node("Mul", [f"{out}_w", f"{out}_h"], [out])]


def _cluster_nodes() -> list[onnx.NodeProto]:
    """Each detection assigned to the seed of its image and class it overlaps most (the
    group-wise maximum by ScatterElements' reduction max over (N K, P)), when above the
    fusion IoU."""
    node = helper.make_node
    return [
        node("Greater", ["tta/weights", "tta/zero_f"], ["tta/is_member"]),
        node("Where", ["tta/is_member", "tta/iou", "tta/minus_one_f"], ["tta/member_iou"]),
        node("Mul", ["tta/seed_b", "tta/k_scalar"], ["tta/seed_b_k"]),
        node("Add", ["tta/seed_b_k", "nms/sel_label"], ["tta/group"]),  # (S,)
        node("Unsqueeze", ["tta/group", "tta/ax1"], ["tta/group_col"]),
        node("Shape", ["tta/member_iou"], ["tta/sa"]),
        node("Expand", ["tta/group_col", "tta/sa"], ["tta/group_index"]),
        node("Mul", ["tta/n", "tta/k"], ["tta/nk"]),
        node("Concat", ["tta/nk", "tta/p"], ["tta/best_shape"], axis=0),
        node("ConstantOfShape", ["tta/best_shape"], ["tta/best_init"],
             value=helper.make_tensor("minus_one", TensorProto.FLOAT, [1], [-1.0])),
        node("ScatterElements", ["tta/best_init", "tta/group_index", "tta/member_iou"],
             ["tta/best"], axis=0, reduction="max"),
        node("Gather", ["tta/best", "tta/group"], ["tta/best_of_group"], axis=0),
        node("GreaterOrEqual", ["tta/member_iou", "tta/best_of_group"], ["tta/is_best"]),
        node("Greater", ["tta/iou", "tta/fusion_iou"], ["tta/overlaps"]),
        node("And", ["tta/is_member", "tta/overlaps"], ["tta/member_overlaps"]),
        node("And", ["tta/member_overlaps", "tta/is_best"], ["tta/assigned"]),
    ]


def _fused_nodes() -> list[onnx.NodeProto]:
    """Each seed's fused box and score, and its image's row (N, S) of fused scores (-inf for
    the other images' seeds): what nms._padded_output_nodes pads per image."""
    node = helper.make_node
    return [
        node("Where", ["tta/assigned", "tta/weights", "tta/zero_f"], ["tta/w"]),
        node("ReduceSum", ["tta/w", "tta/ax1"], ["tta/sum_w"], keepdims=0),
        node("Cast", ["tta/assigned"], ["tta/assigned_f"], to=TensorProto.FLOAT),
        node("ReduceSum", ["tta/assigned_f", "tta/ax1"], ["tta/count"], keepdims=0),
        node("Unsqueeze", ["tta/w", "tta/ax2"], ["tta/w3"]),
        node("Mul", ["tta/w3", "tta/image_boxes"], ["tta/weighted_boxes"]),
        node("ReduceSum", ["tta/weighted_boxes", "tta/ax1"], ["tta/box_sum"], keepdims=0),
        node("Unsqueeze", ["tta/sum_w", "tta/ax1"], ["tta/sum_w_col"]),
        node("Div", ["tta/box_sum", "tta/sum_w_col"], ["nms/sel_box"]),
        node("Div", ["tta/sum_w", "tta/count"], ["tta/mean_score"]),
        node("Min", ["tta/count", "tta/views"], ["tta/seen"]),
        node("Div", ["tta/seen", "tta/views"], ["tta/share"]),
        node("Mul", ["tta/mean_score", "tta/share"], ["tta/fused_score"]),
        node("Squeeze", ["tta/n", "tta/ax0"], ["tta/n_scalar"]),
        node("Range", ["tta/i0", "tta/n_scalar", "tta/i1"], ["tta/images"]),
        node("Unsqueeze", ["tta/images", "tta/ax1"], ["tta/images_col"]),
        node("Unsqueeze", ["tta/seed_b", "tta/ax0"], ["tta/seed_b_row"]),
        node("Equal", ["tta/images_col", "tta/seed_b_row"], ["nms/mine"]),
        node("Unsqueeze", ["tta/fused_score", "tta/ax0"], ["tta/fused_row"]),
        node("Where", ["nms/mine", "tta/fused_row", "tta/minus_inf"], ["nms/per_image"]),
    ]


def append_fusion(model: onnx.ModelProto, views: int, settings: FusionSettings
                  ) -> onnx.ModelProto:
    """A copy of a views' candidates graph (outputs view_output_names(views)) ending in the
    fusion of their detections (the module's docstring) and model.onnx's four padded outputs:
    boxes (N, M, 4), scores (N, M), labels (N, M) int64, num_detections (N,) int64."""
    opset = default_opset(model)
    names = [o.name for o in model.graph.output]
    if opset < max(MIN_OPSET, FUSION_OPSET) or names != view_output_names(views):
        raise ExportError(f"cannot append box fusion to a graph of opset {opset} with outputs "
                          f"{names}: it needs opset {FUSION_OPSET} or later and the outputs "
                          f"{', '.join(view_output_names(views))}",
                          "export with the default --opset 18")
    if not 0 < settings.fusion_iou < 1:
        raise ExportError(f"the fusion IoU must be in (0, 1), not {settings.fusion_iou}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    graph.node.extend([*_fusion_constants(settings), *_view_nodes(views), *_member_nodes(),
                       *_compact_nodes(), *_seed_nodes(), *_iou_nodes(), *_cluster_nodes(),
                       *_fused_nodes(),
                       *_nms_constants(settings.iou_threshold, settings.score_threshold,
                                       settings.max_detections), *_padded_output_nodes()])
    declare_detection_outputs(graph, settings.max_detections)
    return out


def with_inner_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a TTA graph that also returns INNER_OUTPUTS (the exact-WBF figure reads the
    views' detections from them)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend([
        helper.make_tensor_value_info("tta/boxes", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("tta/member_scores", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("tta/anchor_view", TensorProto.INT64, None)])
    return out


# ----------------------------------------------------------------------------- numpy


def class_nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float,
              score_threshold: float, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX NonMaxSuppression's selection for one image (boxes (A, 4), scores (K, A)): the
    (classes, anchors) kept, by descending score, at most `per_class` per class
    (torchvision's batched_nms, as nms.postprocess)."""
    import torch
    from torchvision.ops import batched_nms

    classes, anchors = np.nonzero(scores > score_threshold)
    if not len(classes):
        return classes, anchors
    keep = batched_nms(torch.from_numpy(boxes[anchors]), torch.from_numpy(scores[classes, anchors]),
                       torch.from_numpy(classes), iou_threshold).numpy()
    seen = np.zeros(scores.shape[0], np.int64)
    kept = []
    for index in keep:
        if seen[classes[index]] < per_class:
            seen[classes[index]] += 1
            kept.append(index)
    kept = np.asarray(kept, np.int64)
    return classes[kept], anchors[kept]


def box_areas(boxes: np.ndarray) -> np.ndarray:
    """Areas (..., ) of xyxy boxes (..., 4), float32, 0 when empty (as the graph's)."""
    wh = np.maximum(boxes[..., 2:] - boxes[..., :2], np.float32(0))
    return wh[..., 0] * wh[..., 1]


def seed_ious(seed_boxes: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(S, A) IoU of each seed box with every box, in float32 as the graph's."""
    lo = np.maximum(seed_boxes[:, None, :2], boxes[None, :, :2])
    hi = np.minimum(seed_boxes[:, None, 2:], boxes[None, :, 2:])
    inter = box_areas(np.concatenate([lo, hi], axis=-1))
    union = box_areas(seed_boxes)[:, None] + box_areas(boxes)[None, :] - inter
    return inter / np.maximum(union, np.finfo(np.float32).tiny)


def member_scores(boxes_list: Sequence[np.ndarray], scores_list: Sequence[np.ndarray],
                  settings: FusionSettings) -> tuple[np.ndarray, np.ndarray]:
    """One image's views (boxes (A_v, 4), scores (K, A_v) each) → the union's boxes (A, 4)
    and the views' detections' scores over it (K, A), 0 elsewhere and for empty boxes."""
    boxes = np.concatenate(boxes_list).astype(np.float32)
    members = np.zeros((scores_list[0].shape[0], len(boxes)), np.float32)
    start = 0
    for view_boxes, view_scores in zip(boxes_list, scores_list):
        classes, anchors = class_nms(view_boxes, view_scores, settings.iou_threshold,
                                     settings.score_threshold, settings.max_detections)
        members[classes, start + anchors] = view_scores[classes, anchors]
        start += len(view_boxes)
    return boxes, members * (box_areas(boxes) > 0)


def fuse_members(boxes: np.ndarray, members: np.ndarray, settings: FusionSettings
                 ) -> Detections:
    """One image's fused detections (the graph's steps 2 to 5), sorted by score, at most
    --max_detections."""
    classes, anchors = class_nms(boxes, members, settings.fusion_iou, settings.score_threshold,
                                 settings.views * settings.max_detections)
    weights = members[classes]  # (S, A)
    iou = seed_ious(boxes[anchors], boxes)
    member_iou = np.where(weights > 0, iou, np.float32(-1))
    best = np.full_like(member_iou, -1)
    for k in np.unique(classes):
        best[classes == k] = member_iou[classes == k].max(axis=0)
    assigned = (weights > 0) & (iou > np.float32(settings.fusion_iou)) & (member_iou >= best)
    w = np.where(assigned, weights, np.float32(0))
    total, count = w.sum(axis=1), assigned.sum(axis=1).astype(np.float32)
    fused = (w[:, :, None] * boxes[None]).sum(axis=1) / total[:, None] if len(w) \
        else np.zeros((0, 4), np.float32)
    scores = total / count * np.minimum(count, settings.views) / np.float32(settings.views)
    order = np.argsort(-scores, kind="stable")[:settings.max_detections]
    return (fused[order].astype(np.float32), scores[order].astype(np.float32),
            classes[order].astype(np.int64))


def fuse_candidates(boxes_list: Sequence[np.ndarray], scores_list: Sequence[np.ndarray],
                    settings: FusionSettings) -> list[Detections]:
    """The TTA graph's fusion in numpy, per image of the batch: the views' candidates (boxes
    (N, A_v, 4), scores (N, K, A_v) per view) → fused detections."""
    return [fuse_members(*member_scores([b[i] for b in boxes_list],
                                        [s[i] for s in scores_list], settings), settings)
            for i in range(len(boxes_list[0]))]


def exact_wbf(boxes: np.ndarray, members: np.ndarray, anchor_view: np.ndarray,
              settings: FusionSettings) -> Detections:
    """Exact weighted box fusion (wbf.py) of one image's views' detections, as the TTA graph's
    inner tensors hold them (INNER_OUTPUTS, one image's): the --max_detections best."""
    per_view = []
    for v in range(settings.views):
        classes, anchors = np.nonzero(members * (anchor_view == v)[None, :] > 0)
        per_view.append((boxes[anchors], members[classes, anchors], classes))
    fused, scores, labels = weighted_box_fusion([p[0] for p in per_view],
                                                [p[1] for p in per_view],
                                                [p[2] for p in per_view],
                                                iou_threshold=settings.fusion_iou)
    m = settings.max_detections
    return fused[:m], scores[:m], labels[:m]


def graph_settings(model: onnx.ModelProto) -> FusionSettings:
    """The settings a TTA graph bakes in, read from its constants (no other record needed)."""
    from onnx import numpy_helper

    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.output[0].startswith("tta/")}
    def number(name: str) -> float:  # float32 constants: 0.1 comes back as 0.100000001
        return round(float(np.asarray(values[name]).ravel()[0]), 6)

    try:
        return FusionSettings(views=int(number("tta/views")),
                              iou_threshold=number("tta/nms_iou"),
                              score_threshold=number("tta/score"),
                              max_detections=int(number("tta/max_per_class")),
                              fusion_iou=number("tta/fusion_iou"))
    except (KeyError, IndexError) as err:
        raise ExportError(f"the TTA graph lacks its fusion constant {err}: it is not a "
                          "detector's TTA graph", "re-export it with --tta true") from None


def inner_runner(session, settings: FusionSettings):
    """A batch → (the TTA graph's fused detections, exact WBF's of the same views'
    detections), per image, from a session of with_inner_outputs(graph)."""
    from ttc.tasks.detect.evaluate import OUTPUTS, unpadded

    name = session.get_inputs()[0].name

    def run(batch: np.ndarray) -> tuple[list[Detections], list[Detections]]:
        *padded, boxes, members, anchor_view = session.run([*OUTPUTS, *INNER_OUTPUTS],
                                                          {name: batch})
        exact = [exact_wbf(boxes[i], members[i], anchor_view, settings)
                 for i in range(len(batch))]
        return unpadded(*padded), exact

    return run
