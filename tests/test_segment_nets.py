"""The segmentation networks (any height and width in, logits at that resolution out; rebuilt
from their manifest record; the U-Net exported with dynamic batch, height and width) and the
pixel metrics against a confusion computed by hand."""
from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from ttc.tasks.segment.metrics import PixelConfusion, majority_matrix, segmentation_scores
from ttc.tasks.segment.nets import (SEGMENTATION_MODULES, SEGMENTATION_NETWORKS,
                                    SegmentationGraph)

CLASSES = 5
SIZES = [(17, 23), (32, 32)]


def preprocessing(channels: int, side: int = 32) -> dict:
    return {"kind": "segmentation", "image_size": [side, side], "channels": channels,
            "ignore_index": 255}


def built(arch: str, channels: int) -> tuple[torch.nn.Module, dict]:
    """The network of `arch` from its record (through JSON, as a manifest holds it), with
    random BatchNorm statistics so that a rebuild that loses them shows."""
    record = json.loads(json.dumps(SEGMENTATION_NETWORKS[arch](preprocessing(channels),
                                                               CLASSES)))
    stats = {"mean": [0.3] * channels, "std": [0.2] * channels}
    net = SEGMENTATION_MODULES[record["name"]](**record, **stats)
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return net.eval(), record


def rebuilt_outputs_match(net: torch.nn.Module, record: dict, x: torch.Tensor) -> None:
    torch.manual_seed(1)  # other weights than `net` had, until its state_dict loads
    twin = SEGMENTATION_MODULES[record["name"]](**record).eval()
    twin.load_state_dict(net.state_dict())
    with torch.no_grad():
        assert torch.equal(twin(x), net(x))


@pytest.mark.parametrize("channels", [1, 3])
def test_the_unet_takes_any_size_and_rebuilds_from_its_record(channels):
    torch.manual_seed(0)
    net, record = built("unet", channels)
    assert record["name"] == "UNet" and record["widths"] == [16, 32, 64]  # bottleneck 8×8
    assert SEGMENTATION_NETWORKS["unet"](preprocessing(channels, 64), CLASSES)["widths"] == [
        16, 32, 64, 128]
    with torch.no_grad():
        for height, width in [*SIZES, (1, 1), (5, 2)]:
            out = net(torch.rand(2, channels, height, width))
            assert out.shape == (2, CLASSES, height, width)
            assert torch.isfinite(out).all()
    rebuilt_outputs_match(net, record, torch.rand(2, channels, 17, 23))


@pytest.mark.parametrize("arch,channels", [("lraspp_mobilenet_v3_large", 1),
                                           ("deeplabv3_mobilenet_v3_large", 3)])
def test_torchvision_segmenters_take_any_size_and_rebuild(arch, channels):
    """Built without downloading anything; the stem takes `channels` and keeps the resolution
    of a small image; the "out" logits come back at the input's size."""
    torch.manual_seed(0)
    net, record = built(arch, channels)
    assert record["name"] == "TorchvisionSegmenter" and record["small_stem"] is True
    stem = net.body.backbone["0"][0]
    assert stem.in_channels == channels and stem.stride == (1, 1)
    with torch.no_grad():
        for height, width in SIZES:
            assert net(torch.rand(2, channels, height, width)).shape == (2, CLASSES, height,
                                                                         width)
    rebuilt_outputs_match(net, record, torch.rand(2, channels, 32, 32))


def test_the_segmentation_graph_gives_class_probabilities_and_the_mask():
    torch.manual_seed(0)
    net, _ = built("unet", 3)
    graph = SegmentationGraph(net, temperature=2.0).eval()
    with torch.no_grad():
        logits, probabilities, mask = graph(torch.rand(2, 3, 9, 11))
    assert probabilities.shape == logits.shape == (2, CLASSES, 9, 11)
    torch.testing.assert_close(probabilities.sum(dim=1), torch.ones(2, 9, 11))
    torch.testing.assert_close(probabilities, torch.softmax(logits / 2.0, dim=1))
    assert mask.shape == (2, 9, 11) and torch.equal(mask, logits.argmax(dim=1))


def test_the_unet_exports_with_dynamic_batch_height_and_width():
    import onnxruntime as ort

    from ttc.convert.tracing import export_graph
    from ttc.serving.bundle import InputSpec

    torch.manual_seed(0)
    net, _ = built("unet", 3)
    spec = InputSpec(name="image", shape=("batch", 3, "height", "width"), dtype="float32",
                     padding_id=None, max_length=None, extra_inputs=())
    example = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    graph = export_graph(net, example, 18, spec, ["logits", "probabilities"])
    session = ort.InferenceSession(graph.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 3, "height", "width"]
    rng = np.random.default_rng(1)
    for batch, (height, width) in [(1, (17, 23)), (3, (40, 29)), (1, (32, 32))]:
        x = rng.random((batch, 3, height, width), dtype=np.float32)
        (logits,) = session.run(["logits"], {"image": x})
        with torch.no_grad():
            expected = net(torch.from_numpy(x)).numpy()
        assert logits.shape == (batch, CLASSES, height, width)
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- metrics

LABELS = ["background", "one", "two", "three"]
# Two 2×4 masks; 255 is void. Counted by hand (rows true, columns predicted): background 8
# right, 1 as "one"; "one" 2 right, 1 as background; "two" 1 right, 1 as background; "three"
# neither true nor predicted anywhere (and the void pixels' predictions are not counted).
TRUTH = np.array([[[0, 0, 0, 1], [0, 1, 1, 255]], [[0, 0, 2, 2], [0, 0, 0, 255]]])
PREDICTED = np.array([[[0, 0, 1, 1], [0, 1, 0, 0]], [[0, 0, 2, 0], [0, 0, 0, 3]]])
BY_HAND = [[8, 1, 0, 0], [1, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]


def test_the_pixel_confusion_leaves_void_out_and_adds_batches():
    whole = PixelConfusion(4).add(PREDICTED, TRUTH)
    assert whole.matrix.dtype == np.int64 and whole.matrix.tolist() == BY_HAND
    assert whole.pixels == 14
    halves = PixelConfusion(4).add(PREDICTED[:1], TRUTH[:1]).add(PREDICTED[1:], TRUTH[1:])
    assert np.array_equal(halves.matrix, whole.matrix)
    with pytest.raises(ValueError, match="differ in shape"):
        PixelConfusion(4).add(PREDICTED[:1], TRUTH)
    with pytest.raises(ValueError, match=r"true class indices must lie in \[0, 4\)"):
        PixelConfusion(4).add(PREDICTED, np.where(TRUTH == 2, 7, TRUTH))


def exactly(value: float, fraction: Fraction) -> bool:
    return value == pytest.approx(float(fraction), abs=1e-12)


def test_segmentation_scores_match_the_hand_computed_confusion():
    scores = segmentation_scores(np.array(BY_HAND), LABELS)
    per_class = scores["per_class"]
    iou = {"background": Fraction(8, 11), "one": Fraction(2, 4), "two": Fraction(1, 2)}
    dice = {"background": Fraction(16, 19), "one": Fraction(4, 6), "two": Fraction(2, 3)}
    for label in iou:
        assert exactly(per_class[label]["iou"], iou[label])
        assert exactly(per_class[label]["dice"], dice[label])
    assert [per_class[k]["pixels"] for k in LABELS] == [9, 3, 2, 0]
    assert [per_class[k]["predicted_pixels"] for k in LABELS] == [10, 3, 1, 0]
    # "three" has an empty union: no score, and left out of the means
    assert per_class["three"]["iou"] is None and per_class["three"]["dice"] is None
    assert scores["pixels"] == 14
    assert exactly(scores["pixel_accuracy"], Fraction(11, 14))
    assert exactly(scores["mean_iou"], sum(iou.values()) / 3)
    assert exactly(scores["mean_dice"], sum(dice.values()) / 3)
    assert exactly(scores["frequency_weighted_iou"],
                   Fraction(9, 14) * iou["background"] + Fraction(3, 14) * iou["one"]
                   + Fraction(2, 14) * iou["two"])
    assert scores["confusion_matrix"] == BY_HAND
    json.dumps(scores)  # the report's JSON


def test_the_majority_baseline_and_its_verdict():
    scores = segmentation_scores(np.array(BY_HAND), LABELS)
    # always background: 9 of 14 pixels right; IoU 9/14 for background, 0 for "one" and "two"
    assert scores["baseline_class"] == "background"
    assert scores["baseline_source"] == "evaluated data"
    assert exactly(scores["baseline_pixel_accuracy"], Fraction(9, 14))
    assert exactly(scores["baseline_mean_iou"], Fraction(9, 14) / 3)
    assert scores["warnings"] == [] and scores["verdict"].startswith("useful: mean IoU 0.5758")

    lazy = segmentation_scores(majority_matrix(np.array(BY_HAND), 0), LABELS)
    assert exactly(lazy["mean_iou"], Fraction(9, 14) / 3)
    assert lazy["verdict"].startswith("NOT USEFUL as it is")
    assert "does not beat answering the majority class 'background'" in lazy["warnings"][0]
    assert "IoU 0 for 2 classes: 'one' (3 pixels), 'two' (2 pixels)" in lazy["warnings"][1]

    from_training = segmentation_scores(np.array(BY_HAND), LABELS, train_pixels=[1, 5, 0, 0])
    assert from_training["baseline_class"] == "one"
    assert from_training["baseline_source"] == "train split"
    assert exactly(from_training["baseline_pixel_accuracy"], Fraction(3, 14))


def test_the_segmentation_graph_exports_its_mask_as_the_argmax_of_its_logits(tmp_path):
    """SegmentationGraph (what a segmenter's export will trace) through torch.onnx.export with
    dynamic batch, height and width: ONNX Runtime's mask is the argmax of its logits and its
    probabilities (softmax(logits / T) over the classes) sum to 1 at every pixel."""
    import onnxruntime as ort

    from ttc.tasks.segment.nets import SegmentationGraph, UNet

    torch.manual_seed(0)
    graph = SegmentationGraph(UNet(in_channels=1, num_classes=4, widths=(8, 16)).eval(), 0.7)
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height"),
            3: torch.export.Dim("width")}
    path = tmp_path / "seg.onnx"
    torch.onnx.export(graph.eval(), (torch.rand(2, 1, 20, 24),), str(path), dynamo=True,
                      input_names=["image"], output_names=["logits", "probabilities", "mask"],
                      dynamic_shapes=(dims,), external_data=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((1, 1, 17, 23), (3, 1, 32, 32)):
        x = np.random.default_rng(2).random(shape, np.float32)
        logits, probabilities, mask = session.run(None, {"image": x})
        assert mask.shape == (shape[0], *shape[2:]) and mask.dtype == np.int64
        np.testing.assert_array_equal(mask, logits.argmax(1))
        np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)
        with torch.no_grad():
            expected = torch.softmax(torch.from_numpy(logits) / 0.7, dim=1).numpy()
        np.testing.assert_allclose(probabilities, expected, atol=1e-6)
