"""Issue 64 item 6: a failed export keeps the training. pipeline.py whose export fails (here a
numeric check held to --validate_atol 1e-300, which ONNX Runtime's float32 rounding never
meets) exits 4 leaving what train.py leaves, model.pt and model.json marked `"exported":
false`, and its one error line names the export.py command that exports them again with other
flags, without training; inference.py and serve.py refuse the unexported folder in one line; a
bundle that was already at that path is left as it was, the weights kept beside it."""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_clean_failure, run_cli

pytestmark = pytest.mark.xdist_group("failed_export")  # one worker trains the module's runs

AGAIN = "to export them again without training: "


def write_iris_csv(path: Path) -> Path:
    from sklearn.datasets import load_iris

    iris = load_iris()
    rows = ["f0,f1,f2,f3,label"] + [",".join([*map(str, x), str(iris.target_names[y])])
                                     for x, y in zip(iris.data, iris.target)]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def failing_run(data: Path, model: Path):
    return run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path", data,
                   "--epochs", "1", "--validate_atol", "1e-300", "--output_model", model,
                   "--no_progress", "true")


def command_in(line: str) -> list[str]:
    """The export.py command an error line names, as argv."""
    return shlex.split(line.split(AGAIN, 1)[1].split(" (this run:", 1)[0])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("failed_export")
    data = write_iris_csv(out / "iris.csv")
    model = out / "run" / "model.onnx"
    return {"run": failing_run(data, model), "model": model, "data": data, "out": out}


@pytest.fixture(scope="module")
def reexported(failed) -> dict:
    """The kept weights, copied, exported by the command the error names with a tolerance
    that passes."""
    folder = failed["out"] / "reexported"
    shutil.copytree(failed["model"].parent, folder)
    argv = command_in(failed["run"].error_lines()[0])
    argv[argv.index("--output_model") + 1] = str(folder / "model.onnx")
    argv[argv.index("VALUE")] = "1e-3"
    assert argv[:2] == ["python", "export.py"]
    return {"run": run_cli("export.py", *argv[2:]), "model": folder / "model.onnx",
            "argv": argv}


def test_a_failed_export_keeps_the_weights_and_names_the_export_command(failed):
    run, model = failed["run"], failed["model"]
    assert_clean_failure(run, 4, "numeric check failed", "raise --validate_atol",
                         f"the trained weights are kept in {model.parent}", AGAIN)
    argv = command_in(run.error_lines()[0])
    assert argv[:4] == ["python", "export.py", "--output_model", str(model)]
    # the data is not built in: export.py must be told where it is, as pipeline.py was
    assert argv[argv.index("--dataset_path") + 1] == str(failed["data"])
    assert argv[argv.index("--validate_atol") + 1] == "VALUE"  # the flag the error says to raise
    assert "(this run: --validate_atol 1e-300)" in run.error_lines()[0]
    assert sorted(p.name for p in model.parent.iterdir()) == ["model.json", "model.pt"]
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["exported"] is False and manifest["export"] is None
    assert manifest["files"]["onnx"] is None
    assert manifest["files"]["sha256"]["weights"] == sha256(model.with_suffix(".pt"))


def test_export_py_exports_the_kept_weights_with_other_flags(reexported):
    import onnxruntime as ort

    run, model = reexported["run"], reexported["model"]
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--validate_atol" in reexported["argv"]
    manifest = json.loads(model.with_suffix(".json").read_text())
    assert manifest["exported"] is True and manifest["export"]["validate_atol"] == 1e-3
    assert manifest["files"]["sha256"]["onnx"] == sha256(model)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    probabilities = session.run(["probabilities"],
                                {"features": np.zeros((2, 4), np.float32)})[0]
    assert probabilities.shape == (2, 3)
    served = run_cli("inference.py", "--model", model, "--dataset_path",
                     write_iris_csv(model.parent / "iris.csv"))
    assert served.returncode == 0, served.stderr[-2000:]


@pytest.mark.parametrize("script", ["inference.py", "serve.py"])
def test_the_unexported_weights_are_refused_in_one_line(failed, script):
    model = failed["model"]
    run = run_cli(script, "--model", model)
    assert_clean_failure(run, 4, "has no exported ONNX graph yet",
                         f"python export.py --output_model {model}")


def test_a_bundle_already_there_is_left_as_it_was(failed, reexported):
    assert reexported["run"].returncode == 0, reexported["run"].stderr[-2000:]
    folder = failed["out"] / "kept_beside"
    shutil.copytree(reexported["model"].parent, folder)
    before = {p.name: sha256(p) for p in folder.glob("model.*")}
    run = failing_run(failed["data"], folder / "model.onnx")
    assert_clean_failure(run, 4, f"the bundle already at {folder / 'model.onnx'} was left as "
                         "it was", "model.unexported.pt")
    assert {p.name: sha256(p) for p in folder.glob("model.*")
            if "unexported" not in p.name} == before
    kept = folder / "model.unexported.onnx"
    argv = command_in(run.error_lines()[0])
    assert argv[argv.index("--output_model") + 1] == str(kept)
    manifest = json.loads(kept.with_suffix(".json").read_text())
    assert manifest["exported"] is False and manifest["files"]["weights"] == "model.unexported.pt"
    served = run_cli("inference.py", "--model", folder / "model.onnx", "--dataset_path",
                     failed["data"])
    assert served.returncode == 0, served.stderr[-2000:]  # the old bundle still serves


# ------------------------------------------------------------------- without training


def parsed(*argv: str):
    from config import build_parser, parse_config

    return parse_config(build_parser("pipeline", "test", required=["dataset_path",
                                                                   "output_model"]), list(argv))


def test_the_command_repeats_the_runs_export_flags_and_asks_for_the_raised_one(tmp_path):
    from ttc.convert.failure import weights_kept
    from ttc.options.stages import ExportOptions, view_of
    from ttc.serving.bundle import BundlePaths
    from utils import ExportError

    model = tmp_path / "a folder" / "model.onnx"
    config = parsed("--model_type", "object_detector", "--dataset_path", "builtin:digit_boxes",
                    "--output_model", str(model), "--score_threshold", "0.1", "--tta", "true",
                    "--opset", "17", "--report_json", str(tmp_path / "r.json"), "--epochs", "2")
    paths = BundlePaths.from_model_path(model)
    error = weights_kept(ExportError("numeric check failed", "train longer, or raise "
                                     "--score_threshold above them",
                                     raise_flags=("score_threshold",)),
                         view_of(config, ExportOptions), paths, paths)  # as pipeline.py's
    line = error.one_line()
    assert line.startswith("numeric check failed; train longer, or raise --score_threshold "
                           f"above them; the trained weights are kept in {model.parent}; ")
    argv = command_in(line)
    assert argv == ["python", "export.py", "--output_model", str(model), "--opset", "17",
                    "--tta", "true", "--score_threshold", "VALUE"]  # builtin: data not named
    assert line.endswith("(this run: --score_threshold 0.1)")


def test_diverged_weights_are_kept_without_a_command(tmp_path):
    from ttc.convert.checking import RETRAIN
    from ttc.convert.failure import weights_kept
    from ttc.serving.bundle import BundlePaths
    from utils import ExportError

    model = tmp_path / "model.onnx"
    config = parsed("--dataset_path", "builtin:digits", "--output_model", str(model))
    paths = BundlePaths.from_model_path(model)
    line = weights_kept(ExportError("non-finite outputs", f"a tolerance cannot fix this: "
                                    f"{RETRAIN}"), config, paths, paths).one_line()
    assert line.endswith(f"{RETRAIN}; the trained weights are kept in {tmp_path}")


@pytest.mark.parametrize("manifest, beside", [
    (None, False),  # nothing there
    ({"format": "ttc-model-bundle", "files": {"onnx": None}}, False),  # train.py's weights
    ({"format": "ttc-model-bundle", "files": {"onnx": "model.onnx"}}, True),  # a bundle
    ("not json", True),  # a file that is no manifest of ours: left alone
])
def test_the_weights_go_beside_a_bundle_that_is_there(tmp_path, manifest, beside):
    from ttc.convert.failure import kept_paths
    from ttc.serving.bundle import BundlePaths

    paths = BundlePaths.from_model_path(tmp_path / "model.onnx")
    if manifest is not None:
        paths.manifest.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    kept = kept_paths(paths)
    assert (kept.weights.name, kept.manifest.name) == (
        ("model.unexported.pt", "model.unexported.json") if beside else
        ("model.pt", "model.json"))


def test_a_second_bundle_beside_is_left_as_it_was_too(tmp_path):
    from ttc.convert.failure import kept_paths
    from ttc.serving.bundle import BundlePaths

    exported = json.dumps({"format": "ttc-model-bundle", "files": {"onnx": "x.onnx"}})
    for name in ("model.json", "model.unexported.json"):
        (tmp_path / name).write_text(exported)
    kept = kept_paths(BundlePaths.from_model_path(tmp_path / "model.onnx"))
    assert kept.weights == tmp_path / "model.unexported-2.pt"


def test_a_model_def_run_trusts_its_own_file_on_export(tmp_path):
    from ttc.convert.failure import export_command
    from ttc.serving.bundle import BundlePaths

    network = tmp_path / "net.py"
    network.write_text("def build(num_classes, **_):\n    raise NotImplementedError\n")
    config = parsed("--dataset_path", "builtin:digits", "--output_model",
                    str(tmp_path / "model.onnx"), "--model_def", str(network))
    argv = shlex.split(export_command(config, BundlePaths.from_model_path(
        tmp_path / "model.onnx"), ()))
    assert argv[-2:] == ["--trust_model_code", "true"]


def test_the_manifest_field_is_checked(failed):
    from ttc.serving.manifest_schema import agreement_problem, manifest_problem

    manifest = json.loads(failed["model"].with_suffix(".json").read_text())
    assert manifest_problem(manifest) is None and agreement_problem(manifest) is None
    assert manifest_problem({**manifest, "exported": "no"}) == \
        "exported must be true or false, not 'no'"
    named = {**manifest, "files": {**manifest["files"], "onnx": "model.onnx"}}
    assert agreement_problem(named) == "exported is false, yet files.onnx names a graph"
    assert agreement_problem({**manifest, "exported": True}) == \
        "exported is true, yet files.onnx names no graph"
    del manifest["exported"]  # a bundle from before the field
    assert manifest_problem(manifest) is None and agreement_problem(manifest) is None
