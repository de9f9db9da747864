"""A model type's part in its report, and the classifier's (the default `Parts.report`): what
the summary, the page and the plots ask the type that made a report for, so that ttc/reporting
never guesses the type from a report's keys. Another type subclasses ClassifierReport in its own
folder (ttc/tasks/TYPE/report.py) and names its instance in its Parts; `report_part`
(ttc/reporting/kinds.py) finds it from the report's model type.

What it answers: the labelled rows of each section (`keys`: the table's, with its own rows),
the summary's formatters that replace the table's (`formatters`), the page's renderers that
replace page.py's (`renderers`), the headline's figures (`headline`), the plots it draws
(`plots`, names of ttc/reporting/sections.py's PLOT_CAPTIONS), and the names of its scores.
stdlib only: the summary asks it at the end of every run.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

from ttc.reporting.sections import Formatter, KeyLabels, Section
from ttc.reporting.summary import format_keys, format_training, format_ttt

Plot = Callable[[dict], Any]  # (report) -> a matplotlib Figure, or None without its data
Renderer = Callable[[Any, Any], list]  # (section data, page._View) -> the section's parts


@dataclass(frozen=True)
class ScoreNames:
    """What a type's training and test-time scores are called: the history's train_accuracy
    and val_accuracy (the page's columns), the same on the training curves' legend and the
    curves' panel title, the summary's candidate column, and the figure a test-time section
    (TTT, TTA) measures."""

    history: tuple[str, str] = ("train accuracy", "val accuracy")
    curves: tuple[str, str] = ("train", "val")
    curves_title: str = "accuracy"
    candidate: str = "val acc"
    metric: str = "accuracy"
    # what a compressed variant's `accuracy*` keys hold (quantize, fp16: the scorer's figure);
    # the table's labels say "accuracy", replaced by this where a type names another
    judged: str = "accuracy"


JUDGED_SECTIONS = frozenset({"quantize", "fp16"})  # their accuracy* rows hold `judged`


@dataclass(frozen=True)
class TtaFigures:
    """The TTA plot's figures: (split, key) pairs plain and with TTA (`KEY_plain` and `KEY`),
    what `fixed` and `broken` count, and the figure's name."""

    scores: tuple[tuple[str, str], ...] = (("test", "accuracy"), ("val", "accuracy_val"))
    unit: str = "test samples"
    metric: str = "accuracy"


def with_rows(keys: KeyLabels, after: str, rows: KeyLabels,
              without: frozenset[str] = frozenset()) -> KeyLabels:
    """`keys` less those in `without`, with `rows` put right after the key `after`."""
    out: list[tuple[str, str]] = []
    for key, label in keys:
        if key not in without:
            out.append((key, label))
        if key == after:
            out += rows
    return tuple(out)


class ClassifierReport:
    """The classifier's report: the table's labels and formatters, page.py's renderers, the
    shared plots only."""

    names: ScoreNames = ScoreNames()
    tta: TtaFigures = TtaFigures()
    confusion_unit: str = "samples"  # what the confusion matrix counts
    confusion_score: str = "accuracy"  # the evaluation's key of its share on the diagonal

    def recognises(self, report: Mapping[str, Any]) -> bool:
        """Whether a report that names no model type (an older one, inference.py's) is this
        type's, from its own sections: never for the classifier, the default."""
        return False

    def keys(self, section: str, labels: KeyLabels | None, data: Any) -> KeyLabels | None:
        """The labelled rows of `section` (the summary's and the page's), given the table's
        `labels` (None: the page shows the section's plain keys) and the section's data."""
        if labels is None or section not in JUDGED_SECTIONS or self.names.judged == "accuracy":
            return labels
        return tuple((key, label.replace("accuracy", self.names.judged)) for key, label in labels)

    def formatters(self) -> dict[str, Formatter]:
        """The summary's lines after a section's key rows, by section, replacing the table's."""
        return {"train": partial(format_training, score=self.names.candidate),
                "ttt": partial(format_ttt, metric=self.names.metric)}

    def renderers(self) -> dict[str, Renderer]:
        """The page's renderers of its own sections (page.py's `_render_<page>` otherwise)."""
        return {}

    def plots(self) -> dict[str, Plot]:
        """The plots it draws itself, by name (the others are ttc/reporting/plots.py's)."""
        return {}

    def summary(self, section: Section, data: Any) -> list[str]:
        """A section's lines in the summary: its labelled key rows, then its formatter's."""
        keys = self.keys(section.key, section.keys, data) or ()
        details = self.formatters().get(section.key, section.details)
        return [*format_keys(data, keys), *(details(data) if details else [])]

    def headline(self, report: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """The page headline's figures (label, value; a None value is left out)."""
        evaluation = _dict(report.get("evaluation"))
        accuracy = evaluation.get("accuracy")
        accuracy_from = f"{evaluation.get('split') or 'test'} accuracy"
        if accuracy is None and _dict(report.get("inference")).get("accuracy") is not None:
            accuracy, accuracy_from = report["inference"]["accuracy"], "test accuracy"
        return [(accuracy_from, accuracy), ("macro-F1", evaluation.get("macro_f1")),
                ("balanced accuracy", evaluation.get("balanced_accuracy")),
                ("baseline accuracy", evaluation.get("baseline_accuracy"))]


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


REPORT = ClassifierReport()
