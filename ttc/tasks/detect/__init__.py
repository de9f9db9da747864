"""Object detection (`--model_type object_detector`): its entry (TASK, plain data like the other
entries) and, beside it, its own code: data readers for YOLO and COCO layouts (data.py), the
bench's and the builtin's digit canvases (canvases.py), the detector (nets.py), decoding and NMS
in the graph (nms.py), COCO metrics (metrics.py), weighted box fusion (wbf.py), training
(training.py), export (export.py), evaluation (evaluate.py), batch prediction (predict.py, and on
Ray cluster.py), bn test-time training (adapt.py), int8 with the head and NMS in float
(quantize.py), in-graph TTA (tta.py, fusion.py) and the inference stage that runs them on a
bundle (stages.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task

DETECTION_OUTPUTS = ("boxes", "scores", "labels", "num_detections")


@dataclass(frozen=True)
class ObjectDetector(Task):
    """Images in at any height and width; per image the best `max_detections` boxes after
    class-aware NMS, padded: boxes (N, M, 4) xyxy in input pixels, scores (N, M), labels
    (N, M) (-1 in padding rows) and num_detections (N,)."""

    def graph_input(self, preprocessing: dict) -> dict:
        return {"name": "image", "dtype": "float32", "layout": "NCHW", "range": [0.0, 1.0],
                "shape": ["batch", preprocessing["channels"], "height", "width"]}

    def graph_outputs(self, num_classes: int) -> list[dict]:
        return [{"name": "boxes", "shape": ["batch", "detections", 4], "dtype": "float32"},
                {"name": "scores", "shape": ["batch", "detections"], "dtype": "float32"},
                {"name": "labels", "shape": ["batch", "detections"], "dtype": "int64"},
                {"name": "num_detections", "shape": ["batch"], "dtype": "int64"}]

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        return [preprocessing.get("channels"), None, None]

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"image_size": preprocessing["image_size"], "channels": preprocessing["channels"]}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"channels": preprocessing["channels"],
                "image_size": list(preprocessing["image_size"])}


# What a detector does not take (yet): the table and text flags, the classifiers' training
# extras, compression, fp16, ensembles, the streams, the iterative methods and the classifiers'
# TTA merges and plans.
REFUSED_FLAGS = (
    "image_column", "text_column", "feature_columns", "label_column", "dataset_format",
    "max_vocab", "max_length", "init_weights", "freeze_epochs", "label_smoothing", "max_norm",
    "teacher_lm", "unlabeled_path", "qat", "prune", "ensemble_size", "ensemble", "tta_merge",
    "tta_threshold", "tta_plan", "ttt_reset_every", "eval_stream", "iterative", "benchmark",
    "profile", "top_k", "fp16", "ignore_index", "mask_dir", "id_column")
TASK = ObjectDetector(
    name="object_detector", kind="detection", archs=("centernet", "mobilenet_v3_large", "ssdlite320_mobilenet_v3_large"),
    parts=Parts(reader="ttc.tasks.detect.data:load_detection_dataset",
                rows="ttc.serving.batch:ImageRows",
                networks="ttc.tasks.detect.nets:DETECTION_NETWORKS",
                modules="ttc.tasks.detect.nets:DETECTION_MODULES",
                evaluation="ttc.tasks.detect.evaluate:evaluation_section",
                trainer="ttc.tasks.detect.training:train_detector",
                report="ttc.tasks.detect.report:REPORT",
                test_split="ttc.tasks.detect.stages:evaluate_detector",
                new_input="ttc.tasks.detect.stages:predict_detections",
                quantizing="ttc.tasks.detect.quantize:QUANTIZING",
                served="ttc.tasks.detect.served:DetectorServing",
                flag_checks="ttc.tasks.detect.flags:check_detector_flags",
                exporter="ttc.tasks.detect.export:export_detection_bundle"),
    regularisation={"centernet": Regularisation(0.0, 1e-4, source="ours"),
                    "mobilenet_v3_large": Regularisation(0.0, 1e-4, source="ours"),
                    "ssdlite320_mobilenet_v3_large": Regularisation(None, 1e-4,
                                                                    source="torchvision")},
    builtins=("builtin:digit_boxes",), input_role="image", input_field="image",
    image_files=True, scored_by="map", program="DetectorProgram", class_prior=False,
    uncalibrated="a detector's box scores are not temperature-scaled (COCO mAP ranks them)",
    image_loop=True, learning_rate=4e-3, tta_graph=True, refused_flags=REFUSED_FLAGS,
    default_tta="scale:0.75,1.25",  # the views of --tta without --tta_transforms (detection.md)
    own_flags=("annotations", "iou_threshold", "score_threshold", "max_detections",
               "output_format", "min_score"),
    guide="detection.md")
