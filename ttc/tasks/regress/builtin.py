"""The regression types' built-in tables, made without importing scikit-learn (about a second
of start-up) or torch: scikit-learn's bundled diabetes files read directly, Friedman #1 and a
text-regression set generated in memory. Each is a pandas DataFrame whose numeric target is the
column `target`."""
from __future__ import annotations

import gzip
import importlib.util
import random
from pathlib import Path

import numpy as np

TARGET = "target"
DIABETES_FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")
FRIEDMAN_FEATURES = 10

# the review set's vocabulary: each graded word moves the score by its grade
GRADED_WORDS = {"awful": -2.0, "terrible": -2.0, "bad": -1.0, "dull": -1.0, "slow": -1.0,
                "fine": 0.5, "good": 1.0, "nice": 1.0, "great": 2.0, "superb": 2.0}
NEUTRAL_WORDS = ("the", "food", "service", "room", "staff", "was", "and", "very", "place",
                 "price", "view", "really", "quite", "but", "our", "visit")


def sklearn_data_folder() -> Path:
    """The folder of scikit-learn's bundled data files, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-learn is not installed: its bundled diabetes files are "
                                "what builtin:diabetes reads")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"


def _read_gz_numbers(path: Path) -> np.ndarray:
    with gzip.open(path, "rt", encoding="ascii") as handle:
        return np.loadtxt(handle, dtype=np.float64, ndmin=1)


def load_diabetes_table(scaled: bool = True):
    """scikit-learn's diabetes set (Efron et al. 2004): 442 rows, the ten baseline variables
    `age, sex, bmi, bp, s1..s6` and `target`, a measure of disease progression one year later.

    `scaled` (the default, as `sklearn.datasets.load_diabetes()`): each feature mean-centred and
    divided by its standard deviation (ddof 0) times sqrt(442), the same values scikit-learn
    gives; False: the raw measurements (age in years, sex 1/2, ...)."""
    import pandas as pd

    folder = sklearn_data_folder()
    data = _read_gz_numbers(folder / "diabetes_data_raw.csv.gz")
    target = _read_gz_numbers(folder / "diabetes_target.csv.gz")
    if scaled:
        data = (data - data.mean(axis=0)) / data.std(axis=0)
        data /= data.shape[0] ** 0.5
    frame = pd.DataFrame(data, columns=list(DIABETES_FEATURES))
    frame[TARGET] = target
    return frame


def friedman1_table(n_rows: int = 2500, noise: float = 1.0, seed: int = 0):
    """Friedman #1 (Friedman 1991; scikit-learn's make_friedman1 with 10 features): x0..x9 drawn
    uniformly from [0, 1], y = 10 sin(pi x0 x1) + 20 (x2 - 0.5)^2 + 10 x3 + 5 x4 + noise * N(0, 1);
    x5..x9 do not enter y. Drawn with numpy's legacy RandomState(seed) in scikit-learn's order,
    so the rows are those of make_friedman1(n_rows, noise=noise, random_state=seed) with numpy's
    current stream (tests/test_regression_data.py checks it); only the formula is promised."""
    import pandas as pd

    if n_rows < 1 or noise < 0:
        raise ValueError(f"friedman1_table needs n_rows >= 1 and noise >= 0, got {n_rows}, {noise}")
    generator = np.random.RandomState(seed)
    x = generator.uniform(size=(n_rows, FRIEDMAN_FEATURES))
    y = friedman1_mean(x) + noise * generator.standard_normal(size=n_rows)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(FRIEDMAN_FEATURES)])
    frame[TARGET] = y
    return frame


def friedman1_mean(x: np.ndarray) -> np.ndarray:
    """Friedman #1's noise-free target of rows x (at least 5 columns)."""
    return (10 * np.sin(np.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2
            + 10 * x[:, 3] + 5 * x[:, 4])


def review_scores_table(n_rows: int = 600, seed: int = 0, noise: float = 0.25):
    """Short made-up reviews (`text`) with a numeric `target`: 3 + half the sum of the grades
    of the graded words it holds (GRADED_WORDS: "awful" -2 ... "superb" +2; a word may repeat)
    + noise * N(0, 1), so a bag of words can learn it and the best possible RMSE is `noise`.
    Each review has 1-4 graded words among 3-8 neutral ones; the same seed gives the same rows."""
    import pandas as pd

    if n_rows < 1 or noise < 0:
        raise ValueError(f"review_scores_table needs n_rows >= 1 and noise >= 0, "
                         f"got {n_rows}, {noise}")
    rng = random.Random(seed)
    graded = sorted(GRADED_WORDS)
    texts, targets = [], []
    for _ in range(n_rows):
        chosen = [rng.choice(graded) for _ in range(rng.randint(1, 4))]
        words = chosen + [rng.choice(NEUTRAL_WORDS) for _ in range(rng.randint(3, 8))]
        rng.shuffle(words)
        texts.append(" ".join(words))
        targets.append(3.0 + 0.5 * sum(GRADED_WORDS[w] for w in chosen) + noise * rng.gauss(0, 1))
    return pd.DataFrame({"text": texts, TARGET: targets})
