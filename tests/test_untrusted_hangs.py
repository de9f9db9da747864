"""Untrusted bundles that hang ONNX Runtime: a graph with a Loop of 10^12 iterations ends at
--timeout_s (exit 124) and on SIGTERM or SIGINT (exit 130), promptly, with nothing half-written.

Two forms of the Loop: a body with nodes, which ONNX Runtime stops through the run's terminate
flag, and a body without nodes, which never checks that flag and is ended by the process's own
watcher after its grace period (utils.STOP_GRACE_S)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import REPO, assert_clean_failure, run_cli, write_image_folder

BUNDLE_FILES = ("model.onnx", "model.json", "model.pt", "model.bn.onnx", "model.mc.onnx")
TRIPS = 10**12
SECONDS_TO_STOP = 10  # after the timeout or the signal: a 2 s grace, and a busy 2-core machine


def looping_for_ever(model: onnx.ModelProto, body_nodes: bool) -> onnx.ModelProto:
    """`model` whose probabilities pass through a Loop of TRIPS iterations that hands them on
    unchanged: the output depends on the Loop, and the graph's inputs, outputs and metadata
    (the manifest's contract stamp) stay as exported."""
    producer = next(n for n in model.graph.node if "probabilities" in n.output)
    producer.output[list(producer.output).index("probabilities")] = "probabilities_in"
    nodes = [helper.make_node("Identity", ["cond"], ["cond_out"]),
             helper.make_node("Identity", ["carried"], ["carried_out"])] if body_nodes else []
    outputs = ("cond_out", "carried_out") if body_nodes else ("cond", "carried")
    body = helper.make_graph(
        nodes, "spin",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carried", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(outputs[0], TensorProto.BOOL, []),
         helper.make_tensor_value_info(outputs[1], TensorProto.FLOAT, None)])
    model.graph.node.extend([
        helper.make_node("Constant", [], ["trips"],
                         value=helper.make_tensor("trips", TensorProto.INT64, [], [TRIPS])),
        helper.make_node("Constant", [], ["go_on"],
                         value=helper.make_tensor("go_on", TensorProto.BOOL, [], [True])),
        helper.make_node("Loop", ["trips", "go_on", "probabilities_in"], ["probabilities"],
                         body=body)])
    onnx.checker.check_model(model)
    return model


def loop_bundle(digits_bundle: dict, folder: Path, body_nodes: bool) -> Path:
    """A copy of the digits bundle whose model.onnx loops for ever, its sha256 in the manifest
    recomputed as an attacker would."""
    folder.mkdir(parents=True)
    for name in BUNDLE_FILES:
        shutil.copy(digits_bundle["dir"] / name, folder / name)
    graph = looping_for_ever(onnx.load(str(folder / "model.onnx")), body_nodes)
    data = graph.SerializeToString()
    (folder / "model.onnx").write_bytes(data)
    manifest = json.loads((folder / "model.json").read_text())
    manifest["files"]["sha256"]["onnx"] = hashlib.sha256(data).hexdigest()
    (folder / "model.json").write_text(json.dumps(manifest))
    return folder / "model.onnx"


def temporary_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".", "tmp")))


BODIES = [pytest.param(True, id="terminate-flag"), pytest.param(False, id="ended-by-watcher")]


@pytest.mark.parametrize("body_nodes", BODIES)
def test_a_graph_that_loops_for_ever_ends_at_timeout_s(digits_bundle, tmp_path, body_nodes):
    model = loop_bundle(digits_bundle, tmp_path / "bundle", body_nodes)
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    # 5 s: time for the start (imports, the test split; 1.5 s unloaded) on a busy machine,
    # so that the timeout finds the run inside the Loop
    run = run_cli("inference.py", "--model", model, "--num_threads", "1", "--timeout_s", "5",
                  "--report_json", out / "report.json", timeout=60)
    assert time.monotonic() - started < 5 + SECONDS_TO_STOP
    assert_clean_failure(run, 124, "ran longer than --timeout_s 5 s",
                         "stopped inside ONNX Runtime's session.run")
    assert temporary_files(out) == [] and temporary_files(model.parent) == []
    if body_nodes:  # ONNX Runtime stopped: the run ended as usual, its report whole
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "error" and report["error"]["code"] == 124
    else:  # ended at once, saying so, and without a report
        assert "did not stop within 2 s" in run.stderr
        assert not (out / "report.json").exists()


def as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a runner in the background ignores SIGINT


@pytest.mark.parametrize("sig,body_nodes", [(signal.SIGTERM, True), (signal.SIGINT, True),
                                            (signal.SIGTERM, False)],
                         ids=["sigterm-flag", "sigint-flag", "sigterm-watcher"])
def test_a_signal_inside_onnx_runtime_ends_the_run(digits_bundle, tmp_path, sig, body_nodes):
    """Predicting new data on the Loop bundle: SIGTERM or SIGINT once the predictions are being
    written (ONNX Runtime runs the Loop) → exit 130 within seconds; the previous --output kept,
    no temporary file left, the report whole or absent."""
    model = loop_bundle(digits_bundle, tmp_path / "bundle", body_nodes)
    images = write_image_folder(tmp_path / "images", classes=(0, 1), per_class=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "preds.csv").write_text("the previous predictions\n")
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "inference.py"), "--model", str(model), "--input",
             str(images), "--output", str(out / "preds.csv"), "--report_json",
             str(out / "report.json"), "--num_threads", "1"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=as_from_a_terminal,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 60
            while not temporary_files(out) and time.monotonic() < deadline:
                time.sleep(0.05)  # the staged preds.csv appears as the predicting starts
            assert temporary_files(out), log.read_text()[-2000:]
            time.sleep(1.0)  # well inside the Loop
            proc.send_signal(sig)
            signalled = time.monotonic()
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
    assert time.monotonic() - signalled < SECONDS_TO_STOP
    assert code == 130, log.read_text()[-2000:]
    lines = log.read_text().strip().splitlines()
    assert lines[-1] == "inference.py: interrupted" and "Traceback" not in log.read_text()
    assert (out / "preds.csv").read_text() == "the previous predictions\n"
    assert temporary_files(out) == []
    if body_nodes:
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "error" and report["error"]["code"] == 130
    else:
        assert not (out / "report.json").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_timeout_s_must_be_a_number_of_seconds(digits_bundle, value):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--timeout_s", value,
                  timeout=60)
    assert run.returncode == 2 and "--timeout_s" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_a_run_within_its_timeout_is_unchanged(digits_bundle, tmp_path):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--num_threads", "1",
                  "--timeout_s", "300", "--report_json", tmp_path / "r.json", timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "ok" and report["inference"]["accuracy"] > 0.8
