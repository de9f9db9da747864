"""int8 for a detector (issue 44, item 6), its `Parts.quantizing` (QUANTIZING; the shape:
ttc/compress/quantizing.py): which nodes of the graph int8 keeps in float, how an int8 graph is
judged against fp32 (COCO mAP@[.5:.95] of the validation split) and their detections compared,
and its calibration batch. ttc/compress/quantization.py quantizes, gates, times and records; no
torch here.

The exported graph is the network, its decoding into candidates (ttc/tasks/detect/nms.py's
DetectionCandidates) and the NMS that append_nms writes after them. Its parts are told apart by
the one NonMaxSuppression node, whatever names the exporter gave the others:
- backbone: the nodes that both candidate tensors (NonMaxSuppression's boxes and scores) depend
  on: the encoder and the decoder, up to the feature map the two heads share;
- head: the nodes only one of them depends on: each head's convolutions and the decoding (the
  sigmoid heatmap at its peaks, the boxes from the distances, the clipping);
- post-processing: the nodes neither depends on: NMS and the padding of each image's rows.
Only the backbone is quantized. The head's last convolutions give the box distances and the
heatmap's logits, whose rounding moves boxes and reorders scores, and the post-processing
compares and gathers exact values (mAP@.75 and above are lost first, and a rounded score can cross
--score_threshold): both stay in float, as the issue asks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx

from ttc.tasks.detect.evaluate import (Detections, DetectionRunner, detection_runner,
                                       predict_detections)
from ttc.tasks.detect.metrics import detection_metrics
from ttc.tasks.detect.wbf import iou_with
from utils import ExportError

AGREEMENT_IOU = 0.5  # two graphs' best detections of an image agree at this IoU and class
# Images per calibration batch (a classifier's: 32). ONNX Runtime's calibration session holds a
# whole batch's activations (its augmented graph outputs every tensor's range): a detector that
# resizes to 320 pixels inside (SSDlite) took 13.8 GB at 32 images on a tiny bundle, and the
# bench's run was killed for memory at 22 GB; at 4 images it took 0.8 GB (27 November 2026).
CALIBRATION_BATCH = 4


@dataclass(frozen=True)
class GraphParts:
    """The detection graph's node names by part (see the module's docstring); `boundary`: the
    backbone's nodes whose outputs the head or the post-processing reads, kept float as well so
    that no quantize-dequantize pair sits between them (the head reads float tensors)."""

    backbone: list[str]
    head: list[str]
    postprocessing: list[str]
    boundary: list[str]

    def kept_float(self) -> list[str]:
        return [*self.boundary, *self.head, *self.postprocessing]

    def section(self, model: onnx.ModelProto, op_types: Sequence[str]) -> dict:
        return kept_float_section(self, model, op_types)

    def problems(self, int8: onnx.ModelProto) -> list[str]:
        """The nodes meant to stay float (head, NMS) that int8 quantized anyway."""
        wrong = float_violations(int8, [*self.head, *self.postprocessing])
        return [f"int8 quantized {len(wrong)} node(s) of the head or NMS meant to stay float: "
                f"{', '.join(wrong[:5])}"] if wrong else []


def graph_parts(model: onnx.ModelProto) -> GraphParts:
    """Split a detection graph (every node named: ttc/compress/int8.py names the unnamed ones
    first) into backbone, head and post-processing by what the NMS's two inputs depend on."""
    nodes = list(model.graph.node)
    nms = [n for n in nodes if n.op_type == "NonMaxSuppression"]
    if len(nms) != 1:
        raise ExportError(f"a detection graph has one NonMaxSuppression node; this one has "
                          f"{len(nms)}", "re-export the bundle with export.py")
    producers = {out: k for k, node in enumerate(nodes) for out in node.output if out}
    of_boxes = ancestors(nodes, producers, nms[0].input[0])
    of_scores = ancestors(nodes, producers, nms[0].input[1])
    names = [node.name for node in nodes]
    backbone = of_boxes & of_scores
    read_after = {name for k, node in enumerate(nodes) if k not in backbone
                  for name in node.input}
    return GraphParts(backbone=[names[k] for k in sorted(backbone)],
                      head=[names[k] for k in sorted(of_boxes ^ of_scores)],
                      postprocessing=[names[k] for k in range(len(nodes))
                                      if k not in of_boxes | of_scores],
                      boundary=[names[k] for k in sorted(backbone)
                                if read_after.intersection(nodes[k].output)])


def float_violations(model: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    """Those of the nodes `names` (kept float) that an int8 graph lost (replaced by integer ops)
    or feeds from a DequantizeLinear: none where the head and the NMS run in float."""
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    by_name = {node.name: node for node in model.graph.node}
    return [name for name in names if name not in by_name or any(
        producer.get(i) == "DequantizeLinear" for i in by_name[name].input)]


def ancestors(nodes: Sequence[onnx.NodeProto], producers: dict[str, int], tensor: str
              ) -> set[int]:
    """The indices of the nodes `tensor` is computed from (its producer included)."""
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        k = producers.get(stack.pop())
        if k is None or k in seen:
            continue
        seen.add(k)
        stack.extend(name for name in nodes[k].input if name)
    return seen


def kept_float_section(parts: GraphParts, model: onnx.ModelProto, op_types: Sequence[str]
                       ) -> dict:
    """The report's quantize.exclusion.kept_float: the head's and the post-processing's nodes
    (all kept in float), the ones int8 would otherwise have quantized named first."""
    types = {node.name: node.op_type for node in model.graph.node}
    return {"rule": "the detection head (its convolutions and the decoding into candidate "
                    "boxes and scores) and the NMS post-processing stay float; only the "
                    "backbone is quantized",
            "quantizable": [n for n in parts.kept_float() if types[n] in op_types],
            "backbone_nodes": len(parts.backbone), "boundary": parts.boundary,
            "head": parts.head, "postprocessing": parts.postprocessing}


class DetectionScorer:
    """What a detector's variant is judged by (the methods of ttc/compress/quantizing.py's
    Scorer): its detections per image (NMS in the graph), scored by COCO's mAP@[.5:.95] ("map"),
    with mAP@.5 beside it."""

    name = "map"

    def __init__(self, labels: Sequence[str]) -> None:
        self.labels = list(labels)

    def runner(self, session) -> DetectionRunner:
        return detection_runner(session)

    def predict(self, session, x: np.ndarray, batch_size: int) -> list[Detections]:
        return predict_detections(detection_runner(session), x, batch_size)

    def evaluate(self, found: Sequence[Detections], truth: Sequence[np.ndarray]
                 ) -> dict[str, float]:
        metrics = detection_metrics(list(found), list(truth), self.labels)
        return {"map": metrics["map"], "map50": metrics["map50"]}

    def compare(self, found: Sequence[Detections], reference: Sequence[Detections]
                ) -> tuple[float, float]:
        """(the share of images whose best detection agrees with fp32's: same class and IoU
        ≥ AGREEMENT_IOU, or neither finds anything; the largest score difference of those best
        detections)."""
        agreed, worst = 0, 0.0
        for (boxes, scores, labels), (ref_boxes, ref_scores, ref_labels) in zip(found, reference):
            if not len(scores) or not len(ref_scores):
                agreed += len(scores) == len(ref_scores)
                continue
            worst = max(worst, abs(float(scores[0]) - float(ref_scores[0])))
            overlap = iou_with(np.asarray(boxes[:1], np.float64), ref_boxes[0])[0]
            agreed += int(labels[0] == ref_labels[0] and overlap >= AGREEMENT_IOU)
        return agreed / max(1, len(found)), worst


class DetectorQuantizing:
    """A detector's part in int8: judged by COCO mAP, calibrated 4 images a batch, its head and
    NMS kept float (graph_parts)."""

    calibration_batch = CALIBRATION_BATCH

    def scorer(self, manifest) -> DetectionScorer:
        return DetectionScorer(manifest.labels)

    def kept_float(self, graph: onnx.ModelProto) -> GraphParts:
        return graph_parts(graph)


QUANTIZING = DetectorQuantizing()
