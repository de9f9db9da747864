"""A segmenter's numeric check (issue 43, item 3): the exported graph against PyTorch on held-out
images at the training resolution and at a second one, at batch 1 and a larger batch: the
largest per-pixel difference of the logits and probabilities (bounded by --validate_atol) and
the share of pixels whose mask (the graph's argmax) agrees with PyTorch's (bounded by
MIN_MASK_AGREEMENT: a near-tie between two classes may flip under float rounding, a wrong graph
flips many). export_dense_bundle, the segmenter's exporter (its Parts.exporter), traces the
graph (SegmentationGraph, dynamic batch, height and width) with ttc/convert's machinery, checks
it here and writes the bundle."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ttc.convert.checking import NumericCheck
from ttc.convert.extras import export_adaptation_graph
from ttc.convert.graphs import optimised
from ttc.convert.tracing import check_graph, export_graph, fold_constants, slim_graph
from ttc.convert.writing import ExportJob, ExportResult, ExtraGraph, write_bundle
from ttc.serving.runtime import RuntimeOptions, create_session
from ttc.tasks.segment.nets import SegmentationGraph
from ttc.tasks.segment.tta import SegmentationTTA, parse_views
from ttc.tasks.segment.views import parse_view_specs, views_text
from utils import LOG, ExportError

if TYPE_CHECKING:
    from ttc.options.stages import ExportOptions
    from ttc.serving.bundle import Manifest

MIN_MASK_AGREEMENT = 0.9999  # the goal: 99.99 % of the pixels
SECOND_SCALE = 1.5  # the second resolution checked: the training size times this
MAX_CHECK_IMAGES = 16  # per resolution: the pixels, not the images, are what is counted


@dataclass
class MaskCheck:
    """What the check measured, in the fields ttc/convert's NumericCheck has."""

    max_abs_diff: float
    top1_agreement: float  # the share of pixels whose mask agrees
    samples: int
    batch_sizes: list[int]
    probes: list[str]  # "held_out HxW" per resolution
    pixels: int = 0
    mask_disagreements: int = 0
    resolutions: list[str] = field(default_factory=list)  # "HxW"


def second_size(height: int, width: int) -> tuple[int, int]:
    """The second resolution: SECOND_SCALE times the training size (an odd size stays odd-safe:
    the networks upsample to their skips' sizes)."""
    return max(2, round(height * SECOND_SCALE)), max(2, round(width * SECOND_SCALE))


def resized(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Images resized (bilinear) to `size`, kept in [0, 1]."""
    if tuple(x.shape[-2:]) == tuple(size):
        return np.ascontiguousarray(x)
    out = F.interpolate(torch.from_numpy(x), size=size, mode="bilinear", align_corners=False)
    return np.ascontiguousarray(out.clamp(0, 1).numpy())


def probes_at_two_sizes(samples: np.ndarray) -> dict[str, np.ndarray]:
    """Held-out images at the training size and at the second size."""
    images = samples[:MAX_CHECK_IMAGES]
    height, width = images.shape[-2:]
    second = second_size(height, width)
    return {f"held_out {height}x{width}": np.ascontiguousarray(images),
            f"held_out {second[0]}x{second[1]}": resized(images, second)}


def require_input_size(logits: np.ndarray, images: np.ndarray, whose: str) -> None:
    """Logits (N, K, H, W) at the images' own height and width, or ExportError (exit 4): a
    network that resizes to a fixed size (a --model_def module's hard-coded nn.Upsample) passes
    training's check at the training size and fails here, at the second size."""
    if logits.ndim == 4 and logits.shape[-2:] == images.shape[-2:]:
        return
    got = "x".join(map(str, logits.shape[-2:])) if logits.ndim == 4 else str(logits.shape)
    raise ExportError(f"{whose} logits are {got} for images of {images.shape[-2]}x"
                      f"{images.shape[-1]}: a segmenter's logits keep the input's height and "
                      "width at any size; the bundle was not written",
                      "resize the logits to the input's size in forward, not to a fixed size "
                      "(e.g. F.interpolate(logits, size=images.shape[-2:], mode=\"bilinear\"))")


def compare_segmentation(run: Callable[[np.ndarray], list[np.ndarray]], net: torch.nn.Module,
                         samples: np.ndarray, atol: float, batch_size: int,
                         temperature: float = 1.0) -> MaskCheck:
    """`run` maps a batch to the graph's [logits, probabilities, mask] (an ONNX Runtime
    session's run). Raises ExportError when a difference passes --validate_atol or the masks
    agree on fewer than MIN_MASK_AGREEMENT of the pixels."""
    wrapper = SegmentationGraph(net, temperature).eval()
    probes = probes_at_two_sizes(samples)
    batch_sizes = sorted({1, max(2, min(len(samples[:MAX_CHECK_IMAGES]), batch_size))})
    max_diff, pixels, flips = 0.0, 0, 0
    for probe in probes.values():
        with torch.no_grad():
            expected = [t.numpy() for t in wrapper(torch.from_numpy(probe))]
        require_input_size(expected[0], probe, "the network's")
        for size in batch_sizes:
            got = [np.concatenate(parts) for parts in zip(*(
                run(probe[i:i + size]) for i in range(0, len(probe), size)))]
            require_input_size(got[0], probe, "the graph's")
            if not all(np.isfinite(g).all() for g in got[:2]):
                raise ExportError("the segmentation graph produces non-finite outputs on "
                                  "held-out images; the bundle was not written",
                                  "retrain with a lower --learning_rate (e.g. 1e-3)")
            max_diff = max(max_diff, *(float(np.abs(g - e).max())
                                       for g, e in zip(got[:2], expected[:2])))
            pixels += got[2].size
            flips += int((got[2] != expected[2]).sum())
    agreement = 1.0 - flips / max(1, pixels)
    check = MaskCheck(max_diff, agreement, len(samples[:MAX_CHECK_IMAGES]), batch_sizes,
                      list(probes), pixels, flips,
                      [f"{p.shape[-2]}x{p.shape[-1]}" for p in probes.values()])
    if not max_diff <= atol:
        raise ExportError(f"numeric check failed: max |onnx - torch| = {max_diff:.3g} > "
                          f"--validate_atol {atol:g} over {pixels:,} pixels at "
                          f"{' and '.join(check.probes)}; the bundle was not written",
                          "raise --validate_atol if this difference is acceptable",
                          raise_flags=("validate_atol",))
    if agreement < MIN_MASK_AGREEMENT:
        raise ExportError(f"numeric check failed: the graph's mask differs from PyTorch's on "
                          f"{flips:,} of {pixels:,} pixels ({1 - agreement:.4%}, more than "
                          f"{1 - MIN_MASK_AGREEMENT:.2%}); the bundle was not written",
                          "rerun with --log_level DEBUG and report it")
    return check


def export_dense_bundle(job: ExportJob) -> ExportResult:
    """A segmenter's bundle: SegmentationGraph (logits, probabilities and mask per pixel) with
    dynamic batch, height and width, slimmed, checked, and compared with PyTorch at two
    resolutions (compare_segmentation); its BatchNorm graph (model.bn.onnx) for --ttt bn,
    checked against model.onnx, and with --tta its TTA graph. Both graphs come from one trace
    (ttc/convert/graphs.py)."""
    options, net, manifest, samples = job.options, job.net, job.manifest, job.samples
    spec, temperature = manifest.input, manifest.temperature
    raw = export_graph(net, samples[:2], options.opset, spec, manifest.output_names,
                       optimize=False, temperature=temperature,
                       wrapper=SegmentationGraph(net, temperature))
    exported = optimised(raw)
    slimmed = slim_graph(exported)
    check_graph(slimmed)
    session = create_session(slimmed.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    masks = compare_segmentation(lambda batch: session.run(None, {spec.name: batch}), net,
                                 samples, options.validate_atol, options.batch_size, temperature)
    LOG.info("export ok: %d → %d nodes after onnxslim, max |onnx - torch| %.2g, mask agreement "
             "%.4f%% of %d pixels at %s", len(exported.graph.node), len(slimmed.graph.node),
             masks.max_abs_diff, 100 * masks.top1_agreement, masks.pixels,
             " and ".join(masks.probes))
    check = NumericCheck(masks.max_abs_diff, masks.top1_agreement, masks.samples,
                         masks.batch_sizes, masks.probes)
    result = job.result(exported, slimmed, check, {
        "mask_agreement": masks.top1_agreement, "pixels_checked": masks.pixels,
        "mask_disagreements": masks.mask_disagreements,
        "resolutions_checked": masks.resolutions})
    unoptimised = fold_constants(raw)
    has_batchnorm = any(n.op_type == "BatchNormalization" for n in unoptimised.graph.node)
    extras = {"bn": export_adaptation_graph(net, unoptimised if has_batchnorm else None,
                                            samples, slimmed, options, manifest)}
    if options.tta:
        extras["tta"] = segmentation_tta_graph(options, net, samples, manifest)
    write_bundle(slimmed, net, result, {k: v for k, v in extras.items() if v is not None})
    return result


def segmentation_tta_graph(options: ExportOptions, net: torch.nn.Module, samples: np.ndarray,
                           manifest: Manifest) -> ExtraGraph:
    """--tta for a segmenter: its views (--tta_transforms, default hflip) and the mean of their
    logits, mapped back onto the input's pixels, in one graph (model.tta.onnx), checked against
    the same module in PyTorch at two resolutions as model.onnx is."""
    spec, temperature = manifest.input, manifest.temperature
    views = views_text(parse_view_specs(options.tta_transforms))
    merged = SegmentationTTA(net, parse_views(views)).eval()
    graph = slim_graph(export_graph(merged, samples[:2], options.opset, spec,
                                    manifest.output_names, temperature=temperature,
                                    wrapper=SegmentationGraph(merged, temperature)))
    check_graph(graph)
    session = create_session(graph.SerializeToString(),
                             RuntimeOptions(intra_op_threads=options.num_threads))
    check = compare_segmentation(lambda batch: session.run(None, {spec.name: batch}), merged,
                                 samples, options.validate_atol, options.batch_size, temperature)
    LOG.info("TTA graph (%s) ok: max |onnx - torch| %.2g, mask agreement %.4f%%", views,
             check.max_abs_diff, 100 * check.top1_agreement)
    return ExtraGraph(graph, {"views": views, "max_abs_diff": check.max_abs_diff,
                              "mask_agreement": check.top1_agreement,
                              "resolutions_checked": check.resolutions})
