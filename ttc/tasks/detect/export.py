"""A detector's numeric check (issue 44, item 3): the exported graph (the network, its decoding
and NMS in one ONNX graph) against PyTorch's `detect` (the same network, decoding and
torchvision's NMS) on held-out images at batch sizes 1, 4 and 8 and at two image sizes. The
final detections are compared, not raw tensors: per image the same number of detections, each
graph detection matched to an eager one of the same class with IoU ≥ MIN_MATCHED_IOU, scores
within --validate_atol. export_detection_bundle, the detector's exporter (its Parts.exporter),
exports with ttc/convert's machinery, checks here and writes the bundle."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import onnx
import torch

from ttc.convert.checking import NumericCheck, _require_close
from ttc.convert.graphs import optimised
from ttc.convert.tracing import check_graph, fold_constants, slim_graph
from ttc.convert.writing import ExportJob, ExportResult, ExtraGraph, write_bundle
from ttc.serving.bundle import as_manifest
from ttc.serving.runtime import RuntimeOptions, create_session
from ttc.tasks.detect.nms import DetectionCandidates, append_nms, detect, export_candidates
from ttc.tasks.detect.training import NmsSettings, box_iou
from ttc.tasks.segment.export import MAX_CHECK_IMAGES, probes_at_two_sizes
from utils import LOG, ExportError, first_line

if TYPE_CHECKING:
    from ttc.options.stages import ExportOptions

MIN_MATCHED_IOU = 0.99  # the issue's: a graph box and PyTorch's overlap at least this much
CHECK_BATCH_SIZES = (1, 4, 8)

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (M, 4), scores (M,), labels (M,)


@dataclass
class DetectionCheck:
    """What the check measured, in the fields ttc/convert's NumericCheck has."""

    max_abs_diff: float  # the largest score difference of matched detections
    top1_agreement: float  # the share of images whose detections all matched
    samples: int
    batch_sizes: list[int]
    probes: list[str]  # "held_out HxW" per resolution
    detections: int = 0  # compared, over every probe and batch size
    min_matched_iou: float = 1.0
    count_mismatches: int = 0  # images whose number of detections differs
    ties: int = 0  # detections paired as NMS ties (Tolerance), not as the same box
    resolutions: list[str] = field(default_factory=list)  # "HxW"


def eager_detections(net: torch.nn.Module, images: np.ndarray, nms: NmsSettings
                     ) -> list[Detections]:
    """PyTorch's detections of the images, one batch, padding removed."""
    with torch.no_grad():
        boxes, scores, labels, counts = (t.numpy() for t in detect(
            net.eval(), torch.from_numpy(images), nms.iou_threshold, nms.score_threshold,
            nms.max_detections))
    return [(boxes[i, :n], scores[i, :n], labels[i, :n]) for i, n in enumerate(counts)]


@dataclass(frozen=True)
class Tolerance:
    """What two runtimes may differ by and still run the same graph. Scores differ in their
    last bits, and where the decisions on them are ties within `atol` either outcome is right:
    - the cutoff: --score_threshold, and the lowest score of a full list (--max_detections);
      a detection within `atol` of it may be kept on one side only;
    - NMS's order: of two boxes of a class overlapping by more than `iou_threshold` with scores
      within `atol`, either may suppress the other (an untrained network's near-equal scores
      do this); such a pair counts as a tie, not a mismatch, when the graph's box is one of
      PyTorch's candidates before NMS (so a box the graph moved is never excused).
    A trained network rarely has either (0 of 3,870 image comparisons in bench/detect.py)."""

    score_threshold: float
    max_detections: int
    iou_threshold: float
    atol: float

    def cutoff(self, got: Detections, expected: Detections) -> float:
        """The score at or below which a detection is borderline for these two lists."""
        full = [d[1] for d in (got, expected) if len(d[1]) >= self.max_detections]
        return max([self.score_threshold, *(float(scores.min()) for scores in full)])


@dataclass
class Pairing:
    """How one image's graph detections paired with PyTorch's."""

    min_iou: float = 1.0  # over the pairs of the same box
    max_score_diff: float = 0.0
    ties: int = 0  # pairs of two boxes NMS's order chose between (Tolerance)


def _best_partner(k: int, overlaps: np.ndarray, used: set[int], at_least: float) -> int | None:
    ranked = [j for j in np.argsort(-overlaps[k], kind="stable") if j not in used]
    return ranked[0] if ranked and overlaps[k, ranked[0]] >= at_least else None


def among(got: Detections, candidates: Detections | None, atol: float) -> np.ndarray:
    """Per graph detection: whether PyTorch has it before NMS (a candidate of its class with
    IoU ≥ MIN_MATCHED_IOU and a score within atol); all False without candidates."""
    if candidates is None or not len(got[0]) or not len(candidates[0]):
        return np.zeros(len(got[0]), dtype=bool)
    same = ((box_iou(got[0], candidates[0]) >= MIN_MATCHED_IOU)
            & (got[2][:, None] == candidates[2][None, :])
            & (np.abs(got[1][:, None] - candidates[1][None, :]) <= atol))
    return same.any(axis=1)


def pair_detections(got: Detections, expected: Detections, tolerance: Tolerance | None = None,
                    candidates: Detections | None = None) -> Pairing | None:
    """The graph's detections each paired with an eager one of its class (each used once), or
    None when one finds no partner or the counts differ. Without a tolerance, each takes the
    unused one it overlaps most, in score order. With one, first the boxes overlapping by
    MIN_MATCHED_IOU pair up, then the NMS ties (overlap above its IoU threshold, scores within
    atol, the graph's box among PyTorch's `candidates` before NMS), then the rest by overlap (a
    low IoU then fails the check); detections within atol of the cutoff (the graph's among the
    candidates) may go unpaired, and only they may make the counts differ."""
    if tolerance is None and len(got[0]) != len(expected[0]):
        return None
    floor = tolerance.cutoff(got, expected) if tolerance else -np.inf
    atol = tolerance.atol if tolerance else 0.0
    overlaps = (box_iou(got[0], expected[0]) if len(got[0]) and len(expected[0])
                else np.zeros((len(got[0]), len(expected[0]))))
    overlaps[got[2][:, None] != expected[2][None, :]] = -1.0
    real = among(got, candidates, atol)
    tie = (np.abs(got[1][:, None] - expected[1][None, :]) <= atol) & real[:, None]
    passes = [(overlaps, MIN_MATCHED_IOU, False)] if tolerance else []
    if tolerance:
        passes.append((np.where(tie, overlaps, -1.0), tolerance.iou_threshold, True))
    passes.append((overlaps, 0.0, False))
    pairing, used = Pairing(), set()
    left = [k for k in np.argsort(-got[1], kind="stable")
            if not (got[1][k] <= floor + atol and real[k])]
    for table, at_least, is_tie in passes:
        for k in list(left):
            j = _best_partner(k, table, used, at_least)
            if j is None:
                continue
            used.add(j)
            left.remove(k)
            pairing.ties += is_tie
            if not is_tie:
                pairing.min_iou = min(pairing.min_iou, float(overlaps[k, j]))
            pairing.max_score_diff = max(pairing.max_score_diff,
                                         abs(float(got[1][k]) - float(expected[1][j])))
    unpaired = [j for j in range(len(expected[0])) if j not in used]
    if left or any(expected[1][j] > floor + 2 * atol for j in unpaired):
        return None
    return pairing


def matched(got: Detections, expected: Detections) -> tuple[float, float] | None:
    """(smallest IoU, largest score difference) of the graph's detections each matched to the
    eager detection of its class that it overlaps most (each used once), or None when the counts
    differ or one finds no partner: two graphs of the same bundle, no tolerance."""
    pairing = pair_detections(got, expected)
    return None if pairing is None else (pairing.min_iou, pairing.max_score_diff)


def eager_candidates(net: torch.nn.Module, images: np.ndarray, nms: NmsSettings, atol: float
                     ) -> list[Detections]:
    """PyTorch's candidates before NMS per image: every (cell, class) scoring above
    --score_threshold - atol, with its box."""
    with torch.no_grad():
        boxes, scores = DetectionCandidates(net.eval())(torch.from_numpy(images))
    out = []
    for i in range(len(images)):
        classes, anchors = (scores[i] > nms.score_threshold - atol).nonzero(as_tuple=True)
        out.append((boxes[i, anchors].numpy(), scores[i, classes, anchors].numpy(),
                    classes.numpy()))
    return out


def compare_detections(run: Callable[[np.ndarray], list[Detections]], net: torch.nn.Module,
                       samples: np.ndarray, nms: NmsSettings, atol: float,
                       reference: Callable[[np.ndarray], list[Detections]] | None = None
                       ) -> DetectionCheck:
    """`run` maps a batch to the graph's detections per image (evaluate.detection_runner);
    `reference` a batch to the expected ones (default: eager_detections; the TTA graph's:
    tta.tta_reference). Raises ExportError (exit 4) when an image's detections differ in
    number, a box matches with IoU < MIN_MATCHED_IOU or a score differs by more than `atol`
    (ties within `atol` at the cutoff and in NMS's order excepted: Tolerance)."""
    probes = probes_at_two_sizes(samples)
    sizes = [s for s in CHECK_BATCH_SIZES if s <= len(samples[:MAX_CHECK_IMAGES])] or [1]
    check = DetectionCheck(0.0, 1.0, len(samples[:MAX_CHECK_IMAGES]), sizes, list(probes),
                           resolutions=[f"{p.shape[-2]}x{p.shape[-1]}" for p in probes.values()])
    images_ok = images_seen = 0
    tolerance = Tolerance(nms.score_threshold, nms.max_detections, nms.iou_threshold, atol)
    for name, probe in probes.items():
        expected = reference(probe) if reference else eager_detections(net, probe, nms)
        before_nms = [None] * len(probe) if reference else eager_candidates(net, probe, nms,
                                                                             atol)
        for size in sizes:
            got = [d for i in range(0, len(probe), size) for d in run(probe[i:i + size])]
            for k, (g, e) in enumerate(zip(got, expected)):
                images_seen += 1
                pairing = pair_detections(g, e, tolerance, before_nms[k])
                if pairing is None:
                    check.count_mismatches += len(g[0]) != len(e[0])
                    raise_mismatch(name, size, k, g, e, atol)
                check.min_matched_iou = min(check.min_matched_iou, pairing.min_iou)
                check.max_abs_diff = max(check.max_abs_diff, pairing.max_score_diff)
                check.ties += pairing.ties
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
                   expected: Detections, atol: float) -> None:
    hint, raise_flags = "rerun with --log_level DEBUG and report it", ()
    gaps = np.diff(np.sort(expected[1]))
    ties = int((gaps <= atol).sum())
    if ties and ties >= len(gaps) / 10:  # an undertrained network's near-constant heatmap
        hint = (f"{ties} of PyTorch's {len(expected[1])} scores of this image are within "
                f"--validate_atol {atol:g} of the next, so which of the overlapping boxes NMS "
                "keeps depends on the last bits of each runtime: train longer, or raise "
                "--score_threshold above them")
        raise_flags = ("score_threshold",)
    raise ExportError(f"numeric check failed: on {probe} image {index} at batch {batch_size} "
                      f"the graph finds {len(got[0])} detections and PyTorch {len(expected[0])}"
                      " (or a box has no partner of its class); the bundle was not written",
                      hint, raise_flags=raise_flags)


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
                          "raise --validate_atol if this difference is acceptable",
                          raise_flags=("validate_atol",))


def nms_settings(options: ExportOptions, preprocessing: dict) -> NmsSettings:
    """The bundle's NMS settings (recorded at training), with --iou_threshold,
    --score_threshold and --max_detections over them where export.py was given them."""
    recorded = NmsSettings.from_preprocessing(preprocessing)
    given: Sequence[str] = getattr(options, "given", ())
    return NmsSettings(*(getattr(options, name) if name in given else getattr(recorded, name)
                         for name in ("iou_threshold", "score_threshold", "max_detections")))


def export_detection_bundle(job: ExportJob) -> ExportResult:
    """A detector's bundle: the network, its decoding and class-aware NMS in one graph
    (ttc/tasks/detect/nms.py: padded boxes, scores, labels and num_detections, with dynamic
    batch, height and width), slimmed, checked, and compared with PyTorch's detections at batch
    sizes 1, 4 and 8 and two image sizes (compare_detections); its BatchNorm graph for --ttt bn
    and with --tta its TTA graph. The NMS settings it bakes are recorded in the manifest's
    preprocessing.nms."""
    from ttc.tasks.detect.evaluate import detection_runner

    options, net, samples, draft = job.options, job.net, job.samples, job.draft
    nms = nms_settings(options, draft["preprocessing"])
    draft["preprocessing"]["nms"] = nms.record()
    job = dataclasses.replace(job, manifest=as_manifest(draft))
    try:  # one trace for the deployable graph and the adaptation graph (ttc/convert/graphs.py)
        raw = export_candidates(net, samples[:2], options.opset, optimize=False)
        exported = append_nms(optimised(raw), nms.iou_threshold, nms.score_threshold,
                              nms.max_detections)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(f"torch.onnx.export failed at opset {options.opset}: "
                          f"{first_line(err)}", "rerun with --log_level DEBUG") from err
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    session = create_session(slimmed.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    check = compare_detections(detection_runner(session), net, samples, nms,
                               options.validate_atol)
    LOG.info("export ok: %d → %d nodes after onnxslim; %d detections equal to PyTorch's "
             "(IoU ≥ %.4f, scores within %.2g) at batch %s and %s", len(exported.graph.node),
             len(slimmed.graph.node), check.detections, check.min_matched_iou,
             check.max_abs_diff, ", ".join(map(str, check.batch_sizes)),
             " and ".join(check.resolutions))
    numeric = NumericCheck(check.max_abs_diff, check.top1_agreement, check.samples,
                           check.batch_sizes, check.probes)
    result = job.result(exported, slimmed, numeric, {
        "detections_checked": check.detections, "min_matched_iou": check.min_matched_iou,
        "count_mismatches": check.count_mismatches, "ties": check.ties,
        "resolutions_checked": check.resolutions, "nms": nms.record()})
    adaptation = detection_adaptation_graph(options, raw, samples, nms,
                                            detection_runner(session))
    extras = {"bn": adaptation} if adaptation else {}
    if options.tta:
        extras["tta"] = detection_tta_graph(options, net, samples, nms)
    write_bundle(slimmed, net, result, extras)
    return result


def detection_adaptation_graph(options: ExportOptions, raw: onnx.ModelProto, samples: np.ndarray,
                               nms: NmsSettings, deployed: Callable) -> ExtraGraph | None:
    """A detector's graph for --ttt bn (model.bn.onnx): the candidates' unoptimised export
    (`raw`, the same trace the deployable graph was optimised from) constant-folded, so that
    the BatchNormalization nodes survive, with the same NMS appended; its detections checked
    against the deployable graph's (`deployed`) on held-out images. None for a network without
    BatchNorm."""
    from ttc.tasks.detect.evaluate import detection_runner

    candidates = fold_constants(copy.deepcopy(raw))
    if not any(n.op_type == "BatchNormalization" for n in candidates.graph.node):
        return None
    graph = append_nms(candidates, nms.iou_threshold, nms.score_threshold, nms.max_detections)
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    diff = max_score_diff(detection_runner(session), deployed,
                          np.ascontiguousarray(samples[:MAX_CHECK_IMAGES]),
                          "BatchNorm adaptation graph")
    _require_close(diff, "BatchNorm adaptation graph", options)
    layers = sum(n.op_type == "BatchNormalization" for n in graph.graph.node)
    LOG.info("adaptation graph: %d BatchNorm layers kept, max score diff to the exported graph "
             "%.2g", layers, diff)
    return ExtraGraph(graph, {"purpose": "test-time training: BatchNorm nodes kept "
                              "(unoptimised export, constant-folded, not slimmed), the same NMS",
                              "batchnorm_layers": layers, "max_abs_diff": diff})


def detection_tta_graph(options: ExportOptions, net: torch.nn.Module, samples: np.ndarray,
                        nms: NmsSettings) -> ExtraGraph:
    """--tta for a detector: its views (--tta_transforms, default the TASK entry's) with their
    boxes mapped back and fused inside one graph (model.tta.onnx: ttc/tasks/detect/tta.py and
    fusion.py), checked against the same computation in PyTorch and numpy at batch sizes 1,
    4 and 8 and two image sizes, as model.onnx is."""
    from ttc.tasks.detect.evaluate import detection_runner
    from ttc.tasks.detect.flags import detector_views
    from ttc.tasks.detect.fusion import append_fusion
    from ttc.tasks.detect.tta import (default_settings, export_view_candidates,
                                      parse_box_views, tta_reference)

    views_text = detector_views(options.tta_transforms)
    views = parse_box_views(views_text)
    settings = default_settings(nms, len(views))
    candidates = export_view_candidates(net, views, samples[:2], options.opset)
    graph = append_fusion(slim_graph(candidates), len(views), settings)
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    check = compare_detections(detection_runner(session), net, samples, nms,
                               options.validate_atol, tta_reference(net, views, settings))
    LOG.info("TTA graph (%s, box fusion at IoU %.2f) ok: %d detections equal to PyTorch's and "
             "numpy's (IoU ≥ %.4f, scores within %.2g)", views_text, settings.fusion_iou,
             check.detections, check.min_matched_iou, check.max_abs_diff)
    return ExtraGraph(graph, {"views": views_text, "fusion": settings.record(),
                              "max_abs_diff": check.max_abs_diff,
                              "detections_checked": check.detections,
                              "min_matched_iou": check.min_matched_iou,
                              "resolutions_checked": check.resolutions})
