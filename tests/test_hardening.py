"""Hardening: manifests and models that must not be trusted, a full disk, runs that are killed
or stopped, and threads sharing sessions."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import REPO, assert_clean_failure, run_cli, write_image_folder

BUNDLE_FILES = ("model.onnx", "model.json", "model.pt", "model.bn.onnx", "model.mc.onnx")


def copy_bundle(digits_bundle, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in BUNDLE_FILES:
        shutil.copy(digits_bundle["dir"] / name, folder / name)
    return folder / "model.onnx"


def hashes(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in BUNDLE_FILES}


def edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / "model.json").read_text())
    change(manifest)
    (folder / "model.json").write_text(json.dumps(manifest))


def replace_graph(folder: Path, data: bytes) -> None:
    (folder / "model.onnx").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    edit_manifest(folder, lambda m: m["files"]["sha256"].update(onnx=digest))


@pytest.mark.parametrize("change,phrase", [
    (lambda m: m.update(extra_key=1), "unknown keys ['extra_key']"),
    (lambda m: m.update(labels="0123456789"), "labels must be a list"),
    (lambda m: m.update(labels=["a"]), "labels must be a list of 2 or more"),
    (lambda m: m.update(model_type="audio_classifier"), "model_type 'audio_classifier'"),
    (lambda m: m["preprocessing"].update(kind="text"), "must be a image preprocessing"),
    (lambda m: m["files"].update(onnx="../other/model.onnx"), "bare file name"),
    (lambda m: m["files"]["sha256"].update(onnx="not-a-hash"), "not a sha256"),
    (lambda m: m.pop("architecture"), "'architecture' is missing"),
    (lambda m: m.update(format_version=99), "format version 99"),
])
def test_a_malformed_manifest_is_refused_before_use(digits_bundle, tmp_path, change, phrase):
    model = copy_bundle(digits_bundle, tmp_path)
    edit_manifest(tmp_path, change)
    assert_clean_failure(run_cli("inference.py", "--model", model), 4, phrase)


def test_truncated_and_foreign_graphs_fail_cleanly(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path)
    replace_graph(tmp_path, model.read_bytes()[:5000])  # manifest updated: only ORT can tell
    assert_clean_failure(run_cli("inference.py", "--model", model), 4, "cannot load",
                         "truncated")
    replace_graph(tmp_path, os.urandom(3000))
    assert_clean_failure(run_cli("inference.py", "--model", model), 4, "cannot load")


def test_external_data_outside_the_model_folder_is_refused(digits_bundle, tmp_path):
    model_path = copy_bundle(digits_bundle, tmp_path / "bundle")
    (tmp_path / "secret.bin").write_bytes(np.zeros(64, np.float32).tobytes())
    model = onnx.load(str(model_path))
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    del weight.float_data[:]
    weight.data_location = onnx.TensorProto.EXTERNAL
    del weight.external_data[:]
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    replace_graph(tmp_path / "bundle", model.SerializeToString())
    run = run_cli("inference.py", "--model", model_path)
    assert_clean_failure(run, 4, "outside", "'../secret.bin'")


def limited_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    return apply


def test_a_full_disk_fails_cleanly_and_keeps_the_previous_bundle(digits_bundle, tmp_path):
    model = copy_bundle(digits_bundle, tmp_path)
    before = hashes(tmp_path)
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model", model,
                  "--epochs", "1", "--no_progress", "true",
                  preexec_fn=limited_file_size(100_000))
    assert_clean_failure(run, 5, "cannot read or write", "File too large")
    assert hashes(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def wait_for(predicate, timeout: float = 300, step: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def as_from_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it: a runner started in the background (nohup, `&`)
    hands its children SIGINT ignored, and a run that inherits that rightly keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_run_stopped_or_killed_in_training_leaves_the_bundle(digits_bundle, tmp_path, sig):
    """SIGTERM and SIGINT: exit 130, temporary files removed. SIGKILL: the bundle unchanged."""
    model = copy_bundle(digits_bundle, tmp_path)
    before = hashes(tmp_path)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(REPO / "pipeline.py"), "--dataset_path",
                                 "builtin:digits", "--output_model", str(model), "--epochs",
                                 "200"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=as_from_a_terminal)
        assert wait_for(lambda: "epoch 2/200" in log.read_text())
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    assert hashes(tmp_path) == before
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        return
    assert code == 130 and log.read_text().strip().splitlines()[-1].endswith("interrupted")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_sigkill_while_the_bundle_is_written_leaves_old_or_new_never_a_mix(digits_bundle,
                                                                         tmp_path):
    model = copy_bundle(digits_bundle, tmp_path)
    before = hashes(tmp_path)
    proc = subprocess.Popen([sys.executable, str(REPO / "pipeline.py"), "--dataset_path",
                             "builtin:digits", "--output_model", str(model), "--epochs", "1",
                             "--seed", "3", "--no_progress", "true"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = wait_for(lambda: any(p.name.endswith(".tmp") for p in tmp_path.iterdir()),
                      step=0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    after = hashes(tmp_path)
    if staged and after == before:  # killed while staging: nothing was touched
        return
    # killed after every file was staged: the new bundle is whole and consistent
    assert all(after[n] != before[n] for n in ("model.onnx", "model.json", "model.pt"))
    run = run_cli("inference.py", "--model", model)
    assert run.returncode == 0, run.stderr[-2000:]


def in_threads(work, count: int) -> None:
    """work(0) ... work(count - 1), each in its own thread, all at once."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_threads_sharing_a_session_get_single_threaded_results(digits_bundle):
    from sklearn.datasets import load_digits

    x = (load_digits().images / 16.0).astype(np.float32)[:, None]
    session = ort.InferenceSession(str(digits_bundle["model"]),
                                   providers=["CPUExecutionProvider"])
    batches = [x[i:i + 50] for i in range(0, 400, 50)]
    expected = [session.run(["probabilities"], {"image": b})[0] for b in batches]
    results: dict[int, list] = {}

    def work(k: int) -> None:
        order = list(range(len(batches)))[k:] + list(range(len(batches)))[:k]
        results[k] = [(i, session.run(["probabilities"], {"image": batches[i]})[0])
                      for _ in range(5) for i in order]

    in_threads(work, 4)
    for k in range(4):
        for i, got in results[k]:
            np.testing.assert_array_equal(got, expected[i])


def test_test_time_training_in_one_thread_never_leaks_into_another(digits_bundle):
    from sklearn.datasets import load_digits

    from ttc.inputs.shifts import corrupt
    from ttc.testtime.ttt import AdaptationGraph, adapt_and_predict

    x = (load_digits().images / 16.0).astype(np.float32)[:256, None]
    graph = AdaptationGraph(onnx.load(str(digits_bundle["dir"] / "model.bn.onnx")),
                            lambda m: ort.InferenceSession(m, providers=["CPUExecutionProvider"]))
    data = [x, corrupt(x, "contrast", 4, {"kind": "image"}, 0),
            corrupt(x, "gaussian_noise", 4, {"kind": "image"}, 0), x[::-1].copy()]
    modes = ["online", "episodic", "online", "episodic"]
    expected = [adapt_and_predict(graph, "bn", d, 32, m, 16, 0).probabilities
                for d, m in zip(data, modes)]
    got: dict[int, np.ndarray] = {}

    def work(k: int) -> None:
        for _ in range(3):
            got[k] = adapt_and_predict(graph, "bn", data[k], 32, modes[k], 16, 0).probabilities

    in_threads(work, 4)
    for k in range(4):
        np.testing.assert_array_equal(got[k], expected[k])


def test_a_decompression_bomb_is_an_error_not_a_decode(digits_bundle, tmp_path):
    from PIL import Image

    folder = write_image_folder(tmp_path / "new", classes=(1,), per_class=3)
    Image.new("1", (12_000, 12_000)).save(folder / "1" / "bomb.png")  # 144 Mpx, a tiny file
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--input", folder,
                  "--output", tmp_path / "p.csv", "--errors", tmp_path / "e.csv")
    assert_clean_failure(run, 3, "1 of 4 rows")
    reason = (tmp_path / "e.csv").read_text()
    assert "bomb.png" in reason and "decompression bomb" in reason.lower()


def test_labels_unseen_at_training_exit_3(digits_bundle, tmp_path):
    folder = write_image_folder(tmp_path / "data", classes=(3, 4), per_class=12)
    (folder / "4").rename(folder / "four")
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--dataset_path", folder)
    assert_clean_failure(run, 3, "labels the model was not trained on", "['four']")
