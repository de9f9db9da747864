"""A detector's batch inference on Ray (`inference.py --input ... --engine ray`, issue 44 item
7) against the local engine: a tiny detector bundle predicts a folder (images of several sizes
and modes, subfolders, two images sharing a stem, a corrupt file) with each engine; the rows,
the COCO results and images files, the overlays and the error rows are the same bytes, the exit
code the same, and the Ray run's report has its `engine` section. Path checks fail before Ray is
imported.

Like tests/test_ray.py's, the Ray runs here join the test worker's running head node
(conftest's ray_cluster, by --ray_address): the tests share that module's xdist worker."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_clean_failure, run_cli
from test_ray import ray_failing_on_import
from test_segment_ray import files_under, new_images
from ttc.tasks.detect.canvases import write_yolo_canvases
from utils import EXIT_DATA, EXIT_USAGE

pytestmark = pytest.mark.xdist_group("ray")

RAY = ("--engine", "ray", "--num_workers", "2", "--worker_batch_size", "3")


@pytest.fixture(scope="module")
def boxes_bundle(tmp_path_factory) -> dict:
    """A detector trained one epoch on 40 YOLO canvases of 24x24 (what it learned does not
    matter: it finds many boxes of several classes), and the canvases."""
    root = tmp_path_factory.mktemp("detect_ray")
    data = write_yolo_canvases(root / "yolo", 40, size=24)
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "object_detector", "--dataset_path", data,
                  "--epochs", "1", "--plots", "none", "--output_model", model, "--no_progress",
                  "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": model, "data": data}


def detect(bundle: dict, folder: Path, out: Path, *flags: str):
    return run_cli("inference.py", "--model", bundle["model"], "--input", folder, "--batch_size",
                   "2", "--no_progress", "true", "--json", "true", "--output", out, *flags,
                   timeout=300)


def test_rows_overlays_and_errors_on_ray_are_the_local_engine_s(boxes_bundle, ray_cluster,
                                                                tmp_path):
    folder = new_images(boxes_bundle["data"], tmp_path / "new")
    reports = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        run = detect(boxes_bundle, folder, out / "dets.csv", "--overlay", "true", "--errors",
                     out / "errors.csv",
                     *((*RAY, "--ray_address", ray_cluster) if engine == "ray" else ()))
        # the corrupt image: exit 3 with everything written, as locally
        assert_clean_failure(run, EXIT_DATA, "1 of 14 images could not be predicted")
        reports[engine] = json.loads(run.stdout)  # nothing of Ray's on stdout
    local, ray = tmp_path / "local", tmp_path / "ray"
    for name in ("dets.csv", "errors.csv"):
        assert (local / name).read_bytes() == (ray / name).read_bytes(), name
    overlays = files_under(ray / "dets_overlays")
    assert overlays == files_under(local / "dets_overlays")
    assert len(overlays) == 13 and {"sub/x.png", "sub/x.jpg.png"} <= set(overlays)
    rows = (ray / "dets.csv").read_text().splitlines()
    assert len(rows) > 14 and len({row.split(",")[2] for row in rows[1:]}) > 2  # classes
    assert (ray / "errors.csv").read_text().splitlines()[1].startswith("sub/broken.png,")
    engine = reports["ray"]["engine"]
    assert engine["engine"] == "ray" and engine["workers"] == 2 and engine["rows"] == 14
    assert engine["failed_rows"] == 1 and engine["worker_batch_size"] == 4  # whole batches of 2
    assert engine["threads_per_worker"] == 1 and engine["first_batch_s"] > 0
    same = ("images", "predicted", "errors", "boxes", "images_without_detections",
            "boxes_per_class")
    assert {k: reports["ray"]["predictions"][k] for k in same} == \
        {k: reports["local"]["predictions"][k] for k in same}


def test_coco_results_on_ray_are_the_local_engine_s_and_paths_are_checked_first(
        boxes_bundle, ray_cluster, tmp_path):
    folder = new_images(boxes_bundle["data"], tmp_path / "new")
    for engine in ("local", "ray"):
        run = detect(boxes_bundle, folder, tmp_path / engine / "dets.json", "--output_format",
                     "coco", "--allow_errors", "true",
                     *((*RAY, "--ray_address", ray_cluster) if engine == "ray" else ()))
        assert run.returncode == 0, run.stderr[-3000:]
    for name in ("dets.json", "dets_images.json"):
        local, ray = (tmp_path / engine / name for engine in ("local", "ray"))
        assert local.read_bytes() == ray.read_bytes(), name
    results = json.loads((tmp_path / "ray" / "dets.json").read_text())
    images = json.loads((tmp_path / "ray" / "dets_images.json").read_text())["images"]
    assert len(images) == 14 and results and {r["image_id"] for r in results} < set(range(14))
    # an overlay folder inside the input: exit 2 before Ray is imported, nothing written
    env, marker = ray_failing_on_import(tmp_path)
    run = run_cli("inference.py", "--model", boxes_bundle["model"], "--input", folder,
                  "--output", folder / "dets.csv", "--overlay", "true", *RAY, extra_env=env)
    assert_clean_failure(run, EXIT_USAGE, "overlap")
    assert not marker.exists() and not (folder / "dets.csv").exists()
