"""The compressed variants (--prune, --qat): each exported (a pruned network as fp32, a
fake-quantized one as a QDQ int8 graph), checked against its own PyTorch network, and written
with its weights and the manifest that names them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx

from ttc.convert.checking import NumericCheck, check_samples, compare_with_torch, export_example
from ttc.convert.tracing import check_graph, export_graph, slim_graph
from ttc.options.stages import ExportOptions
from ttc.serving.bundle import (BundlePaths, Manifest, manifest_text, read_manifest,
                                stamp_contract)
from utils import LOG, ExportError, sha256_of, staged_files

if TYPE_CHECKING:  # torch loads only when a variant is exported
    import torch


# A QDQ graph runs integer kernels where PyTorch's fake quantization rounds in float: their
# outputs differ by about one quantization step, so the check is on decisions (top-1 agreement
# on held-out samples) and the difference is recorded, not bounded by --validate_atol.
QDQ_MIN_AGREEMENT = 0.98


@dataclass
class CompressedGraph:
    """A compressed variant's graph, exported and checked against its own PyTorch network."""

    name: str
    model: onnx.ModelProto
    check: NumericCheck
    nodes: int
    structure: dict | None  # a QDQ graph's nodes and the integer kernels ONNX Runtime runs


def export_compressed_graph(options: ExportOptions, variant, samples: np.ndarray, manifest: Manifest
                            ) -> CompressedGraph:
    """Export one compressed variant (a pruned network as fp32, slimmed; a fake-quantized one as
    a QDQ int8 graph), onnx.checker, and the numeric check against its own PyTorch network."""
    spec, output_names = manifest.input, list(manifest.output_names)
    example = export_example(samples, spec)
    def exported(net: torch.nn.Module, x: np.ndarray) -> onnx.ModelProto:
        return export_graph(net, x, options.opset, spec, output_names,
                            temperature=manifest.temperature)

    if variant.quantized:
        from ttc.compress.qat import export_qdq, qdq_structure, require_integer_kernels

        graph = slim_graph(export_qdq(variant.net, example, exported))
    else:
        graph = slim_graph(exported(variant.net, example))
    check_graph(graph)
    structure = None
    if variant.quantized:
        require_integer_kernels(graph)
        structure = qdq_structure(graph)
    atol = float("inf") if variant.quantized else options.validate_atol
    check = compare_with_torch(graph, variant.net, samples, spec, atol, options.batch_size,
                               options.num_threads, manifest.temperature)
    if variant.quantized and check.top1_agreement < QDQ_MIN_AGREEMENT:
        raise ExportError(f"numeric check failed for the {variant.name} graph: top-1 agreement "
                          f"with its fake-quantized PyTorch network is {check.top1_agreement:.1%}"
                          f" (< {QDQ_MIN_AGREEMENT:.0%}) on {check.samples} held-out samples; "
                          "the bundle was not changed",
                          "train without --qat, or report it with --log_level DEBUG")
    LOG.info("%s graph ok: %d nodes, max |onnx - torch| %.2g, top-1 agreement %.1f%%",
             variant.name, len(graph.graph.node), check.max_abs_diff,
             100 * check.top1_agreement)
    return CompressedGraph(variant.name, graph, check, len(graph.graph.node), structure)


def export_compressed(options: ExportOptions, variants: Sequence, paths: BundlePaths,
                      held_out: np.ndarray, train_samples: np.ndarray) -> list[CompressedGraph]:
    """Every compressed variant exported and checked, then written with its weights and the
    manifest that names them, staged together (graphs first, manifest last). `options`: those
    export_bundle exported the bundle with (their validate_atol resolved)."""
    from ttc.compress.variants import compression_record
    from ttc.nets.models import weights_bytes

    manifest = read_manifest(paths)
    samples = check_samples(held_out, train_samples, manifest.input)
    graphs = [export_compressed_graph(options, v, samples, manifest) for v in variants]
    draft = manifest.to_json_dict()
    with staged_files() as stage:
        for variant, graph in zip(variants, graphs):
            weights_path = paths.variant_weights(variant.name)
            draft["files"][f"weights_{variant.name}"] = weights_path.name
            draft["files"]["sha256"][f"weights_{variant.name}"] = sha256_of(
                stage(weights_path, lambda tmp, b=weights_bytes(variant.net): tmp.write_bytes(b)))
            model = stamp_contract(graph.model, manifest)
            draft["files"][variant.name] = paths.variant(variant.name).name
            draft["files"]["sha256"][variant.name] = sha256_of(
                stage(paths.variant(variant.name),
                      lambda tmp, m=model: onnx.save_model(m, str(tmp))))
        draft["compression"] = compression_record(variants, graphs, paths, draft)
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(draft), encoding="utf-8"))
    return graphs


def bundle_compressed_nets(manifest: Manifest, paths: BundlePaths, net: torch.nn.Module,
                           samples: np.ndarray) -> list:
    """export.py on a bundle train.py compressed (--prune, --qat): its variants rebuilt from
    their weights and recorded shapes (checked against the manifest train.py wrote, before any
    export rewrites it); [] for a bundle without."""
    if not manifest.compression or not manifest.compression.variants:
        return []
    from ttc.compress.variants import example_input, load_compressed

    return load_compressed(manifest, paths, net, example_input(samples, manifest.input.pad_id
                                                               or 0))
