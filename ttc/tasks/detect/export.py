"""A detector's numeric check (issue 44, item 3): the exported graph (the network, its decoding
and NMS in one ONNX graph) against PyTorch's `detect` (the same network, decoding and
torchvision's NMS) on held-out images at batch sizes 1, 4 and 8 and at two image sizes. The
final detections are compared, not raw tensors: per image the same number of detections, each
graph detection matched to an eager one of the same class with IoU ≥ MIN_MATCHED_IOU, scores
within --validate_atol. export.py exports and writes the bundle; this module decides whether
it may."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ttc.tasks.detect.nms import detect
from ttc.tasks.detect.training import NmsSettings, box_iou
from ttc.tasks.segment.export import MAX_CHECK_IMAGES, probes_at_two_sizes
from utils import ExportError

MIN_MATCHED_IOU = 0.99  # the issue's: a graph box and PyTorch's overlap at least this much
CHECK_BATCH_SIZES = (1, 4, 8)

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)


@dataclass
class DetectionCheck:
    """What the check measured, in the fields export.py's NumericCheck has."""

    max_abs_diff: float  # the largest score difference of matched detections
    top1_agreement: float  # the share of images whose detections all matched
    samples: int
    batch_sizes: list[int]
    probes: list[str]  # "held_out HxW" per resolution
    detections: int = 0  # compared, over every probe and batch size
    min_matched_iou: float = 1.0
    count_mismatches: int = 0  # images whose number of detections differs
    resolutions: list[str] = field(default_factory=list)  # "HxW"


def eager_detections(net: torch.nn.Module, images: np.ndarray, nms: NmsSettings
                     ) -> list[Detections]:
    """PyTorch's detections of the images, one batch, padding removed."""
    with torch.no_grad():
        boxes, scores, labels, counts = (t.numpy() for t in detect(
            net.eval(), torch.from_numpy(images), nms.iou_threshold, nms.score_threshold,
            nms.max_detections))
    return [(boxes[i, :n], scores[i, :n], labels[i, :n]) for i, n in enumerate(counts)]


def matched(got: Detections, expected: Detections) -> tuple[float, float] | None:
    """(smallest IoU, largest score difference) of the graph's detections each matched to the
    eager detection of its class that it overlaps most (each used once), or None when the counts
    differ or one finds no partner."""
    if len(got[0]) != len(expected[0]):
        return None
    if not len(got[0]):
        return 1.0, 0.0
    overlaps = box_iou(got[0], expected[0])
    overlaps[got[2][:, None] != expected[2][None, :]] = -1.0
    low, worst, used = 1.0, 0.0, set()
    for k in np.argsort(-got[1], kind="stable"):
        ranked = [j for j in np.argsort(-overlaps[k], kind="stable") if j not in used]
        if not ranked or overlaps[k, ranked[0]] < 0:
            return None
        j = ranked[0]
        used.add(j)
        low = min(low, float(overlaps[k, j]))
        worst = max(worst, abs(float(got[1][k]) - float(expected[1][j])))
    return low, worst


def compare_detections(run: Callable[[np.ndarray], list[Detections]], net: torch.nn.Module,
                       samples: np.ndarray, nms: NmsSettings, atol: float,
                       reference: Callable[[np.ndarray], list[Detections]] | None = None
                       ) -> DetectionCheck:
    """`run` maps a batch to the graph's detections per image (evaluate.detection_runner);
    `reference` a batch to the expected ones (default: eager_detections; the TTA graph's:
    tta.tta_reference). Raises ExportError (exit 4) when an image's detections differ in
    number, a box matches with IoU < MIN_MATCHED_IOU or a score differs by more than `atol`."""
    probes = probes_at_two_sizes(samples)
    sizes = [s for s in CHECK_BATCH_SIZES if s <= len(samples[:MAX_CHECK_IMAGES])] or [1]
    check = DetectionCheck(0.0, 1.0, len(samples[:MAX_CHECK_IMAGES]), sizes, list(probes),
                           resolutions=[f"{p.shape[-2]}x{p.shape[-1]}" for p in probes.values()])
    images_ok = images_seen = 0
    for name, probe in probes.items():
        expected = reference(probe) if reference else eager_detections(net, probe, nms)
        for size in sizes:
            got = [d for i in range(0, len(probe), size) for d in run(probe[i:i + size])]
            for k, (g, e) in enumerate(zip(got, expected)):
                images_seen += 1
                result = matched(g, e)
                if result is None:
                    check.count_mismatches += len(g[0]) != len(e[0])
                    raise_mismatch(name, size, k, g, e)
                check.min_matched_iou = min(check.min_matched_iou, result[0])
                check.max_abs_diff = max(check.max_abs_diff, result[1])
                check.detections += len(g[0])
                images_ok += 1
    check.top1_agreement = images_ok / max(1, images_seen)
    require_close(check, atol)
    return check


def max_score_diff(run: Callable[[np.ndarray], list[Detections]],
                   reference: Callable[[np.ndarray], list[Detections]], images: np.ndarray,
                   what: str) -> float:
    """The largest score difference between two graphs' matched detections of the same images
    (a second graph of the bundle against the deployable one); ExportError (exit 4) when an
    image's detections differ in number or a box matches with IoU < MIN_MATCHED_IOU."""
    worst = 0.0
    for k, (got, expected) in enumerate(zip(run(images), reference(images))):
        result = matched(got, expected)
        if result is None or result[0] < MIN_MATCHED_IOU:
            raise ExportError(f"the {what} finds other detections than the exported graph on "
                              f"held-out image {k}; the bundle was not written",
                              "rerun with --log_level DEBUG and report it")
        worst = max(worst, result[1])
    return worst


def raise_mismatch(probe: str, batch_size: int, index: int, got: Detections,
                   expected: Detections) -> None:
    raise ExportError(f"numeric check failed: on {probe} image {index} at batch {batch_size} "
                      f"the graph finds {len(got[0])} detections and PyTorch {len(expected[0])}"
                      " (or a box has no partner of its class); the bundle was not written",
                      "rerun with --log_level DEBUG and report it (a score at "
                      "--score_threshold may tip either way: try another threshold)")


def require_close(check: DetectionCheck, atol: float) -> None:
    if check.min_matched_iou < MIN_MATCHED_IOU:
        raise ExportError(f"numeric check failed: a graph box overlaps PyTorch's by IoU "
                          f"{check.min_matched_iou:.4f} < {MIN_MATCHED_IOU} at "
                          f"{' and '.join(check.probes)}; the bundle was not written",
                          "rerun with --log_level DEBUG and report it")
    if not check.max_abs_diff <= atol:
        raise ExportError(f"numeric check failed: max |onnx - torch| score = "
                          f"{check.max_abs_diff:.3g} > --validate_atol {atol:g} over "
                          f"{check.detections:,} detections at {' and '.join(check.probes)}; "
                          "the bundle was not written",
                          "raise --validate_atol if this difference is acceptable")


def nms_settings(config, preprocessing: dict) -> NmsSettings:
    """The bundle's NMS settings (recorded at training), with --iou_threshold,
    --score_threshold and --max_detections over them where export.py was given them."""
    recorded = NmsSettings.from_preprocessing(preprocessing)
    given: Sequence[str] = getattr(config, "given", ())
    return NmsSettings(*(getattr(config, name) if name in given else getattr(recorded, name)
                         for name in ("iou_threshold", "score_threshold", "max_detections")))
