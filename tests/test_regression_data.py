"""The regression types' data and intervals, as plain functions: builtin:diabetes gives
scikit-learn's load_diabetes values without importing scikit-learn, Friedman #1 follows its
formula (and make_friedman1's rows), the review set's target is learnable from its words; split
conformal radii hold their coverage on exchangeable residuals and refuse what they cannot do."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from ttc.tasks.regress.builtin import (DIABETES_FEATURES, GRADED_WORDS, friedman1_mean,
                                       friedman1_table, load_diabetes_table, review_scores_table)
from ttc.tasks.regress.intervals import (IntervalReport, conformal_interval, conformal_radius,
                                         coverage, gaussian_interval, mean_width)

# ----------------------------------------------------------------------------- built-in tables


def test_diabetes_matches_scikit_learn_scaled_and_raw():
    from sklearn.datasets import load_diabetes

    for scaled in (True, False):
        ours = load_diabetes_table(scaled=scaled)
        theirs = load_diabetes(as_frame=True, scaled=scaled).frame
        assert list(ours.columns) == [*DIABETES_FEATURES, "target"] == list(theirs.columns)
        assert len(ours) == 442
        np.testing.assert_allclose(ours.to_numpy(), theirs.to_numpy(), rtol=0, atol=1e-12)


def test_builtin_tables_load_without_scikit_learn_or_torch():
    code = ("import sys; from ttc.tasks.regress import builtin as b; b.load_diabetes_table(); "
            "b.friedman1_table(50); b.review_scores_table(20); "
            "print([m for m in ('sklearn', 'torch') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_friedman1_follows_its_formula_and_make_friedman1():
    from sklearn.datasets import make_friedman1

    exact = friedman1_table(n_rows=300, noise=0.0, seed=3)
    x = exact[[f"x{i}" for i in range(10)]].to_numpy()
    assert x.min() >= 0 and x.max() < 1 and len(exact) == 300
    by_hand = (10 * np.sin(np.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2
               + 10 * x[:, 3] + 5 * x[:, 4])
    np.testing.assert_allclose(exact["target"], by_hand, rtol=1e-12)
    noisy = friedman1_table(n_rows=2000, noise=1.0, seed=3)
    residual = noisy["target"].to_numpy() - friedman1_mean(noisy.iloc[:, :10].to_numpy())
    assert abs(residual.std() - 1.0) < 0.06 and abs(residual.mean()) < 0.08
    their_x, their_y = make_friedman1(n_samples=200, noise=1.0, random_state=7)
    ours = friedman1_table(n_rows=200, noise=1.0, seed=7)
    np.testing.assert_allclose(ours.iloc[:, :10].to_numpy(), their_x)
    np.testing.assert_allclose(ours["target"].to_numpy(), their_y)


def test_review_scores_are_a_function_of_their_words_plus_noise():
    table = review_scores_table(n_rows=400, seed=1, noise=0.0)
    assert list(table.columns) == ["text", "target"]
    for text, target in zip(table["text"], table["target"]):
        grades = [GRADED_WORDS[w] for w in text.split() if w in GRADED_WORDS]
        assert grades and target == pytest.approx(3.0 + 0.5 * sum(grades))
    again = review_scores_table(n_rows=400, seed=1, noise=0.0)
    assert table.equals(again)
    assert not table.equals(review_scores_table(n_rows=400, seed=2, noise=0.0))


@pytest.mark.parametrize("call", [lambda: friedman1_table(0), lambda: friedman1_table(10, -1.0),
                                  lambda: review_scores_table(0)])
def test_generators_refuse_bad_sizes(call):
    with pytest.raises(ValueError):
        call()


# ----------------------------------------------------------------------------- intervals


def test_conformal_coverage_holds_on_exchangeable_residuals():
    """Averaged over draws, level <= coverage <= level + 1/(n+1) (here 23/25 = 0.92 exactly)."""
    rng = np.random.default_rng(0)
    n, level, draws = 24, 0.9, 3000
    covered = []
    for _ in range(draws):
        calibration = rng.standard_t(3, size=n)  # heavy tails: no Gaussian assumption
        test = rng.standard_t(3, size=50)
        lower, upper = conformal_interval(np.zeros(50), conformal_radius(calibration, level))
        covered.append(coverage(test, lower, upper))
    assert level <= np.mean(covered) <= level + 1 / (n + 1)
    assert np.mean(covered) == pytest.approx(23 / 25, abs=0.005)


def test_conformal_radius_is_the_order_statistic():
    residuals = np.array([-5.0, 1.0, -2.0, 4.0, 3.0, -9.0, 7.0, 6.0, -8.0])  # |r| 1..9
    assert conformal_radius(residuals, 0.9) == 9.0  # ceil(10 * 0.9) = 9th smallest
    assert conformal_radius(residuals, 0.5) == 5.0  # ceil(5) = 5th
    assert conformal_radius(residuals, 0.55) == 6.0  # ceil(5.5) = 6th


@pytest.mark.parametrize("n, level", [(0, 0.9), (8, 0.9), (18, 0.95)])
def test_too_few_calibration_rows_give_an_infinite_radius(n, level):
    """n < level / (1 - level) rows cannot hold the level: 9 are the fewest for 90%, 19 for 95%."""
    radius = conformal_radius(np.ones(n), level)
    assert radius == math.inf
    lower, upper = conformal_interval(np.zeros(3), radius)
    assert coverage(np.array([1e9, -1e9, 0.0]), lower, upper) == 1.0
    assert mean_width(lower, upper) == math.inf
    assert conformal_radius(np.ones(round(level / (1 - level))), level) == 1.0


@pytest.mark.parametrize("level", [0.0, 1.0, -0.1, 1.5, float("nan"), "0.9"])
def test_levels_outside_zero_one_are_refused(level):
    with pytest.raises(ValueError, match="level"):
        conformal_radius(np.ones(50), level)
    with pytest.raises(ValueError, match="level"):
        gaussian_interval(np.zeros(2), np.ones(2), level)


def test_bad_residuals_and_arrays_are_refused():
    with pytest.raises(ValueError, match="finite"):
        conformal_radius(np.array([1.0, np.nan] * 20), 0.9)
    with pytest.raises(ValueError, match="one length"):
        coverage(np.zeros(3), np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="non-empty"):
        mean_width(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match=">= 0"):
        gaussian_interval(np.zeros(2), np.array([1.0, -1.0]), 0.9)


def test_gaussian_interval_uses_the_normal_quantile():
    lower, upper = gaussian_interval(np.array([0.0, 10.0]), np.array([1.0, 2.0]), 0.9)
    np.testing.assert_allclose(upper, [1.6448536, 10 + 2 * 1.6448536], rtol=1e-6)
    np.testing.assert_allclose(lower, [-1.6448536, 10 - 2 * 1.6448536], rtol=1e-6)
    rng = np.random.default_rng(1)
    y = rng.normal(size=20000)
    lower, upper = gaussian_interval(np.zeros_like(y), np.ones_like(y), 0.9)
    assert coverage(y, lower, upper) == pytest.approx(0.9, abs=0.01)
    assert mean_width(lower, upper) == pytest.approx(2 * 1.6448536)


def test_interval_report_is_json_ready():
    report = IntervalReport("conformal", 0.9, 0.91, 12.5, "calibration slice", 30)
    assert json.loads(json.dumps(report.to_json())) == {
        "method": "conformal", "level": 0.9, "coverage": 0.91, "mean_width": 12.5,
        "calibrated_on": "calibration slice", "n_calibration": 30}
    infinite = IntervalReport("conformal", 0.9, 1.0, math.inf, "calibration slice", 3)
    assert json.dumps(infinite.to_json(), allow_nan=False)
    assert infinite.to_json()["mean_width"] is None
