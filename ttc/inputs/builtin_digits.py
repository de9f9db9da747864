"""scikit-learn's digits (1,797 8x8 images, pixel values 0..16, and their digits) read with numpy
alone: `from sklearn.datasets import load_digits` imports scikit-learn's base modules, pandas and
scipy (about 0.9 s on a quiet 2-core machine) to read one small CSV that scikit-learn ships."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

DIGITS_CSV = ("datasets", "data", "digits.csv.gz")


def sklearn_data_file(*parts: str) -> Path | None:
    """A file inside the installed scikit-learn package, located without importing it; None when
    scikit-learn or the file is not there."""
    spec = importlib.util.find_spec("sklearn")  # a top-level name: finds it, imports nothing
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*parts)
    return path if path.is_file() else None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The arrays of `sklearn.datasets.load_digits()`: images float64 (1797, 8, 8) in 0..16 and
    target int64 (1797,), equal element for element (the same file, read the same way)."""
    path = sklearn_data_file(*DIGITS_CSV)
    if path is None:  # a scikit-learn that keeps its data elsewhere: its own loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)  # 64 pixels, then the digit
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
