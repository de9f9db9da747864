"""`--tta_transforms auto[:LIST]`: the TTA views and merge chosen on held-out data, by greedy
policy search (Lyzhov et al. 2020, "Greedy Policy Search").

Start from the plain view; at each step score every candidate view not yet taken added to the
policy, merged by each candidate merge, and take the best candidate if it beats the policy so
far by the margin; stop when none does. The score is accuracy on the held-out rows, then NLL
(the tie-break): accuracy is what TTA is judged by (the report's verdict, the issue's goals),
and NLL, a proper scoring rule, separates the many candidates that move no top class on a
slice of a few hundred rows. A candidate is better when it gets more rows right, or as many
and lowers NLL by at least NLL_MARGIN of the current NLL; so an empty policy (the plain pass)
is what a pool of views that all hurt gives.

The rows are the selection-free calibration slice (served.Heldout.calibration): rows no
training, candidate or epoch choice has seen, so the plain pass is not favoured over the views
by having been selected on them. Each candidate view's probabilities are computed once, on the
plain graph; the search merges cached probabilities (tta.merge, the runner's own rule), so it
costs one pass per candidate view over the slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ttc.reporting.metrics import nll
from ttc.serving.runtime import batches_of
from ttc.testtime.transforms import Transform, parse_auto, transform as transform_named
from ttc.testtime.tta import merge, view_sets
from utils import ConfigError

# Fewer held-out rows than this choose nothing: on 12 rows (wine's slice) every candidate ties
# on accuracy and NLL's differences between two seeds' jitter draws exceed the margin.
MIN_ROWS = 50
NLL_MARGIN = 0.02  # a step that gets no more rows right must lower NLL by 2% of it
# The merges auto tries when --tta_merge is left at its default (mean); vote and max, whose
# probabilities are not a mean of the views', serve NLL badly and are not candidates.
MERGE_POOL = ("mean", "gmean", "tsharpen")
CRITERION = "accuracy, then NLL (a step must gain a row, or lower NLL by 2%)"

Predict = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Score:
    correct: int
    nll: float
    rows: int

    def beats(self, other: Score) -> bool:
        """More rows right, or as many and NLL lower by the margin."""
        if self.correct != other.correct:
            return self.correct > other.correct
        return self.nll < other.nll * (1 - NLL_MARGIN)

    def row(self) -> dict:
        return {"accuracy": round(self.correct / max(self.rows, 1), 6),
                "nll": round(self.nll, 6)}


@dataclass
class Candidate:
    """One candidate transform, compiled, and its views' probabilities on the held-out rows
    (with the row each view row belongs to)."""

    transform: Transform
    probabilities: np.ndarray
    owners: np.ndarray


@dataclass
class Policy:
    """What the search chose (transforms and merge; no transform: the plain pass), what on,
    and every candidate's score at every step (the report's tta.policy and tta.candidates)."""

    transforms: list[Transform]
    merge: str
    chosen_on: str | None
    rows: int
    pool: list[str] = field(default_factory=list)
    candidates: list[dict] = field(default_factory=list)
    plain: dict | None = None
    score: dict | None = None
    reason: str = ""

    @property
    def specs(self) -> list[str]:
        return [t.spec for t in self.transforms]

    def report(self) -> dict:
        return {"transforms": self.specs, "merge": self.merge, "chosen_on": self.chosen_on,
                "rows": self.rows, "pool": self.pool, "criterion": CRITERION, "plain": self.plain,
                "score": self.score, "reason": self.reason}

    def summary(self) -> str:
        where = (f"on the {self.chosen_on} slice ({self.rows} rows)" if self.chosen_on
                 else "with no held-out rows")
        if not self.transforms:
            why = f"; {self.reason}" if self.reason else ""
            return f"TTA chose no views: plain pass ({where}{why})"
        return f"TTA chose {', '.join(self.specs)} (merge {self.merge}) {where}"


def candidate_transforms(text: str, pre: dict, seed: int) -> list[Transform]:
    """The pool of `auto[:LIST]`, compiled as the runner compiles views (a seeded one draws
    from [seed, its place in the pool]). A quarter turn of a non-square image is left out of
    the default pool (a classifier's graph takes one size); named in LIST it is exit 2."""
    kind = pre["kind"]
    default_pool = not text.strip().partition(":")[1]
    out = []
    for k, (name, value) in enumerate(parse_auto(text, kind)):
        try:
            out.append(transform_named(name, value).compile(pre, np.random.default_rng([seed, k])))
        except ConfigError:
            if not default_pool:
                raise
    return out


def view_probabilities(predict: Predict, transform: Transform, x: np.ndarray,
                       batch_size: int, pad_id: int) -> Candidate:
    """One transform's views of x, predicted by the plain graph batch by batch."""
    probs, owners = [], []
    for start in range(0, len(x), batch_size):
        chunk = x[start:start + batch_size]
        for k, (view, rows) in enumerate(view_sets(chunk, [transform])):
            if k == 0:
                continue  # the plain view: computed once for all candidates
            probs.append(np.concatenate([predict(b) for b in batches_of(view, batch_size, pad_id)]))
            owners.append(start + (np.arange(len(chunk)) if rows is None else rows))
    if not probs:  # window:N over texts all shorter than N: no extra view
        return Candidate(transform, np.zeros((0, 0), np.float32), np.zeros(0, np.int64))
    return Candidate(transform, np.concatenate(probs), np.concatenate(owners))


def _score(plain: np.ndarray, chosen: Sequence[Candidate], merge_mode: str,
           y: np.ndarray) -> Score:
    parts = [plain, *(c.probabilities for c in chosen if len(c.owners))]
    owners = np.concatenate([np.arange(len(plain)), *(c.owners for c in chosen)])
    merged = merge(np.concatenate(parts), owners, len(plain), merge_mode)
    return Score(int((merged.argmax(1) == y).sum()), nll(merged, y), len(y))


def greedy(plain: np.ndarray, pool: Sequence[Candidate], merge_mode: str, y: np.ndarray,
           log: list[dict]) -> tuple[list[Candidate], Score]:
    """Greedy policy search with one merge: every step's candidates scored into `log`."""
    chosen: list[Candidate] = []
    current = _score(plain, [], merge_mode, y)
    step = 0
    while len(chosen) < len(pool):
        step += 1
        scored = [(c, _score(plain, [*chosen, c], merge_mode, y))
                  for c in pool if all(c is not d for d in chosen)]
        best, best_score = scored[0]
        for candidate, score in scored[1:]:
            if score.beats(best_score):
                best, best_score = candidate, score
        taken = best_score.beats(current)
        log += [{"step": step, "merge": merge_mode, "add": c.transform.spec, **s.row(),
                 "chosen": taken and c is best} for c, s in scored]
        if not taken:
            break
        chosen.append(best)
        current = best_score
    return chosen, current


def search(plain: np.ndarray, pool: Sequence[Candidate], merges: Sequence[str],
           y: np.ndarray, chosen_on: str) -> Policy:
    """The best policy over `merges` (each searched greedily); a later merge replaces an
    earlier one only when it beats it (so ties keep the first: mean)."""
    log: list[dict] = []
    plain_score = _score(plain, [], "mean", y)
    best: tuple[list[Candidate], Score, str] | None = None
    for merge_mode in merges:
        chosen, score = greedy(plain, pool, merge_mode, y, log)
        if chosen and (best is None or score.beats(best[1])):
            best = (chosen, score, merge_mode)
    specs = [c.transform.spec for c in pool]
    if best is None:
        return Policy([], merges[0], chosen_on, len(y), specs, log, plain_score.row(),
                      plain_score.row(), "no candidate view beat it")
    chosen, score, merge_mode = best
    return Policy([c.transform for c in chosen], merge_mode, chosen_on, len(y), specs, log,
                  plain_score.row(), score.row())


def choose_policy(predict: Predict, text: str, pre: dict, merge_flag: str, seed: int,
                  heldout: tuple[np.ndarray, np.ndarray] | None, batch_size: int, pad_id: int,
                  chosen_on: str = "calibration") -> Policy:
    """The views and merge of `--tta_transforms auto[:LIST]` for a classifier served by
    `predict`, chosen on `heldout` (x, y). --tta_merge other than its default mean is kept;
    mean (the default) lets the search try MERGE_POOL. Without held-out rows: the plain pass,
    with the reason."""
    merges = MERGE_POOL if merge_flag == "mean" else (merge_flag,)
    if heldout is None or not len(heldout[1]):
        return Policy([], merges[0], None, 0, reason="no selection-free held-out rows to "
                      "choose views on (the calibration slice is empty or off)")
    if len(heldout[1]) < MIN_ROWS:
        return Policy([], merges[0], chosen_on, len(heldout[1]), reason=f"{len(heldout[1])} "
                      f"rows are too few to choose views on (at least {MIN_ROWS}: raise "
                      "--calibration_fraction)")
    x, y = heldout
    pool = [view_probabilities(predict, t, x, batch_size, pad_id)
            for t in candidate_transforms(text, pre, seed)]
    plain = np.concatenate([predict(b) for b in batches_of(x, batch_size, pad_id)])
    return search(plain, pool, merges, np.asarray(y), chosen_on)
