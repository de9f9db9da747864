"""The model types, in --model_type's order (the first is the default): adding one is its entry
(a module in this folder, or a folder whose __init__.py holds it beside the type's own code, which
its Parts reference) and a line here. Its manifest records are the one other place: a bundle is
untrusted, so every schema it is checked against stays in serving/manifest_schema.py."""
from __future__ import annotations

from ttc.tasks import detect, image, segment, tabular, text
from ttc.tasks import regress
from ttc.tasks.base import Task

TASKS: tuple[Task, ...] = (image.TASK, text.TASK, tabular.TASK, segment.TASK, detect.TASK,
                           regress.TABULAR, regress.TEXT)
_BY_NAME = {task.name: task for task in TASKS}
_BY_KIND = {task.kind: task for task in TASKS}


def task_for(model_type: str) -> Task:
    """The entry of a --model_type name (KeyError for an unknown one: the flags' choices and the
    manifest's schema refuse those first)."""
    return _BY_NAME[model_type]


def find_task(model_type: str) -> Task | None:
    """The entry of a --model_type name, or None for a name no entry has."""
    return _BY_NAME.get(model_type)


def task_of_kind(kind: str) -> Task:
    """The entry of a manifest's preprocessing.kind."""
    return _BY_KIND[kind]


def model_types() -> tuple[str, ...]:
    return tuple(task.name for task in TASKS)


def builtin_datasets() -> dict[str, str]:
    """builtin:NAME → the model type it is data for, in the order --help lists them."""
    return {name: task.name for task in TASKS for name in task.builtins}


def archs() -> dict[str, tuple[str, ...]]:
    return {task.name: task.archs for task in TASKS}
