"""docs/design.md's "add a model type" is true: a copy of the repository gets a throwaway type
(tests/throwaway_type/signal: 1-D signals and a 1-D CNN) as a folder of its own, one line in
ttc/tasks/registry.py and its records in ttc/serving/manifest_schema.py, and nothing else; then
pipeline.py trains, exports, quantizes and reports it, inference.py predicts a file with it and
serve.py answers for it, each as a user runs them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import CLI_ENV, REPO, fork_server
from test_serve import serving

THROWAWAY = REPO / "tests" / "throwaway_type" / "signal"
LENGTH = 16

# The registry line and the manifest records: what design.md's row says a new type adds outside
# its folder. Each edit is (file, anchor, text put after the anchor).
EDITS = [
    ("ttc/tasks/registry.py", "from ttc.tasks import detect, image, segment, tabular, text\n",
     "from ttc.tasks import signal\n"),
    ("ttc/tasks/registry.py", "detect.TASK", ", signal.TASK"),
    ("ttc/serving/manifest_schema.py", "PREPROCESSING = {  # by kind; the text kind by tokenizer "
     "(\"words\": ours)\n",
     '    "signal": record({"columns": list_of(record({"name": STRING, "type": text(("numeric",))},'
     ' required=("name", "type")), min_length=1), "feature_names": list_of(STRING, min_length=1),'
     ' "median": list_of(FINITE), "mean": list_of(FINITE), "std": list_of(POSITIVE)},'
     ' required=("columns", "feature_names")),\n'),
    ("ttc/serving/manifest_schema.py", "NETWORKS = {\n",
     '    "SignalCNN": record({"length": SIZE, "channels": SIZE, "dropout": DROPOUT},'
     ' required=("length",)),\n'),
    ("ttc/serving/manifest_schema.py", "INPUT_FORMS = {", '"signal": ("float32", 3), '),
    ("ttc/serving/manifest_schema.py", "NETWORK_FORMS = {", '"SignalCNN": "signal", '),
]


def copy_repository(dest: Path) -> Path:
    """The repository's files (what git tracks and what it would add, but tests/, bench/ and
    docs/) under `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file() and not name.startswith(("tests/", "bench/", "docs/")):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def apply_edits(repo: Path, edits: list[tuple[str, str, str]]) -> None:
    """Each (file, anchor, text): the text put after the anchor, which must occur once."""
    for name, anchor, added in edits:
        path = repo / name
        source = path.read_text(encoding="utf-8")
        assert source.count(anchor) == 1, f"{name}: the anchor {anchor!r} moved; update the edit"
        path.write_text(source.replace(anchor, anchor + added), encoding="utf-8")


def copy_with_the_new_type(dest: Path) -> Path:
    """The repository under `dest` with the throwaway type added as EDITS says."""
    copy_repository(dest)
    shutil.copytree(THROWAWAY, dest / "ttc" / "tasks" / "signal")
    apply_edits(dest, EDITS)
    return dest


def signals(count: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """Sines and square waves of random phase and frequency, with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(LENGTH)
    phase = rng.uniform(0, 2 * np.pi, (count, 1))
    frequency = rng.uniform(0.3, 0.8, (count, 1))
    wave = np.sin(frequency * t + phase)
    square = rng.random(count) < 0.5
    wave[square] = np.sign(wave[square])
    wave += rng.normal(0, 0.05, wave.shape)
    return wave.astype(np.float32), ["square" if s else "sine" for s in square]


def write_signals(path: Path, count: int, seed: int, labelled: bool = True) -> Path:
    wave, labels = signals(count, seed)
    header = ",".join(f"s{i}" for i in range(LENGTH)) + (",label" if labelled else "")
    rows = [",".join(f"{v:.5f}" for v in row) + (f",{label}" if labelled else "")
            for row, label in zip(wave, labels)]
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def run(repo: Path, *args: str, timeout: int = 600):
    """`python SCRIPT ARGS` in the copy, with a bare environment: through the fork server
    (which preloads libraries only, so the copy's own package is what the run imports)."""
    env = {**CLI_ENV, "PATH": "/usr/bin:/bin", "HOME": str(repo)}
    server = fork_server()
    if server:
        return server.run([str(repo / args[0]), *args[1:]], repo, env, timeout)
    return subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def with_signal(tmp_path_factory) -> Path:
    """The copy, its data and its bundle trained by pipeline.py."""
    repo = copy_with_the_new_type(tmp_path_factory.mktemp("repo"))
    write_signals(repo / "signals.csv", 400, seed=0)
    done = run(repo, "pipeline.py", "--model_type", "signal_classifier", "--dataset_path",
               "signals.csv", "--epochs", "20", "--quantize", "dynamic",
               "--output_model", "runs/signal/model.onnx", "--report_json",
               "runs/signal/report.json")
    assert done.returncode == 0, done.stderr[-3000:]
    return repo


def test_pipeline_trains_exports_quantizes_and_reports_the_new_type(with_signal):
    report = json.loads((with_signal / "runs/signal/report.json").read_text())
    assert report["dataset"]["model_type"] == "signal_classifier"
    assert report["dataset"]["length"] == LENGTH
    assert report["inference"]["accuracy"] > 0.9, report["inference"]
    manifest = json.loads((with_signal / "runs/signal/model.json").read_text())
    assert manifest["model_type"] == "signal_classifier"
    assert manifest["input"]["shape"] == ["batch", 1, LENGTH]
    session = ort.InferenceSession(str(with_signal / "runs/signal/model.onnx"),
                                   providers=["CPUExecutionProvider"])
    wave, labels = signals(50, seed=7)
    probabilities = session.run(["probabilities"], {"signal": wave[:, None, :]})[0]
    predicted = [manifest["labels"][k] for k in probabilities.argmax(1)]
    assert np.mean([p == t for p, t in zip(predicted, labels)]) > 0.9


def test_inference_predicts_a_file_with_the_new_type(with_signal):
    write_signals(with_signal / "new.csv", 30, seed=3, labelled=False)
    done = run(with_signal, "inference.py", "--model", "runs/signal/model.onnx",
               "--input", "new.csv", "--output", "runs/signal/predictions.csv")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (with_signal / "runs/signal/predictions.csv").read_text().splitlines()
    assert len(lines) == 31
    _, labels = signals(30, seed=3)
    label_at = lines[0].split(",").index("label")
    predicted = [line.split(",")[label_at] for line in lines[1:]]
    assert np.mean([p == t for p, t in zip(predicted, labels)]) > 0.9


def test_serve_answers_for_the_new_type(with_signal, tmp_path):
    wave, labels = signals(10, seed=5)
    rows = [{f"s{i}": float(v) for i, v in enumerate(row)} for row in wave]
    with serving(with_signal / "runs/signal/model.onnx", logs=tmp_path, cwd=with_signal) as server:
        predicted = [p["label"] for p in server.predict(rows)]
    assert np.mean([p == t for p, t in zip(predicted, labels)]) >= 0.9
