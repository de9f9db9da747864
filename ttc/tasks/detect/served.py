"""A detector served (its `Parts.served` part; ttc/online/served.py says the shape): an image in
(a row's base64 file bytes, as an image classifier's rows), its boxes out, each {label,
class_index, score, x1, y1, x2, y2} in the image's own pixels: the rows `inference.py --input`
writes for that image, by the same code (predict.Predicting decodes, runs, checks the graph's
detections, keeps those at --min_score and scales them back to the image's size;
predict.RowWriter rounds them). The rows to images, the split of a batch into its requests and
the warm-up are the segmenter's (segment/served.py's ImageServing). numpy and Pillow only."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ttc.tasks.detect.evaluate import detection_runner
from ttc.tasks.detect.predict import (DetectBatchOptions, ImageDetections, Predicting,
                                      RowWriter)
from ttc.tasks.segment.predict import Listed
from ttc.tasks.segment.served import ImageServing

BOX_KEYS = ("label", "class_index", "score", "x1", "y1", "x2", "y2")  # of a --input row
REQUEST = Path("the request")  # where the images come from, for the options (no file is read)


class DetectorServing(ImageServing):
    """A detector's answer per image: {"height", "width", "boxes": [{label, class_index, score,
    x1, y1, x2, y2}, ...]} (best first); V2: `boxes` (FP32, [rows, M, 4]), `scores` (FP32,
    [rows, M]), `labels` (BYTES, [rows, M]) padded to the most boxes of an image of the
    request, M (a padding box is zeros with the label ""), and `num_detections` (INT64,
    [rows])."""

    task_words = "a detector"
    runner = staticmethod(detection_runner)

    def __init__(self, opened: Any) -> None:
        super().__init__(opened)
        options = DetectBatchOptions(REQUEST, REQUEST.with_suffix(".jsonl"),
                                     min_score=float(opened.options.min_score))
        self.predicting = Predicting(options, self.preprocessing, self.labels, self.run)
        self.rows = RowWriter(None, "jsonl", self.labels)  # its records only, no file

    def batch(self, items: Sequence[Listed]) -> list[ImageDetections]:
        return self.predicting.batch(items)

    def answer(self, result: ImageDetections) -> dict:
        records = self.rows._records(result)  # noqa: SLF001 - --input's rows of the image
        return {"height": result.height, "width": result.width,
                "boxes": [{key: record[key] for key in BOX_KEYS} for record in records]}

    def output_metadata(self) -> list[dict]:
        return [{"name": "boxes", "datatype": "FP32", "shape": [-1, -1, 4]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, -1]},
                {"name": "labels", "datatype": "BYTES", "shape": [-1, -1]},
                {"name": "num_detections", "datatype": "INT64", "shape": [-1]}]

    def v2_outputs(self, outputs: np.ndarray, extra: Mapping[str, np.ndarray]) -> list[dict]:
        rows = len(outputs)
        most = max((len(answer["boxes"]) for answer in outputs), default=0)
        padded = [answer["boxes"] + [None] * (most - len(answer["boxes"])) for answer in outputs]
        return [{"name": "boxes", "datatype": "FP32", "shape": [rows, most, 4],
                 "data": [value for boxes in padded for box in boxes
                          for value in ([box[k] for k in ("x1", "y1", "x2", "y2")] if box
                                        else [0.0] * 4)]},
                {"name": "scores", "datatype": "FP32", "shape": [rows, most],
                 "data": [box["score"] if box else 0.0 for boxes in padded for box in boxes]},
                {"name": "labels", "datatype": "BYTES", "shape": [rows, most],
                 "data": [box["label"] if box else "" for boxes in padded for box in boxes]},
                {"name": "num_detections", "datatype": "INT64", "shape": [rows],
                 "data": [len(answer["boxes"]) for answer in outputs]}]

    def tool_description(self) -> str:
        arch = self.manifest.architecture.arch or self.manifest.architecture.name
        return (f"Finds objects of {len(self.labels)} classes ({self.class_list()}) in an image "
                f"with a trained {arch} detector run by ONNX Runtime. Takes the image file's "
                "bytes, base64. Returns the image's height and width and its boxes, best first: "
                "each its label, class_index, score (0 to 1) and corners x1, y1, x2, y2 in the "
                "image's pixels.")
