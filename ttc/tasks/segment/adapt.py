"""Test-time training for a segmenter (issue 43, item 4), episodic: every batch of test images
starts from the bundle's parameters.
- `bn` re-estimates BatchNorm statistics on the batch, through the bundle's adaptation graph
  (model.bn.onnx, rewritten by ttc/testtime/ttt.py so that every BatchNormalization normalises
  with the batch's statistics blended with the stored ones by --ttt_bn_prior). A batch of
  images holds thousands of pixels per channel, so even one image gives usable statistics.
- `tent` minimises the mean entropy over the batch's pixels (ttt.py's Tent, whose softmax and
  entropy run over axis 1, a segmenter's class axis) in --ttt_iterations steps on a PyTorch copy
  of the network, then predicts through the adaptation graph with the adapted affine
  parameters (--ttt_predict after) or returns the last step's own forward (before). With
  --ttt_guard filter, pixels whose entropy is above EATA's limit stay out of the loss.
With --eval_shift, the same on each corruption of the test images (the photometric ones: a
geometric shift would move the pixels away from their masks): mean IoU before and after, per
corruption. bn runs in ONNX Runtime only; tent imports torch."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ttc.inputs.shifts import corrupt
from ttc.tasks.segment.evaluate import MaskRunner, batches, confusion_of
from ttc.tasks.segment.metrics import summary_scores
from ttc.testtime.ttt import AdaptationGraph, Tent, with_clean_only_hint

METRIC = "mean_iou"  # what the section's accuracy_* cells hold (the classifiers': accuracy)


@dataclass(frozen=True)
class EpisodicScores:
    """What an image model's episodic `ttt` section holds of a pass's figures: `metric` the one
    its accuracy_* cells repeat, `figures` those each row keeps per method, and `compared` the
    one the verdict compares, by its name `compared_name`."""

    metric: str
    figures: tuple[str, ...]
    compared: str
    compared_name: str


SCORES = EpisodicScores(METRIC, ("mean_iou", "pixel_accuracy"), "mean_iou", "mean IoU")
# A runner (a segmenter's MaskRunner, a detector's DetectionRunner) and images → (its figures
# over them, seconds)
ScoredPass = Callable[[Callable, np.ndarray], tuple[dict, float]]


def adapted_runner(graph: AdaptationGraph, prior: float) -> MaskRunner:
    """A batch → its masks after bn: the argmax of the probabilities the adaptation graph gives
    with the batch's own (blended) statistics."""
    return lambda batch: graph.run(batch, prior, {})[0].argmax(axis=1)


def tent_runner(graph: AdaptationGraph, tent: Tent, predict_before: bool) -> MaskRunner:
    """A batch → its masks after tent's steps on it, from the bundle's parameters."""
    def run(batch: np.ndarray) -> np.ndarray:
        tent.reset()
        observed = tent.step(batch)
        if predict_before and observed is not None:
            return observed.argmax(axis=1)
        return graph.run(batch, 0.0, tent.parameters())[0].argmax(axis=1)
    return run


def scored_pass(run: MaskRunner, x: np.ndarray, y: np.ndarray, num_classes: int,
                ignore_index: int, batch_size: int) -> tuple[dict, float]:
    """(mean IoU and pixel accuracy over the split, seconds) of one pass, a batch at a time."""
    started = time.perf_counter()
    masks = np.concatenate([run(batch) for batch in batches(x, batch_size)])
    seconds = time.perf_counter() - started
    return summary_scores(confusion_of(masks, y, num_classes, ignore_index).matrix), seconds


def data_row(score: ScoredPass, source: Callable, adapted: dict[str, Callable], x: np.ndarray,
             scores: EpisodicScores) -> dict:
    """The figures (`scores`) of the source graph's pass over the images `x` and of each
    method's (`adapted`), with each method's cost against the source pass. `score`: a runner's
    figures and seconds over images."""
    before, plain_seconds = score(source, x)
    row = {"accuracy_source": before[scores.metric],
           **{f"{name}_source": before[name] for name in scores.figures}}
    for method, run in adapted.items():
        after, seconds = score(run, x)
        row.update({f"accuracy_{method}": after[scores.metric],
                    **{f"{name}_{method}": after[name] for name in scores.figures},
                    f"cost_ratio_{method}": round(seconds / max(plain_seconds, 1e-9), 3)})
    return row


def mean_row(rows: Sequence[dict]) -> dict | None:
    if not rows:
        return None
    keys = [k for k in rows[0] if k not in ("name", "severity")]
    return {k: float(np.mean([row[k] for row in rows])) for k in keys}


def dense_ttt_section(source: MaskRunner, adapted: dict[str, MaskRunner], x: np.ndarray,
                      y: np.ndarray, labels: Sequence[str], preprocessing: dict,
                      batch_size: int, shifts: Sequence[str], severity: int, seed: int,
                      settings: dict) -> dict:
    """The report's `ttt` for a segmenter, in the classifiers' shape (clean, shifts,
    mean_shifted; each row's accuracy_* cells hold mean IoU: `metric` says so), with the
    verdict. `adapted`: each method's runner (bn: adapted_runner, tent: tent_runner);
    `settings`: the section's method, bn_prior, iterations, learning_rate, guard, predict."""
    ignore_index, classes = preprocessing["ignore_index"], len(labels)
    return episodic_section(
        lambda run, images: scored_pass(run, images, y, classes, ignore_index, batch_size),
        source, adapted, x, preprocessing, shifts, severity, seed, batch_size, settings, SCORES)


def episodic_section(score: ScoredPass, source: Callable, adapted: dict[str, Callable],
                     x: np.ndarray, preprocessing: dict, shifts: Sequence[str], severity: int,
                     seed: int, batch_size: int, settings: dict, scores: EpisodicScores) -> dict:
    """An image model's episodic `ttt` section (a segmenter's, a detector's): a data_row on
    the clean images and on each corruption of them (`shifts` at `severity`, seeded), their
    mean, and the verdict. `score`: a runner's figures and seconds over images."""
    clean = data_row(score, source, adapted, x, scores)
    rows = [{"name": name, "severity": severity,
             **data_row(score, source, adapted, corrupt(x, name, severity, preprocessing, seed),
                        scores)} for name in shifts]
    section = {**settings, "mode": "episodic", "batch_size": batch_size,
               "metric": scores.metric, "clean": clean, "shifts": rows,
               "mean_shifted": mean_row(rows)}
    section["verdict"] = verdict(clean, section["mean_shifted"], list(adapted), scores)
    if not shifts:
        section["verdict"] = with_clean_only_hint(section["verdict"], preprocessing.get("kind"))
    return section


def verdict(clean: dict, shifted: dict | None, methods: Sequence[str],
            scores: EpisodicScores = SCORES) -> str:
    parts = []
    for method in methods:
        for name, row in (("the corruptions (mean)", shifted), ("clean images", clean)):
            if row is None:
                continue
            before = row[f"{scores.compared}_source"]
            after = row[f"{scores.compared}_{method}"]
            parts.append(f"{method} {'raised' if after > before else 'did not raise'} "
                         f"{scores.compared_name} on {name} ({before:.4f} → {after:.4f}, "
                         f"{after - before:+.4f})")
    return "; ".join(parts)
