"""Semantic segmentation (`--model_type image_segmenter`): its entry (TASK, plain data like the
other entries) and, beside it, its own code: data reader (data.py), networks (nets.py), pixel
metrics (metrics.py), in-graph TTA (tta.py), mask files (masks.py), training (training.py),
export (export.py), evaluation (evaluate.py), batch prediction (predict.py) and the inference
stage that runs them on a bundle (stages.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task


@dataclass(frozen=True)
class ImageSegmenter(Task):
    """Images in at any height and width; logits and calibrated probabilities (N, K, H, W) and
    the mask (N, H, W), the argmax, out."""

    def graph_input(self, preprocessing: dict) -> dict:
        return {"name": "image", "dtype": "float32", "layout": "NCHW", "range": [0.0, 1.0],
                "shape": ["batch", preprocessing["channels"], "height", "width"]}

    def graph_outputs(self, num_classes: int) -> list[dict]:
        planes = ["batch", num_classes, "height", "width"]
        return [{"name": "logits", "shape": planes, "dtype": "float32"},
                {"name": "probabilities", "shape": planes, "dtype": "float32"},
                {"name": "mask", "shape": ["batch", "height", "width"], "dtype": "int64"}]

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        return [preprocessing.get("channels"), None, None]

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"image_size": preprocessing["image_size"], "channels": preprocessing["channels"],
                "ignore_index": preprocessing["ignore_index"]}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"channels": preprocessing["channels"],
                "image_size": list(preprocessing["image_size"])}


# What a segmenter does not take (yet): the table and text flags, the classifiers' training
# extras, compression, ensembles, Tent and the streams, the iterative methods.
REFUSED_FLAGS = (
    "image_column", "text_column", "feature_columns", "label_column", "dataset_format",
    "max_vocab", "max_length", "init_weights", "freeze_epochs", "label_smoothing", "max_norm",
    "teacher_lm", "unlabeled_path", "qat", "prune", "ensemble_size", "ensemble", "tta_merge",
    "tta_threshold", "tta_plan", "ttt_reset_every", "eval_stream", "iterative", "benchmark",
    "profile", "top_k", "id_column")
_TORCHVISION = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large")
TASK = ImageSegmenter(
    name="image_segmenter", kind="segmentation", archs=("unet", *_TORCHVISION),
    parts=Parts(reader="ttc.tasks.segment.data:load_segmentation_dataset",
                rows="ttc.serving.batch:ImageRows",
                networks="ttc.tasks.segment.nets:SEGMENTATION_NETWORKS",
                modules="ttc.tasks.segment.nets:SEGMENTATION_MODULES",
                evaluation="ttc.tasks.segment.evaluate:evaluation_section",
                trainer="ttc.tasks.segment.training:train_segmenter",
                report="ttc.tasks.segment.report:REPORT",
                test_split="ttc.tasks.segment.stages:evaluate_dense",
                new_input="ttc.tasks.segment.stages:predict_masks",
                quantizing="ttc.tasks.segment.quantize:QUANTIZING",
                served="ttc.tasks.segment.served:SegmenterServing",
                validation_scores="ttc.tasks.segment.training:validation_scores",
                flag_checks="ttc.tasks.segment.flags:check_flags",
                exporter="ttc.tasks.segment.export:export_dense_bundle"),
    regularisation={"unet": Regularisation(0.1, 1e-4, source="ours"),
                    **{arch: Regularisation(None, 1e-4, source="torchvision's own dropout")
                       for arch in _TORCHVISION}},
    default_tta="hflip", builtins=("builtin:digit_canvases",), input_role="image",
    input_field="image",
    image_files=True,
    scored_by="mean_iou", program="SegmenterProgram", calibrated_on="pixels",
    image_loop=True, learning_rate=1e-2, tta_graph=True, masks=True, refused_flags=REFUSED_FLAGS,
    guide="segmentation.md")
