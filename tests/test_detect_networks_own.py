"""A detector's other networks (issue 44, item 2), through the CLIs: `--model_def FILE.py:FACTORY`
(checked for its two heads before training, exported with decoding and NMS in the graph, kept
in the bundle, rebuilt by export.py only with --trust_model_code), `--arch mobilenet_v3_large`
(torchvision's MobileNetV3-Large under our heads) and its `--pretrained` (the ImageNet weights
read from a fake torch hub cache, never downloaded; refused for networks without them); and
the numeric check's tolerance of ties, on fixed detections."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import MARK, assert_clean_failure, run_cli, trains_from_the_fake_hub_cache
from ttc.tasks.detect.canvases import write_yolo_canvases
from ttc.tasks.detect.export import Tolerance, pair_detections
from ttc.tasks.detect.ssd import TorchvisionSSD, decode
from utils import EXIT_DATA, EXIT_USAGE

SIDE = 32
QUICK = ("--epochs", "2", "--batch_size", "16", "--no_progress", "true")
OUTPUTS = ["boxes", "scores", "labels", "num_detections"]
# what the weights' tests need of pipeline.py: training, the export and its numeric check (int8
# and plots are other tests')
NO_EXTRAS = ("--quantize", "none", "--plots", "none")

MYDETECTOR = '''
import math

from torch import nn


class TinyDetector(nn.Module):
    """Two stride-2 convolutions to the output stride 4, then the two heads."""

    def __init__(self, channels, num_classes, width=16):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.heatmap = nn.Conv2d(width, num_classes, 1)
        self.box = nn.Conv2d(width, 4, 1)
        nn.init.constant_(self.heatmap.bias, math.log(0.1 / 0.9))

    def forward(self, images):
        features = self.body(images)
        return self.heatmap(features), self.box(features)


def build(num_classes, input_spec):
    return TinyDetector(input_spec["channels"], num_classes)
'''
# Wrong heads: the heatmap alone, and both at stride 2.
HEATMAP_ONLY = MYDETECTOR.replace("return self.heatmap(features), self.box(features)",
                                  "return self.heatmap(features)")
STRIDE_TWO = MYDETECTOR.replace(
    "nn.Conv2d(width, width, 3, stride=2, padding=1)", "nn.Conv2d(width, width, 3, padding=1)")


@pytest.fixture(scope="module")
def boxes_root(tmp_path_factory) -> Path:
    return write_yolo_canvases(tmp_path_factory.mktemp("own") / "canvases", 30, size=SIDE)


def train(root: Path, out: Path, *flags: str, script: str = "pipeline.py",
          home: Path | None = None):
    env = {"TORCH_HOME": str(home)} if home else None
    return run_cli(script, "--model_type", "object_detector", "--dataset_path", root, *QUICK,
                   *flags, "--output_model", out / "model.onnx", "--report_json",
                   out / "report.json", extra_env=env)


def graph_runs_at_any_batch_and_size(model: Path) -> None:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == OUTPUTS
    for batch, side in ((1, SIDE), (3, 40)):
        boxes, scores, labels, counts = session.run(
            None, {"image": np.random.default_rng(0).random((batch, 1, side, side), np.float32)})
        assert boxes.shape[0] == scores.shape[0] == labels.shape[0] == counts.shape[0] == batch


# ----------------------------------------------------------------------------- --model_def


def test_your_own_module_trains_exports_and_is_kept_with_the_bundle(boxes_root, tmp_path):
    (tmp_path / "mydetector.py").write_text(MYDETECTOR)
    out = tmp_path / "run"
    run = train(boxes_root, out, "--model_def", f"{tmp_path / 'mydetector.py'}:build")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["architecture"]["name"] == "UserNetwork"
    assert (out / "model.def.py").read_text() == MYDETECTOR
    graph_runs_at_any_batch_and_size(out / "model.onnx")
    report = json.loads((out / "report.json").read_text())
    assert report["export"]["detections_checked"] > 0 and report["export"]["ties"] >= 0
    before = (out / "model.onnx").read_bytes()
    again = ["--dataset_path", boxes_root, "--output_model", out / "model.onnx",
             "--iou_threshold", "0.6", "--no_progress", "true"]
    run = run_cli("export.py", *again)
    assert_clean_failure(run, EXIT_USAGE, "--trust_model_code true")
    assert (out / "model.onnx").read_bytes() == before
    run = run_cli("export.py", *again, "--trust_model_code", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["preprocessing"]["nms"]["iou_threshold"] == 0.6


@pytest.mark.parametrize("source", [HEATMAP_ONLY, STRIDE_TWO], ids=["heatmap_only", "stride_2"])
def test_a_module_without_the_two_heads_at_stride_4_is_refused_before_training(
        boxes_root, tmp_path, source):
    (tmp_path / "mydetector.py").write_text(source)
    run = train(boxes_root, tmp_path / "run", "--model_def",
                f"{tmp_path / 'mydetector.py'}:build")
    assert_clean_failure(run, EXIT_USAGE, "expected heatmap logits and box distances",
                         "(2, 4, 8, 8)", "detection.md")
    assert not (tmp_path / "run" / "model.onnx").exists()


# ----------------------------------------------------------------------------- MobileNetV3


def test_the_mobilenet_backbone_starts_from_the_hub_cache_s_imagenet_weights(boxes_root,
                                                                            tmp_path):
    home, out = tmp_path / "torch_home", tmp_path / "run"
    flags = ("--arch", "mobilenet_v3_large", "--pretrained", "true", "--score_threshold", "0.2",
             *NO_EXTRAS)
    init, state = trains_from_the_fake_hub_cache(
        lambda: train(boxes_root, out, *flags, home=home), home, out)
    assert init["skipped_keys"] == sorted(k for k in state if k.startswith("classifier."))[:10]
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["architecture"]["name"] == "MobileNetCenterNet"
    graph_runs_at_any_batch_and_size(out / "model.onnx")


@pytest.mark.parametrize("flags, phrase", [
    ([], "--arch centernet has none"), (["--arch", "centernet"], "--arch centernet has none"),
    (["--model_def", "mydetector.py:build"], "--model_def mydetector.py:build has none")])
def test_pretrained_is_refused_for_a_network_without_an_imagenet_backbone(tmp_path, flags,
                                                                           phrase):
    (tmp_path / "mydetector.py").write_text(MYDETECTOR)
    flags = [str(tmp_path / f) if f.startswith("mydetector") else f for f in flags]
    phrase = phrase.replace("mydetector.py", str(tmp_path / "mydetector.py"))
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path",
                  "builtin:digit_boxes", "--pretrained", "true", *flags,
                  "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, EXIT_USAGE, phrase, "mobilenet_v3_large")
    assert not (tmp_path / "m.onnx").exists()


# ----------------------------------------------------------------------------- SSDlite

SSD = "ssdlite320_mobilenet_v3_large"
COCO_FILE = "ssdlite320_mobilenet_v3_large_coco-a79551df.pth"  # its COCO_V1 weights


def test_the_ssd_s_loss_and_decoding_are_torchvision_s():
    """Our traceable path (resize and normalise, heads, anchors, BoxCoder) gives torchvision's
    own training loss and boxes on the same images and targets."""
    torch.manual_seed(0)
    net = TorchvisionSSD(SSD, 1, 10).train()
    images = torch.rand(2, 1, 48, 64)
    rows = [np.array([[3, 10, 10, 40, 30]], np.float32), np.zeros((0, 5), np.float32)]
    with torch.no_grad():
        _, ours = net.detection_loss(images, rows)
        theirs = net.body([image.expand(3, -1, -1).clone() for image in images],
                          [{"boxes": torch.from_numpy(r[:, 1:]), "labels": torch.from_numpy(
                              r[:, 0]).long() + 1} for r in rows])
    assert ours["boxes"] == pytest.approx(float(theirs["bbox_regression"]), rel=1e-4)
    assert ours["classes"] == pytest.approx(float(theirs["classification"]), rel=1e-4)
    net.eval()
    transformed = net.body.transform([image.expand(3, -1, -1) for image in images])[0].tensors
    assert torch.allclose(net.network_input(images), transformed, atol=1e-5)
    regression, logits = net(images)
    assert logits.shape == (2, len(net.anchors), 11)
    expected = torch.stack([net.body.box_coder.decode_single(r, net.anchors) for r in regression])
    assert torch.allclose(decode(regression, net.anchors), expected)
    with torch.no_grad():
        boxes, scores = net.candidates(images)  # in the input's pixels, background dropped
    assert boxes.shape == (2, len(net.anchors), 4) and scores.shape == (2, 10, len(net.anchors))
    assert float(boxes[..., 0::2].max()) <= 64 and float(boxes[..., 1::2].max()) <= 48


def fake_coco_cache(home: Path) -> dict[str, torch.Tensor]:
    """COCO-shaped SSDlite weights (91 classes) made here, under torch hub's file name."""
    import torchvision

    torch.manual_seed(2)
    state = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None).state_dict()
    state["head.regression_head.module_list.0.1.weight"].fill_(MARK)
    path = home / "hub" / "checkpoints" / COCO_FILE
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return state


def test_torchvision_s_ssdlite_trains_from_its_coco_weights_and_exports(boxes_root, tmp_path):
    home, out = tmp_path / "torch_home", tmp_path / "run"
    flags = ("--arch", SSD, "--pretrained", "true", "--epochs", "1", "--learning_rate", "1e-3",
             *NO_EXTRAS)
    run = train(boxes_root, out, *flags, home=home)
    assert_clean_failure(run, EXIT_DATA, str(home / "hub" / "checkpoints" / COCO_FILE),
                         "does not download")
    state = fake_coco_cache(home)
    run = train(boxes_root, out, *flags, home=home)
    assert run.returncode == 0, run.stderr[-3000:]
    init = json.loads((out / "report.json").read_text())["train"]["init_weights"]
    # the class head's last convolutions, 91 x anchors outputs each: all that does not load
    class_head = sorted(k for k in state if k.startswith("head.classification_head.")
                        and state[k].dim() and state[k].shape[0] % 91 == 0)
    assert len(class_head) == 12 and init["tensors_in_file"] == len(state)
    assert init["loaded"] == len(state) - 12 and init["skipped"] == init["missing"] == 12
    assert init["skipped_keys"] == class_head[:10]
    assert any("class head" in note for note in init["notes"])
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["architecture"]["name"] == "TorchvisionSSD"
    weights = torch.load(out / "model.pt", weights_only=True)
    marked = weights["body.head.regression_head.module_list.0.1.weight"]
    assert abs(float(marked.mean()) - MARK) < 0.05  # one epoch of small steps from the file
    graph_runs_at_any_batch_and_size(out / "model.onnx")
    report = json.loads((out / "report.json").read_text())
    assert report["export"]["detections_checked"] > 0


# ----------------------------------------------------------------------------- ties


def detections(*rows: tuple[float, float, float, float, float, int]):
    """(boxes, scores, labels) from rows (x1, y1, x2, y2, score, label), best first."""
    table = np.array(rows, dtype=np.float64).reshape(-1, 6)
    return table[:, :4].astype(np.float32), table[:, 4].astype(np.float32), \
        table[:, 5].astype(np.int64)


TOLERANCE = Tolerance(score_threshold=0.05, max_detections=3, iou_threshold=0.5, atol=1e-4)


def test_the_same_boxes_pair_in_any_order_and_a_moved_box_fails():
    graph = detections((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.8, 2))
    eager = detections((20, 20, 30, 30, 0.80001, 2), (0, 0, 10, 10, 0.9, 1))
    pairing = pair_detections(graph, eager, TOLERANCE, candidates=eager)
    assert pairing.min_iou == 1.0 and pairing.ties == 0
    assert pairing.max_score_diff == pytest.approx(1e-5, abs=1e-6)
    # a box the graph moved, its score the same: never a tie, since PyTorch has no such box
    moved = detections((0, 0, 10, 10, 0.9, 1), (22, 20, 32, 30, 0.8, 2))
    assert pair_detections(moved, eager, TOLERANCE, candidates=eager).min_iou < 0.99
    other_class = detections((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.8, 3))
    assert pair_detections(other_class, eager, TOLERANCE, candidates=eager) is None
    one = detections((0, 0, 10, 10, 0.9, 1))  # the 0.8 box missing: far above the cutoff
    assert pair_detections(one, eager, TOLERANCE, candidates=eager) is None


def test_a_tie_at_the_cutoff_or_in_nms_s_order_is_not_a_mismatch():
    # a full list (3): the last place goes to either of two boxes scoring within atol
    graph = detections((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.8, 2), (40, 0, 50, 10, 0.3, 1))
    eager = detections((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.8, 2),
                       (0, 40, 10, 50, 0.30005, 4))
    before_nms = (np.concatenate([eager[0], graph[0][2:]]), np.concatenate([eager[1], graph[1][2:]]),
                  np.concatenate([eager[2], graph[2][2:]]))
    assert pair_detections(graph, eager, TOLERANCE, before_nms) is not None
    assert pair_detections(graph, eager, TOLERANCE, eager) is None  # not a candidate of PyTorch's
    assert pair_detections(graph, eager) is None  # no tolerance
    # a box at --score_threshold on one side only
    graph = detections((0, 0, 10, 10, 0.9, 1), (40, 0, 50, 10, 0.05005, 1))
    assert pair_detections(graph, detections((0, 0, 10, 10, 0.9, 1)), TOLERANCE,
                           graph) is not None
    # two overlapping boxes of a class scoring within atol: NMS kept one here, the other there
    graph = detections((0, 0, 10, 10, 0.6, 1))
    eager = detections((1, 0, 11, 10, 0.60003, 1))
    both = detections((1, 0, 11, 10, 0.60003, 1), (0, 0, 10, 10, 0.6, 1))
    assert pair_detections(graph, eager, TOLERANCE, both).ties == 1
    assert pair_detections(graph, eager, TOLERANCE, eager).min_iou < 0.99  # no such candidate
    apart = detections((1, 0, 11, 10, 0.7, 1))  # the same overlap, scores apart: a mismatch
    assert pair_detections(graph, apart, TOLERANCE, both).min_iou < 0.99
