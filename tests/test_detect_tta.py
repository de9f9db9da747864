"""A detector's box-fusing TTA in the graph (issue 44, item 5; ttc/tasks/detect/tta.py and
fusion.py): each view's boxes mapped back onto the input's pixels (a flip undone, a rescaled
view's boxes scaled by the real size ratio), the views' detections fused in ONNX ops equal to
the numpy reference and, on a hand-computed case, to exact weighted box fusion; the whole graph
keeps model.onnx's contract at batch 1 and 3 and two image sizes and detects as PyTorch+numpy."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from ttc.tasks.detect.export import matched
from ttc.tasks.detect.fusion import (FusionSettings, append_fusion, class_nms,
                                     fuse_candidates, graph_settings, inner_runner,
                                     view_output_names, with_inner_outputs)
from ttc.tasks.detect.nms import DETECTION_OUTPUTS
from ttc.tasks.detect.tta import (ViewCandidates, export_view_candidates, parse_box_views,
                                  tta_reference)
from ttc.testtime.transforms import (HorizontalFlip, Identity, Scale, VerticalFlip, View,
                                     image_views)
from ttc.tasks.detect.wbf import weighted_box_fusion
from utils import ConfigError

CLASSES = 3


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- mapping back


def test_each_view_maps_a_known_box_back_onto_the_input():
    box = torch.tensor([[[2.0, 3.0, 10.0, 7.0]]])  # in a 12 x 20 (H x W) input's view
    assert View(HorizontalFlip()).deaugment_boxes(box, (12, 20), (12, 20)).tolist() == [
        [[10, 3, 18, 7]]]
    assert View(VerticalFlip()).deaugment_boxes(box, (12, 20), (12, 20)).tolist() == [
        [[2, 5, 10, 9]]]
    view = View(Scale(0.75), True)  # a box view: on its real size's grid
    seen = view.augment(torch.zeros(1, 1, 17, 23)).shape[-2:]
    assert tuple(seen) == (12, 17)  # floor(17 × 0.75), floor(23 × 0.75)
    back = view.deaugment_boxes(torch.tensor([[[3.0, 6.0, 9.0, 12.0]]]), seen, (17, 23))
    expected = [3 * 23 / 17, 6 * 17 / 12, 9 * 23 / 17, 12 * 17 / 12]  # the real ratio, not 4/3
    np.testing.assert_allclose(back[0, 0].numpy(), expected, rtol=1e-6)


class BlobNet(torch.nn.Module):
    """A stand-in detector: class 0's heatmap is the image's mean per 4x4 cell (the peak: the
    blob's cells), and every cell's box is its centre ± 4 pixels."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = F.avg_pool2d(x, 4, ceil_mode=True)
        logits = torch.cat([20 * pooled - 10, torch.full_like(pooled, -20).expand(
            -1, CLASSES - 1, -1, -1)], dim=1)
        raw = torch.full_like(pooled, float(np.log(np.expm1(4 / 16)))).expand(-1, 4, -1, -1)
        return logits, raw


def blob_image(height: int = 32, width: int = 48) -> torch.Tensor:
    """One bright 4x4 blob at columns 8-11 and rows 4-7 (no flip maps it onto itself), with
    a weaker tail beside it so that a single cell is the peak."""
    image = torch.zeros(1, 1, height, width)
    image[..., 4:8, 8:12] = 1.0
    image[..., 4:8, 12:16] = 0.5
    return image


def peak_boxes(boxes: torch.Tensor, scores: torch.Tensor) -> np.ndarray:
    """The boxes of the candidates that score, by descending score."""
    rows = scores[0, 0] > 0.01
    order = torch.argsort(scores[0, 0][rows], descending=True)
    return boxes[0][rows][order].numpy()


@pytest.mark.parametrize("spec", ["hflip", "vflip", "rot180"])
def test_a_flipped_view_finds_the_blob_where_the_identity_does(spec):
    """The flip undone: the same boxes as the plain view; a forgotten un-flip would put the
    blob on the other side of this asymmetric image."""
    view = image_views([(spec, None)], "boxes")[1]
    with torch.no_grad():
        plain_boxes, plain_scores, boxes, scores = ViewCandidates(
            BlobNet(), [View(Identity()), view])(blob_image())
    assert peak_boxes(plain_boxes, plain_scores)[0].tolist() == [6, 2, 14, 10]
    np.testing.assert_allclose(peak_boxes(boxes, scores), peak_boxes(plain_boxes,
                                                                      plain_scores), atol=1e-5)
    unflipped = view.deaugment_boxes(boxes, (32, 48), (32, 48))  # mapped back twice: mirrored
    assert not np.allclose(peak_boxes(unflipped, scores)[0], [6, 2, 14, 10])


def test_a_rescaled_view_finds_the_blob_at_the_input_s_pixels():
    with torch.no_grad():
        outputs = ViewCandidates(BlobNet(), image_views([("scale", 2.0), ("scale", 0.5)], "boxes"))(
            blob_image())
    centres = [peak_boxes(b, s)[0].reshape(2, 2).mean(0) for b, s in
               zip(outputs[0::2], outputs[1::2])]
    for centre in centres:  # the blob's centre (10, 6), within a cell of each view
        assert np.abs(centre - [10, 6]).max() <= 2 * 1.01
    doubled = peak_boxes(outputs[2], outputs[3])[0]  # ± 4 view pixels = ± 2 input pixels
    np.testing.assert_allclose(doubled[2:] - doubled[:2], [4, 4], atol=1e-5)


@pytest.mark.parametrize("spec,words", [
    ("rotate:10", "'rotate:10' does not fit detection models: a rotated box's"),
    ("crop:0.9", "'crop:0.9' does not fit detection models"),
    ("token_dropout:0.1", "unknown TTA transform 'token_dropout:0.1' for detection models"),
    ("scale:1", "'scale:1': the parameter must be a factor in (0, 4], not 1"),
    (",", "names no view")])
def test_bad_views_are_refused_in_one_line(spec, words):
    with pytest.raises(ConfigError) as refused:
        parse_box_views(spec)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    if spec != "scale:1":  # the others name what a detector does take
        assert "rot90" in refused.value.hint and "rotate" not in refused.value.hint


# ----------------------------------------------------------------------------- the fusion


def views_graph(anchors: list[int]) -> onnx.ModelProto:
    """A stand-in views' candidates graph: per view its inputs passed through as
    candidate_boxes_v (N, A_v, 4) and candidate_scores_v (N, K, A_v)."""
    names = view_output_names(len(anchors))
    inputs = [helper.make_tensor_value_info(f"in_{name}", TensorProto.FLOAT,
                                            ["batch", f"a{v // 2}", 4] if v % 2 == 0
                                            else ["batch", CLASSES, f"a{v // 2}"])
              for v, name in enumerate(names)]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    nodes = [helper.make_node("Identity", [f"in_{name}"], [name]) for name in names]
    graph = helper.make_graph(nodes, "views", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def view_candidates(batch: int, anchors: list[int], seed: int = 0
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per view: boxes jittered around 4 objects per image (so that the views agree roughly,
    as a detector's do), distinct scores; the last image of 3 or more scores low."""
    rng = np.random.default_rng(seed)
    objects = rng.uniform(12, 52, size=(batch, 4, 2))
    sides = rng.uniform(8, 16, size=(batch, 4, 2))
    boxes_list, scores_list = [], []
    for count in anchors:
        which = rng.integers(0, 4, size=(batch, count))
        centre = np.take_along_axis(objects, which[..., None], 1) + rng.normal(0, 1.2,
                                                                                 (batch, count, 2))
        side = np.take_along_axis(sides, which[..., None], 1) * rng.uniform(0.85, 1.15,
                                                                            (batch, count, 1))
        boxes_list.append(np.concatenate([centre - side / 2, centre + side / 2], -1)
                          .astype(np.float32))
        scores = rng.uniform(0, 1, size=(batch, CLASSES, count)) ** 3
        if batch >= 3:
            scores[-1] *= 0.05
        scores_list.append(scores.astype(np.float32))
    return boxes_list, scores_list


def feed(boxes_list: list[np.ndarray], scores_list: list[np.ndarray]) -> dict:
    arrays = [a for pair in zip(boxes_list, scores_list) for a in pair]
    return {f"in_{name}": a for name, a in zip(view_output_names(len(boxes_list)), arrays)}


def assert_same_detections(got: tuple, expected: tuple) -> None:
    assert len(got[0]) == len(expected[0])
    np.testing.assert_array_equal(got[2], expected[2])
    np.testing.assert_allclose(got[1], expected[1], atol=1e-6)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-4)


@pytest.mark.parametrize("batch,anchors,m", [(1, [30, 20], 100), (3, [25, 40, 15], 100),
                                             (3, [30, 30], 4)])
def test_the_fusion_graph_equals_its_numpy_reference(batch, anchors, m):
    settings = FusionSettings(views=len(anchors), iou_threshold=0.5, score_threshold=0.1,
                              max_detections=m)
    boxes_list, scores_list = view_candidates(batch, anchors)
    graph = append_fusion(views_graph(anchors), len(anchors), settings)
    onnx.checker.check_model(graph, full_check=True)
    assert graph_settings(graph) == settings
    out = session(graph).run(DETECTION_OUTPUTS, feed(boxes_list, scores_list))
    assert [a.dtype for a in out] == [np.float32, np.float32, np.int64, np.int64]
    expected = fuse_candidates(boxes_list, scores_list, settings)
    for i, want in enumerate(expected):
        n = int(out[3][i])
        assert_same_detections((out[0][i, :n], out[1][i, :n], out[2][i, :n]), want)
        assert (out[2][i, n:] == -1).all() and not out[0][i, n:].any()
        assert list(out[1][i, :n]) == sorted(out[1][i, :n], reverse=True)
    found = sum(len(class_nms(b[0], s[0], 0.5, 0.1, m)[0])
                for b, s in zip(boxes_list, scores_list))
    assert 0 < out[3][0] < min(found, m + 1)  # the views' detections were fused
    assert (out[3] <= m).all()
    if batch >= 3:
        assert out[3][-1] == 0  # the low-scoring image: nothing above the threshold


def test_a_hand_computed_fusion_is_exact_wbf():
    """Two views, one object each found (IoU 0.68 between them) and a second object only the
    second view found: one fused box, the score-weighted mean, scored by the mean of the two;
    the lone box keeps half its score. Exact WBF (wbf.py) gives the same."""
    boxes = [np.array([[[10, 10, 30, 30], [60, 60, 70, 70]]], np.float32),
             np.array([[[12, 10, 32, 32], [40, 40, 50, 50]]], np.float32)]
    scores = [np.zeros((1, CLASSES, 2), np.float32), np.zeros((1, CLASSES, 2), np.float32)]
    scores[0][0, 1, 0], scores[1][0, 1, 0], scores[1][0, 2, 1] = 0.9, 0.6, 0.8
    settings = FusionSettings(views=2, iou_threshold=0.5, score_threshold=0.05,
                              max_detections=10)
    out = session(append_fusion(views_graph([2, 2]), 2, settings)).run(
        DETECTION_OUTPUTS, feed(boxes, scores))
    n = int(out[3][0])
    got = out[0][0, :n], out[1][0, :n], out[2][0, :n]
    fused = (0.9 * np.array([10, 10, 30, 30]) + 0.6 * np.array([12, 10, 32, 32])) / 1.5
    np.testing.assert_allclose(got[0], [fused, [40, 40, 50, 50]], atol=1e-5)
    np.testing.assert_allclose(got[1], [0.75, 0.4], atol=1e-6)
    assert got[2].tolist() == [1, 2]
    exact = weighted_box_fusion([[[10, 10, 30, 30]], [[12, 10, 32, 32], [40, 40, 50, 50]]],
                                [[0.9], [0.6, 0.8]], [[1], [1, 2]], iou_threshold=0.55)
    assert_same_detections(got, exact)


def test_the_inner_tensors_give_exact_wbf_of_the_views_detections():
    """inference.py's third figure: exact WBF of the views' detections as the graph's inner
    tensors hold them, equal to wbf.py on the same detections found by the numpy reference."""
    anchors = [30, 25]
    settings = FusionSettings(views=2, iou_threshold=0.5, score_threshold=0.1,
                              max_detections=100)
    boxes_list, scores_list = view_candidates(3, anchors, seed=1)
    graph = append_fusion(views_graph(anchors), 2, settings)
    inner = session(with_inner_outputs(graph))
    run = inner_runner(_FedSession(inner, boxes_list, scores_list), settings)
    fused, exact = run(np.zeros((3, 1, 8, 8), np.float32))
    plain = session(graph).run(DETECTION_OUTPUTS, feed(boxes_list, scores_list))
    for i in range(3):
        n = int(plain[3][i])
        assert_same_detections(fused[i], (plain[0][i, :n], plain[1][i, :n], plain[2][i, :n]))
        views = [class_nms(b[i], s[i], 0.5, 0.1, 100) for b, s in zip(boxes_list, scores_list)]
        expected = weighted_box_fusion(
            [b[i][a] for b, (_, a) in zip(boxes_list, views)],
            [s[i][c, a] for s, (c, a) in zip(scores_list, views)],
            [c for c, _ in views], iou_threshold=settings.fusion_iou)
        assert_same_detections(exact[i], expected)


class _FedSession:
    """The stand-in graph's session behind inner_runner's one-input call: its batch ignored,
    the fixed views' candidates fed instead."""

    def __init__(self, inner: ort.InferenceSession, boxes_list, scores_list) -> None:
        self.inner, self.feed = inner, feed(boxes_list, scores_list)

    def get_inputs(self):
        return self.inner.get_inputs()

    def run(self, names, _):
        return self.inner.run(names, self.feed)


def test_append_fusion_refuses_another_graph():
    from utils import ExportError

    settings = FusionSettings(views=2, iou_threshold=0.5, score_threshold=0.1,
                              max_detections=10)
    with pytest.raises(ExportError, match="candidate_boxes_0"):
        append_fusion(views_graph([3]), 2, settings)
    old = views_graph([3, 3])
    old.opset_import[0].version = 17
    with pytest.raises(ExportError, match="opset 18"):
        append_fusion(old, 2, settings)


# ----------------------------------------------------------------------------- the whole graph


@pytest.fixture(scope="module")
def tta_graph() -> tuple[torch.nn.Module, list, FusionSettings, onnx.ModelProto]:
    """A random-weight CenterNet (its heatmap's last layer scaled up, so that scores spread
    over (0.1, 0.7) rather than sit at the prior) under hflip and a scale, exported with its
    fusion."""
    from ttc.convert.tracing import slim_graph
    from ttc.tasks.detect.nets import CenterNet

    torch.manual_seed(0)
    net = CenterNet(in_channels=1, num_classes=CLASSES, widths=(8, 16), head_width=8).eval()
    with torch.no_grad():
        net.heatmap[-1].weight.mul_(100)
    views = parse_box_views("hflip,scale:0.75")
    settings = FusionSettings(views=len(views), iou_threshold=0.5, score_threshold=0.3,
                              max_detections=6)
    example = np.random.default_rng(0).random((2, 1, 32, 32), np.float32)
    graph = append_fusion(slim_graph(export_view_candidates(net, views, example, 18)),
                          len(views), settings)
    onnx.checker.check_model(graph)
    return net, views, settings, graph


@pytest.mark.parametrize("batch,size", [(1, (32, 32)), (3, (32, 32)), (1, (45, 38)),
                                        (3, (45, 38))])
def test_the_tta_graph_keeps_the_contract_and_fuses_as_pytorch(tta_graph, batch, size):
    net, views, settings, graph = tta_graph
    run = session(graph)
    assert [o.name for o in run.get_outputs()] == list(DETECTION_OUTPUTS)
    x = np.random.default_rng(batch).random((batch, 1, *size), np.float32)
    boxes, scores, labels, counts = run.run(DETECTION_OUTPUTS, {"image": x})
    m = settings.max_detections
    assert boxes.shape == (batch, m, 4) and scores.shape == labels.shape == (batch, m)
    assert counts.shape == (batch,) and counts.dtype == labels.dtype == np.int64
    expected = tta_reference(net, views, settings)(x)
    for i in range(batch):
        n = int(counts[i])
        assert 0 < n <= m
        assert (labels[i, n:] == -1).all() and not boxes[i, n:].any() and not scores[i, n:].any()
        assert list(scores[i, :n]) == sorted(scores[i, :n], reverse=True)
        assert (boxes[i, :n, 2] <= size[1] + 1e-4).all() and (boxes[i, :n] >= 0).all()
        result = matched((boxes[i, :n], scores[i, :n], labels[i, :n]), expected[i])
        assert result is not None and result[0] >= 0.99 and result[1] <= 1e-4


def test_rot90_through_the_cli_on_a_detector(tmp_path):
    """pipeline.py with --tta_transforms rot90: the TTA graph fuses the plain and the turned
    view (model.json names it) and the report's TTA section says so."""
    import json

    from conftest import run_cli
    from ttc.tasks.detect.canvases import write_coco_canvases

    images, annotations = tmp_path / "images", tmp_path / "instances.json"
    write_coco_canvases(images, annotations, 40, size=32, seed=0)
    model = tmp_path / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path", images,
                  "--annotations", annotations, "--epochs", "1", "--batch_size", "16",
                  "--tta", "true", "--tta_transforms", "rot90", "--output_model", model,
                  "--report_json", tmp_path / "report.json", "--plots", "none",
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    graph = json.loads(model.with_suffix(".json").read_text())["extra_graphs"]["tta"]
    assert graph["views"] == "rot90"
    section = json.loads((tmp_path / "report.json").read_text())["tta"]
    assert section["transforms"] == "rot90" and section["views"] == 2
