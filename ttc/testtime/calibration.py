"""The report's `calibration` section at inference: the bundle's temperature and what it does on
the test split, and with --eval_shift every calibration variant (the single pass without and
with its temperature, an iterative method's average without and with its own) on corrupted
copies of the test split. calibrate.py holds the fit and the figures (numpy only); this module
runs them on a bundle's graph.

Not a registry entry: no flag asks for it (every evaluation reports it), it predicts nothing on
--input, and under shift it measures the variants the other methods hand back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ttc.serving.runtime import predict_proba
from ttc.testtime.served import Variants
from utils import LOG

if TYPE_CHECKING:
    import onnxruntime as ort

    from ttc.serving.manifest import Manifest, Preprocessing
    from ttc.testtime.iterative import Passes


def single_variants(session: ort.InferenceSession, manifest: Manifest, batch_size: int
                    ) -> Variants:
    """The single pass without the temperature (softmax of the graph's logits) and, for a
    calibrated bundle, with it (the graph's probabilities)."""
    calibrated = manifest.temperature != 1.0

    def variants(x: np.ndarray) -> dict:
        out = {"single": without_temperature(session, x, batch_size)}
        if calibrated:
            out["single+T"] = predict_proba(session, x, batch_size)
        return out

    return variants


def averaged_variants(name: str, passes: Callable[[np.ndarray], Passes],
                      temperature: float | None) -> Variants:
    """An average of passes or members, and the average rescaled by its own temperature."""
    from ttc.testtime.calibrate import rescale

    def variants(x: np.ndarray) -> dict:
        mean = passes(x).mean
        return {name: mean, **({f"{name}+T": rescale(mean, temperature)}
                               if temperature is not None else {})}

    return variants


def joined(*parts: Variants) -> Variants:
    return lambda x: {name: p for part in parts for name, p in part(x).items()}


def without_temperature(session: ort.InferenceSession, x: np.ndarray, batch_size: int
                        ) -> np.ndarray | None:
    """softmax(logits) of the graph on x: the single pass without its temperature (None for a
    graph without a logits output)."""
    from ttc.testtime.calibrate import softmax

    if "logits" not in {o.name for o in session.get_outputs()}:
        return None
    return softmax(predict_proba(session, x, batch_size, "logits"))


def run_calibration(manifest: Manifest, raw: np.ndarray | None, probabilities: np.ndarray,
                    y: np.ndarray, seed: int) -> dict | None:
    """The report's `calibration`: the bundle's temperature and what it does on the test split,
    from the single pass without (`raw`) and with it (None without a raw pass)."""
    from ttc.testtime.calibrate import calibration_section, no_fit

    if raw is None:
        return None
    fit = (manifest.calibration.report_entry() if manifest.calibration else None) or no_fit(
        "a bundle written before calibration: re-run pipeline.py to fit a temperature"
    ).manifest_entry()
    section = calibration_section(fit, raw, probabilities, y, seed)
    (LOG.warning if section["ece_change_interval_90"][0] > 0 else LOG.info)(
        "calibration: %s", section["verdict"])
    return section


def calibration_under_shift(eval_shift: str, severity: int, seed: int,
                            preprocessing: Preprocessing,
                            variants: Variants, test: tuple[np.ndarray, np.ndarray]) -> dict:
    """--eval_shift: accuracy, ECE and NLL of every variant on each corrupted copy of the test
    split (Ovadia et al. 2019's protocol), and which variant is best calibrated on average."""
    from ttc.inputs.shifts import corrupt, parse_shift_names
    from ttc.testtime.calibrate import best_calibrated, shift_rows

    x, y = test
    shifts = []
    for name in parse_shift_names(eval_shift, preprocessing.kind):
        shifted = corrupt(x, name, severity, preprocessing.spec, seed)
        shifts.append({"name": name, "severity": severity,
                       "rows": shift_rows(variants(shifted), y)})
    best = best_calibrated(shifts)
    LOG.info("calibration under shift (severity %d): mean ECE %s; best calibrated: %s",
             severity, ", ".join(f"{k} {v:.4f}" for k, v in best["mean_ece"].items()),
             best["best"])
    return {"shifts": shifts, "under_shift": best}
