"""Temperature scaling (Guo et al. 2017): one temperature T, fitted by minimising the negative
log-likelihood on the calibration slice (data.CALIBRATION: training rows set aside before
training, which no selection step saw; the validation split picked the epoch, so its errors are
too few and a T fitted there sharpens), divides a model's scores before the softmax. T changes
confidence, never the predicted class. numpy only.

A single network's scores are its logits; an average of several passes or members (MC-dropout,
an ensemble) is rescaled through the log of its mean probabilities: softmax(log(mean p) / T),
with its own T fitted on that averaged output.

NLL(β = 1/T) = mean(logsumexp(β·z) − β·z_y) is convex in β, and its derivative
mean(E_p[z] − z_y) is monotone, so bisection on the derivative finds the one minimum within
[T_MIN, T_MAX]. A split with no errors has no minimum: NLL keeps falling as T → 0, since every
answer is right. Such a fit falls back to the temperature whose mean confidence on the split
equals the one-sided 90% lower bound of its accuracy, 0.1 ** (1 / n) (accuracy_lower_bound): n
right answers say the error rate is small, not zero, and sharpening further than they show
raised test NLL.

A fitted T is applied only on evidence (`decide`, docs/calibration.md): the same bootstrap
resamples give the 90% interval of T and of the slice's gains in the two proper scores, NLL and
Brier, score(T = 1) − score(T), paired on each resample; when T's interval contains 1, or either
gain's does not lie above 0, T is kept at 1 and the fit is recorded beside the decision.
`--calibrate temperature_always` applies it anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ttc.reporting.metrics import ece_change_interval, expected_calibration_error, nll, nll_change_interval

T_MIN, T_MAX = 0.05, 20.0
BISECTIONS = 60  # β's bracket shrinks 2**60-fold: far below float precision
RESAMPLES = 100  # bootstrap refits for the temperature's interval
MAX_RESAMPLED_SCORES = 2_000_000  # samples x classes beyond which the interval is skipped
LOG_FLOOR = 1e-12  # log of an averaged probability: the floor metrics.nll clips at
# --calibrate → the rule that decides whether a fitted T is applied (`decide`)
RULES = {"temperature": "evidence", "temperature_always": "always"}
FITTED_ON = "calibration"  # the split a network's T is fitted on (data.CALIBRATION)
SPLIT_WORDS = {"calibration": "calibration slice", "validation": "validation split"}


def softmax(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(scores, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def log_scores(probabilities: np.ndarray) -> np.ndarray:
    """Scores whose softmax is `probabilities` (an average of passes or members)."""
    return np.log(np.clip(np.asarray(probabilities, np.float64), LOG_FLOOR, 1.0))


def rescale(probabilities: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(log p / T): what a graph that bakes T after an average computes."""
    return softmax(log_scores(probabilities), temperature)


@dataclass
class TemperatureFit:
    """One fitted temperature and how it was found, on the split it was fitted on."""

    temperature: float  # the T the graphs bake: the fitted T, or 1 where `decide` keeps it
    # "nll"; "lower_bound" (no errors on the fitted split: no NLL minimum; "laplace" in a bundle
    # from before the slice); or "none"
    method: str
    samples: int
    errors: int
    nll_before: float | None
    nll_after: float | None
    note: str | None = None
    interval: list[float] | None = None  # 90% bootstrap interval of T (fit_with_interval)
    gain_interval: list[float] | None = None  # ... of the NLL gain, on the same resamples
    fitted: float | None = None  # the fitted T; `temperature` is 1 where it is not applied
    applied: bool | None = None  # None until `decide`
    reason: str | None = None  # why it is applied or not, in words with the numbers
    rule: str | None = None  # "evidence" or "always" (--calibrate), None for no fit
    fitted_on: str = FITTED_ON  # "calibration" (the slice), "validation" (an older bundle's)
    brier_before: float | None = None  # the split's Brier score at T = 1 and at the fitted T
    brier_after: float | None = None
    brier_gain_interval: list[float] | None = None  # ... of the Brier gain, same resamples

    def manifest_entry(self) -> dict:
        """The manifest's `calibration` (and the report's `train.calibration`): `temperature`
        is the T every graph bakes, `fitted_temperature` the fit's, `fitted_on` the split it
        was fitted on (`samples` rows of it), `nll_*`/`brier_*` that split's scores at T = 1
        and at the fitted T."""
        return {"temperature": self.temperature, "method": self.method,
                "fitted_on": self.fitted_on, "samples": self.samples, "errors": self.errors,
                "nll_before": self.nll_before, "nll_after": self.nll_after,
                "brier_before": self.brier_before, "brier_after": self.brier_after,
                "temperature_interval_90": self.interval, "note": self.note,
                "fitted_temperature": self.fitted, "nll_gain_interval_90": self.gain_interval,
                "brier_gain_interval_90": self.brier_gain_interval,
                "applied": bool(self.applied), "reason": self.reason, "rule": self.rule}


def no_fit(reason: str, samples: int = 0) -> TemperatureFit:
    return TemperatureFit(1.0, "none", samples, 0, None, None, reason, applied=False,
                          reason=reason)


def brier(probabilities: np.ndarray, y: np.ndarray) -> float:
    """The Brier score: mean over samples of Σ_k (p_k − [k = y])², in [0, 2]."""
    return float(sample_brier(probabilities, y).mean())


def sample_brier(probabilities: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each sample's Brier score, Σ_k (p_k − [k = y])²."""
    p = np.asarray(probabilities, np.float64)
    rows = np.arange(len(y))
    return (p ** 2).sum(1) - 2 * p[rows, y] + 1.0


def sample_nll(scores: np.ndarray, y: np.ndarray, temperature: float) -> np.ndarray:
    """Each sample's NLL under softmax(scores / T), clipped as metrics.nll clips."""
    p = softmax(scores, temperature)[np.arange(len(y)), y]
    return -np.log(np.clip(p, LOG_FLOOR, 1.0))


def _nll_slope(scores: np.ndarray, y: np.ndarray, beta: float) -> float:
    """d NLL / d β at β: mean over samples of E_softmax(β z)[z] − z_y."""
    return _nll_derivatives(scores, y, beta)[0]


def _nll_derivatives(scores: np.ndarray, y: np.ndarray, beta: float) -> tuple[float, float]:
    """d NLL / d β and d² NLL / d β² (the mean variance of z under softmax(β z): ≥ 0)."""
    p = softmax(scores * beta)
    mean = (p * scores).sum(1)
    variance = (p * scores ** 2).sum(1) - mean ** 2
    return float((mean - scores[np.arange(len(y)), y]).mean()), float(variance.mean())


def _minimum_beta(scores: np.ndarray, y: np.ndarray, low: float, high: float,
                  start: float = 1.0) -> float:
    """The β where the NLL's slope crosses 0 in [low, high]: Newton steps from `start`, a
    bisection step whenever Newton would leave the bracket (the slope is increasing, so its
    sign keeps the bracket). It ends when Newton's step is below 1e-12 of β: a slope at the
    floor of float noise still has a sign, and bisecting on it would run on for dozens of
    steps without moving β (as it did from a warm start)."""
    beta = start if low < start < high else (low + high) / 2
    for _ in range(BISECTIONS):
        slope, curvature = _nll_derivatives(scores, y, beta)
        if slope > 0:
            high = beta
        else:
            low = beta
        step = beta - slope / curvature if curvature > 0 else None
        if step is not None and abs(step - beta) <= 1e-12 * beta:
            return step
        following = step if step is not None and low < step < high else (low + high) / 2
        beta = following
    return beta


def _bisect(increasing: Callable[[float], float], low: float, high: float) -> float:
    """The root of a function increasing on [low, high] (an end when it has none there)."""
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        if increasing(middle) > 0:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def fitted_temperature(scores: np.ndarray, y: np.ndarray, errors: int,
                       start: float = 1.0) -> float:
    """fit_temperature's T alone (what a bootstrap refit needs). `start`: the T Newton's steps
    start from (a refit starts from the whole split's T: 3-4 steps instead of 7 from T = 1)."""
    low_beta, high_beta = 1 / T_MAX, 1 / T_MIN
    if errors == 0:  # NLL falls without end as T → 0: no minimum to find
        target = accuracy_lower_bound(len(y))
        return 1 / _bisect(lambda b: softmax(scores * b).max(1).mean() - target, low_beta,
                           high_beta)
    return 1 / _minimum_beta(scores, y, low_beta, high_beta, 1 / start)


def accuracy_lower_bound(samples: int) -> float:
    """The one-sided 90% (Clopper-Pearson) lower bound of the accuracy of `samples` answers with
    no error: 0.1 ** (1 / n). Laplace's (n + 1) / (n + 2), the target before the slice, is a
    point estimate: 0.992 for 126 right answers, sharper than a 98%-accurate network (digits
    seed 0 raised test NLL with it); the bound, 0.982, is what those answers show at least."""
    return 0.1 ** (1 / samples)


def fit_temperature(scores: np.ndarray, y: np.ndarray,
                    fitted_on: str = FITTED_ON) -> TemperatureFit:
    """T in [T_MIN, T_MAX] minimising NLL of softmax(scores / T) on (scores, y), the split
    `fitted_on`; the Laplace fallback when every answer is right (module docstring)."""
    scores, y = np.asarray(scores, np.float64), np.asarray(y, np.int64)
    where = SPLIT_WORDS.get(fitted_on, fitted_on)
    if len(y) == 0:
        fit = no_fit(f"no samples in the {where} to fit a temperature on")
        fit.fitted_on = fitted_on
        return fit
    errors = int((scores.argmax(1) != y).sum())
    before = nll(softmax(scores), y)
    temperature = fitted_temperature(scores, y, errors)
    if errors == 0:
        target = accuracy_lower_bound(len(y))
        method = "lower_bound"
        note = (f"the {where} has no errors in {len(y)}, so NLL keeps falling as T → 0; T set "
                f"so that its mean confidence is {target:.4f}, the one-sided 90% lower bound "
                f"of its accuracy (0.1 ** (1 / {len(y)})): no sharper than it shows")
    else:
        method, note = "nll", None
        for bound, slope_sign, why in ((T_MIN, -1, "the network is far too unsure"),
                                       (T_MAX, 1, "the scores barely tell the classes apart")):
            beta = 1 / bound
            if np.sign(_nll_slope(scores, y, beta)) == slope_sign and \
                    abs(temperature - bound) < 1e-9 * bound:
                note = f"NLL is lowest at the bound T = {bound:g}: {why}"
    return TemperatureFit(float(temperature), method, len(y), errors, before,
                          nll(softmax(scores, temperature), y), note, fitted_on=fitted_on,
                          brier_before=brier(softmax(scores), y),
                          brier_after=brier(softmax(scores, temperature), y))


def fit_with_interval(scores: np.ndarray, y: np.ndarray, seed: int = 0,
                      fitted_on: str = FITTED_ON) -> TemperatureFit:
    """fit_temperature, with the 90% bootstrap interval of T (the fit repeated on RESAMPLES
    resamples of the split) and, on the same resamples, of the fitted T's gains in NLL and in
    Brier score, score(T = 1) − score(T) (paired: both scored on each resample). A split with a
    handful of errors gives wide ones, and then a T that helps on one test split may hurt on
    another (docs/calibration.md). Undecided: `decide` says whether T is applied."""
    fit = fit_temperature(scores, y, fitted_on)
    fit.fitted = fit.temperature if fit.method != "none" else None
    scores, y = np.asarray(scores, np.float64), np.asarray(y, np.int64)
    if fit.method == "none" or scores.size > MAX_RESAMPLED_SCORES:
        return fit
    gains = sample_nll(scores, y, 1.0) - sample_nll(scores, y, fit.temperature)
    brier_gains = (sample_brier(softmax(scores), y)
                   - sample_brier(softmax(scores, fit.temperature), y))
    rng = np.random.default_rng(seed)
    refits, resampled_gains, resampled_brier = [], [], []
    wrong = scores.argmax(1) != y
    for pick in (rng.integers(0, len(y), len(y)) for _ in range(RESAMPLES)):
        refits.append(fitted_temperature(scores[pick], y[pick], int(wrong[pick].sum()),
                                         fit.temperature))
        resampled_gains.append(gains[pick].mean())
        resampled_brier.append(brier_gains[pick].mean())
    fit.interval = [float(t) for t in np.percentile(refits, [5, 95])]
    fit.gain_interval = [float(g) for g in np.percentile(resampled_gains, [5, 95])]
    fit.brier_gain_interval = [float(g) for g in np.percentile(resampled_brier, [5, 95])]
    return fit


def evidence(fit: TemperatureFit) -> tuple[bool, str]:
    """Whether the fitted split shows that the fitted T helps, and why, with the numbers: T's
    90% interval must exclude 1, the NLL gain's (the score T is fitted to) must lie above 0,
    and the Brier gain's must not lie below 0 (the second proper score may not be shown worse;
    demanding a shown gain in both kept T = 1 on an SMS network trained without weight decay
    or dropout whose T = 1.62 lowered test NLL 0.083 → 0.057). A Laplace fit (no errors) is judged the same way: with no errors the NLL falls as T
    falls, so its gain lies above 0 for a T < 1 (the network is surer than it says: evidence)
    and below for a T > 1 (Laplace's prior alone asks for softer answers: no evidence)."""
    t = f"T = {fit.temperature:.3f}"
    where = SPLIT_WORDS.get(fit.fitted_on, fit.fitted_on)
    if fit.interval is None:
        return True, (f"{t} applied without the interval test: the {where} "
                      f"({fit.samples} samples) is too large to resample")
    low, high = fit.interval
    if low <= 1.0 <= high:
        return False, (f"the 90% bootstrap interval of the fitted {t}, [{low:.3f}, {high:.3f}], "
                       f"contains 1: the {where} cannot tell it from no temperature")
    for score, (gain_low, gain_high) in (("NLL", fit.gain_interval),
                                         ("Brier", fit.brier_gain_interval or [1.0, 1.0])):
        gain = f"[{gain_low:+.4f}, {gain_high:+.4f}]"
        if score == "Brier" and gain_high < 0.0:
            return False, (f"the 90% bootstrap interval of the {where}'s Brier gain of the "
                           f"fitted {t}, {gain}, lies below 0: it makes the Brier score worse "
                           f"(T's interval [{low:.3f}, {high:.3f}] excludes 1)")
        if score == "NLL" and gain_low <= 0.0:
            why = (", since no answer in it is wrong and only a T < 1 lowers its NLL"
                   if fit.method in ("laplace", "lower_bound") else "")
            return False, (f"the 90% bootstrap interval of the {where}'s NLL gain of the "
                           f"fitted {t}, {gain}, does not lie above 0{why} (T's interval "
                           f"[{low:.3f}, {high:.3f}] excludes 1)")
    nll_gain, brier_gain = fit.gain_interval, fit.brier_gain_interval or fit.gain_interval
    return True, (f"the 90% bootstrap interval of the fitted {t}, [{low:.3f}, {high:.3f}], "
                  f"excludes 1, the NLL gain's on the {where} lies above 0 and the Brier "
                  f"gain's not below: NLL "
                  f"[{nll_gain[0]:+.4f}, {nll_gain[1]:+.4f}], Brier "
                  f"[{brier_gain[0]:+.4f}, {brier_gain[1]:+.4f}]")


def decide(fit: TemperatureFit, rule: str) -> TemperatureFit:
    """Whether the fitted T is applied: `rule` "evidence" (--calibrate temperature) applies it
    only on evidence (`evidence`), and then at the end of its 90% interval nearest 1
    (`cautious`), and otherwise keeps T = 1, which every graph then bakes; "always" (--calibrate
    temperature_always) applies the fitted T whatever the intervals say. A fit of nothing
    (method "none") stays unapplied."""
    if fit.method == "none":
        fit.applied, fit.reason = False, fit.reason or fit.note
        return fit
    fit.rule = rule
    shown, why = evidence(fit)
    if rule == "always":
        fit.applied, fit.reason = True, (f"--calibrate temperature_always applies it whatever "
                                         f"the evidence ({why})")
    else:
        fit.applied, fit.reason = shown, why
        if shown:
            fit.temperature, fit.reason = cautious(fit, why)
    if not fit.applied:
        fit.temperature = 1.0
    return fit


def cautious(fit: TemperatureFit, why: str) -> tuple[float, str]:
    """The T applied on evidence: of the fitted T and the end of its 90% interval nearest 1, the
    one nearer 1, and the reason saying so. The slice shows the direction and that T is at least
    that far from 1; the fitted T itself can overshoot (digits seed 0: fitted 0.234 on 1 error in
    126 raised test NLL 0.085 → 0.090; the interval's end, 0.845, lowered it to 0.068), and NLL
    is convex in 1/T, so a T between 1 and the fitted one still gains on the slice."""
    if fit.interval is None:
        return fit.temperature, why
    end = fit.interval[1] if fit.temperature < 1 else fit.interval[0]
    chosen = min(fit.temperature, end, key=lambda t: abs(np.log(t)))
    if chosen == fit.temperature:
        return chosen, why
    return chosen, (f"{why}; applied at the end of T's interval nearest 1, T = {chosen:.3f}: "
                    "as far from 1 as the slice shows at least")


def calibrate_scores(scores: np.ndarray, y: np.ndarray, rule: str = "evidence",
                     seed: int = 0, fitted_on: str = FITTED_ON) -> TemperatureFit:
    """The fit on the split `fitted_on` with its intervals, decided by `rule`: the T the graphs
    bake and its record."""
    return decide(fit_with_interval(scores, y, seed, fitted_on), rule)


# ----------------------------------------------------------------------------- judging


def before_after(before: np.ndarray, after: np.ndarray, y: np.ndarray, seed: int) -> dict:
    """Accuracy, mean confidence, ECE, NLL and Brier score without and with the temperature on
    one split, with the 90% paired bootstrap interval of each change."""
    row = {"samples": int(len(y))}
    for name, probabilities in (("before", before), ("after", after)):
        row[f"accuracy_{name}"] = float((probabilities.argmax(1) == y).mean())
        row[f"mean_confidence_{name}"] = float(probabilities.max(1).mean())
        row[f"ece_{name}"] = expected_calibration_error(probabilities, y)
        row[f"nll_{name}"] = nll(probabilities, y)
        row[f"brier_{name}"] = brier(probabilities, y)
    row["ece_change_interval_90"] = list(ece_change_interval(before, after, y, seed=seed))
    row["nll_change_interval_90"] = list(nll_change_interval(before, after, y, seed=seed))
    row["brier_change_interval_90"] = brier_change_interval(before, after, y, seed)
    return row


def brier_change_interval(before: np.ndarray, after: np.ndarray, y: np.ndarray, seed: int,
                          resamples: int = 500) -> list[float]:
    """The 90% paired bootstrap interval of Brier(after) − Brier(before) (as
    metrics.nll_change_interval: the mean of per-sample differences on each resample)."""
    change = sample_brier(after, y) - sample_brier(before, y)
    rng = np.random.default_rng(seed)
    means = [change[rng.integers(0, len(y), len(y))].mean() for _ in range(resamples)]
    return [float(v) for v in np.percentile(means, [5, 95])]


def verdict(fit: dict, row: dict) -> str:
    """One line: what the temperature did to ECE and NLL on the test split, judged by the
    bootstrap intervals."""
    low, high = row["ece_change_interval_90"]
    nll_low, nll_high = row["nll_change_interval_90"]
    ece = (f"ECE {row['ece_before']:.4f} → {row['ece_after']:.4f} (90% interval of the change "
           f"[{low:+.4f}, {high:+.4f}])")
    loss = (f"NLL {row['nll_before']:.4f} → {row['nll_after']:.4f} "
            f"([{nll_low:+.4f}, {nll_high:+.4f}])")
    if "brier_change_interval_90" in row:
        b_low, b_high = row["brier_change_interval_90"]
        loss += (f", Brier {row['brier_before']:.4f} → {row['brier_after']:.4f} "
                 f"([{b_low:+.4f}, {b_high:+.4f}])")
    where = f"on {row['samples']} test samples"
    t = f"T = {fit['temperature']:.3f}"
    if fit["method"] == "none":
        return f"not calibrated ({fit.get('note') or '--calibrate none'})"
    if fit.get("applied") is False:
        return (f"temperature not applied, T kept at 1: {fit.get('reason') or 'no evidence'}; "
                f"ECE {row['ece_before']:.4f}, NLL {row['nll_before']:.4f} {where}")
    if high < 0:
        return f"temperature scaling ({t}) lowers {ece} and {loss} {where}"
    if low > 0:
        return (f"temperature scaling ({t}) raises {ece} {where}: the model was better "
                f"calibrated without it ({loss})")
    return f"temperature scaling ({t}): no ECE change this test split can detect, {ece}; {loss}"


def calibration_section(fit: dict, raw: np.ndarray, calibrated: np.ndarray, y: np.ndarray,
                        seed: int) -> dict:
    """The report's `calibration`: the bundle's fit (manifest; `applied`, `fitted_temperature`
    and `rule` filled in for older bundles, manifest.Calibration) and what it does on the test
    split: `raw` is softmax(logits), `calibrated` the graph's probabilities."""
    from ttc.reporting.evaluation import reliability

    row = before_after(raw, calibrated, y, seed)
    return {"temperature": fit["temperature"], "method": fit["method"],
            "applied": fit.get("applied", fit["method"] != "none" and fit["temperature"] != 1.0),
            "reason": fit.get("reason"), "rule": fit.get("rule"),
            "fitted_temperature": fit.get("fitted_temperature", fit["temperature"]),
            "fitted_on": fit.get("fitted_on", "validation"), "fit_samples": fit.get("samples"),
            "fit_errors": fit.get("errors"), "fit_note": fit.get("note"),
            "temperature_interval_90": fit.get("temperature_interval_90"),
            "nll_gain_interval_90": fit.get("nll_gain_interval_90"),
            "brier_gain_interval_90": fit.get("brier_gain_interval_90"), "split": "test",
            **row, "verdict": verdict(fit, row),
            "reliability_before": reliability(raw, y),
            "reliability_after": reliability(calibrated, y), "shifts": None}


def shift_rows(variants: dict[str, np.ndarray], y: np.ndarray) -> list[dict]:
    """Accuracy, ECE and NLL of each variant's probabilities on one (shifted) split."""
    return [{"variant": name, "accuracy": float((p.argmax(1) == y).mean()),
             "ece": expected_calibration_error(p, y), "nll": nll(p, y)}
            for name, p in variants.items()]


def best_calibrated(shifts: list[dict]) -> dict:
    """Per variant, the mean ECE over the corruptions, and which variant is lowest."""
    names = [row["variant"] for row in shifts[0]["rows"]] if shifts else []
    means = {name: float(np.mean([r["ece"] for s in shifts for r in s["rows"]
                                  if r["variant"] == name])) for name in names}
    best = min(means, key=means.get) if means else None
    return {"mean_ece": means, "best": best}
