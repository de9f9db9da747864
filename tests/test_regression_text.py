"""`--model_type text_regressor` through the CLIs (issue 67): one pipeline run on the built-in
review scores (texts with a numeric score), then its graph, inference.py --input and the report."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from conftest import run_cli


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("text_regress")
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "text_regressor", "--dataset_path",
                  "builtin:review_scores", "--epochs", "4", "--interval", "0.9",
                  "--output_model", model, "--report_json", root / "report.json",
                  "--no_progress", "true", "--plots", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"root": root, "model": model,
            "manifest": json.loads(model.with_suffix(".json").read_text()),
            "report": json.loads((root / "report.json").read_text())}


def test_the_text_graph_takes_word_ids_and_answers_a_number(bundle):
    manifest = bundle["manifest"]
    assert manifest["preprocessing"]["kind"] == "text_regression"
    assert manifest["input"]["name"] == "token_ids" and manifest["labels"] == ["target"]
    session = ort.InferenceSession(str(bundle["model"]), providers=["CPUExecutionProvider"])
    ids = np.array([[2, 3, 4, 0], [5, 0, 0, 0]], dtype=np.int64)
    prediction = session.run(None, {"token_ids": ids})[0]
    assert prediction.shape == (2,) and np.isfinite(prediction).all()


def test_the_review_scores_are_learned_and_the_interval_holds(bundle):
    evaluation = bundle["report"]["evaluation"]
    assert evaluation["r2"] > 0.3 and evaluation["verdict"].startswith("useful")
    assert evaluation["interval"]["coverage"] >= 0.7


def scored_rows(model: Path, texts: list[str], folder: Path) -> list[dict]:
    """`inference.py --input` on a CSV of `texts` (one `text` column): the rows it wrote."""
    given, out = folder / "reviews.csv", folder / "scores.csv"
    given.write_text("text\n" + "\n".join(texts) + "\n")
    run = run_cli("inference.py", "--model", model, "--input", given, "--output", out,
                  "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    with open(out, newline="") as handle:
        return list(csv.DictReader(handle))


def test_inference_input_ranks_graded_words(bundle, tmp_path: Path):
    rows = scored_rows(bundle["model"], ["great superb food and great view",
                                         "awful terrible slow service"], tmp_path)
    assert [set(r) for r in rows] == [{"id", "prediction", "lower", "upper"}] * 2
    assert float(rows[0]["prediction"]) > float(rows[1]["prediction"])


def test_requests_of_texts_of_different_lengths_are_answered_in_one_run(bundle):
    """serve.py's batcher joins several requests' rows into one run: each request gets what it
    gets alone."""
    from ttc.online.predictor import Predictor

    predictor = Predictor.load(bundle["model"])
    short = [{"text": "great"}]
    long = [{"text": "awful terrible slow service and a very very long wait for cold food"}]
    joined = predictor.predict_parts([(short, 1), (long, 1)])
    assert not any(isinstance(outcome, Exception) for outcome in joined), joined
    alone = [predictor.predict(rows)[0]["prediction"] for rows in (short, long)]
    assert [predictor.predictions(*outcome)[0]["prediction"] for outcome in joined] == \
        pytest.approx(alone, abs=1e-5)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, hf_model_dir) -> dict:
    """The review scores through `--arch hf:` (conftest's tiny BERT, random weights: trained
    from scratch here), its head of one output."""
    root = tmp_path_factory.mktemp("text_regress_hf")
    model = root / "run" / "model.onnx"
    run = run_cli("pipeline.py", "--model_type", "text_regressor", "--dataset_path",
                  "builtin:review_scores", "--arch", f"hf:{hf_model_dir}", "--epochs", "4",
                  "--learning_rate", "3e-3", "--batch_size", "16", "--interval", "0.9",
                  "--output_model", model, "--report_json", root / "report.json",
                  "--no_progress", "true", "--plots", "none")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": model, "manifest": json.loads(model.with_suffix(".json").read_text()),
            "report": json.loads((root / "report.json").read_text())}


def test_an_hf_network_answers_the_score_with_its_tokenizer(hf_run, tmp_path: Path):
    from ttc.inputs.preprocess import register_hf_tokenizer, text_graph_feed, text_tokenizer
    from ttc.serving.manifest_schema import agreement_problem, manifest_problem

    manifest, report = hf_run["manifest"], hf_run["report"]
    assert manifest_problem(manifest) is None and agreement_problem(manifest) is None
    assert manifest["architecture"]["name"] == "HFTextRegressor"
    assert manifest["architecture"]["num_classes"] == 1
    assert manifest["preprocessing"]["tokenizer"] == "huggingface"
    assert report["export"]["max_abs_diff"] < 1e-4  # ONNX against PyTorch, in target σ
    assert report["evaluation"]["r2"] > 0.1 and report["evaluation"]["verdict"].startswith(
        "useful")
    texts = ["great superb food and great view", "awful terrible slow service"]
    rows = scored_rows(hf_run["model"], texts, tmp_path)
    session = ort.InferenceSession(str(hf_run["model"]), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == manifest["preprocessing"]["graph_inputs"]
    pre = manifest["preprocessing"]
    register_hf_tokenizer(hf_run["model"].with_suffix(".tokenizer.json").read_text(),
                          pre["sha256"])
    ids = text_tokenizer(pre).encode_batch(texts)
    expected = session.run(["prediction"], text_graph_feed(
        ids, names, manifest["preprocessing"]["pad_id"]))[0]
    assert expected.shape == (2,)
    assert np.allclose([float(r["prediction"]) for r in rows], expected, atol=1e-4)
