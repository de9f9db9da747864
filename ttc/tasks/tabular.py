"""The tabular classifier: numeric and categorical feature columns, NaN as missing."""
from __future__ import annotations

from ttc.tasks.base import Task

TASK = Task(name="tabular_classifier", kind="tabular", archs=("mlp", "resmlp"),
            builtins=("builtin:iris", "builtin:wine", "builtin:breast_cancer"),
            input_role="feature", missing_values=True)
