"""The detector's graph (issue 44, item 3): NMS appended in ONNX ops equals the eager
torchvision.ops.batched_nms post-processing on fixed candidates; the exported graph's contract
(output names, dtypes, padding rows, num_detections, order by score) at batch 1 and 3 and two
image sizes; the graph's detections equal PyTorch's `detect`; the CenterNet's targets and loss
reward the right answer, and the net overfits one tiny batch into the right boxes."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ttc.tasks.detect.nets import (DETECTION_MODULES, DETECTION_NETWORKS, STRIDE, cell_boxes,
                                   detection_loss, detection_targets, output_size)
from ttc.tasks.detect.nms import (DETECTION_OUTPUTS, DetectionCandidates, append_nms, detect,
                                  export_detector, postprocess)

CLASSES = 3
SIDE = 32


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def candidates_graph(opset: int = 18) -> onnx.ModelProto:
    """A stand-in for an exported candidates graph: its inputs passed through as
    candidate_boxes (N, A, 4) and candidate_scores (N, K, A)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["in_boxes"], ["candidate_boxes"]),
         helper.make_node("Identity", ["in_scores"], ["candidate_scores"])], "candidates",
        [helper.make_tensor_value_info("in_boxes", TensorProto.FLOAT, ["batch", "a", 4]),
         helper.make_tensor_value_info("in_scores", TensorProto.FLOAT, ["batch", CLASSES, "a"])],
        [helper.make_tensor_value_info("candidate_boxes", TensorProto.FLOAT, ["batch", "a", 4]),
         helper.make_tensor_value_info("candidate_scores", TensorProto.FLOAT,
                                       ["batch", CLASSES, "a"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def fixed_candidates(batch: int, anchors: int = 40, seed: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Boxes in a few clusters (so that NMS suppresses), distinct scores (no ties), and one
    image (the last of 3 or more) with every score under the thresholds used."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(10, 50, size=(batch, 4, 2))[:, rng.integers(0, 4, anchors)]
    sides = rng.uniform(6, 14, size=(batch, anchors, 2))
    jitter = rng.normal(0, 1.5, size=(batch, anchors, 2))
    boxes = np.concatenate([centres + jitter - sides / 2, centres + jitter + sides / 2], axis=-1)
    scores = rng.permutation(batch * CLASSES * anchors).reshape(batch, CLASSES, anchors)
    scores = (scores + 1) / (scores.size + 1)
    if batch >= 3:
        scores[-1] *= 0.1
    return boxes.astype(np.float32), scores.astype(np.float32)


def greedy_nms(boxes: np.ndarray, scores: np.ndarray, iou: float, score: float, m: int
               ) -> list[list[tuple[float, int, int]]]:
    """ONNX NonMaxSuppression's specification, literally, then the m best per image: per
    image, (score, class, anchor) rows sorted by score."""
    found = []
    for image_boxes, image_scores in zip(boxes, scores):
        rows = []
        for cls, row in enumerate(image_scores):
            kept: list[int] = []
            for anchor in sorted(np.flatnonzero(row > score), key=lambda a: -row[a]):
                if len(kept) < m and all(box_iou(image_boxes[anchor], image_boxes[k]) <= iou
                                         for k in kept):
                    kept.append(anchor)
            rows += [(float(row[a]), cls, int(a)) for a in kept]
        found.append(sorted(rows, reverse=True)[:m])
    return found


@pytest.mark.parametrize("batch,iou,score,m", [(1, 0.5, 0.2, 10), (3, 0.3, 0.15, 4),
                                               (3, 0.7, 0.0, 100)])
def test_nms_in_the_graph_equals_batched_nms(batch, iou, score, m):
    """Class-aware suppression, the score threshold, at most m per class and the m best per
    image: the same rows, in the same order, as the eager torchvision reference."""
    boxes, scores = fixed_candidates(batch)
    got = session(append_nms(candidates_graph(), iou, score, m)).run(
        None, {"in_boxes": boxes, "in_scores": scores})
    expected = postprocess(torch.from_numpy(boxes), torch.from_numpy(scores), iou, score, m)
    for name, g, e in zip(DETECTION_OUTPUTS, got, expected):
        assert g.dtype == e.numpy().dtype and g.shape == tuple(e.shape), name
        np.testing.assert_array_equal(g, e.numpy(), err_msg=name)
    reference = greedy_nms(boxes, scores, iou, score, m)
    for i, rows in enumerate(reference):
        assert got[3][i] == len(rows) and got[1][i, :len(rows)].tolist() == [r[0] for r in rows]
        assert got[2][i, :len(rows)].tolist() == [r[1] for r in rows]
        assert (got[0][i, :len(rows)] == boxes[i, [r[2] for r in rows]]).all()
    kept = len(greedy_nms(boxes[:1], scores[:1], iou, score, 10**6)[0])
    assert 0 < kept < int((scores[0] > score).sum())  # NMS suppressed some...
    assert got[3][0] == min(kept, m)  # ...and m cut the rest
    if batch == 3:  # the image whose scores are all low: nothing, unless the threshold is 0
        assert (got[3][-1] == 0) == (score > 0)


def test_append_nms_refuses_a_graph_without_candidates():
    from utils import ExportError

    graph = candidates_graph()
    graph.graph.output[0].name = "logits"
    with pytest.raises(ExportError, match="candidate_boxes"):
        append_nms(graph, 0.5, 0.1, 10)
    with pytest.raises(ExportError, match="opset"):
        append_nms(candidates_graph(opset=12), 0.5, 0.1, 10)


# ----------------------------------------------------------------------------- a tiny detector


def rectangles(count: int, side: int = SIDE, seed: int = 0
               ) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Images of 1-2 filled rectangles whose class is their brightness (0.35, 0.65, 1.0)."""
    rng = np.random.default_rng(seed)
    images = np.zeros((count, 1, side, side), np.float32)
    boxes = []
    for i in range(count):
        rows = []
        for j in range(1 + i % 2):
            cls = int(rng.integers(CLASSES))
            w, h = (int(v) for v in rng.integers(8, 13, size=2))
            x = int(rng.integers(0, side // 2 - w)) + (side // 2 if j else 0)
            y = int(rng.integers(0, side - h))
            images[i, 0, y:y + h, x:x + w] = (0.35, 0.65, 1.0)[cls]
            rows.append([cls, x, y, x + w, y + h])
        boxes.append(np.array(rows, np.float32))
    return torch.from_numpy(images), boxes


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union


def tiny_net() -> torch.nn.Module:
    """The CenterNet of the record for SIDE-pixel images, through JSON as a manifest holds it."""
    record = json.loads(json.dumps(DETECTION_NETWORKS["centernet"](
        {"kind": "detection", "image_size": [SIDE, SIDE], "channels": 1}, CLASSES)))
    assert record["name"] == "CenterNet" and record["widths"] == [16, 32]
    return DETECTION_MODULES[record["name"]](**record, mean=[0.1], std=[0.25])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the suite runs two workers on two cores, and a second thread each
    makes these tiny steps ten times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def overfit() -> tuple[torch.nn.Module, torch.Tensor, list[np.ndarray]]:
    """The tiny net after 80 Adam steps on one batch of 4 images (train mode throughout, so
    BatchNorm's running statistics track the batch)."""
    torch.manual_seed(0)
    images, boxes = rectangles(4)
    net = tiny_net()
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    targets = detection_targets(boxes, CLASSES, images.shape[-2:])
    net.train()
    for _ in range(80):
        loss, _ = detection_loss(net(images), targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return net.eval(), images, boxes


@pytest.fixture(scope="module")
def exported(overfit) -> onnx.ModelProto:
    net, images, _ = overfit
    return export_detector(net, images[:2], 18, iou_threshold=0.5, score_threshold=0.3,
                           max_detections=5)


def test_the_net_overfits_one_batch_into_the_right_boxes(overfit):
    net, images, boxes = overfit
    found = detect(net, images, 0.5, 0.3, 5)
    for i, truth in enumerate(boxes):
        assert found.num_detections[i] == len(truth)
        for row in truth:  # each object: a detection of its class over IoU 0.8
            mine = found.labels[i] == int(row[0])
            assert max(box_iou(b, row[1:]) for b in found.boxes[i][mine].numpy()) > 0.8


@pytest.mark.parametrize("batch,size", [(1, (SIDE, SIDE)), (3, (SIDE, SIDE)), (1, (45, 38)),
                                        (3, (45, 38))])
def test_the_graph_keeps_the_contract_and_detects_as_pytorch(overfit, exported, batch, size):
    """Outputs boxes (N, M, 4) float32, scores (N, M) float32, labels (N, M) int64 and
    num_detections (N,) int64; padding rows zero with label -1; rows sorted by score; the same
    detections as `detect` in eager PyTorch (boxes within 1e-4)."""
    net, images, _ = overfit
    x = torch.nn.functional.interpolate(images.repeat(1, 1, 1, 1)[:batch], size=size,
                                        mode="bilinear", align_corners=False)
    got = session(exported).run(None, {"image": x.numpy()})
    assert [o.name for o in exported.graph.output] == list(DETECTION_OUTPUTS)
    assert [g.dtype for g in got] == [np.float32, np.float32, np.int64, np.int64]
    assert [g.shape for g in got] == [(batch, 5, 4), (batch, 5), (batch, 5), (batch,)]
    boxes, scores, labels, counts = got
    assert counts.min() >= 1
    for i, k in enumerate(counts):
        assert (np.diff(scores[i, :k]) <= 0).all() and (scores[i, :k] > 0.3).all()
        assert (labels[i, :k] >= 0).all() and (labels[i, k:] == -1).all()
        assert not boxes[i, k:].any() and not scores[i, k:].any()
        assert (boxes[i, :k, 0::2] <= size[1]).all() and (boxes[i, :k, 1::2] <= size[0]).all()
    expected = detect(net, x, 0.5, 0.3, 5)
    np.testing.assert_array_equal(counts, expected.num_detections.numpy())
    np.testing.assert_array_equal(labels, expected.labels.numpy())
    np.testing.assert_allclose(boxes, expected.boxes.numpy(), atol=1e-4)
    np.testing.assert_allclose(scores, expected.scores.numpy(), atol=1e-5)


def test_the_candidates_cover_any_size_in_input_pixels():
    """h = ceil(H / 4) cells per side, boxes decoded around each cell's centre and clipped to
    the image, scores 0 but at 3x3 peaks."""
    torch.manual_seed(0)
    net = tiny_net().eval()
    for height, width in [(16, 16), (17, 30), (33, 21)]:
        with torch.no_grad():
            boxes, scores = DetectionCandidates(net)(torch.rand(2, 1, height, width))
        h, w = output_size(height, width)
        assert boxes.shape == (2, h * w, 4) and scores.shape == (2, CLASSES, h * w)
        assert (boxes[..., 0::2] <= width).all() and (boxes[..., 1::2] <= height).all()
        assert (boxes >= 0).all() and (boxes[..., 2:] >= boxes[..., :2]).all()
        peaks = torch.nn.functional.max_pool2d(scores.view(2, CLASSES, h, w), 3, 1, 1)
        assert ((scores == 0) | (scores == peaks.flatten(2))).all()
    centres = cell_boxes(torch.full((1, 4, 2, 3), -30.0))  # distances ~0: the cells' centres
    assert torch.allclose(centres[0, 1, 2], torch.tensor([2.5, 1.5, 2.5, 1.5]) * STRIDE,
                          atol=1e-4)


# ----------------------------------------------------------------------------- targets and loss


def test_targets_put_a_peak_at_each_centre_and_boxes_around_it():
    rows = np.array([[2, 4, 8, 20, 28], [0, 30, 2, 46, 12]], np.float32)
    targets = detection_targets([rows, np.zeros((0, 5), np.float32)], CLASSES, (48, 50))
    assert targets["heatmap"].shape == (2, CLASSES, 12, 13)
    assert targets["box"].shape == (2, 4, 12, 13) and targets["weight"].shape == (2, 12, 13)
    heatmap = targets["heatmap"][0]
    assert heatmap[2, 18 // 4, 12 // 4] == 1 and heatmap[0, 7 // 4, 38 // 4] == 1
    assert int(heatmap.eq(1).sum()) == 2 and not targets["heatmap"][1].any()
    assert torch.equal(targets["box"][0, :, 18 // 4, 12 // 4], torch.tensor(rows[0, 1:]))
    for row in rows:  # each object's weights sum to log(its area)
        x1, y1, x2, y2 = (int(v) // 4 for v in row[1:])
        region = targets["weight"][0, y1:y2 + 1, x1:x2 + 1]
        assert region.sum() == pytest.approx(np.log((row[3] - row[1]) * (row[4] - row[2])),
                                             rel=1e-5)
    assert not targets["weight"][1].any()


def perfect_outputs(targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads that decode into the targets: heatmap logits of the target probabilities, and
    distances from each cell's centre to its target box (inverse softplus)."""
    heat = targets["heatmap"].clamp(1e-4, 1 - 1e-4)
    centres = cell_boxes(torch.full((1, 4, *heat.shape[-2:]), -30.0))[0]  # (h, w, 4)
    box = targets["box"].permute(0, 2, 3, 1)
    distances = torch.cat([centres[..., :2] - box[..., :2], box[..., 2:] - centres[..., 2:]],
                          dim=-1).clamp(min=1e-3) / 16.0
    raw = torch.log(torch.expm1(distances)).permute(0, 3, 1, 2)
    return torch.log(heat / (1 - heat)), raw


def test_the_loss_is_lower_for_the_right_answer():
    _, boxes = rectangles(3, side=40, seed=1)
    targets = detection_targets(boxes, CLASSES, (40, 40))
    logits, raw = perfect_outputs(targets)
    loss, parts = detection_loss((logits, raw), targets)
    assert set(parts) == {"heatmap", "giou", "total"} and parts["giou"] < 1e-3
    wrong_class = detection_loss((logits.roll(1, dims=1), raw), targets)[0]
    wrong_place = detection_loss((logits.roll(2, dims=-1), raw), targets)[0]
    wrong_boxes, wrong_parts = detection_loss((logits, raw - 1.0), targets)
    assert loss < min(wrong_class, wrong_place, wrong_boxes)
    assert wrong_parts["giou"] > 0.1 and wrong_parts["heatmap"] == pytest.approx(
        parts["heatmap"])
    empty = detection_targets([np.zeros((0, 5), np.float32)], CLASSES, (40, 40))
    assert torch.isfinite(detection_loss((logits[:1], raw[:1]), empty)[0])
