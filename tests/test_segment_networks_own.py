"""A segmenter's own network and starting weights (issue 43, item 2), through the CLIs:
`--model_def FILE.py:FACTORY` (trained, checked for its output shape before training, exported
with dynamic height and width, kept in the bundle, evaluated by inference.py, rebuilt by
export.py only with --trust_model_code) and `--pretrained` (the ImageNet MobileNetV3-Large
backbone read from a fake torch hub cache, never downloaded; refused for the U-Net)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import assert_clean_failure, run_cli, trains_from_the_fake_hub_cache
from ttc.tasks.segment.canvases import write_digit_canvases
from utils import EXIT_EXPORT, EXIT_USAGE

SIDE = 16
CLASSES = 11  # the digit canvases: background and the ten digits
QUICK = ("--epochs", "1", "--batch_size", "16", "--calibrate", "none", "--no_progress", "true")

MYSEGNET = '''
from torch import nn


def build(num_classes, input_spec):
    width = 8
    return nn.Sequential(
        nn.Conv2d(input_spec["channels"], width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, num_classes, 1))
'''
# Wrong shapes: a mask at half the input's size, a classifier's (N, K), and a size fixed at
# the training size (right there, wrong at the export's second size).
HALF = '''
from torch import nn


def build(num_classes, input_spec):
    return nn.Conv2d(input_spec["channels"], num_classes, 3, stride=2, padding=1)
'''
FLAT = '''
from torch import nn


def build(num_classes, input_spec):
    return nn.Sequential(nn.Conv2d(input_spec["channels"], num_classes, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())
'''
FIXED = '''
from torch import nn


def build(num_classes, input_spec):
    return nn.Sequential(nn.Conv2d(input_spec["channels"], num_classes, 3, stride=2, padding=1),
                         nn.Upsample(size=tuple(input_spec["image_size"]), mode="nearest"))
'''


@pytest.fixture(scope="module")
def canvases(tmp_path_factory) -> Path:
    return write_digit_canvases(tmp_path_factory.mktemp("canvases") / "scans", 40, size=SIDE,
                                seed=0)


@pytest.fixture(scope="module")
def own_bundle(canvases, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("own")
    (root / "mysegnet.py").write_text(MYSEGNET)
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path", canvases,
                  "--model_def", f"{root / 'mysegnet.py'}:build", *QUICK, "--plots", "none",
                  "--output_model", model, "--report_json", root / "run" / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    (root / "mysegnet.py").unlink()  # the bundle's copy is what later stages read
    return {"model": model, "report": json.loads((root / "run" / "report.json").read_text())}


def test_a_model_def_segmenter_trains_and_its_bundle_keeps_the_file(own_bundle):
    folder = own_bundle["model"].parent
    manifest = json.loads((folder / "model.json").read_text())
    architecture = manifest["architecture"]
    assert architecture["name"] == "UserNetwork" and architecture["num_classes"] == CLASSES
    spec = architecture["input_spec"]
    assert spec["kind"] == "segmentation" and spec["channels"] == 1
    assert spec["image_size"] == [SIDE, SIDE] and spec["shape"][-2:] == ["height", "width"]
    assert manifest["files"]["model_def"] == "model.def.py"
    assert (folder / "model.def.py").read_text() == MYSEGNET
    report = own_bundle["report"]
    assert report["train"]["network"] == "UserNetwork" and report["train"]["arch"] == "model_def"
    assert report["export"]["resolutions_checked"] == [f"{SIDE}x{SIDE}", "24x24"]
    assert report["export"]["mask_agreement"] == 1.0
    assert 0.0 <= report["evaluation"]["mean_iou"] <= 1.0


@pytest.mark.parametrize("size", [(SIDE, SIDE), (23, 29)])
def test_the_exported_graph_has_dynamic_height_and_width(own_bundle, size):
    from ttc.nets.models import load_weights
    from ttc.serving.bundle import BundlePaths, read_manifest

    model = own_bundle["model"]
    x = np.random.default_rng(0).random((3, 1, *size), dtype=np.float32)
    graph = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    logits, probabilities, mask = graph.run(None, {"image": x})
    assert logits.shape == probabilities.shape == (3, CLASSES, *size)
    assert np.array_equal(mask, logits.argmax(axis=1))
    paths = BundlePaths.from_model_path(model)
    net = load_weights(read_manifest(paths), paths.weights, trust_model_code=True)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    assert np.abs(logits - expected).max() < 1e-4


def test_export_rebuilds_it_only_when_trusted_and_inference_evaluates_it(own_bundle, canvases):
    model = own_bundle["model"]
    common = ["--output_model", model, "--dataset_path", canvases, "--no_progress", "true"]
    run = run_cli("export.py", *common, "--tta", "true")
    assert_clean_failure(run, EXIT_USAGE, "--trust_model_code true")
    assert not model.with_suffix(".tta.onnx").exists()
    run = run_cli("export.py", *common, "--trust_model_code", "true", "--tta", "true",
                  "--tta_transforms", "vflip")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["extra_graphs"]["tta"]["views"] == "vflip"
    report = model.parent / "inference.json"
    run = run_cli("inference.py", "--model", model, "--dataset_path", canvases, "--tta", "true",
                  "--ttt", "true", "--plots", "none", "--report_json", report,
                  "--no_progress", "true")  # ONNX graphs only: the module is not imported
    assert run.returncode == 0, run.stderr[-3000:]
    scores = json.loads(report.read_text())
    assert 0.0 <= scores["evaluation"]["mean_iou"] <= 1.0
    assert scores["tta"]["mean_iou_plain"] == pytest.approx(scores["evaluation"]["mean_iou"])
    assert scores["ttt"]["clean"]["mean_iou_bn"] is not None


@pytest.mark.parametrize("code, code_exit, phrases", [
    (HALF, EXIT_USAGE, (f"forward returned (2, {CLASSES}, 8, 8)",
                        f"expected (2, {CLASSES}, {SIDE}, {SIDE})")),
    (FLAT, EXIT_USAGE, (f"forward returned (2, {CLASSES})", "height and width")),
    (FIXED, EXIT_EXPORT, (f"logits are {SIDE}x{SIDE} for images of 24x24",
                          "the bundle was not written")),
], ids=["half_size", "classifier_shape", "fixed_size"])
def test_a_factory_of_the_wrong_shape_fails_in_one_line(canvases, tmp_path, code, code_exit,
                                                        phrases):
    (tmp_path / "net.py").write_text(code)
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path", canvases,
                  "--model_def", f"{tmp_path / 'net.py'}:build", *QUICK,
                  "--output_model", tmp_path / "run" / "model.onnx")
    assert_clean_failure(run, code_exit, *phrases)
    assert not (tmp_path / "run" / "model.onnx").exists()


# ----------------------------------------------------------------------------- --pretrained


def test_pretrained_loads_the_imagenet_backbone_from_the_hub_cache(canvases, tmp_path):
    home = tmp_path / "torch_home"
    out = tmp_path / "run"
    flags = ["--model_type", "image_segmenter", "--dataset_path", canvases, "--arch",
             "lraspp_mobilenet_v3_large", "--pretrained", "true", *QUICK,
             "--output_model", out / "model.onnx", "--report_json", out / "report.json"]
    init, state = trains_from_the_fake_hub_cache(
        lambda: run_cli("train.py", *flags, extra_env={"TORCH_HOME": str(home)}), home, out)
    assert init["skipped_keys"] == sorted(k for k in state if k.startswith("classifier."))
    assert init["missing_keys"] and all(k.startswith("body.classifier.")
                                        for k in init["missing_keys"])


@pytest.mark.parametrize("flags, phrase", [
    (["--arch", "unet"], "--arch unet has none"),
    ([], "--arch unet has none"),
    (["--model_def", "mysegnet.py:build"], "--model_def mysegnet.py:build has none"),
])
def test_pretrained_is_refused_for_a_network_without_an_imagenet_backbone(tmp_path, flags,
                                                                           phrase):
    (tmp_path / "mysegnet.py").write_text(MYSEGNET)
    flags = [str(tmp_path / f) if f.startswith("mysegnet") else f for f in flags]
    phrase = phrase.replace("mysegnet.py", str(tmp_path / "mysegnet.py"))
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path",
                  "builtin:digit_canvases", "--pretrained", "true", *flags,
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_USAGE, phrase, "lraspp_mobilenet_v3_large")
    assert not (tmp_path / "m.onnx").exists()
