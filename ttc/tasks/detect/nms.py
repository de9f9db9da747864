"""A detector's decoding and its non-maximum suppression, in PyTorch (eager, the reference) and
in the exported graph (ONNX's NonMaxSuppression and the ops that pad its selection per image).

`DetectionCandidates` turns the network's raw heads into every cell's candidate box and its
per-class scores: the sigmoid heatmap kept only at its 3x3 local maxima (CenterNet's peak
extraction; the other cells score 0, which no score threshold of 0 or more keeps), the boxes
decoded into xyxy input pixels and clipped to the image. `postprocess` is class-aware NMS with
ONNX NonMaxSuppression's semantics (per image and class: scores above `score_threshold`,
greedy by score, suppressing IoU above `iou_threshold`, at most `max_detections` per class),
then the `max_detections` best of the image, sorted by score and padded (labels -1, the rest
0). `append_nms` writes the same into an exported candidates graph, `export_detector` builds
the whole graph (its contract: docs/detection.md), and `detect` is what it computes, in eager
PyTorch.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ttc.tasks.detect.nets import cell_boxes
from utils import ExportError, debug_enabled, stdout_to_stderr

INPUT_NAME = "image"
CANDIDATE_OUTPUTS = ("candidate_boxes", "candidate_scores")
DETECTION_OUTPUTS = ("boxes", "scores", "labels", "num_detections")
MIN_OPSET = 13  # Unsqueeze, Squeeze and ReduceSum with their axes as inputs
PEAK_WINDOW = 3  # a heatmap cell is a candidate where it is the maximum of its 3x3 window


class DetectionBatch(NamedTuple):
    """One batch's detections, padded to M per image: boxes (N, M, 4) float32 xyxy in input
    pixels, scores (N, M) float32, labels (N, M) int64 (-1 in padding rows), num_detections
    (N,) int64; rows sorted by score, descending."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    num_detections: torch.Tensor


class DetectionCandidates(nn.Module):
    """net → (boxes (N, A, 4) xyxy in input pixels, clipped to the image; scores (N, K, A)):
    of the two heads, A = h * w cells, the scores the sigmoid heatmap at its 3x3 peaks and 0
    elsewhere; a network with a `candidates` method decodes its own (a torchvision SSD: A
    anchors)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        own = getattr(self.net, "candidates", None)
        if own is not None:  # a network with its own decoding (a torchvision SSD's anchors)
            return own(pixels)
        logits, raw = self.net(pixels)[:2]
        heat = torch.sigmoid(logits)
        peaks = F.max_pool2d(heat, PEAK_WINDOW, stride=1, padding=PEAK_WINDOW // 2)
        scores = torch.where(heat == peaks, heat, torch.zeros_like(heat)).flatten(2)
        boxes = cell_boxes(raw).flatten(1, 2)
        height, width = pixels.shape[-2:]
        xs = boxes[..., 0::2].clamp(min=0).clamp(max=width)
        ys = boxes[..., 1::2].clamp(min=0).clamp(max=height)
        return torch.stack([xs[..., 0], ys[..., 0], xs[..., 1], ys[..., 1]], dim=-1), scores


# ----------------------------------------------------------------------------- eager


def postprocess(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                score_threshold: float, max_detections: int) -> DetectionBatch:
    """Candidates (boxes (N, A, 4), scores (N, K, A)) → the padded detections of ONNX
    NonMaxSuppression (class-aware, max_output_boxes_per_class = max_detections) followed by
    the max_detections best per image (torchvision.ops.batched_nms). At most M per class and
    then the M best of the image are the M best: a class's (M+1)-th is never among them."""
    from torchvision.ops import batched_nms

    n, m = boxes.shape[0], int(max_detections)
    out = DetectionBatch(boxes.new_zeros(n, m, 4), scores.new_zeros(n, m),
                         torch.full((n, m), -1, dtype=torch.int64, device=boxes.device),
                         torch.zeros(n, dtype=torch.int64, device=boxes.device))
    for i in range(n):
        classes, anchors = (scores[i] > score_threshold).nonzero(as_tuple=True)
        picked, kept_boxes = scores[i, classes, anchors], boxes[i, anchors]
        keep = batched_nms(kept_boxes, picked, classes, iou_threshold)[:m]  # by score
        count = len(keep)
        out.boxes[i, :count] = kept_boxes[keep]
        out.scores[i, :count] = picked[keep]
        out.labels[i, :count] = classes[keep]
        out.num_detections[i] = count
    return out


def detect(net: nn.Module, images: torch.Tensor, iou_threshold: float, score_threshold: float,
           max_detections: int) -> DetectionBatch:
    """The exported graph's computation in eager PyTorch: candidates, then postprocess."""
    with torch.no_grad():
        boxes, scores = DetectionCandidates(net)(images)
        return postprocess(boxes, scores, iou_threshold, score_threshold, max_detections)


# ----------------------------------------------------------------------------- the graph


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _nms_constants(iou_threshold: float, score_threshold: float,
                   max_detections: int) -> list[onnx.NodeProto]:
    f32, i64 = np.float32, np.int64
    values = {"nms/max_per_class": np.array([max_detections], i64),
              "nms/iou": np.array([iou_threshold], f32),
              "nms/score": np.array([score_threshold], f32),
              "nms/zero": np.array([0], i64), "nms/one": np.array([1], i64),
              "nms/two": np.array([2], i64), "nms/batch_anchor": np.array([0, 2], i64),
              "nms/zero_f": np.array(0, f32), "nms/minus_inf": np.array(-np.inf, f32),
              "nms/minus_one": np.array(-1, i64), "nms/scalar_zero": np.array(0, i64),
              "nms/scalar_one": np.array(1, i64), "nms/pads_2d": np.array([0, 0, 0], i64),
              "nms/pads_3d_head": np.array([0, 0, 0, 0], i64)}
    return [_constant(name, value) for name, value in values.items()]


def _selection_nodes(boxes: str, scores: str) -> list[onnx.NodeProto]:
    """NonMaxSuppression → per image (N, S): the selected rows' mask, their scores (-inf
    elsewhere), and each selected row's box, label and score."""
    node = helper.make_node
    return [
        node("NonMaxSuppression", [boxes, scores, "nms/max_per_class", "nms/iou", "nms/score"],
             ["nms/selected"], center_point_box=0),
        node("Gather", ["nms/selected", "nms/scalar_zero"], ["nms/sel_batch"], axis=1),
        node("Gather", ["nms/selected", "nms/scalar_one"], ["nms/sel_label"], axis=1),
        node("GatherND", [scores, "nms/selected"], ["nms/sel_score"]),
        node("Gather", ["nms/selected", "nms/batch_anchor"], ["nms/sel_pair"], axis=1),
        node("GatherND", [boxes, "nms/sel_pair"], ["nms/sel_box"]),
        node("Shape", [scores], ["nms/n"], start=0, end=1),
        node("Squeeze", ["nms/n", "nms/zero"], ["nms/n_scalar"]),
        node("Range", ["nms/scalar_zero", "nms/n_scalar", "nms/scalar_one"], ["nms/images"]),
        node("Unsqueeze", ["nms/images", "nms/one"], ["nms/images_col"]),
        node("Unsqueeze", ["nms/sel_batch", "nms/zero"], ["nms/sel_batch_row"]),
        node("Equal", ["nms/images_col", "nms/sel_batch_row"], ["nms/mine"]),
        node("Unsqueeze", ["nms/sel_score", "nms/zero"], ["nms/sel_score_row"]),
        node("Where", ["nms/mine", "nms/sel_score_row", "nms/minus_inf"], ["nms/per_image"]),
    ]


def _padded_output_nodes() -> list[onnx.NodeProto]:
    """The min(S, M) best of each image's row (TopK), masked where the image has fewer, padded
    to M: boxes, scores, labels and num_detections."""
    node = helper.make_node
    return [
        node("Shape", ["nms/selected"], ["nms/s"], start=0, end=1),
        node("Min", ["nms/s", "nms/max_per_class"], ["nms/k"]),
        node("TopK", ["nms/per_image", "nms/k"], ["nms/top_score", "nms/top_index"], axis=1,
             largest=1, sorted=1),
        node("GatherElements", ["nms/mine", "nms/top_index"], ["nms/valid"], axis=1),
        node("Unsqueeze", ["nms/valid", "nms/two"], ["nms/valid_box"]),
        node("Gather", ["nms/sel_box", "nms/top_index"], ["nms/top_box"], axis=0),
        node("Gather", ["nms/sel_label", "nms/top_index"], ["nms/top_label"], axis=0),
        node("Where", ["nms/valid", "nms/top_score", "nms/zero_f"], ["nms/k_scores"]),
        node("Where", ["nms/valid", "nms/top_label", "nms/minus_one"], ["nms/k_labels"]),
        node("Where", ["nms/valid_box", "nms/top_box", "nms/zero_f"], ["nms/k_boxes"]),
        node("Sub", ["nms/max_per_class", "nms/k"], ["nms/missing"]),
        node("Concat", ["nms/pads_2d", "nms/missing"], ["nms/pads2"], axis=0),
        node("Concat", ["nms/pads_3d_head", "nms/missing", "nms/zero"], ["nms/pads3"], axis=0),
        node("Pad", ["nms/k_scores", "nms/pads2", "nms/zero_f"], ["scores"]),
        node("Pad", ["nms/k_labels", "nms/pads2", "nms/minus_one"], ["labels"]),
        node("Pad", ["nms/k_boxes", "nms/pads3", "nms/zero_f"], ["boxes"]),
        node("Cast", ["nms/valid"], ["nms/valid_int"], to=TensorProto.INT64),
        node("ReduceSum", ["nms/valid_int", "nms/one"], ["num_detections"], keepdims=0),
    ]


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def append_nms(model: onnx.ModelProto, iou_threshold: float, score_threshold: float,
               max_detections: int) -> onnx.ModelProto:
    """A copy of a candidates graph (outputs "candidate_boxes" (N, A, 4) and "candidate_scores"
    (N, K, A)) ending in class-aware NonMaxSuppression and its padding per image: outputs
    boxes (N, M, 4) float32, scores (N, M) float32, labels (N, M) int64, num_detections (N,)
    int64 (M = max_detections; the thresholds constants of the graph)."""
    opset = default_opset(model)
    names = [o.name for o in model.graph.output]
    if opset < MIN_OPSET or not set(CANDIDATE_OUTPUTS) <= set(names):
        raise ExportError(f"cannot append NMS to a graph of opset {opset} with outputs "
                          f"{names}: it needs opset {MIN_OPSET} or later and the outputs "
                          f"{', '.join(CANDIDATE_OUTPUTS)}", "export with the default --opset 18")
    if not max_detections >= 1:
        raise ExportError(f"max_detections must be 1 or more, not {max_detections}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    graph.node.extend([*_nms_constants(iou_threshold, score_threshold, max_detections),
                       *_selection_nodes(*CANDIDATE_OUTPUTS),
                       *_padded_output_nodes()])
    declare_detection_outputs(graph, max_detections)
    return out


def declare_detection_outputs(graph: onnx.GraphProto, max_detections: int) -> None:
    """The graph's outputs become the contract's four, padded to `max_detections` rows, with
    the input's batch dimension: boxes (N, M, 4), scores (N, M), labels (N, M),
    num_detections (N,)."""
    batch = graph.input[0].type.tensor_type.shape.dim[0]
    batch_dim = batch.dim_param or batch.dim_value or "batch"
    m = int(max_detections)
    del graph.output[:]
    graph.output.extend([
        helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [batch_dim, m, 4]),
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch_dim, m]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, [batch_dim, m]),
        helper.make_tensor_value_info("num_detections", TensorProto.INT64, [batch_dim])])


def _without_stack_traces(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exporter's per-node Python stack traces (absolute paths of this checkout) dropped,
    as export.without_stack_traces does for the other graphs."""
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    return model


def export_candidates(net: nn.Module, example: torch.Tensor | np.ndarray,
                      opset: int, optimize: bool = True, wrapper: nn.Module | None = None,
                      output_names: Sequence[str] = CANDIDATE_OUTPUTS) -> onnx.ModelProto:
    """DetectionCandidates(net) traced by torch.onnx.export (dynamo) with dynamic batch, height
    and width: input "image", outputs candidate_boxes and candidate_scores. The example's batch
    must be 2 or more (a batch of 1 would be fixed into the graph). `optimize` False keeps the
    BatchNormalization nodes (the adaptation graph's export). `wrapper` (with its
    `output_names`) replaces DetectionCandidates(net): the TTA graph's views (tta.py)."""
    example = torch.as_tensor(np.ascontiguousarray(example), dtype=torch.float32)
    if example.ndim != 4 or example.shape[0] < 2:
        raise ExportError(f"the example batch must be (N >= 2, C, H, W), not "
                          f"{tuple(example.shape)}")
    wrapper = DetectionCandidates(net).eval() if wrapper is None else wrapper
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height", min=2),
            3: torch.export.Dim("width", min=2)}
    try:
        with stdout_to_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapper, (example,), input_names=[INPUT_NAME],
                output_names=list(output_names), dynamic_shapes=(dims,),
                opset_version=opset, external_data=False, dynamo=True, optimize=optimize,
                verbose=debug_enabled())  # its [torch.onnx] progress lines: DEBUG only
    except Exception as err:  # noqa: BLE001 - exporter failures are many and varied
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(f"torch.onnx.export failed at opset {opset}: {first}",
                          "try the default --opset 18, or --log_level DEBUG for details") from None
    return _without_stack_traces(program.model_proto)


def export_detector(net: nn.Module, example: torch.Tensor | np.ndarray, opset: int,
                    iou_threshold: float, score_threshold: float,
                    max_detections: int) -> onnx.ModelProto:
    """The deployable detection graph: image (N, C, H, W) in [0, 1] → boxes, scores, labels,
    num_detections (export_candidates, then append_nms)."""
    return append_nms(export_candidates(net, example, opset), iou_threshold, score_threshold,
                      max_detections)
