"""Train a classifier: a torch network inside a DSPy program, trained by a DSPy Teleprompter.

    python train.py --dataset_path builtin:digits --output_model runs/digits/model.onnx

writes the weights (model.pt) and manifest (model.json) of the bundle; export.py then writes
model.onnx. pipeline.py runs both in one process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from config import Config, build_parser, start_cli
from data import Dataset, DataOptions, load_dataset
from bundle import (BundlePaths, manifest_text, new_manifest, record_side_file, record_weights,
                    side_files)
from report import run_with_report
from utils import (LOG, atomic_write, atomic_write_text, exit_cli, quiet_library_loggers,
                   run_cli, sha256_of)

if TYPE_CHECKING:  # torch and dspy load only once flags are parsed: --help stays instant
    import dspy

    from program import TrainedModel


def cap_batch_size(config: Config, dataset: Dataset) -> None:
    """A --batch_size above the training split's size trains on the whole split per step: say
    so once, and use the split's size everywhere (training, validation, timing)."""
    samples = len(dataset.train)
    if config.batch_size > samples > 0:
        LOG.warning("--batch_size %d is larger than the training split (%d samples); using %d",
                    config.batch_size, samples, samples)
        config.batch_size = samples


def train_stage(config: Config, dataset: Dataset, report: dict,
                teacher_lm: dspy.BaseLM | None = None) -> tuple[TrainedModel, Dataset]:
    """Training as pipeline.py and train.py run it: with --teacher_lm, the teacher labels the
    unlabeled texts and the student is trained twice, without and with them, so the report can
    say what the teacher's labels bought. Returns the model to export and the data it saw.
    `teacher_lm` replaces the LM --teacher_lm names (tests pass dspy.utils.DummyLM)."""
    from program import train_classifier

    if not config.teacher_lm:
        trained = train_classifier(config, dataset)
        report["train"] = trained.report_section()
        return trained, dataset
    from teacher import distill

    distilled = distill(config, dataset, teacher_lm)
    report["teacher"] = distilled.section
    LOG.info("student without the teacher's labels (%d training texts)", len(dataset.train))
    baseline = train_classifier(config, dataset)
    LOG.info("student with the teacher's labels (%d training texts)", len(distilled.dataset.train))
    trained = train_classifier(config, distilled.dataset)
    report["train"] = trained.report_section()
    report["teacher"].update(teacher_comparison(baseline, dataset, trained, distilled.dataset))
    return trained, distilled.dataset


def teacher_comparison(baseline: TrainedModel, dataset: Dataset, student: TrainedModel,
                       enlarged: Dataset) -> dict:
    """Student accuracy without and with the teacher's data, and a plain verdict."""
    from program import split_accuracy

    test = "test" in dataset.splits
    row = {"student_val_accuracy_without_teacher": baseline.val_accuracy,
           "student_val_accuracy_with_teacher": student.val_accuracy,
           "student_accuracy_without_teacher": split_accuracy(baseline.net, dataset.test)
           if test else None,
           "student_accuracy_with_teacher": split_accuracy(student.net, enlarged.test)
           if test else None}
    before, after = (("student_accuracy_without_teacher", "student_accuracy_with_teacher")
                     if test else ("student_val_accuracy_without_teacher",
                                   "student_val_accuracy_with_teacher"))
    delta = row[after] - row[before]
    where = "test" if test else "validation"
    row["verdict"] = (f"the teacher's labels raised {where} accuracy by {delta:+.4f}" if delta > 0
                      else f"the teacher's labels did not help: {where} accuracy {delta:+.4f}; "
                      "check the teacher's validation accuracy, or give it more demos "
                      "(--teacher_demos) or a stronger model")
    if delta <= 0:
        LOG.warning("%s", row["verdict"])
    return row


def build_manifest(config: Config, trained: TrainedModel, dataset: Dataset,
                   teacher: dict | None = None) -> dict:
    """The bundle manifest as training knows it (bundle.new_manifest); export fills the rest."""
    from models import input_spec

    return new_manifest(
        model_type=config.model_type, labels=trained.labels,
        input_spec=input_spec(trained.preprocessing), preprocessing=trained.preprocessing,
        architecture=trained.architecture,
        dataset={**dataset.options.to_manifest(), "given_splits": dataset.given_splits,
                 "counts": dataset.counts, "skipped_images": len(dataset.skipped),
                 "columns": dataset.columns.to_manifest() if dataset.columns else None},
        training={"program": "ClassifierProgram (dspy.Module)",
                  "optimizer": "WeightTrainer (dspy.teleprompt.Teleprompter): AdamW, " + (
                      "linear warm-up and decay, gradients clipped to norm 1"
                      if trained.architecture["name"] == "HFTextNet" else "one-cycle"),
                  "epochs": config.epochs, "batch_size": config.batch_size,
                  "learning_rate": config.learning_rate, "weight_decay": config.weight_decay,
                  "train_augment": config.train_augment, "seed": config.seed,
                  "augment_transforms": (config.tta_transforms or "default")
                  if config.tta and config.train_augment else None,
                  **trained.report_section(),
                  "history": [vars(r) for r in trained.history], "teacher": teacher})


def save_checkpoint(config: Config, trained: TrainedModel, dataset: Dataset,
                    paths: BundlePaths, teacher: dict | None = None) -> dict:
    """train.py alone: weights and a manifest without an ONNX graph (export.py adds it)."""
    from models import save_weights

    manifest = build_manifest(config, trained, dataset, teacher)
    record_weights(manifest, paths, save_weights(trained.net, paths.weights))
    # the bundle keeps the --model_def file (export and Tent rebuild from it) and an hf tokenizer
    for key, data in side_files(manifest).items():
        atomic_write(paths.side_file(key), lambda tmp, d=data: tmp.write_bytes(d))
        record_side_file(manifest, paths, key, sha256_of(paths.side_file(key)))
    atomic_write_text(paths.manifest, manifest_text(manifest))
    return manifest


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "train", "Train a classifier and write its weights (PATH.pt) and manifest "
        "(PATH.json); export.py turns them into PATH.onnx.",
        required=["dataset_path", "output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits "
               "--output_model runs/digits/model.onnx --epochs 20")
    config = start_cli(parser, argv)
    config.validate_tta(config.model_type)
    from program import set_torch_threads  # imports torch and dspy

    quiet_library_loggers()
    set_torch_threads(config.num_threads)

    def stages(report: dict) -> None:
        # With a teacher, the test split measures what its labels bought.
        splits = ("train", "val", "test") if config.teacher_lm else ("train", "val")
        dataset = load_dataset(DataOptions.from_config(config), splits=splits)
        report["dataset"] = dataset.report_section()
        cap_batch_size(config, dataset)
        trained, dataset = train_stage(config, dataset, report)
        save_checkpoint(config, trained, dataset, BundlePaths.from_model_path(config.output_model),
                        report.get("teacher"))

    return run_with_report(config, stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
