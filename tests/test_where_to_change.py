"""docs/design.md's "Where do I change X" table, checked against three real changes made in a
copy of the repository: a TTA transform, a detection metric and the served output format. Each
change touches only files its row names, and each works through the CLIs: a detector trained
by pipeline.py with --tta_transforms of the new transform reports the new metric, and serve.py
answers each box in the new format."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO
from test_add_a_model_type import apply_edits, copy_repository, run
from test_serve import serving

TTA_TRANSFORM = [  # both flips at once: a view of its own, mapped back for every output kind
    ("ttc/testtime/transforms.py", "        return tta_graph.flip(nodes, x, [2])\n", '''

class BothFlips(TTATransform):
    name = "hvflip"

    def augment(self, x: Array, setting: Any = None) -> Array:
        return _flip(_flip(x, -1), -2)

    def deaugment_mask(self, planes: Array, size: Sequence, setting: Any = None) -> Array:
        return _flip(_flip(planes, -1), -2)

    def deaugment_boxes(self, boxes: Array, seen: Sequence, size: Sequence,
                        setting: Any = None) -> Array:
        x1, y1, x2, y2 = _unpack(boxes)
        return _corners(boxes, size[1] - x2, size[0] - y2, size[1] - x1, size[0] - y1)

    def graph(self, nodes: GraphNodes, x: str, setting: Any, pre: dict) -> str:
        from ttc.testtime import tta_graph

        return tta_graph.flip(nodes, x, [2, 3])
'''),
    ("ttc/testtime/transforms.py", "Identity, HorizontalFlip, VerticalFlip,", " BothFlips,"),
    ("ttc/options/tta.py", '"identity, hflip (flip), vflip, ', "hvflip, "),
]
DETECTION_METRIC = [  # COCO's AP at IoU .9 (the ninth of its ten thresholds)
    ("ttc/tasks/detect/metrics.py", '"map75": mean_or_zero(precision[5, :, :, 0]),\n',
     '        "map90": mean_or_zero(precision[8, :, :, 0]),\n'),
    ("ttc/tasks/detect/report.py", '("map75", "mAP@.75"),', ' ("map90", "mAP@.9"),'),
]
SERVED_FORMAT = [  # each served box also says its area in pixels
    ("ttc/tasks/detect/served.py", "{key: record[key] for key in BOX_KEYS}",
     ' | {"area": round((record["x2"] - record["x1"]) * (record["y2"] - record["y1"]), 2)}'),
]
ROWS = {"a TTA transform": TTA_TRANSFORM, "a detection metric": DETECTION_METRIC,
        "the served output format": SERVED_FORMAT}


def table_row(what: str) -> str:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    table = text[text.index("## Where do I change X"):text.index("## What it does")]
    found = re.search(rf"^\| {re.escape(what)} \|(.*)$", table, re.M)
    assert found, f"design.md's table has no row for {what!r}"
    return found.group(1)


@pytest.mark.parametrize("what", sorted(ROWS))
def test_each_change_touches_only_the_files_its_row_names(what):
    row = table_row(what)
    for name, _, _ in ROWS[what]:
        assert f"`{name}`" in row, f"{what}: the change edits {name}, which the row does not name"


@pytest.fixture(scope="module")
def changed(tmp_path_factory) -> Path:
    """The copy with the three changes, and a detector trained there by pipeline.py with the
    new transform as its TTA."""
    repo = copy_repository(tmp_path_factory.mktemp("repo"))
    for edits in ROWS.values():
        apply_edits(repo, edits)
    done = run(repo, "pipeline.py", "--model_type", "object_detector", "--dataset_path",
               "builtin:digit_boxes", "--epochs", "2", "--tta", "true", "--tta_transforms",
               "hvflip", "--output_model", "runs/boxes/model.onnx", "--report_json",
               "runs/boxes/report.json", "--plots", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    (repo / "summary.txt").write_text(done.stdout)
    return repo


def test_the_new_tta_transform_runs_in_the_detector_s_tta(changed):
    report = json.loads((changed / "runs/boxes/report.json").read_text())
    assert "hvflip" in json.dumps(report["tta"]), report["tta"]
    assert report["tta"]["map"] is not None


def test_the_new_metric_is_in_the_report_and_the_summary(changed):
    evaluation = json.loads((changed / "runs/boxes/report.json").read_text())["evaluation"]
    assert 0.0 <= evaluation["map90"] <= evaluation["map75"] + 1e-9
    assert re.search(r"^\s+mAP@\.9\s+\d", (changed / "summary.txt").read_text(), re.M)


def test_serve_answers_in_the_new_format(changed, tmp_path):
    from ttc.tasks.detect.canvases import write_coco_canvases

    write_coco_canvases(tmp_path / "images", tmp_path / "instances.json", 4, size=64, seed=3)
    images = sorted((tmp_path / "images").rglob("*.png"))
    boxes = []
    with serving(changed / "runs/boxes/model.onnx", logs=tmp_path, cwd=changed) as server:
        for image in images:
            answer = server.post("/predict/image",
                                 files={"file": (image.name, image.read_bytes())})
            assert answer.status_code == 200, answer.text
            [prediction] = answer.json()["predictions"]
            boxes += prediction["boxes"]
    assert boxes, "the detector found no box to check the format on"
    for box in boxes:
        assert box["area"] == round((box["x2"] - box["x1"]) * (box["y2"] - box["y1"]), 2), box
