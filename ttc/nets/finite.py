"""The checks that stop a training run whose data or weights are not finite: inputs refused
before training (check_finite_inputs, exit 3), a loss or weights that stop being finite while
training (TrainingDiverged, exit 4), and the learning rate its message suggests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ttc.inputs.data import Dataset
from ttc.tasks.registry import task_of_kind
from utils import DataError, TrainingError


def example_rate(learning_rate: float) -> str:
    """A learning rate to suggest after `learning_rate` diverged: 1e-3, or a tenth of it when it
    was already that low, written short ("1e-3")."""
    mantissa, exponent = f"{min(1e-3, learning_rate / 10):.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


class TrainingDiverged(TrainingError):
    """A candidate's training stopped because its loss or weights stopped being finite."""

    def __init__(self, epoch: int, batch: int, what: str, learning_rate: float,
                 seed: int) -> None:
        self.epoch, self.batch, self.what = epoch, batch, what
        self.learning_rate, self.seed = learning_rate, seed
        super().__init__(f"training diverged at epoch {epoch}, batch {batch}: {what} (learning "
                         f"rate {learning_rate:g}, seed {seed})",
                         f"lower --learning_rate (e.g. {example_rate(learning_rate)})")


def nonfinite_tensors(net: nn.Module) -> list[str]:
    """The parameters and buffers (BatchNorm statistics) of `net` holding a NaN or an inf."""
    return [name for name, tensor in net.state_dict().items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


def require_finite_weights(net: nn.Module, epoch: int, batch: int, learning_rate: float,
                           seed: int) -> None:
    """TrainingDiverged (exit 4) when a weight of `net` is NaN or infinite."""
    broken = nonfinite_tensors(net)
    if broken:
        shown = ", ".join(broken[:3]) + (" ..." if len(broken) > 3 else "")
        raise TrainingDiverged(epoch, batch, f"the weights became non-finite (in {shown})",
                               learning_rate, seed)


def _sample_name(ident: str) -> str:
    """A split's sample id as a user finds it: a table row `PATH:INDEX` (0-based) becomes
    `NAME row N`, numbered like inference.py's row ids (1 = the first data row, header
    excluded); an image keeps its file name."""
    source, _, index = str(ident).rpartition(":")
    if source and index.isdigit():
        return f"{Path(source).name} row {int(index) + 1}"
    return Path(str(ident)).name


def check_finite_inputs(dataset: Dataset) -> None:
    """Refuse data the network cannot learn from before training starts: an infinite feature
    (a cell such as `inf` or `1e400`, or a number beyond float32's ±3.4e38) or a non-finite
    pixel would make the loss NaN, which would then read as divergence. NaN is a missing feature
    in a table (imputed inside the graph), so only ±inf counts there."""
    task = task_of_kind(dataset.preprocessing["kind"])
    if task.input_role == "text":  # token ids
        return
    tabular = task.missing_values  # NaN is a missing feature there
    counts: list[str] = []
    columns: set[int] = set()
    examples: list[str] = []
    total = 0
    for name, split in dataset.splits.items():
        x = split.x
        if len(x) == 0 or not np.issubdtype(x.dtype, np.floating):
            continue
        if not tabular and np.isfinite(x.sum(dtype=np.float64)):
            continue  # the usual case, without a mask as large as the images
        bad = np.isinf(x) if tabular else ~np.isfinite(x)
        rows = np.flatnonzero(bad.reshape(len(x), -1).any(axis=1))
        if not len(rows):
            continue
        total += len(rows)
        counts.append(f"{len(rows)} in the {name} split")
        examples += [_sample_name(split.ids[i]) for i in rows[:3 - len(examples)]]
        if tabular:
            columns.update(np.flatnonzero(bad.any(axis=0)).tolist())
    if not total:
        return
    where = f"e.g. {', '.join(examples)}" if examples else ""
    if tabular:
        names = [dataset.preprocessing["feature_names"][c] for c in sorted(columns)]
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        rows_hold = "1 row holds" if total == 1 else f"{total} rows hold"
        raise DataError(f"{rows_hold} an infinite value (inf, 1e400, or a number beyond "
                        f"float32's ±3.4e38) in the numeric column(s) {shown}: "
                        f"{', '.join(counts)} ({where})",
                        "remove those rows, or empty those cells so that they count as missing")
    images_hold = "1 image holds" if total == 1 else f"{total} images hold"
    raise DataError(f"{images_hold} non-finite pixel values (nan or inf): {', '.join(counts)} "
                    f"({where})", "remove or re-save those images")
