"""Regression (`--model_type tabular_regressor` and `text_regressor`): their entries (TABULAR and
TEXT, plain data like the other entries) and, beside them, their own code: the reader of a table
with a numeric target (data.py: the tables' and texts' shared input rules, the target checked and
standardised), the networks with a one-output head that undo the standardisation in the graph
(nets.py), training scored by validation RMSE (training.py), export and its numeric check
(export.py), int8 judged by RMSE (quantize.py), the figures and the verdict against the
mean-of-train baseline (metrics.py), the test split and --input (stages.py), serving
(served.py), the report (report.py, report_plots.py); the built-in tables (builtin.py) and the
conformal intervals (intervals.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks import tabular, text
from ttc.tasks.base import Parts
from ttc.tasks.tabular import TabularClassifier
from ttc.tasks.text import TextClassifier

PREDICTION = "prediction"  # the graph's one output: (batch,) float32 in the target's units


def _prediction_output() -> list[dict]:
    return [{"name": PREDICTION, "shape": ["batch"], "dtype": "float32"}]


def target_sizes(preprocessing: dict) -> dict:
    """The report's dataset rows about the target (a classifier's are its classes): its name
    and the training split's range, mean and standard deviation (a bundle written before the
    range was recorded has none)."""
    target = preprocessing.get("target") or {}
    return {"target": target.get("name"), "target_min": target.get("min"),
            "target_max": target.get("max"), "target_mean": target.get("mean"),
            "target_std": target.get("std")}


@dataclass(frozen=True)
class TabularRegressor(TabularClassifier):
    """A table's feature columns in (NaN missing, as the tabular classifier's), the predicted
    target out."""

    def graph_outputs(self, num_classes: int) -> list[dict]:
        return _prediction_output()

    def report_sizes(self, preprocessing: dict) -> dict:
        return {**super().report_sizes(preprocessing), **target_sizes(preprocessing)}


@dataclass(frozen=True)
class TextRegressor(TextClassifier):
    """A text's word ids in (as the text classifier's), the predicted target out."""

    def graph_outputs(self, num_classes: int) -> list[dict]:
        return _prediction_output()

    def report_sizes(self, preprocessing: dict) -> dict:
        return {**super().report_sizes(preprocessing), **target_sizes(preprocessing)}


# What a regressor does not take (yet): the classifiers' training extras, the teacher,
# compression, fp16, other bundles as ensemble members (--ensemble; --ensemble_size it takes),
# the TTA merges and plans, and the streams (flags.py checks the test-time methods it takes:
# --iterative mc_dropout or ensemble, --tta for a table, --ttt bn).
REFUSED_FLAGS = (
    "image_column", "init_weights", "freeze_epochs", "label_smoothing", "teacher_lm",
    "unlabeled_path", "qat", "prune", "ensemble", "tta_merge", "tta_threshold",
    "tta_plan", "ttt_reset_every", "eval_stream", "top_k", "fp16", "ignore_index",
    "mask_dir", "pretrained", "engine", "model_def")
OWN_FLAGS = ("loss", "interval")
UNCALIBRATED = ("a regressor's prediction is a number, not class probabilities: no temperature "
                "(--interval gives conformal intervals from the calibration slice instead)")


def _parts(kind: str) -> Parts:
    return Parts(reader="ttc.tasks.regress.data:load_regression_dataset",
                 rows=f"ttc.serving.batch:{'TextRows' if kind == 'text' else 'FeatureRows'}",
                 networks=f"ttc.tasks.regress.nets:{kind.upper()}_NETWORKS",
                 modules=f"ttc.tasks.regress.nets:{kind.upper()}_MODULES",
                 evaluation="ttc.tasks.regress.metrics:evaluation_section",
                 trainer="ttc.tasks.regress.training:train_regressor",
                 served="ttc.tasks.regress.served:RegressorServing",
                 flag_checks=f"ttc.tasks.regress.flags:check_{kind}_regressor_flags",
                 exporter="ttc.tasks.regress.export:export_regression_bundle",
                 quantizing="ttc.tasks.regress.quantize:QUANTIZING",
                 test_split="ttc.tasks.regress.stages:evaluate_regressor",
                 new_input="ttc.tasks.regress.stages:predict_values",
                 report="ttc.tasks.regress.report:REPORT")


# its own plots (report_plots.py draws them), with their captions on the page
PLOTS = (("predicted_vs_true", "regression: predicted against true target on the test split (a "
                               "sample of up to 500 rows), the diagonal and the conformal band"),
         ("residuals", "regression: residual (true − predicted) against the prediction"),
         ("decile_errors", "regression: MAE and RMSE per decile of the true target, with the "
                           "mean-of-train baseline's RMSE"))
_COMMON = dict(plots=PLOTS, refused_flags=REFUSED_FLAGS, own_flags=OWN_FLAGS,
               flags="ttc.tasks.regress.options:RegressionFlags", guide="regression.md",
               scored_by="rmse", program="RegressorProgram", class_prior=False,
               uncalibrated=UNCALIBRATED, calibration_slice=True, min_labels=1)
TABULAR = TabularRegressor(
    name="tabular_regressor", kind="tabular_regression", archs=("mlp", "resmlp"),
    parts=_parts("tabular"), regularisation=tabular.TASK.regularisation,
    builtins=("builtin:diabetes", "builtin:friedman1"), input_role="feature",
    default_tta="jitter:0.1,0.1,0.1,0.1",  # four small feature-noise views beside the plain
    missing_values=True, **_COMMON)
TEXT = TextRegressor(
    name="text_regressor", kind="text_regression", archs=("bag", "cnn", "transformer"),
    parts=_parts("text"), regularisation=text.TASK.regularisation,
    builtins=("builtin:review_scores",), input_role="text", input_field="text",
    reads_lines=True, hf_archs=True, **_COMMON)
