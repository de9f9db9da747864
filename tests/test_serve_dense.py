"""serve.py, the V2 endpoints, the Predictor and the DSPy tool on a detector and a segmenter
(issue 63, item 6), from the outside: real servers on 127.0.0.1, a free port, real HTTP. A
served detector answers the rows `inference.py --input` writes for the same image (its boxes in
the image's pixels), a served segmenter the mask PNG it writes (pixel-equal) with the per-class
pixel counts and shares of its summary; V2 infer answers the same as tensors; the tool returns
what the API does; a bad image is a 4xx with one line; test-time flags and a reload onto another
model type are refused. The trained bundles are test_detect_cli.py's and test_segment_cli.py's
fixtures (the same recipes; the tests go to their xdist groups)."""
from __future__ import annotations

import base64
import csv
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_clean_failure, copy_bundle, run_cli
from test_serve import NAME, Server, assert_error, serving
from utils import EXIT_USAGE

IMAGES = 3  # training canvases served, beside one of another size and mode


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def new_images(source: Path, folder: Path) -> list[Path]:
    """IMAGES canvases of `source` (searched recursively), and the first again as an RGB image
    of another size (56x40), so that the answers are scaled back to an image's own size."""
    folder.mkdir(parents=True)
    files = sorted(p for p in source.rglob("*.png") if "mask" not in p.parts[-2])[:IMAGES]
    copies = [shutil.copyfile(p, folder / p.name) for p in files]
    with Image.open(files[0]) as first:
        first.convert("RGB").resize((56, 40)).save(folder / "wide.png")
    return sorted([*map(Path, copies), folder / "wide.png"])


def served(model: Path, logs: Path) -> Iterator[Server]:
    with serving(model, "--max_queue_delay_ms", "20", logs=logs) as server:
        yield server


@pytest.fixture(scope="module")
def detector(detect_bundle, tmp_path_factory) -> Iterator[Server]:
    yield from served(detect_bundle["model"], tmp_path_factory.mktemp("detector-logs"))


@pytest.fixture(scope="module")
def segmenter(segment_bundle, tmp_path_factory) -> Iterator[Server]:
    yield from served(segment_bundle["model"], tmp_path_factory.mktemp("segmenter-logs"))


@pytest.fixture(scope="module")
def detect_images(detect_bundle, tmp_path_factory) -> list[Path]:
    return new_images(detect_bundle["images"], tmp_path_factory.mktemp("detect") / "new")


@pytest.fixture(scope="module")
def segment_images(segment_bundle, tmp_path_factory) -> list[Path]:
    return new_images(Path(segment_bundle["data"]), tmp_path_factory.mktemp("segment") / "new")


def upload(server: Server, image: Path) -> dict:
    """/predict/image's answer to one image file, which must be 200."""
    response = server.post("/predict/image", files={"file": (image.name, image.read_bytes())})
    assert response.status_code == 200, response.text
    [answer] = response.json()["predictions"]
    return answer


def infer(server: Server, images: list[Path]) -> dict[str, dict]:
    """V2 infer on the images (an `image` BYTES tensor of their base64): its outputs by name."""
    body = {"id": "dense-1", "inputs": [{"name": "image", "datatype": "BYTES",
                                         "shape": [len(images)],
                                         "data": [b64(p.read_bytes()) for p in images]}]}
    response = server.post(f"/v2/models/{NAME}/infer", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "dense-1" and answer["model_name"] == NAME
    return {output["name"]: output for output in answer["outputs"]}


# ----------------------------------------------------------------------------- a detector


def inference_boxes(model: Path, images: list[Path], folder: Path) -> dict[str, list[dict]]:
    """`inference.py --input FOLDER --output rows.jsonl`: each image's rows, less image and
    error, in the file's order."""
    output = folder / "rows.jsonl"
    run = run_cli("inference.py", "--model", model, "--input", images[0].parent, "--output",
                  output, "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    rows: dict[str, list[dict]] = {p.name: [] for p in images}
    for line in output.read_text().splitlines():
        row = json.loads(line)
        assert row.pop("error") == ""
        rows[row.pop("image")].append(row)
    return rows


def test_a_served_detector_answers_the_boxes_inference_writes(detect_bundle, detector,
                                                              detect_images, tmp_path):
    expected = inference_boxes(detect_bundle["model"], detect_images, tmp_path)
    assert any(expected.values())
    rows = [{"image": b64(p.read_bytes())} for p in detect_images]
    together = detector.predict(rows)
    for image, answer in zip(detect_images, together):
        with Image.open(image) as picture:
            assert (answer["width"], answer["height"]) == picture.size
        assert answer["boxes"] == expected[image.name], image.name
        assert upload(detector, image) == answer
    if together[0]["boxes"]:  # the wide copy's boxes are scaled to its own size
        assert together[-1]["boxes"] != together[0]["boxes"]


def test_v2_infer_answers_a_detector_s_boxes_as_padded_tensors(detector, detect_images):
    metadata = detector.metadata()
    assert [i["name"] for i in metadata["inputs"]] == ["image"]
    assert metadata["inputs"][0]["datatype"] == "BYTES"
    assert [o["name"] for o in metadata["outputs"]] == ["boxes", "scores", "labels",
                                                        "num_detections"]
    answers = detector.predict([{"image": b64(p.read_bytes())} for p in detect_images])
    outputs = infer(detector, detect_images)
    counts = [len(answer["boxes"]) for answer in answers]
    most = max(counts)
    assert outputs["num_detections"]["data"] == counts
    assert outputs["boxes"]["shape"] == [len(answers), most, 4]
    boxes = np.asarray(outputs["boxes"]["data"]).reshape(len(answers), most, 4)
    scores = np.asarray(outputs["scores"]["data"]).reshape(len(answers), most)
    labels = np.asarray(outputs["labels"]["data"], dtype=object).reshape(len(answers), most)
    for k, answer in enumerate(answers):
        n = counts[k]
        assert boxes[k, :n].tolist() == [[b["x1"], b["y1"], b["x2"], b["y2"]]
                                         for b in answer["boxes"]]
        assert scores[k, :n].tolist() == [b["score"] for b in answer["boxes"]]
        assert labels[k, :n].tolist() == [b["label"] for b in answer["boxes"]]
        assert not boxes[k, n:].any() and set(labels[k, n:]) <= {""}
    only = detector.post(f"/v2/models/{NAME}/infer", {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                    "data": [b64(detect_images[0].read_bytes())]}],
        "outputs": [{"name": "num_detections"}]})
    assert [o["name"] for o in only.json()["outputs"]] == ["num_detections"]


# ----------------------------------------------------------------------------- a segmenter


def inference_masks(model: Path, images: list[Path], folder: Path
                    ) -> dict[str, tuple[Path, dict]]:
    """`inference.py --input FOLDER --output summary.csv`: each image's mask file and row."""
    output = folder / "summary.csv"
    run = run_cli("inference.py", "--model", model, "--input", images[0].parent, "--output",
                  output, "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    with open(output, newline="") as handle:
        return {row["id"]: (folder / row["mask"], row) for row in csv.DictReader(handle)}


def mask_pixels(data: bytes | Path) -> tuple[np.ndarray, list[int] | None]:
    """A mask PNG's class indices and its palette."""
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as mask:
        assert mask.mode == "P"
        return np.asarray(mask), mask.getpalette()


def test_a_served_segmenter_answers_the_mask_inference_writes(segment_bundle, segmenter,
                                                              segment_images, tmp_path):
    expected = inference_masks(segment_bundle["model"], segment_images, tmp_path)
    labels = json.loads(segment_bundle["model"].with_suffix(".json").read_text())["labels"]
    answers = segmenter.predict([{"image": b64(p.read_bytes())} for p in segment_images])
    for image, answer in zip(segment_images, answers):
        written, row = expected[image.name]
        mine, palette = mask_pixels(base64.b64decode(answer["mask"]))
        theirs, their_palette = mask_pixels(written)
        assert np.array_equal(mine, theirs) and palette == their_palette, image.name
        assert (answer["height"], answer["width"]) == theirs.shape
        assert (answer["height"], answer["width"]) == (int(row["height"]), int(row["width"]))
        counts = np.bincount(theirs.ravel(), minlength=len(labels))
        assert answer["pixels"] == {label: int(n) for label, n in zip(labels, counts)}
        assert answer["shares"] == {label: float(row[f"share_{label}"]) for label in labels}
        assert upload(segmenter, image) == answer


def test_v2_infer_answers_a_segmenter_s_masks_and_pixel_counts(segmenter, segment_images):
    metadata = segmenter.metadata()
    classes = len(metadata["parameters"]["classes"])
    assert metadata["outputs"] == [{"name": "mask", "datatype": "BYTES", "shape": [-1]},
                                   {"name": "pixels", "datatype": "INT64",
                                    "shape": [-1, classes]}]
    answers = segmenter.predict([{"image": b64(p.read_bytes())} for p in segment_images])
    outputs = infer(segmenter, segment_images)
    assert outputs["mask"]["shape"] == [len(answers)]
    assert outputs["mask"]["data"] == [answer["mask"] for answer in answers]
    assert outputs["pixels"]["shape"] == [len(answers), classes]
    assert np.asarray(outputs["pixels"]["data"]).reshape(len(answers), classes).tolist() == [
        list(answer["pixels"].values()) for answer in answers]


# ----------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("which", ["detector", "segmenter"])
def test_a_bad_image_is_a_4xx_with_one_line(request, which, tmp_path):
    server = request.getfixturevalue(which)
    upload_bad = server.post("/predict/image", files={"file": ("x.png", b"not an image")})
    assert_error(upload_bad, 422, "unreadable image", "cannot identify image file")
    png = io.BytesIO()
    Image.new("L", (16, 16)).save(png, format="PNG")
    cut = server.post("/predict/image", files={"file": ("cut.png", png.getvalue()[:40])})
    assert_error(cut, 422, "unreadable image")
    assert_error(server.post("/predict/image", files={"other": ("x.png", b"x")}), 422, "file")
    assert_error(server.post("/predict", {"instances": [{"image": "%%%"}]}), 422,
                 "row 1", "not base64")
    assert_error(server.post("/predict", {"instances": [{"picture": b64(png.getvalue())}]}),
                 422, "row 1", "'image'")
    v2 = server.post(f"/v2/models/{NAME}/infer", {"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [2],
         "data": [b64(png.getvalue()), b64(b"GIF89a broken")]}]})
    assert_error(v2, 422, "row 2", "unreadable image", key="error")
    assert len(server.predict([{"image": b64(png.getvalue())}])) == 1  # still serving


def test_test_time_flags_are_refused_before_the_port_opens(detect_bundle):
    run = run_cli("serve.py", "--model", detect_bundle["model"], "--port", "0", "--tta", "true")
    assert_clean_failure(run, EXIT_USAGE, "object_detector", "--tta")


def test_a_reload_onto_another_model_type_keeps_the_model_serving(detect_bundle,
                                                                  segment_bundle, tmp_path):
    """A reload onto a bundle of another type (the segmenter's files copied over the served
    detector's) is refused, 400 with one line, and the detector keeps answering."""
    model = copy_bundle(detect_bundle, tmp_path / "bundle")
    image = b64(next(iter(sorted(detect_bundle["images"].glob("*.png")))).read_bytes())
    with serving(model, logs=tmp_path) as server:
        version = server.version()
        for path in segment_bundle["dir"].glob("model.*"):
            temporary = model.parent / f".{path.name}.new"
            shutil.copyfile(path, temporary)
            temporary.replace(model.parent / path.name)
        reload = server.post(f"/v2/repository/models/{NAME}/load")
        assert reload.status_code == 400, reload.text
        assert reload.json()["loaded"] is False and reload.json()["version"] == version
        assert "a reload keeps the model type" in reload.json()["error"]
        assert "boxes" in server.predict([{"image": image}])[0]


# ----------------------------------------------------------------------------- Python and DSPy


@pytest.mark.parametrize("which, returns", [("detect", "boxes"), ("segment", "mask")])
def test_the_dspy_tool_returns_the_api_s_answer(request, which, returns):
    from ttc.online.predictor import Predictor

    bundle = request.getfixturevalue(f"{which}_bundle")
    images = request.getfixturevalue(f"{which}_images")
    predictor = Predictor.load(bundle["model"])
    tool = predictor.as_dspy_tool()
    assert tool.name == predictor.manifest.model_type
    assert returns in tool.desc and all(repr(label) in tool.desc
                                        for label in predictor.manifest.labels[:20])
    assert tool.args == {"image": {"type": "string",
                                   "description": "the image file's bytes, base64"}}
    row = {"image": b64(images[-1].read_bytes())}
    assert tool(**row) == predictor.predict([row])[0]
    assert returns in tool(**row)


def test_the_api_refuses_a_flag_the_type_does_not_take_as_serve_py_does(segment_bundle):
    """Predictor.load checks its flags against the bundle's model type with serve.py's line
    (ServeOptions.validate_tta; serve.py's is config.Config.validate_tta)."""
    from ttc.online.predictor import Predictor
    from utils import ConfigError

    cli = run_cli("serve.py", "--model", segment_bundle["model"], "--top_k", "2")
    assert cli.returncode == 2
    with pytest.raises(ConfigError) as raised:
        Predictor.load(segment_bundle["model"], top_k=2)
    assert "--top_k does not apply to an image_segmenter" in raised.value.one_line()
    assert raised.value.one_line() in cli.stderr


def test_a_react_program_calls_a_detector_as_a_tool(detect_bundle, detect_images):
    import dspy
    from dspy.utils import DummyLM

    from ttc.online.predictor import Predictor

    predictor = Predictor.load(detect_bundle["model"])
    tool = predictor.as_dspy_tool()
    image = b64(detect_images[0].read_bytes())
    expected = predictor.predict([{"image": image}])[0]
    lm = DummyLM([{"next_thought": "Ask the detector.", "next_tool_name": tool.name,
                   "next_tool_args": {"image": image}},
                  {"next_thought": "It answered.", "next_tool_name": "finish",
                   "next_tool_args": {}},
                  {"reasoning": "Its boxes.", "objects": len(expected["boxes"])}])
    with dspy.context(lm=lm):
        result = dspy.ReAct("image -> objects: int", tools=[tool])(image=image)
    assert result.trajectory["tool_name_0"] == "object_detector"
    assert result.trajectory["observation_0"] == expected
    assert result.objects == len(expected["boxes"])


# ----------------------------------------------------------------------------- the layout


def test_the_online_layer_imports_no_model_type_s_own_code():
    """ttc/online reaches a type's serving code through its Parts.served reference only."""
    from test_layout import import_graph, is_type_code

    graph = import_graph()
    offenders = {name: {d for d in deps if is_type_code(d)} for name, deps in graph.items()
                 if name.startswith("ttc.online.") and any(is_type_code(d) for d in deps)}
    assert offenders == {}
