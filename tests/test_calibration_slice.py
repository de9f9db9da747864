"""The calibration slice (issue 65, item 1): training rows set aside before training
(--calibration_fraction), never trained on nor used for selection, the same rows again from a
bundle; the temperature (and the MC-dropout average's) fitted on it, decided by its NLL and Brier
gains, and the report saying which data T was fitted on and why it was or was not applied.
Data and seeds other than the bench's (digits seeds 0-4, SMS seeds 0-2)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import FAST_TRAINING, run_cli
from ttc.inputs.data import CALIBRATION, DataOptions, calibration_cut, load_dataset
from ttc.testtime.calibrate import TemperatureFit, calibrate_scores, decide, softmax

SEED = 7


@pytest.fixture(scope="module")
def wine_run(tmp_path_factory):
    """pipeline.py on builtin:wine, seed 7, the default slice: its bundle, report and stdout."""
    folder = tmp_path_factory.mktemp("wine")
    run = run_cli("pipeline.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:wine", "--seed", SEED, "--output_model", folder / "model.onnx",
                  "--report_json", folder / "report.json", "--plots", "none", *FAST_TRAINING)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"model": folder / "model.onnx", "report": json.loads((folder / "report.json")
                                                                  .read_text()), "run": run}


def wine(fraction: float, splits=("train", "val", "test", CALIBRATION), **bundle):
    return load_dataset(DataOptions(path="builtin:wine", model_type="tabular_classifier",
                                    seed=SEED, calibration_fraction=fraction,
                                    show_progress=False), splits=splits, **bundle)


def test_the_slice_is_cut_from_training_rows_alone_stratified_and_disjoint():
    plain, sliced = wine(0.0), wine(0.2)
    ids = {name: set(split.ids) for name, split in sliced.splits.items()}
    assert len(sliced.calibration) > 0 and not ids[CALIBRATION] & (ids["train"] | ids["val"]
                                                                   | ids["test"])
    assert ids["train"] | ids[CALIBRATION] == set(plain.train.ids)  # only training rows move
    assert plain.val.ids == sliced.val.ids and plain.test.ids == sliced.test.ids
    assert set(sliced.calibration.y) == set(plain.train.y)  # every class has a share
    assert sliced.counts[CALIBRATION] == len(sliced.calibration)
    assert len(plain.calibration) == 0 and plain.counts[CALIBRATION] == 0


def test_calibration_cut_is_seeded_and_keeps_a_row_of_each_class_to_train_on():
    strata = ["a"] * 10 + ["b"] * 2 + ["c"]
    cut = calibration_cut(strata, 0.5, seed=3)
    assert (cut == calibration_cut(strata, 0.5, seed=3)).all()
    assert cut[:10].sum() == 5 and cut[10:12].sum() == 1 and not cut[12]
    assert not calibration_cut(strata, 0.0, seed=3).any()


def test_a_type_with_its_own_reader_gets_the_slice_cut_after_reading():
    options = DataOptions(path="builtin:digit_canvases", model_type="image_segmenter",
                          seed=SEED, calibration_fraction=0.1, show_progress=False)
    whole = load_dataset(options)
    again = load_dataset(options, preprocessing=whole.preprocessing, labels=whole.labels,
                         splits=(CALIBRATION,))
    assert list(again.splits) == [CALIBRATION] and again.calibration.ids == whole.calibration.ids
    assert not set(whole.calibration.ids) & set(whole.train.ids)
    assert whole.counts["train"] == len(whole.train)


def test_a_bundle_gives_the_same_slice_and_an_older_one_none():
    recorded = {**DataOptions(path="builtin:wine").to_manifest(), "seed": SEED,
                "model_type": "tabular_classifier", "calibration_fraction": 0.2}
    fresh = wine(0.2)
    reread = load_dataset(DataOptions.from_manifest(recorded), splits=(CALIBRATION,),
                          preprocessing=fresh.preprocessing, labels=fresh.labels)
    assert reread.calibration.ids == fresh.calibration.ids
    np.testing.assert_array_equal(reread.calibration.x, fresh.calibration.x)
    older = {k: v for k, v in recorded.items() if k != "calibration_fraction"}
    assert DataOptions.from_manifest(older).calibration_fraction == 0.0  # its T: validation's


def test_the_temperature_is_fitted_on_the_slice_and_the_report_says_so(wine_run):
    report, manifest = wine_run["report"], json.loads(wine_run["model"].with_suffix(".json")
                                                      .read_text())
    fit = report["train"]["calibration"]
    assert fit["fitted_on"] == "calibration" and fit["samples"] == report["dataset"][CALIBRATION]
    assert report["dataset"]["calibration_fraction"] == 0.1 and fit["samples"] > 0
    assert {"brier_before", "brier_after", "brier_gain_interval_90"} <= set(fit)
    assert fit["reason"] and isinstance(fit["applied"], bool)
    assert manifest["calibration"] == fit and manifest["dataset"]["calibration_fraction"] == 0.1
    assert report["calibration"]["fitted_on"] == "calibration"
    assert "brier_change_interval_90" in report["calibration"]
    assert f"fitted on {fit['samples']} calibration samples" in wine_run["run"].stdout
    mc = (manifest.get("extra_graphs") or {}).get("mc")
    if mc is not None:  # the MC-dropout average's temperature: fitted on the same slice
        assert mc["temperature_fit"]["fitted_on"] == "calibration"
        assert mc["temperature_fit"]["samples"] == fit["samples"]


def test_export_refits_the_mc_temperature_on_the_same_slice(wine_run, tmp_path):
    """export.py on the saved bundle reloads the slice from the manifest: the same fit."""
    import shutil

    for path in wine_run["model"].parent.glob("model.*"):
        shutil.copy(path, tmp_path / path.name)
    before = json.loads((tmp_path / "model.json").read_text())
    run = run_cli("export.py", "--output_model", tmp_path / "model.onnx", "--no_progress",
                  "true")
    assert run.returncode == 0, run.stderr[-3000:]
    after = json.loads((tmp_path / "model.json").read_text())
    mc_before = (before.get("extra_graphs") or {}).get("mc")
    if mc_before is not None:
        refit = after["extra_graphs"]["mc"]["temperature_fit"]  # export's own passes
        assert refit["fitted_on"] == "calibration"
        assert refit["samples"] == mc_before["temperature_fit"]["samples"]


def test_fraction_0_fits_nothing_and_says_why(tmp_path):
    out = tmp_path / "report.json"
    run = run_cli("train.py", "--model_type", "tabular_classifier", "--dataset_path",
                  "builtin:iris", "--seed", SEED, "--calibration_fraction", "0",
                  "--output_model", tmp_path / "model.onnx", "--report_json", out,
                  *FAST_TRAINING)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    fit = report["train"]["calibration"]
    assert (fit["method"], fit["applied"], fit["temperature"]) == ("none", False, 1.0)
    assert "--calibration_fraction 0" in fit["reason"] and "validation" in fit["reason"]
    assert report["dataset"][CALIBRATION] == 0
    whole = load_dataset(DataOptions(path="builtin:iris", model_type="tabular_classifier",
                                     seed=SEED, show_progress=False))
    assert report["dataset"]["train"] == len(whole.train)  # every training row trained on


@pytest.mark.parametrize("value", ["0.9", "-0.1", "nan", "half"])
def test_a_bad_fraction_is_one_line_and_exit_2(value, tmp_path):
    run = run_cli("pipeline.py", "--dataset_path", "builtin:iris", "--model_type",
                  "tabular_classifier", "--calibration_fraction", value, "--output_model",
                  tmp_path / "model.onnx")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--calibration_fraction" in lines[0], run.stderr


def calibrated_scores(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels drawn from softmax(logits): T = 1 is right."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, (n, 3))
    y = np.array([rng.choice(3, p=row) for row in softmax(logits)])
    return logits, y


def test_weak_evidence_keeps_t_at_1_with_the_reason():
    logits, y = calibrated_scores(300, seed=11)
    fit = calibrate_scores(logits, y, "evidence", seed=SEED)
    assert not fit.applied and fit.temperature == 1.0 and fit.fitted != 1.0
    assert fit.fitted_on == "calibration" and "calibration slice cannot tell" in fit.reason
    assert fit.manifest_entry()["fitted_on"] == "calibration"


def test_a_brier_gain_shown_below_0_keeps_t_at_1_even_when_nll_gains():
    """NLL is what T is fitted to (its gain must be shown); Brier may not be shown worse."""
    fit = TemperatureFit(1.5, "nll", 400, 9, 0.2, 0.19, interval=[1.2, 1.8],
                         gain_interval=[0.001, 0.02], fitted=1.5,
                         brier_gain_interval=[-0.004, -0.001])
    kept = decide(fit, "evidence")
    assert (kept.applied, kept.temperature) == (False, 1.0)
    assert "Brier gain" in kept.reason and "[-0.0040, -0.0010]" in kept.reason
    assert "lies below 0" in kept.reason


def test_a_brier_gain_that_holds_0_does_not_stop_a_shown_nll_gain():
    """The overconfident SMS network's case: NLL gain shown, Brier's interval holds 0."""
    fit = TemperatureFit(2.07, "nll", 781, 9, 0.2, 0.19, interval=[1.62, 2.42],
                         gain_interval=[0.0028, 0.0373], fitted=2.07,
                         brier_gain_interval=[-0.0016, 0.0022])
    applied = decide(fit, "evidence")
    assert applied.applied and applied.temperature == 1.62
    assert "Brier [-0.0016, +0.0022]" in applied.reason


def test_an_nll_gain_that_holds_0_keeps_t_at_1():
    fit = TemperatureFit(1.5, "nll", 400, 9, 0.2, 0.19, interval=[1.2, 1.8],
                         gain_interval=[-0.001, 0.02], fitted=1.5,
                         brier_gain_interval=[0.001, 0.004])
    kept = decide(fit, "evidence")
    assert (kept.applied, kept.temperature) == (False, 1.0)
    assert "NLL gain" in kept.reason and "does not lie above 0" in kept.reason


def test_the_brier_score_is_the_squared_distance_to_the_one_hot_label():
    from ttc.testtime.calibrate import brier

    p = np.array([[0.5, 0.5], [1.0, 0.0]])
    assert math.isclose(brier(p, np.array([0, 1])), (0.5 + 2.0) / 2)


def test_an_applied_t_goes_no_further_from_1_than_its_interval_shows():
    fit = TemperatureFit(0.25, "nll", 126, 1, 0.3, 0.2, interval=[0.2, 0.85],
                         gain_interval=[0.01, 0.05], fitted=0.25,
                         brier_gain_interval=[0.001, 0.01])
    applied = decide(fit, "evidence")
    assert applied.applied and applied.temperature == 0.85 and applied.fitted == 0.25
    assert "end of T's interval nearest 1, T = 0.850" in applied.reason
    assert applied.manifest_entry()["fitted_temperature"] == 0.25
