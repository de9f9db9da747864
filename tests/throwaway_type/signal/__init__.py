"""A throwaway model type for tests/test_add_a_model_type.py: fixed-length 1-D signals (a table's
numeric columns s0..sN-1, read as one channel) classified by a small 1-D CNN. The test copies
this folder to ttc/tasks/signal/ in a copy of the repository, adds its line to
ttc/tasks/registry.py and its records to ttc/serving/manifest_schema.py, and runs the CLIs:
docs/design.md's "a model type" row, done as a user would."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task


@dataclass(frozen=True)
class SignalClassifier(Task):
    def graph_input(self, preprocessing: dict) -> dict:
        return {"name": "signal", "dtype": "float32",
                "shape": ["batch", 1, len(preprocessing["feature_names"])]}

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        names = preprocessing.get("feature_names")
        return [1, len(names)] if isinstance(names, list) else []

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"length": len(preprocessing["feature_names"])}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"length": len(preprocessing["feature_names"])}


TASK = SignalClassifier(
    name="signal_classifier", kind="signal", archs=("conv1d",),
    parts=Parts(reader="ttc.tasks.signal.code:load_signals",
                rows="ttc.tasks.signal.code:SignalRows",
                networks="ttc.tasks.signal.code:SIGNAL_NETWORKS",
                modules="ttc.tasks.signal.code:SIGNAL_MODULES"),
    regularisation={"conv1d": Regularisation(0.1, 1e-4, source="ours")},
    input_role="feature")
