"""builtin:digits read with numpy gives scikit-learn's load_digits() arrays, without importing
scikit-learn (ttc/inputs/builtin_digits.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

from ttc.inputs import builtin_digits

ROOT = Path(__file__).resolve().parents[1]


def _assert_same_as_sklearn(images: np.ndarray, target: np.ndarray) -> None:
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and images.shape == (1797, 8, 8)
    assert target.dtype == bunch.target.dtype and target.shape == (1797,)
    assert np.array_equal(images, bunch.images)
    assert np.array_equal(target, bunch.target)


def test_the_numpy_reader_gives_load_digits_arrays():
    assert builtin_digits.sklearn_data_file(*builtin_digits.DIGITS_CSV) is not None
    _assert_same_as_sklearn(*builtin_digits.load_digits_arrays())


def test_without_the_bundled_file_it_falls_back_to_load_digits(monkeypatch):
    monkeypatch.setattr(builtin_digits, "sklearn_data_file", lambda *parts: None)
    _assert_same_as_sklearn(*builtin_digits.load_digits_arrays())


def test_a_missing_file_is_none():
    assert builtin_digits.sklearn_data_file("datasets", "data", "no-such-file.csv") is None


def test_reading_the_digits_imports_no_scikit_learn():
    code = ("import sys; from ttc.inputs.builtin_digits import load_digits_arrays; "
            "images, target = load_digits_arrays(); "
            "print(images.shape, sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == ["(1797,", "8,", "8)", "[]"]
