"""The typed manifest (issue 38): bundle.read_manifest returns frozen dataclasses whose
attributes the stages read; a bundle written by an earlier version, whose manifest lacks the
sections added since (--arch, calibration, extra graphs, variants, recorded columns, export
figures), still loads, its gaps read as the defaults the stages always used; and the JSON the
typed manifest came from is given back unchanged, so a bundle written from it is
byte-identical."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import copy_bundle, edit_manifest, run_cli


def strip_to_an_older_schema(manifest: dict) -> None:
    """Remove what bundles from before --arch, calibration, the extra graphs, quantization and
    recorded column names lacked (labels, input and preprocessing stay: the graph is stamped
    with them)."""
    del manifest["architecture"]["arch"]
    for key in ("calibration", "extra_graphs", "quantization", "export", "created", "training"):
        manifest.pop(key, None)
    for key in ("columns", "train_class_counts", "given_splits", "skipped_images"):
        manifest["dataset"].pop(key, None)
    for key in ("bn", "mc", "ensemble"):
        manifest["files"].pop(key, None)
        manifest["files"]["sha256"].pop(key, None)


def test_a_bundle_in_an_older_schema_loads_typed_and_frozen(digits_bundle, tmp_path):
    from ttc.nets.models import load_weights
    from ttc.serving.bundle import BundlePaths, read_manifest, require_onnx_in_bundle
    from ttc.serving.manifest import Architecture, InputSpec, Manifest

    model = copy_bundle(digits_bundle, tmp_path / "old")
    written = edit_manifest(model, strip_to_an_older_schema)
    paths = BundlePaths.from_model_path(model)
    manifest = read_manifest(paths)
    assert isinstance(manifest, Manifest)
    assert manifest.model_type == "image_classifier" and manifest.classes == 10
    assert manifest.labels == tuple(written["labels"])
    assert isinstance(manifest.input, InputSpec) and manifest.input.name == "image"
    assert manifest.input.shape == tuple(written["input"]["shape"])
    assert manifest.output_names == ("logits", "probabilities")
    assert manifest.preprocessing.kind == "image" and not manifest.preprocessing.is_hf
    assert isinstance(manifest.architecture, Architecture)
    assert manifest.architecture.name == "SmallCNN" and manifest.architecture.arch is None
    assert manifest.architecture.num_classes == 10
    # the older schema's gaps read as the defaults
    assert manifest.calibration is None and manifest.temperature == 1.0
    assert manifest.quantization is None and manifest.fp16 is None
    assert manifest.extra_graphs.mc is None and manifest.extra_graphs.bn is None
    assert manifest.dataset.columns is None and manifest.dataset.train_class_counts is None
    assert manifest.files.name("onnx") == "model.onnx" and "bn" not in manifest.files
    assert manifest.files.digest("onnx") == written["files"]["sha256"]["onnx"]
    # frozen: no attribute can be set, on the manifest or its sections
    for obj, name in ((manifest, "labels"), (manifest.input, "name"),
                      (manifest.architecture, "arch"), (manifest.files, "names")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    # what the stages do with it: the graph checks out, the network rebuilds (the default arch)
    assert require_onnx_in_bundle(paths, manifest) == paths.onnx
    assert load_weights(manifest, paths.weights) is not None
    # the JSON as written, for a writer (a copy: filling it leaves the typed manifest alone)
    draft = manifest.to_json_dict()
    assert draft == written
    draft["labels"].append("x")
    assert manifest.to_json_dict() == written


def test_an_older_schema_bundle_runs_inference(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path / "old")
    edit_manifest(model, strip_to_an_older_schema)
    run = run_cli("inference.py", "--model", model, "--report_json", tmp_path / "r.json",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert 0 <= report["evaluation"]["accuracy"] <= 1


def test_the_manifest_text_written_from_the_typed_manifest_is_byte_identical(digits_bundle):
    from ttc.serving.bundle import BundlePaths, manifest_text, read_manifest

    paths = BundlePaths.from_model_path(digits_bundle["model"])
    assert manifest_text(read_manifest(paths).to_json_dict()) == paths.manifest.read_text()


def test_a_draft_manifest_reads_typed_with_defaults():
    """Training's draft (and a test's partial dict) reads typed too: what it lacks reads as the
    defaults; the typed sections keep the JSON they were read from."""
    from ttc.serving.manifest import as_manifest

    draft = {"model_type": "tabular_classifier", "labels": ["a", "b"], "dataset": {},
             "input": {"name": "features", "dtype": "float32", "shape": ["batch", 2]},
             "preprocessing": {"kind": "tabular", "columns": [{"name": "h", "type": "numeric"}]},
             "calibration": {"temperature": 2, "method": "val_nll"}}
    manifest = as_manifest(draft)
    assert as_manifest(manifest) is manifest
    assert manifest.temperature == 2.0 and manifest.calibration.method == "val_nll"
    assert manifest.input.pad_id == 0 and manifest.input.extra_inputs == ()
    assert manifest.architecture.name == "" and manifest.files.name("onnx") is None
    assert manifest.extra_graphs.ensemble is None and manifest.dataset.has_header is None
    assert (manifest.preprocessing.spec == draft["preprocessing"]
            and "dataset" in manifest.to_json_dict())
    assert manifest.fp16 is None
