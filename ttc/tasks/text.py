"""The text classifier: a text column (or several, joined), word or Hugging Face tokens."""
from __future__ import annotations

from ttc.tasks.base import Task

TASK = Task(name="text_classifier", kind="text", archs=("bag", "cnn", "transformer"),
            input_role="text", input_field="text", reads_lines=True, hf_archs=True, teacher=True)
