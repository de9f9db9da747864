"""Test-time augmentation: transforms, merge rules, adaptive triggering, and the CLIs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_clean_failure, run_cli

IMAGE = {"kind": "image", "image_size": [6, 6], "channels": 3}
TEXT = {"kind": "text"}
TABULAR = {"kind": "tabular", "feature_names": ["a", "b", "c=x"], "std": [2.0, 0.5, 0.4],
           "columns": [{"name": "a", "type": "numeric"}, {"name": "b", "type": "numeric"},
                       {"name": "c", "type": "categorical", "categories": ["x"]}]}
IMAGE_SPECS = {"hflip": 1, "flip": 1, "vflip": 1, "rot90": 1, "rot180": 1, "rot270": 1,
               "rotate:15": 2, "shift:1": 4, "crop:0.8": 1, "scale:1.2": 1, "brightness:0.1": 2,
               "contrast:1.5": 1}


def build(spec, pre):
    from tta import build_transforms

    return build_transforms(spec, pre)


@pytest.mark.parametrize("spec,views", IMAGE_SPECS.items())
def test_image_transforms_keep_shape_dtype_and_range(spec, views):
    from tta import expand

    x = np.random.default_rng(0).random((5, 3, 6, 6)).astype(np.float32)
    stacked, owners = expand(x, build(spec, IMAGE), seed=0)
    assert stacked.shape == (5 * (1 + views), 3, 6, 6) and stacked.dtype == np.float32
    assert stacked.min() >= 0 and stacked.max() <= 1
    assert owners is None  # every view covers the whole batch, in order: the fast merge path
    np.testing.assert_array_equal(stacked[:5], x)  # the plain view comes first


def test_transforms_that_compose_to_identity_do():
    x = np.random.default_rng(1).random((2, 3, 6, 6)).astype(np.float32)
    rng = np.random.default_rng(0)
    (hflip,), (rot90,), (shift,) = build("hflip", IMAGE), build("rot90", IMAGE), build("shift:1", IMAGE)
    np.testing.assert_array_equal(hflip.views(hflip.views(x, rng)[0], rng)[0], x)
    y = x
    for _ in range(4):
        y = rot90.views(y, rng)[0]
    np.testing.assert_array_equal(y, x)
    right, left = shift.views(x, rng)[2], shift.views(x, rng)[3]
    np.testing.assert_array_equal(right[..., 1:], x[..., :-1])  # content moved one pixel right
    np.testing.assert_array_equal(left[..., :-1], x[..., 1:])


def test_rotate_small_angle_is_close_and_rot90_needs_square_images():
    from utils import ConfigError

    x = np.random.default_rng(2).random((1, 1, 6, 6)).astype(np.float32)
    (rotate,) = build("rotate:1", IMAGE)
    plus, minus = rotate.views(x, np.random.default_rng(0))
    assert np.abs(plus - x).mean() < 0.05 and not np.array_equal(plus, minus)
    with pytest.raises(ConfigError):
        build("rot90", {**IMAGE, "image_size": [6, 8]})


def test_text_transforms_keep_padding_at_the_end_and_windows_cover_long_texts():
    from tta import expand

    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 0, 0, 0, 0, 0, 0]], dtype=np.int64)
    stacked, owners = expand(ids, build("token_dropout:0.5", TEXT), seed=3)
    assert stacked.dtype == np.int64 and stacked.shape == (4, 8)
    for row in stacked:
        tokens = row[row != 0]
        assert len(tokens) >= 1 and (row[len(tokens):] == 0).all()
    stacked, owners = expand(ids, build("window:4", TEXT), seed=0)
    # the long text gets windows [0:4], [2:6], [4:8]; the short one only its plain view
    assert list(owners) == [0, 1, 0, 0, 0]
    np.testing.assert_array_equal(stacked[2:, :4], [[5, 6, 7, 8], [7, 8, 9, 10], [9, 10, 11, 12]])


def test_tabular_jitter_moves_numeric_features_only_and_keeps_nan():
    x = np.array([[1.0, np.nan, 1.0], [2.0, 3.0, 0.0]], dtype=np.float32)
    (jitter,) = build("jitter:0.5", TABULAR)
    (view,) = jitter.views(x, np.random.default_rng(0))
    assert view.dtype == np.float32 and view.shape == x.shape
    assert np.isnan(view[0, 1]) and not np.allclose(view[:, 0], x[:, 0])
    np.testing.assert_array_equal(view[:, 2], x[:, 2])


def test_merge_rules_match_hand_computed_values():
    from tta import merge

    # two samples, two views each (views stacked: sample 0, sample 1, sample 0, sample 1)
    probs = np.array([[0.6, 0.4], [0.2, 0.8], [0.2, 0.8], [0.4, 0.6]], dtype=np.float32)
    owners = np.array([0, 1, 0, 1])
    np.testing.assert_allclose(merge(probs, owners, 2, "mean"), [[0.4, 0.6], [0.3, 0.7]], atol=1e-6)
    g0 = np.sqrt([0.6 * 0.2, 0.4 * 0.8])
    np.testing.assert_allclose(merge(probs, owners, 2, "gmean")[0], g0 / g0.sum(), atol=1e-6)
    np.testing.assert_allclose(merge(probs, owners, 2, "max")[0], [0.6 / 1.4, 0.8 / 1.4], atol=1e-6)
    t0 = np.array([np.sqrt(0.6) + np.sqrt(0.2), np.sqrt(0.4) + np.sqrt(0.8)])
    np.testing.assert_allclose(merge(probs, owners, 2, "tsharpen")[0], t0 / t0.sum(), atol=1e-6)
    vote = merge(probs, owners, 2, "vote")
    assert vote[0].argmax() == 1 and vote[1].argmax() == 1  # tie on sample 0 → higher mean
    irregular = merge(probs[:3], np.array([0, 1, 0]), 2, "mean")  # the general path
    np.testing.assert_allclose(irregular, [[0.4, 0.6], [0.2, 0.8]], atol=1e-6)


def test_adaptive_threshold_only_touches_uncertain_samples():
    from tta import run_tta

    x = np.random.default_rng(4).random((10, 3, 6, 6)).astype(np.float32)
    calls = []

    def predict(batch):
        calls.append(len(batch))
        confident = batch[:, 0, 0, 0] > 0.5
        return np.where(confident[:, None], [[0.9, 0.1]], [[0.55, 0.45]]).astype(np.float32)

    out = run_tta(predict, x, build("hflip", IMAGE), "mean", batch_size=4, threshold=0.8)
    uncertain = x[:, 0, 0, 0] <= 0.5
    assert list(out.triggered) == list(uncertain)
    np.testing.assert_array_equal(out.probabilities[~uncertain], out.plain[~uncertain])
    assert sum(calls[3:]) == 2 * uncertain.sum() and max(calls) <= 4 * 2  # batch × views


def test_pipeline_tta_report_is_consistent(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--output_model", tmp_path / "m.onnx", "--tta", "true",
                  "--tta_transforms", "jitter:0.2,jitter:0.1", "--tta_merge", "gmean",
                  "--report_json", "-", "--no_progress", "true")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    tta, n = report["tta"], report["dataset"]["test"]
    assert tta["transforms"] == ["jitter:0.2", "jitter:0.1"] and tta["views"] == 3
    assert tta["merge"] == "gmean" and tta["triggered_fraction"] == 1.0
    assert tta["accuracy_plain"] == report["inference"]["accuracy"]
    assert tta["fixed"] - tta["broken"] == round((tta["accuracy"] - tta["accuracy_plain"]) * n)
    assert tta["cost_ratio"] > 1 and tta["accuracy_val"] is not None and tta["verdict"]


def test_inference_tta_on_an_existing_bundle_with_threshold(digits_bundle):
    run = run_cli("inference.py", "--model", digits_bundle["model"], "--tta", "true",
                  "--tta_transforms", "shift:1,rotate:10", "--tta_threshold", "0.99",
                  "--report_json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    tta = json.loads(run.stdout)["tta"]
    assert tta["views"] == 7 and 0 < tta["triggered_fraction"] < 1 and tta["threshold"] == 0.99
    assert ("TTA lowers" in tta["verdict"]) == (tta["accuracy_val"] < tta["accuracy_val_plain"])


@pytest.mark.parametrize("args,phrase", [
    (["--tta_transforms", "mirror"], "unknown TTA transform 'mirror'"),
    (["--tta_transforms", "rotate"], "needs a parameter"),
    (["--tta_transforms", "crop:2"], "fraction in (0, 1)"),
    (["--tta_transforms", "token_dropout:0.1"], "valid: identity, hflip"),
    (["--tta_merge", "median"], "--tta_merge"),
    (["--tta_threshold", "1.5"], "--tta_threshold"),
])
def test_bad_tta_flags_exit_2(tmp_path, args, phrase):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:digits", "--output_model",
                  tmp_path / "m.onnx", "--tta", "true", *args)
    assert_clean_failure(run, 2, phrase)


def test_transform_of_another_model_type_exits_2(tmp_path):
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--output_model", tmp_path / "m.onnx", "--tta", "true",
                  "--tta_transforms", "hflip")
    assert_clean_failure(run, 2, "for tabular models", "jitter:X")
