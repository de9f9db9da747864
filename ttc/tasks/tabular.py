"""The tabular classifier: numeric and categorical feature columns, NaN as missing."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task


@dataclass(frozen=True)
class TabularClassifier(Task):
    def graph_input(self, preprocessing: dict) -> dict:
        return {"name": "features", "dtype": "float32",
                "shape": ["batch", len(preprocessing["feature_names"])], "missing": "NaN"}

    def fixed_input_dims(self, preprocessing: dict) -> list[int | None]:
        names = preprocessing.get("feature_names")
        return [len(names)] if isinstance(names, list) else []

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"num_features": len(preprocessing["feature_names"])}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"num_features": len(preprocessing["feature_names"])}


TASK = TabularClassifier(name="tabular_classifier", kind="tabular", archs=("mlp", "resmlp"),
                         parts=Parts(reader="ttc.inputs.data:load_table_dataset",
                                     rows="ttc.serving.batch:FeatureRows",
                                     networks="ttc.nets.models:TABULAR_NETWORKS",
                                     modules="ttc.nets.models:TABULAR_MODULES"),
                         regularisation={
                             "mlp": Regularisation(0.2, 1e-4, source="ours"),
                             "resmlp": Regularisation(0.1, 1e-4, source=(
                                 "Gorishniy et al. 2021's ResNet, dropout from their tuned "
                                 "range"))},
                         default_tta="jitter:0.1",
                         builtins=("builtin:iris", "builtin:wine", "builtin:breast_cancer"),
                         input_role="feature", missing_values=True)
