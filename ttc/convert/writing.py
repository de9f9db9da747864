"""What an exporter is given (ExportJob) and gives back (ExportResult), and writing the bundle:
weights, graphs and the manifest that names them by hash, staged and moved into place."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx

from ttc.convert.checking import NumericCheck
from ttc.options.stages import ExportOptions
from ttc.serving.bundle import (BundlePaths, Manifest, manifest_text, record_export,
                                stamp_contract)
from utils import sha256_of, staged_files

if TYPE_CHECKING:  # torch loads only when a bundle is exported
    import torch


@dataclass
class ExportResult:
    paths: BundlePaths
    manifest: Manifest
    draft: dict  # the manifest's JSON, which write_bundle fills and writes
    opset: int
    nodes_before_slim: int
    nodes_after_slim: int
    check: NumericCheck
    atol: float
    size_bytes: int
    seconds: float
    fusion: dict | None = None  # the hf graph ONNX Runtime's transformer fusion made (model.onnx)
    own_check: dict | None = None  # a model type's own figures (a segmenter's masks, a
    # detector's boxes), in the report's section and the manifest's export record

    def report_section(self) -> dict:
        return {**(self.own_check or {}), "path": str(self.paths.onnx), "opset": self.opset,
                "nodes_before_slim": self.nodes_before_slim,
                "nodes_after_slim": self.nodes_after_slim,
                "max_abs_diff": self.check.max_abs_diff, "checker": "passed",
                "top1_agreement": self.check.top1_agreement,
                "samples_checked": self.check.samples, "probes": self.check.probes,
                "padding_max_diff": self.check.padding_max_diff, "size_bytes": self.size_bytes,
                "seconds": self.seconds, "fusion": self.fusion}


@dataclass
class ExportJob:
    """What export_bundle hands a model type's exporter (its Parts.exporter): the trained
    network, the manifest (typed, and its JSON draft, which the exporter may fill and
    write_bundle writes), the 32-64 samples of the numeric check and the bundle's paths; a
    classifier's ensemble members and validation split (the averaged graphs' temperatures),
    and export's options (their validate_atol resolved for the network)."""

    options: ExportOptions
    net: torch.nn.Module  # in eval mode
    manifest: Manifest
    draft: dict
    samples: np.ndarray
    paths: BundlePaths
    started: float  # time.perf_counter() when the export began: the result's `seconds`
    members: Sequence[torch.nn.Module] = ()
    val: tuple[np.ndarray, np.ndarray] | None = None

    def result(self, exported: onnx.ModelProto, slimmed: onnx.ModelProto, check: NumericCheck,
               own_check: dict | None = None) -> ExportResult:
        """The result of exporting `exported`, slimmed to `slimmed` and checked by `check`."""
        return ExportResult(paths=self.paths, manifest=self.manifest, draft=self.draft,
                            opset=self.options.opset,
                            nodes_before_slim=len(exported.graph.node),
                            nodes_after_slim=len(slimmed.graph.node), check=check,
                            atol=self.options.validate_atol, size_bytes=slimmed.ByteSize(),
                            seconds=round(time.perf_counter() - self.started, 3),
                            own_check=own_check)


@dataclass
class ExtraGraph:
    """A graph the bundle carries besides model.onnx, with its manifest entry."""

    model: onnx.ModelProto
    info: dict


def write_bundle(model: onnx.ModelProto, net: torch.nn.Module, result: ExportResult,
                 extras: dict[str, ExtraGraph] | None = None) -> None:
    """Weights, graphs and the manifest that names them by hash, all written to temporary
    files first and then moved into place, manifest last (utils.StagedFiles): a run killed
    while writing leaves the previous bundle as it was."""
    from ttc.nets.models import side_files, weights_bytes

    paths, manifest, draft = result.paths, result.manifest, result.draft
    extras = extras or {}
    weights = weights_bytes(net)
    with staged_files() as stage:
        hashes = {"weights": sha256_of(stage(paths.weights,
                                             lambda tmp: tmp.write_bytes(weights)))}
        for key, data in side_files(manifest).items():
            hashes[key] = sha256_of(stage(paths.side_file(key),
                                          lambda tmp, d=data: tmp.write_bytes(d)))
        for key, extra in extras.items():
            graph = stamp_contract(extra.model, manifest)
            hashes[key] = sha256_of(stage(paths.variant(key),
                                          lambda tmp, m=graph: onnx.save_model(m, str(tmp))))
        stamp_contract(model, manifest)
        staged_onnx = stage(paths.onnx, lambda tmp: onnx.save_model(model, str(tmp)))
        hashes["onnx"] = sha256_of(staged_onnx)
        result.size_bytes = staged_onnx.stat().st_size
        record_export(draft, paths, export_section(result),
                      {key: extra.info for key, extra in extras.items()}, hashes)
        stage(paths.manifest, lambda tmp: tmp.write_text(manifest_text(draft),
                                                          encoding="utf-8"))


def export_section(result: ExportResult) -> dict:
    """The manifest's record of how model.onnx was made and checked."""
    import torch

    return {
        "exporter": f"torch.onnx.export (dynamo) torch {torch.__version__}",
        "slimmer": "onnxslim", "opset": result.opset, "checker": "passed (full_check)",
        "nodes_before_slim": result.nodes_before_slim, "nodes_after_slim": result.nodes_after_slim,
        "max_abs_diff": result.check.max_abs_diff, "top1_agreement": result.check.top1_agreement,
        "samples_checked": result.check.samples, "batch_sizes_checked": result.check.batch_sizes,
        "probes": result.check.probes, "padding_max_diff": result.check.padding_max_diff,
        "validate_atol": result.atol, "size_bytes": result.size_bytes, "seconds": result.seconds,
        "fusion": result.fusion, **(result.own_check or {})}
