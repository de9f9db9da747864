"""Segmentation TTA in the graph (ttc/tasks/segment/tta.py): each view's logits mapped back onto
the input's pixels (a flip undone, a rescaled image's logits resized back) before the mean; the
view list parsed with one-line errors; the whole exported with dynamic batch, height and width,
ONNX Runtime matching PyTorch at two resolutions."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from utils import ConfigError


def pointwise_net(classes: int = 3) -> torch.nn.Module:
    """A network with no spatial mixing (1x1 convolutions): it commutes with flips, so a flip
    view undone gives back exactly the identity view's logits."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 1), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, classes, 1)).eval()


def asymmetric_images(height: int = 9, width: int = 13) -> torch.Tensor:
    """A ramp along each axis and a bright corner: no flip maps it onto itself."""
    rows = torch.linspace(0, 1, height)[:, None]
    cols = torch.linspace(0, 1, width)[None, :] ** 2
    image = rows * cols
    image[0, 0] = 1.0
    return torch.stack([image, image.flip(1)])[:, None]


def test_flip_views_are_undone_before_the_merge():
    from ttc.tasks.segment.tta import SegmentationTTA, parse_views

    net, x = pointwise_net(), asymmetric_images()
    with torch.no_grad():
        plain = net(x)
        for spec in ("hflip", "vflip", "hflip,vflip"):
            merged = SegmentationTTA(net, parse_views(spec))(x)
            torch.testing.assert_close(merged, plain, rtol=0, atol=1e-6)
        # what a merge that forgot to undo the flip gives: not the plain logits
        assert not torch.allclose((plain + net(x.flip(-1))) / 2, plain, atol=1e-3)


def test_rescaled_views_come_back_at_the_input_size():
    from ttc.tasks.segment.tta import SegmentationTTA, parse_views

    net = pointwise_net()
    x = torch.rand(2, 1, 17, 23)
    views = parse_views("scale:0.75,1.25")
    assert [v.transform.spec for v in views] == ["identity", "scale:0.75", "scale:1.25"]
    with torch.no_grad():
        merged = SegmentationTTA(net, views)(x)
        smooth = torch.ones(1, 1, 17, 23) * 0.3  # a constant image rescales to itself
        torch.testing.assert_close(SegmentationTTA(net, views)(smooth), net(smooth))
    assert merged.shape == (2, 3, 17, 23)


@pytest.mark.parametrize("spec,words", [
    ("rotate:10", "'rotate:10' does not fit segmentation models: rotating the logits back"),
    ("crop:0.9", "'crop:0.9' does not fit segmentation models"),
    ("jitter:0.1", "unknown TTA transform 'jitter:0.1' for segmentation models"),
    ("scale:1", "'scale:1': the parameter must be a factor in (0, 4], not 1"),
    ("scale:5", "'scale:5': the parameter must be a factor in (0, 4], not 1"),
    ("hflip,0.5", "unknown TTA transform '0.5'"),
    (",", "names no view"),
])
def test_bad_views_are_refused_in_one_line(spec, words):
    from ttc.tasks.segment.tta import parse_views

    with pytest.raises(ConfigError) as refused:
        parse_views(spec)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    if "parameter" not in words:  # the others name what a segmenter does take
        assert "rot90" in refused.value.hint and "rotate" not in refused.value.hint


def test_the_tta_graph_exports_with_dynamic_height_and_width():
    from ttc.convert.tracing import export_graph
    from ttc.serving.bundle import InputSpec
    from ttc.tasks.segment.nets import UNet
    from ttc.tasks.segment.tta import SegmentationTTA, parse_views

    torch.manual_seed(0)
    net = SegmentationTTA(UNet(in_channels=1, num_classes=3, widths=(8, 16)).eval(),
                          parse_views("hflip,vflip,rot90,shift:1,scale:0.75,1.25")).eval()
    spec = InputSpec(name="image", shape=("batch", 1, "height", "width"), dtype="float32",
                     padding_id=None, max_length=None, extra_inputs=())
    graph = export_graph(net, np.random.default_rng(0).random((2, 1, 20, 24), np.float32), 18,
                         spec, ["logits", "probabilities"])
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in ((1, 1, 17, 23), (3, 1, 32, 32)):
        x = np.random.default_rng(1).random(shape, np.float32)
        with torch.no_grad():
            expected = net(torch.from_numpy(x)).numpy()
        got = session.run(["logits"], {"image": x})[0]
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_rot90_through_the_cli_on_a_segmenter(tmp_path):
    """pipeline.py with --tta_transforms rot90: the TTA graph runs the quarter turn (model.json
    names it) and the report's TTA section compares it with the plain graph."""
    import json

    from conftest import run_cli
    from ttc.tasks.segment.canvases import write_digit_canvases

    data = write_digit_canvases(tmp_path / "canvases", 40, size=20, seed=0)
    model = tmp_path / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path", data,
                  "--epochs", "1", "--batch_size", "16", "--tta", "true", "--tta_transforms",
                  "rot90", "--output_model", model, "--report_json", tmp_path / "report.json",
                  "--plots", "none", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(model.with_suffix(".json").read_text())["extra_graphs"]["tta"][
        "views"] == "rot90"
    assert json.loads((tmp_path / "report.json").read_text())["tta"]["transforms"] == "rot90"
