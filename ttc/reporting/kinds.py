"""Which model type made a report, and its report part: the one place ttc/reporting learns a
report's type, from what the report records (dataset.model_type, else config.model_type),
else by asking each type's part whether the report is its own (`recognises`: an older report, or
inference.py's, which names none), else the classifier's. Plain data: no type's code is imported
here; a type's part is resolved through its registry entry (ttc.tasks.base.Parts.report)."""
from __future__ import annotations

from typing import Any, Mapping

from ttc.reporting.classifier_report import ClassifierReport
from ttc.tasks.base import Task
from ttc.tasks.registry import TASKS, find_task


def recorded_task(report: Mapping[str, Any]) -> Task | None:
    """The entry of the model type the report records, or None where it names none we know."""
    for key in ("dataset", "config"):
        section = report.get(key) if isinstance(report, Mapping) else None
        name = section.get("model_type") if isinstance(section, Mapping) else None
        if isinstance(name, str) and find_task(name) is not None:
            return find_task(name)
    return None


def report_part(report: Mapping[str, Any]) -> ClassifierReport:
    """The report part of the type that made `report` (the classifier's by default)."""
    task = recorded_task(report)
    if task is not None:
        return task.part("report")
    parts = [task.part("report") for task in TASKS]
    return next((part for part in parts[1:] if part.recognises(report)), parts[0])
