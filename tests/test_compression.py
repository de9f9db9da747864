"""--prune and --qat end to end (issue 42): the variants a run writes, the gate that judges them
like int8, the served graph, the report's compression section, the split train.py → export.py
flow, and the flags and networks that are refused. The variants' own mechanics (QDQ structure,
pruned shapes) are tested in test_compress_qat.py and test_compress_pruning.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import (assert_clean_failure, copy_bundle, deflate_in_place, edit_manifest,
                      pipeline_bundle, run_cli, sha256, write_image_folder)

COMPRESS = ["--prune", "0.4", "--prune_steps", "1", "--prune_epochs", "1", "--qat", "true",
            "--qat_epochs", "1"]
VARIANTS = ("pruned", "qat", "pruned_qat")


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> dict:
    """One image run with post-training int8 and every compressed variant, its test split a
    folder of its own (so inference.py --input can read the same images)."""
    out = tmp_path_factory.mktemp("compressed")
    folder = write_image_folder(out / "digits", classes=(0, 1, 2), per_class=40, splits=True)
    return pipeline_bundle(out, "--dataset_path", folder, "--epochs", "3", "--quantize", "static",
                           "--max_accuracy_drop", "1", *COMPRESS)


def conv_weight_shapes(model: onnx.ModelProto) -> list[tuple[int, ...]]:
    """The Conv weights' shapes of a float graph (initializers feeding a Conv's input 1)."""
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    return [inits[n.input[1]] for n in model.graph.node if n.op_type == "Conv"
            and n.input[1] in inits]


def test_every_variant_is_written_checked_and_recorded(compressed):
    folder = compressed["dir"]
    manifest = json.loads((folder / "model.json").read_text())
    record = manifest["compression"]
    assert [v["name"] for v in record["variants"]] == list(VARIANTS)
    for entry in record["variants"]:
        name = entry["name"]
        assert (folder / f"model.{name}.onnx").is_file() and (folder / f"model.{name}.pt").is_file()
        assert manifest["files"][name] == f"model.{name}.onnx"
        assert entry["recipe"] and entry["params"] > 0 and entry["macs"] > 0
        assert entry["size_bytes"] > 0 and entry["top1_agreement"] >= 0.98
        assert entry["verdict"] and entry["used_for_inference"] in (True, False)
        onnx.checker.check_model(onnx.load(str(folder / f"model.{name}.onnx")), full_check=True)
    recipes = {v["name"]: v["recipe"] for v in record["variants"]}
    assert recipes["pruned"]["prune_ratio"] == 0.4 and recipes["qat"] == {"qat_epochs": 1}
    assert recipes["pruned_qat"]["prune_ratio"] == 0.4 and recipes["pruned_qat"]["qat_epochs"] == 1
    assert record["served"] in ("onnx", "int8", *VARIANTS)


def test_the_pruned_graph_is_a_smaller_dense_network(compressed):
    folder = compressed["dir"]
    fp32 = conv_weight_shapes(onnx.load(str(folder / "model.onnx")))
    pruned = conv_weight_shapes(onnx.load(str(folder / "model.pruned.onnx")))
    assert len(pruned) == len(fp32)
    assert pruned[0][1] == fp32[0][1]  # the input's channels stay
    assert sum(np.prod(s) for s in pruned) < 0.7 * sum(np.prod(s) for s in fp32)
    assert all(p[0] <= f[0] for p, f in zip(pruned, fp32))


def test_the_qat_graph_is_qdq_int8_that_runs_as_integer_kernels(compressed):
    model = onnx.load(str(compressed["dir"] / "model.qat.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    produced_by = {out: n for n in model.graph.node for out in n.output}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert convs and all(produced_by[n.input[1]].op_type == "DequantizeLinear" for n in convs)
    qdq = json.loads((compressed["dir"] / "model.json").read_text())["compression"]
    structure = next(v for v in qdq["variants"] if v["name"] == "qat")["qdq"]
    assert structure["integer_kernels"], structure


def test_the_report_has_one_compression_row_per_variant_fp32_first(compressed):
    section = compressed["report"]["compression"]
    names = [row["name"] for row in section["variants"]]
    assert names[0] == "fp32" and names[1].startswith("int8 static") and names[2:] == list(VARIANTS)
    keys = {"name", "recipe", "params", "macs", "size_bytes", "val_accuracy", "test_accuracy",
            "latency_ms", "speedup", "verdict", "served"}
    for row in section["variants"]:
        assert keys <= set(row), keys - set(row)
    assert sum(row["served"] for row in section["variants"]) == 1
    served = next(row for row in section["variants"] if row["served"])
    passed = [row for row in section["variants"][1:] if "inference uses" in row["verdict"]
              or row["served"]]
    if passed:  # the fastest that passed its gate is served
        assert served["speedup"] == max(row["speedup"] for row in passed)
    inference = compressed["report"]["inference"]["model_path"]
    expected = {"fp32": "model.onnx", "int8 static (post-training)": "model.int8.onnx"}
    assert inference.endswith(expected.get(served["name"], f"model.{served['name']}.onnx"))
    plot = Path(compressed["report"]["plots"]["compression"])
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(compressed["report"]["html"]).read_text(encoding="utf-8")
    assert "Compression" in page and "pruned_qat" in page and "accuracy against latency" in page


def test_test_time_augmentation_runs_on_a_compressed_variant(compressed, tmp_path):
    """--tta puts its views around the variant's own graph (a QDQ graph here)."""
    run = run_cli("inference.py", "--model", compressed["model"], "--dataset_path",
                  compressed["dir"] / "digits", "--variant", "qat", "--tta", "true",
                  "--report_json", tmp_path / "r.json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["inference"]["model_path"].endswith("model.qat.onnx")
    assert report["tta"]["accuracy"] is not None and report["tta"]["verdict"]


@pytest.mark.parametrize("variant", ["qat", "pruned"])
def test_inference_input_serves_a_variant_as_the_gate_measured_it(compressed, variant, tmp_path):
    """inference.py --input over the test split's own files, with --variant: the same accuracy
    the gate measured on that split."""
    out = tmp_path / "predictions.csv"
    run = run_cli("inference.py", "--model", compressed["model"], "--input",
                  compressed["dir"] / "digits" / "test", "--variant", variant, "--output", out,
                  "--report_json", tmp_path / "r.json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    row = next(r for r in compressed["report"]["compression"]["variants"] if r["name"] == variant)
    assert report["predictions"]["accuracy"] == pytest.approx(row["test_accuracy"], abs=1e-9)
    session = ort.InferenceSession(str(compressed["dir"] / f"model.{variant}.onnx"),
                                   providers=["CPUExecutionProvider"])
    manifest = json.loads((compressed["dir"] / "model.json").read_text())
    assert session.get_inputs()[0].name == manifest["input"]["name"]
    assert report["inference"]["model_path"].endswith(f"model.{variant}.onnx") if \
        report.get("inference") else True


def test_a_variant_s_weights_compressed_to_inflate_are_refused_before_torch_reads_them(
        compressed, tmp_path):
    """model.pruned.pt deflated (torch.save stores its entries): export.py refuses it from the
    ZIP's directory, as it refuses such a model.pt (exit 4), before rebuilding the variant."""
    model = copy_bundle(compressed, tmp_path / "b")
    weights = model.with_suffix(".pruned.pt")
    deflate_in_place(weights)
    edit_manifest(model, lambda m: m["files"]["sha256"].update(weights_pruned=sha256(weights)))
    run = run_cli("export.py", "--output_model", model, "--dataset_path",
                  compressed["dir"] / "digits", "--no_progress", "true")
    assert_clean_failure(run, 4, "cannot load the pruned variant's weights",
                         "entries are compressed, inflating to")


def test_the_gate_refuses_a_variant_made_worse_and_train_export_split_works(tmp_path):
    """train.py prunes 90% of the channels with no fine-tuning (and trains QAT variants);
    export.py rebuilds each from its weights and recorded shapes, exports and checks it, and the
    gate refuses the pruned one for its accuracy."""
    model = tmp_path / "model.onnx"
    folder = write_image_folder(tmp_path / "digits", classes=(0, 1, 2), per_class=40)
    train = run_cli("train.py", "--dataset_path", folder, "--epochs", "3", "--prune", "0.9",
                    "--prune_steps", "1", "--prune_epochs", "0", "--qat", "true",
                    "--qat_epochs", "1", "--output_model", model)
    assert train.returncode == 0, train.stderr[-2000:]
    assert (tmp_path / "model.pruned.pt").is_file() and not (tmp_path / "model.pruned.onnx").exists()
    export = run_cli("export.py", "--output_model", model, "--dataset_path", folder,
                     "--max_accuracy_drop", "0.01",
                     "--report_json", tmp_path / "r.json")
    assert export.returncode == 0, export.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["compression"]["variants"]
    pruned = next(r for r in rows if r["name"] == "pruned")
    assert "loses" in pruned["verdict"] and not pruned["served"], pruned["verdict"]
    assert sum(row["served"] for row in rows) == 1
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest["compression"]["served"] in ("onnx", "qat")
    qat = next(r for r in rows if r["name"] == "qat")  # rebuilt from its weights: fake quant
    assert next(v for v in manifest["compression"]["variants"]  # and integer kernels agree
                if v["name"] == "qat")["top1_agreement"] >= 0.98 and qat["verdict"]


@pytest.mark.parametrize("flags, phrase", [
    (["--prune", "1.5"], "invalid --prune"),
    (["--prune", "0.4", "--prune_steps", "0"], "invalid --prune_steps"),
    (["--qat", "true", "--qat_epochs", "0"], "invalid --qat_epochs"),
    (["--prune_importance", "random"], "--prune_importance"),
])
def test_bad_compression_flags_are_usage_errors(flags, phrase, tmp_path):
    run = run_cli("train.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", *flags)
    assert_clean_failure(run, 2, phrase)


def test_qat_on_a_hugging_face_model_is_refused_before_any_data_is_read(tmp_path):
    run = run_cli("train.py", "--model_type", "text_classifier", "--dataset_path",
                  tmp_path / "missing.csv", "--arch", "hf:some/model", "--qat", "true",
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--qat", "--quantize dynamic")


UNTRACEABLE = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        x = self.conv(x)
        if float(x.mean()) > 0:  # control flow on data: no symbolic trace follows it
            x = torch.relu(x)
        return self.head(x.mean(dim=(2, 3)))


def make(num_classes, **_):
    return Branchy(num_classes)
'''


def test_qat_on_an_untraceable_model_def_is_refused_before_training(tmp_path):
    (tmp_path / "branchy.py").write_text(UNTRACEABLE)
    run = run_cli("train.py", "--dataset_path", "builtin:digits", "--model_def",
                  tmp_path / "branchy.py:make", "--qat", "true", "--output_model",
                  tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--qat")
    assert "epoch 1" not in run.stderr
