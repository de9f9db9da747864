"""A segmenter's batch inference on Ray (`inference.py --input ... --engine ray`, issue 43 item
6) against the local engine: a tiny segmenter bundle predicts a folder (images of several sizes
and modes, subfolders, two images sharing a stem, a corrupt file) with each engine; the masks,
overlays, summary and error rows are the same files, the exit code the same, and the Ray run's
report has its `engine` section. Path checks fail before Ray is imported.

Like tests/test_ray.py's, the Ray run here joins the test worker's running head node (conftest's
ray_cluster, by --ray_address): the tests share that module's xdist worker."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_clean_failure, run_cli
from test_ray import ray_failing_on_import
from ttc.tasks.segment.canvases import write_digit_canvases
from utils import EXIT_DATA, EXIT_USAGE

pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def canvases_bundle(tmp_path_factory) -> dict:
    """A segmenter trained one epoch on 40 canvases of 16x16 (what it learned does not matter:
    its masks hold several classes), and the canvases."""
    root = tmp_path_factory.mktemp("segment_ray")
    data = write_digit_canvases(root / "canvases", 40, size=16)
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path", data,
                  "--epochs", "1", "--plots", "none", "--output_model", model, "--no_progress",
                  "true")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": model, "data": data}


def new_images(canvases: Path, folder: Path) -> Path:
    """13 images from the canvases: at their size and resized, grayscale and RGB, PNG and JPEG,
    in a subfolder, two of one stem (x.png, x.jpg); and a corrupt file."""
    sources = sorted((canvases / "images").iterdir())[:11]
    for k, source in enumerate(sources):
        with Image.open(source) as img:
            img = img.convert("RGB" if k % 2 else "L")
            if k % 3 == 1:
                img = img.resize((23 + k, 17))
            where = folder / ("sub" if k % 2 else "") / f"{k}.png"
            where.parent.mkdir(parents=True, exist_ok=True)
            img.save(where)
    shutil.copy(folder / "sub" / "1.png", folder / "sub" / "x.png")
    with Image.open(folder / "sub" / "3.png") as img:
        img.save(folder / "sub" / "x.jpg", quality=95)
    (folder / "sub" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return folder


def files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_masks_and_summary_on_ray_are_the_local_engine_s(canvases_bundle, ray_cluster,
                                                         tmp_path):
    folder = new_images(canvases_bundle["data"], tmp_path / "new")
    reports = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        extra = ["--engine", "ray", "--num_workers", "2", "--worker_batch_size", "3",
                 "--ray_address", ray_cluster] if engine == "ray" else []
        run = run_cli("inference.py", "--model", canvases_bundle["model"], "--input", folder,
                      "--output", out / "masks.csv", "--overlay", "true", "--errors",
                      out / "errors.csv", "--batch_size", "2", "--no_progress", "true",
                      "--json", "true", *extra)
        # the corrupt image: exit 3 with everything written, as locally
        assert_clean_failure(run, EXIT_DATA, "1 of 14 images could not be segmented")
        reports[engine] = json.loads(run.stdout)  # nothing of Ray's on stdout
    local, ray = tmp_path / "local", tmp_path / "ray"
    for name in ("masks.csv", "errors.csv"):
        assert (local / name).read_text() == (ray / name).read_text(), name
    for name in ("masks_masks", "masks_overlays"):
        assert files_under(local / name) == files_under(ray / name), name
    masks = files_under(ray / "masks_masks")
    assert len(masks) == 13 and {"sub/x.png", "sub/x.jpg.png"} <= set(masks)
    with Image.open(ray / "masks_masks" / "sub" / "7.png") as mask:  # at the image's own size
        assert mask.size == (30, 17) and len(np.unique(np.asarray(mask))) > 1
    assert (ray / "errors.csv").read_text().splitlines()[1].startswith("sub/broken.png,")
    engine = reports["ray"]["engine"]
    assert engine["engine"] == "ray" and engine["workers"] == 2 and engine["rows"] == 14
    assert engine["failed_rows"] == 1 and engine["worker_batch_size"] == 4  # whole batches of 2
    assert engine["threads_per_worker"] == 1 and engine["first_batch_s"] > 0
    same = ("images", "predicted", "errors", "class_pixel_shares")
    assert {k: reports["ray"]["predictions"][k] for k in same} == \
        {k: reports["local"]["predictions"][k] for k in same}


def test_paths_are_checked_before_ray_starts(canvases_bundle, tmp_path):
    folder = new_images(canvases_bundle["data"], tmp_path / "new")
    env, marker = ray_failing_on_import(tmp_path)
    run = run_cli("inference.py", "--model", canvases_bundle["model"], "--input", folder,
                  "--output", tmp_path / "masks.csv", "--mask_dir", folder / "masks",
                  "--engine", "ray", extra_env=env)
    assert_clean_failure(run, EXIT_USAGE, "inside it")
    assert not marker.exists() and not (tmp_path / "masks.csv").exists()
