"""train.py → export.py → inference.py on their own, and what happens to a bundle on failure."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort

from conftest import assert_clean_failure, run_cli, write_image_table


def test_stage_clis_chain_into_a_working_bundle(tmp_path):
    # A JSONL table of image paths and labels (the CSV one: test_image_data.py); inference.py
    # reads it again from the path recorded in the manifest.
    table = write_image_table(tmp_path / "data", "jsonl")
    model = tmp_path / "bundle" / "model.onnx"
    train = run_cli("train.py", "--dataset_path", table, "--output_model", model, "--epochs", "8",
                    "--batch_size", "16", "--no_progress", "true")
    assert train.returncode == 0, train.stderr[-2000:]
    assert model.with_suffix(".pt").is_file() and model.with_suffix(".json").is_file()
    assert not model.exists()
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["labels"] == ["d0", "d1", "d2"]
    assert manifest["dataset"]["path"] == str(table.resolve())

    early = run_cli("inference.py", "--model", model)
    assert_clean_failure(early, 4, "no exported ONNX graph", "export.py")

    export = run_cli("export.py", "--output_model", model, "--dataset_path", table,
                     "--report_json", tmp_path / "e.json")
    assert export.returncode == 0, export.stderr[-2000:]
    figures = json.loads((tmp_path / "e.json").read_text())["export"]
    assert figures["max_abs_diff"] <= 1e-4 and figures["checker"] == "passed"
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[1].name == "probabilities"

    infer = run_cli("inference.py", "--model", model, "--dataset_path", table,
                    "--report_json", "-")
    assert infer.returncode == 0, infer.stderr[-2000:]
    report = json.loads(infer.stdout)
    assert report["inference"]["accuracy"] >= 0.8 and report["dataset"]["test"] > 0
    assert report["dataset"]["num_classes"] == 3


def test_failed_validation_keeps_the_previous_bundle(digits_bundle, tmp_path):
    bundle = tmp_path / "keep"
    shutil.copytree(digits_bundle["dir"], bundle)
    before = {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  bundle / "model.onnx", "--epochs", "1", "--validate_atol", "1e-12",
                  "--report_json", bundle / "failed.json", "--no_progress", "true")
    assert_clean_failure(run, 4, "numeric check failed", "--validate_atol")
    report = json.loads((bundle / "failed.json").read_text())
    assert report["status"] == "error" and report["error"]["code"] == 4
    assert report["train"]["epochs_run"] == 1 and report["export"] is None
    kept = {Path("model.unexported.pt"), Path("model.unexported.json")}  # the training, kept
    after = {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*")
             if p.is_file() and p.name != "failed.json"}
    assert kept <= after.keys()  # beside the bundle, never over it (docs/deploy.md)
    # nothing overwritten, no temporary files left behind
    assert {k: v for k, v in after.items() if k not in kept} == before


def test_truncated_model_is_refused(digits_bundle, tmp_path):
    bundle = tmp_path / "cut"
    shutil.copytree(digits_bundle["dir"], bundle)
    data = (bundle / "model.onnx").read_bytes()
    (bundle / "model.onnx").write_bytes(data[: len(data) // 3])
    run = run_cli("inference.py", "--model", bundle / "model.onnx")
    assert_clean_failure(run, 4, "does not match its manifest")


def test_foreign_onnx_without_manifest_is_refused(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"not an onnx file")
    run = run_cli("inference.py", "--model", tmp_path / "model.onnx")
    assert_clean_failure(run, 4, "manifest", "not found")


def test_export_without_weights_fails_cleanly(tmp_path):
    run = run_cli("export.py", "--output_model", tmp_path / "none.onnx")
    assert_clean_failure(run, 4, "manifest")


def test_debug_log_level_shows_the_traceback(tmp_path):
    run = run_cli("inference.py", "--model", tmp_path / "none.onnx", "--log_level", "DEBUG")
    assert run.returncode == 4 and "Traceback" in run.stderr


def test_repeated_exports_build_the_decomposition_table_once_and_give_the_same_graph():
    """A bundle exports several graphs: torch.onnx.export's ATen → ONNX table is built once per
    process (tracing.torchlib_registry_built_once), the graphs are what a fresh table gives, and
    torch's own function is back afterwards."""
    import torch
    from torch.onnx._internal.exporter import _registration

    from ttc.convert import tracing
    from ttc.convert.tracing import export_graph, torchlib_registry_built_once
    from ttc.serving.bundle import InputSpec

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    spec = InputSpec(name="features", shape=("batch", 4), dtype="float32", padding_id=None,
                     max_length=None, extra_inputs=())
    example = np.zeros((2, 4), dtype=np.float32)
    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    tracing._TORCHLIB_REGISTRIES.clear()  # the first export builds a fresh table
    first = export_graph(net, example, 18, spec, ["logits", "probabilities"])
    with torchlib_registry_built_once():
        table = _registration.ONNXRegistry().from_torchlib(opset_version=18)
        assert _registration.ONNXRegistry().from_torchlib(opset_version=18) is table
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
    second = export_graph(net, example, 18, spec, ["logits", "probabilities"])
    assert first.SerializeToString() == second.SerializeToString()
