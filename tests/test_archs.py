"""--arch: each network trains, exports, validates and runs through the later stages; padding
never changes a text prediction; old bundles without the field still run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from conftest import assert_clean_failure, run_cli, topic_texts

ONE_EPOCH = ["--epochs", "1", "--no_progress", "true"]


@pytest.fixture(scope="module")
def texts_csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("archs") / "texts.csv"
    path.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in topic_texts()))
    return path


def padded_probabilities(model, manifest, texts: list[str], extra: int) -> np.ndarray:
    from ttc.inputs.preprocess import Tokenizer

    ids = Tokenizer.from_manifest(manifest["preprocessing"]).encode_batch(texts)
    ids = np.concatenate([ids, np.zeros((len(ids), extra), dtype=ids.dtype)], axis=1)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(["probabilities"], {"token_ids": ids})[0]


@pytest.mark.parametrize("arch,network", [("cnn", "TextCNN"), ("transformer", "TextTransformer")])
def test_text_archs_run_every_stage_and_ignore_padding(texts_csv, tmp_path, arch, network):
    out = tmp_path / arch
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", texts_csv,
                  "--arch", arch, *ONE_EPOCH, "--quantize", "dynamic", "--iterative",
                  "mc_dropout", "--iterations", "4", "--tta", "true", "--output_model",
                  out / "model.onnx", "--report_json", out / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["architecture"]["arch"] == arch == report["train"]["arch"]
    assert manifest["architecture"]["name"] == network == report["train"]["network"]
    assert report["export"]["padding_max_diff"] <= 1e-4
    assert report["quantize"]["mode"] == "dynamic" and report["iterative"] and report["tta"]
    texts = [t for t, _ in topic_texts()[:16]]
    plain = padded_probabilities(out / "model.onnx", manifest, texts, 0)
    padded = padded_probabilities(out / "model.onnx", manifest, texts, 300)  # past max_length
    np.testing.assert_allclose(padded, plain, atol=1e-5)


def test_tabular_resmlp_runs_every_stage(tmp_path):
    out = tmp_path / "resmlp"
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--arch", "resmlp", *ONE_EPOCH, "--quantize", "static",
                  "--ttt", "true", "--eval_shift", "feature_noise", "--output_model",
                  out / "model.onnx", "--report_json", out / "report.json")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["network"] == "TabularResMLP"
    assert report["ttt"]["clean"]["accuracy_bn"] is not None
    assert report["export"]["max_abs_diff"] <= 1e-4


def test_an_arch_of_another_model_type_or_ttt_without_batchnorm_is_refused(texts_csv, tmp_path):
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", texts_csv,
                  "--arch", "resmlp", "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "invalid --arch 'resmlp'", "bag, cnn, transformer")
    run = run_cli("pipeline.py", "--model_type", "text_classifier", "--dataset_path", texts_csv,
                  "--arch", "transformer", "--ttt", "--output_model", tmp_path / "m.onnx")
    assert_clean_failure(run, 2, "--arch transformer has none", "LayerNorm")


def test_the_arch_names_of_config_and_models_agree():
    """--arch's choices per model type (config, no torch) are the networks its entry builds."""
    from config import ARCHS
    from ttc.tasks.registry import task_for

    for model_type, names in ARCHS.items():
        task = task_for(model_type)
        assert task.default_arch == names[0]
        assert list(task.part("networks")) == list(names)


def test_a_bundle_from_before_arch_still_runs(digits_bundle, tmp_path):
    shutil.copytree(digits_bundle["dir"], tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "model.json").read_text())
    del manifest["architecture"]["arch"]
    (tmp_path / "old" / "model.json").write_text(json.dumps(manifest))
    run = run_cli("inference.py", "--model", tmp_path / "old" / "model.onnx", "--ttt", "true")
    assert run.returncode == 0, run.stderr[-2000:]
