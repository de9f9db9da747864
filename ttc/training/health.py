"""The report's `train` section and the training's health: whether the network learned from its
inputs (its loss against the class shares' prior), whether it overfits, and the hint that names
the flags to change. No torch at import."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ttc.inputs.data import Dataset
from ttc.tasks.registry import task_of_kind
from utils import LOG

if TYPE_CHECKING:
    from ttc.nets.training import TrainedModel

# a training loss that falls by less than this share: the network barely learned
LOSS_FALL_FLOOR = 0.05
# the best epoch's train accuracy this far above its validation accuracy: the network overfits
# (docs/networks.md gives the gaps measured on runs that generalise and on ones that do not)
OVERFIT_GAP = 0.10


def train_section(trained: TrainedModel, dataset: Dataset) -> dict:
    """The report's `train`, with its health: a WARNING and a hint when the network barely
    learned."""
    task = task_of_kind(dataset.preprocessing["kind"])
    metric = task.scored_by
    # a loss that is no cross-entropy over classes (a detector's): no class-share prior
    prior = (prior_loss(class_counts(dataset.train.y, len(trained.labels)))
             if task.class_prior else math.inf)
    section = {**trained.report_section(),
               "health": training_health(trained, prior, metric == "accuracy")}
    if metric != "accuracy":  # a segmenter is scored by mean IoU, a detector by mAP
        section[f"val_{metric}"] = section["val_accuracy"]
        section[f"train_{metric}"] = section["train_accuracy"]
        section["metric"] = metric  # what val_accuracy and train_accuracy hold; the history's
        # train_accuracy is the running training pixel accuracy (a segmenter's) or the box
        # recall at IoU 0.5 on 256 training images (a detector's)
    if section["health"] and section["health"]["hint"]:
        LOG.warning("%s", section["health"]["hint"])
    return section


def class_counts(y, num_classes: int) -> list[int]:
    """Samples per class, in label order (the evaluation's majority-class baseline); for masks,
    pixels per class (void pixels, beyond the classes, left out)."""
    import numpy as np

    if getattr(y, "dtype", None) == object:  # a detector's: one (k, 5) box array per image
        flat = np.concatenate([np.asarray(b).reshape(-1, 5)[:, 0] for b in y] or [[]]
                              ).astype(np.int64)
        return np.bincount(flat[flat < num_classes], minlength=num_classes).tolist()
    if np.asarray(y).dtype.kind == "f":  # a regressor's targets: every row counts for its one
        return [int(np.asarray(y).size)] * num_classes  # output
    flat = np.asarray(y, np.int64).ravel()
    return np.bincount(flat[flat < num_classes], minlength=num_classes).tolist()


def prior_loss(counts: list[int]) -> float:
    """The cross-entropy of answering every input with the classes' shares: what a network
    that learned nothing from its inputs reaches at best."""
    import numpy as np

    from ttc.reporting.metrics import entropy

    return float(entropy(np.asarray(counts, np.float64) / max(1, sum(counts))))


def training_health(trained: TrainedModel, prior: float, overfitting: bool = True
                    ) -> dict | None:
    """Whether the network learned from its inputs: the training loss must fall by
    LOSS_FALL_FLOOR from the first batch (before any update) to the last epoch's mean, and end
    below `prior`, the loss of answering the class shares. Otherwise a hint that names the
    learning rate used. `overfitting`: the history's train and validation accuracies measure
    the same thing, so their gap is a sign of overfitting (not for a segmenter's)."""
    if trained.initial_loss is None or not trained.history or trained.initial_loss <= 0:
        return None
    start, end = trained.initial_loss, trained.history[-1].loss
    fall = (start - end) / start
    problem = None
    if fall < LOSS_FALL_FLOOR:
        moved = (f"fell only {fall:.1%}" if fall > 0 else
                 "did not fall" if fall == 0 else f"rose {-fall:.1%}")
        problem = f"the training loss {moved} ({start:.4f} → {end:.4f})"
    elif end >= prior:
        problem = (f"the training loss ended at {end:.4f}, no lower than {prior:.4f} (the loss "
                   "of answering every input with the class shares)")
    epochs = len(trained.history)
    best = trained.history[max(0, trained.best_epoch - 1)]
    gap = best.train_accuracy - best.val_accuracy if overfitting else None
    hint = problem and (f"after {epochs} epoch{'s' if epochs > 1 else ''} at learning rate "
                        f"{trained.learning_rate:g}, {problem}: the network barely learned; try "
                        f"{learning_rate_advice(trained)}, or more --epochs")
    return {"loss_start": start, "loss_end": end, "loss_fall": fall, "loss_prior": prior,
            "overfit_gap": gap,
            "hint": hint or (overfit_hint(trained, best, gap) if gap is not None else None)}


def overfit_hint(trained: TrainedModel, best, gap: float) -> str | None:
    """The levers against overfitting, when the best epoch's train accuracy runs more than
    OVERFIT_GAP above its validation accuracy."""
    if gap <= OVERFIT_GAP:
        return None
    dropout = trained.architecture.get("dropout")
    return (f"the network overfits: at its best epoch ({best.epoch}) train accuracy "
            f"{best.train_accuracy:.3f} is {gap:.3f} above validation accuracy "
            f"{best.val_accuracy:.3f}; try more --dropout"
            f"{f' (now {dropout:g})' if dropout is not None else ''}, more --weight_decay, a "
            "lower --patience, more data, or a smaller --arch")


def learning_rate_advice(trained: TrainedModel) -> str:
    """The learning rates to try when the network barely learned."""
    from ttc.options.training import HF_LEARNING_RATE, LEARNING_RATE, is_hf_arch

    if is_hf_arch(trained.architecture.get("arch")):
        return (f"--lr_candidates {HF_LEARNING_RATE:g},5e-5,1e-4 (fine-tuning a transformer "
                f"usually works at {HF_LEARNING_RATE:g} to 1e-4)")
    from ttc.options.training import default_learning_rate

    default = default_learning_rate(trained.architecture.get("arch"),
                                    task_of_kind(trained.preprocessing["kind"]).name)
    return (f"--lr_candidates 1e-3,{LEARNING_RATE:g},1e-2 (a network trained from scratch "
            f"usually needs a learning rate around 1e-3; the default is {default:g})")
