"""int8 and fp16 for a segmenter: its `Parts.quantizing` (QUANTIZING; the shape:
ttc/compress/quantizing.py). A variant is judged by the mean IoU of the masks its pixel
probabilities give (argmax over the class axis, void pixels left out), calibrated 32 images a
batch as a classifier's, no node kept float but what the flags say. No torch."""
from __future__ import annotations

from functools import partial

from ttc.compress.quantizing import ClassifierQuantizing, ProbabilityScorer
from ttc.tasks.segment.evaluate import probabilities_mean_iou


class SegmenterQuantizing(ClassifierQuantizing):
    """A classifier's part but for the figure: "mean_iou" of the probabilities (N, K, H, W);
    agreement is top-1 per pixel, the difference the largest of |p - p_fp32|."""

    def scorer(self, manifest) -> ProbabilityScorer:
        return ProbabilityScorer("mean_iou", partial(
            probabilities_mean_iou, num_classes=manifest.classes,
            ignore_index=manifest.preprocessing.spec["ignore_index"]))


QUANTIZING = SegmenterQuantizing()
