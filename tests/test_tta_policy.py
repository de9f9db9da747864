"""--tta_transforms auto: greedy policy search over candidate views on the calibration slice
(ttc/testtime/tta_policy.py), its report, its CLIs and its refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_clean_failure, run_cli

IMAGE = {"kind": "image", "image_size": [5, 5], "channels": 1}
SHAPE = (1, 5, 5)


def linear_predict(seed: int = 3, classes: int = 4):
    """A fixed linear softmax classifier of 1x5x5 images: batch → probabilities."""
    weight = np.random.default_rng(seed).standard_normal((25, classes)).astype(np.float32) * 3

    def predict(x: np.ndarray) -> np.ndarray:
        logits = x.reshape(len(x), -1) @ weight
        e = np.exp(logits - logits.max(1, keepdims=True))
        return (e / e.sum(1, keepdims=True)).astype(np.float32)

    return predict


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, *SHAPE), dtype=np.float32)


def choose(predict, x, y, text, merge="mean", seed=11):
    from ttc.testtime.tta_policy import choose_policy

    return choose_policy(predict, text, IMAGE, merge, seed, (x, y), 16, 0)


def test_a_pool_of_views_that_destroy_the_input_gives_the_plain_pass():
    predict = linear_predict()
    x = images(120, seed=5)
    y = predict(x).argmax(1)  # the plain pass is right on every row
    policy = choose(predict, x, y, "auto:brightness:0.95,contrast:0.05")
    assert policy.transforms == [] and policy.merge == "mean"
    assert policy.summary().startswith("TTA chose no views: plain pass (on the calibration slice "
                                       "(120 rows)")
    steps = {row["step"] for row in policy.candidates}
    assert steps == {1}, "stops after the first step that adds nothing"
    assert {row["add"] for row in policy.candidates} == {"brightness:0.95", "contrast:0.05"}
    assert not any(row["chosen"] for row in policy.candidates)


def test_a_view_that_helps_is_chosen():
    """Labels are what the classifier says of each image flipped left-right: the hflip view
    sees what the labels mean, the others do not."""
    from ttc.testtime.transforms import _flip

    predict = linear_predict(seed=8)
    x = images(150, seed=6)
    y = predict(_flip(x, -1)).argmax(1)
    policy = choose(predict, x, y, "auto:vflip,hflip,rot180,brightness:0.3")
    assert "hflip" in policy.specs and "vflip" not in policy.specs
    assert policy.score["accuracy"] > policy.plain["accuracy"]
    chosen = [row for row in policy.candidates if row["chosen"]]
    assert chosen[0]["add"] == "hflip" and chosen[0]["step"] == 1
    assert policy.report()["pool"] == ["vflip", "hflip", "rot180", "brightness:0.3"]


def test_the_search_is_deterministic_for_a_seed_and_keeps_a_given_merge():
    predict = linear_predict(seed=2)
    x = images(90, seed=9)
    y = (predict(x).argmax(1) + (np.arange(90) % 7 == 0)) % 4  # some rows the plain pass misses
    first = choose(predict, x, y, "auto:shift:1,rotate:20,scale:1.2", merge="gmean")
    again = choose(predict, x, y, "auto:shift:1,rotate:20,scale:1.2", merge="gmean")
    assert first.report() == again.report() and first.candidates == again.candidates
    assert {row["merge"] for row in first.candidates} == {"gmean"}


def test_default_merge_searches_the_merge_pool():
    from ttc.testtime.tta_policy import MERGE_POOL

    predict = linear_predict(seed=4)
    x = images(60, seed=1)
    policy = choose(predict, x, predict(x).argmax(1), "auto:hflip")
    assert {row["merge"] for row in policy.candidates} == set(MERGE_POOL)


def test_too_few_heldout_rows_choose_nothing():
    predict = linear_predict()
    x = images(20, seed=2)
    policy = choose(predict, x, predict(x).argmax(1), "auto:hflip")
    assert policy.transforms == [] and "20 rows are too few" in policy.summary()


def test_no_heldout_rows_is_the_plain_pass_with_the_reason():
    from ttc.testtime.tta_policy import choose_policy

    policy = choose_policy(linear_predict(), "auto", IMAGE, "mean", 0,
                           (np.zeros((0, *SHAPE), np.float32), np.zeros(0, np.int64)), 8, 0)
    assert policy.transforms == [] and policy.chosen_on is None
    assert "no selection-free held-out rows" in policy.summary()


def test_the_default_image_pool_leaves_quarter_turns_out_of_non_square_images():
    from ttc.testtime.tta_policy import candidate_transforms

    wide = {**IMAGE, "image_size": [5, 7]}
    specs = [t.spec for t in candidate_transforms("auto", wide, 0)]
    assert "rot180" in specs and "rot90" not in specs and "rot270" not in specs
    from utils import ConfigError

    with pytest.raises(ConfigError, match="needs square images"):
        candidate_transforms("auto:rot90", wide, 0)


def test_training_takes_the_given_pool_or_the_type_default_views_under_auto():
    from ttc.testtime.tta import build_transforms

    assert [t.spec for t in build_transforms("auto", IMAGE)] == ["shift:1"]
    assert [t.spec for t in build_transforms("auto:hflip,vflip", IMAGE)] == ["hflip", "vflip"]


@pytest.mark.parametrize("value,phrase", [
    ("auto:", "names no candidate view"),
    ("auto:identity", "names no candidate view"),
    ("auto:bogus", "unknown TTA transform 'bogus'"),
    ("auto:jitter:0.1", "unknown TTA transform 'jitter:0.1' for image models"),
    ("auto:rotate:400", "the parameter must be degrees"),
])
def test_bad_auto_values_exit_2_in_one_line(value, phrase, tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", "--tta", "true", "--tta_transforms", value)
    assert_clean_failure(run, 2, phrase)
    assert not (tmp_path / "m.onnx").exists()


def test_auto_for_a_segmenter_is_refused_with_the_reason(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "image_segmenter", "--dataset_path",
                  "builtin:digit_canvases", "--output_model", tmp_path / "m.onnx", "--tta",
                  "true", "--tta_transforms", "auto")
    assert_clean_failure(run, 2, "auto chooses a classifier's views",
                         "fixed in its exported TTA graph")


@pytest.fixture(scope="module")
def cancer_auto(tmp_path_factory) -> dict:
    """A breast_cancer MLP trained with --tta_transforms auto (pipeline.py), its report."""
    out = tmp_path_factory.mktemp("cancer_auto")
    run = run_cli("pipeline.py", "--dataset_path", "builtin:breast_cancer", "--model_type",
                  "tabular_classifier", "--epochs", "8", "--seed", "3", "--tta", "true",
                  "--calibration_fraction", "0.2", "--tta_transforms", "auto",
                  "--output_model", out / "model.onnx",
                  "--report_json", out / "report.json", "--no_progress")
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": out / "model.onnx", "report": json.loads((out / "report.json").read_text()),
            "stdout": run.stdout, "out": out}


def test_pipeline_reports_the_policy_and_every_candidate(cancer_auto):
    report = cancer_auto["report"]
    tta, policy = report["tta"], report["tta"]["policy"]
    assert policy["chosen_on"] == "calibration"
    assert policy["rows"] == report["dataset"]["calibration"] > 0
    assert policy["pool"] == ["jitter:0.05", "jitter:0.1", "jitter:0.1", "jitter:0.2"]
    assert tta["transforms"] == policy["transforms"]
    assert {row["add"] for row in tta["candidates"]} <= set(policy["pool"])
    assert all({"step", "merge", "add", "accuracy", "nll", "chosen"} <= set(row)
               for row in tta["candidates"])
    named = (", ".join(policy["transforms"]) if policy["transforms"]
             else "TTA chose no views: plain pass")
    assert named in tta["verdict"] and named in cancer_auto["stdout"]


def test_inference_and_input_apply_the_policy_pipeline_chose(cancer_auto, tmp_path):
    """inference.py on the bundle reloads the same calibration slice and makes the same choice;
    --input (and so serve.py, the same predictor) predicts with it."""
    report = tmp_path / "inference.json"
    run = run_cli("inference.py", "--model", cancer_auto["model"], "--tta", "true",
                  "--tta_transforms", "auto", "--seed", "3", "--report_json", report,
                  "--no_progress")
    assert run.returncode == 0, run.stderr[-3000:]
    again = json.loads(report.read_text())["tta"]
    chosen = cancer_auto["report"]["tta"]
    assert again["policy"] == chosen["policy"] and again["candidates"] == chosen["candidates"]
    assert again["accuracy"] == chosen["accuracy"]
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer(as_frame=True).frame.drop(columns="target").head(20)
    rows = tmp_path / "rows.csv"
    data.to_csv(rows, index=False)
    out = tmp_path / "preds.csv"
    predicted = run_cli("inference.py", "--model", cancer_auto["model"], "--tta", "true",
                        "--tta_transforms", "auto", "--seed", "3", "--input", rows,
                        "--output", out, "--log_level", "INFO")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    summary = chosen["verdict"].split(";")[0]
    assert summary in predicted.stderr


def test_training_draws_from_the_pool_of_auto_or_the_type_s_default_views():
    """What the manifest's training.augment_transforms records under auto: the views training
    drew its random forms from, never the word auto."""
    from ttc.testtime.transforms import training_spec
    from ttc.training.stage import trained_views

    assert training_spec("auto:hflip,vflip") == "hflip,vflip"
    assert training_spec("shift:1") == "shift:1"
    assert trained_views("auto") == "default" and trained_views("") == "default"
    assert trained_views("auto:hflip, rot90") == "hflip, rot90"
