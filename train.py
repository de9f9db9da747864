"""Train a classifier: a torch network inside a DSPy program, trained by a DSPy Teleprompter.

    python train.py --dataset_path builtin:digits --output_model runs/digits/model.onnx

writes the weights (model.pt) and manifest (model.json) of the bundle; export.py then writes
model.onnx. pipeline.py runs both in one process.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from config import Config, build_parser, start_cli
from ttc.inputs.data import Dataset, DataOptions, load_dataset
from ttc.serving.bundle import (BundlePaths, Manifest, manifest_text, new_manifest,
                                record_side_file, record_weights)
from report import run_with_report
from utils import (LOG, atomic_write, atomic_write_text, exit_cli, quiet_library_loggers,
                   run_cli, sha256_of)

if TYPE_CHECKING:  # torch and dspy load only once flags are parsed: --help stays instant
    import dspy

    from ttc.nets.program import TrainedModel


def cap_batch_size(config: Config, dataset: Dataset) -> None:
    """A --batch_size above the training split's size trains on the whole split per step: say
    so once, and use the split's size everywhere (training, validation, timing)."""
    samples = len(dataset.train)
    if config.batch_size > samples > 0:
        LOG.warning("--batch_size %d is larger than the training split (%d samples); using %d",
                    config.batch_size, samples, samples)
        config.batch_size = samples


def check_training_device(config: Config) -> None:
    """--device and --amp against what torch sees (a local run; a Ray run's workers check
    their own): exit 2 for a GPU that is not there, before any data is read where one is
    named."""
    if config.trains_on_ray():
        return
    from ttc.nets.device import precision_for, training_device

    precision_for(config.amp, training_device(config.device))


def train_stage(config: Config, dataset: Dataset, report: dict,
                teacher_lm: dspy.BaseLM | None = None) -> tuple[TrainedModel, Dataset]:
    """Training as pipeline.py and train.py run it: with --teacher_lm, the teacher labels the
    unlabeled texts and the student is trained twice, without and with them, so the report can
    say what the teacher's labels bought. Returns the model to export and the data it saw.
    `teacher_lm` replaces the LM --teacher_lm names (tests pass dspy.utils.DummyLM)."""
    from ttc.tasks.registry import task_for

    check_training_device(config)
    train_classifier = task_for(config.model_type).part("trainer")
    if config.trains_on_ray():  # a classifier on Ray Train (config refused the other types)
        from ttc.distributed.driver import train_on_ray

        train_classifier = train_on_ray
    if config.compresses():  # a network with no path for --prune / --qat: before training
        from ttc.compress.variants import check_compressible

        check_compressible(config, dataset)
    if not config.teacher_lm:
        trained = train_classifier(config, dataset)
        report["train"] = train_section(trained, dataset)
        calibrate_network(config, trained, dataset, report)
        compress_stage(config, trained, dataset, report)
        return trained, dataset
    from ttc.nets.teacher import distill

    distilled = distill(config, dataset, teacher_lm)
    report["teacher"] = distilled.section
    LOG.info("student without the teacher's labels (%d training texts)", len(dataset.train))
    baseline = train_classifier(config, dataset)
    LOG.info("student with the teacher's labels (%d training texts)", len(distilled.dataset.train))
    trained = train_classifier(config, distilled.dataset)
    report["train"] = train_section(trained, distilled.dataset)
    report["teacher"].update(teacher_comparison(baseline, dataset, trained, distilled.dataset))
    calibrate_network(config, trained, distilled.dataset, report)
    compress_stage(config, trained, distilled.dataset, report)
    return trained, distilled.dataset


def compress_stage(config: Config, trained: TrainedModel, dataset: Dataset, report: dict) -> None:
    """--prune / --qat: the compressed variants of the trained network, fine-tuned (export
    exports and checks them, the gate judges them). In the report: train.compression."""
    if not config.compresses():
        return
    from ttc.compress.variants import compress_trained

    trained.compressed, trained.fp32_record = compress_trained(config, trained, dataset)
    report["train"]["compression"] = [
        {"name": v.name, "recipe": v.recipe, "params": v.params, "macs": v.macs,
         "channels": v.channels, "val_accuracy_torch": v.val_accuracy_torch,
         "seconds": v.seconds, "history": v.history} for v in trained.compressed]


def calibrate_network(config: Config, trained: TrainedModel, dataset: Dataset,
                      report: dict) -> None:
    """--calibrate temperature: fit T on the validation split's logits (calibrate.py); the
    manifest records it and export bakes it into every graph. In the report: train.calibration."""
    from ttc.testtime.calibrate import RULES, calibrate_scores, no_fit

    if config.calibrate == "none":
        fit = no_fit("--calibrate none")
    elif scored_by(dataset) == "map":
        fit = no_fit("a detector's box scores are not temperature-scaled (COCO mAP ranks them)")
    elif len(dataset.val) == 0:
        fit = no_fit("the validation split is empty: no temperature can be fitted")
        LOG.warning("calibration: %s", fit.note)
    else:
        logits, truth = validation_scores(config, trained, dataset)
        fit = calibrate_scores(logits, truth, RULES[config.calibrate], config.seed)
        LOG.info("calibration: temperature %.4f%s (%s) fitted on %d validation %s with %d "
                 "errors, NLL %.4f → %.4f%s; %s: %s", fit.fitted,
                 " [%.3f, %.3f]" % tuple(fit.interval) if fit.interval else "", fit.method,
                 fit.samples, "pixels" if dense(dataset) else "samples", fit.errors,
                 fit.nll_before, fit.nll_after,
                 f"; {fit.note}" if fit.note else "",
                 "applied" if fit.applied else "not applied (T = 1)", fit.reason)
    trained.calibration = fit.manifest_entry()
    report["train"]["calibration"] = trained.calibration


def dense(dataset: Dataset) -> bool:
    """One prediction per pixel (a segmenter), not per sample."""
    from ttc.tasks.registry import task_of_kind

    return task_of_kind(dataset.preprocessing["kind"]).dense


def scored_by(dataset: Dataset) -> str:
    """What train_accuracy and val_accuracy hold: a classifier's accuracy, a segmenter's mean
    IoU, a detector's COCO mAP@[.5:.95]."""
    return {"segmentation": "mean_iou", "detection": "map"}.get(
        dataset.preprocessing["kind"], "accuracy")


def validation_scores(config: Config, trained: TrainedModel, dataset: Dataset):
    """The validation logits and classes a temperature is fitted on: one row per sample, or
    for a segmenter a seeded sample of its non-void pixels."""
    if dense(dataset):
        from ttc.tasks.segment.evaluate import pixel_logits

        return pixel_logits(trained.net, dataset.val.x, dataset.val.y,
                            dataset.preprocessing["ignore_index"], config.batch_size,
                            config.seed)
    from ttc.nets.program import split_logits

    return split_logits(trained.net, dataset.val.x), dataset.val.y


# a training loss that falls by less than this share: the network barely learned
LOSS_FALL_FLOOR = 0.05
# the best epoch's train accuracy this far above its validation accuracy: the network overfits
# (docs/networks.md gives the gaps measured on runs that generalise and on ones that do not)
OVERFIT_GAP = 0.10


def train_section(trained: TrainedModel, dataset: Dataset) -> dict:
    """The report's `train`, with its health: a WARNING and a hint when the network barely
    learned."""
    metric = scored_by(dataset)
    # a detector's loss is no cross-entropy over classes: no class-share prior to compare with
    prior = (math.inf if metric == "map"
             else prior_loss(class_counts(dataset.train.y, len(trained.labels))))
    section = {**trained.report_section(),
               "health": training_health(trained, prior, metric == "accuracy")}
    if metric != "accuracy":  # a segmenter is scored by mean IoU, a detector by mAP
        section[f"val_{metric}"] = section["val_accuracy"]
        section[f"train_{metric}"] = section["train_accuracy"]
        section["metric"] = metric  # what val_accuracy and train_accuracy hold; the history's
        # train_accuracy is the running training pixel accuracy (a segmenter's) or the box
        # recall at IoU 0.5 on 256 training images (a detector's)
    if section["health"] and section["health"]["hint"]:
        LOG.warning("%s", section["health"]["hint"])
    return section


def prior_loss(counts: list[int]) -> float:
    """The cross-entropy of answering every input with the classes' shares: what a network
    that learned nothing from its inputs reaches at best."""
    import numpy as np

    from ttc.reporting.metrics import entropy

    return float(entropy(np.asarray(counts, np.float64) / max(1, sum(counts))))


def training_health(trained: TrainedModel, prior: float, overfitting: bool = True
                    ) -> dict | None:
    """Whether the network learned from its inputs: the training loss must fall by
    LOSS_FALL_FLOOR from the first batch (before any update) to the last epoch's mean, and end
    below `prior`, the loss of answering the class shares. Otherwise a hint that names the
    learning rate used. `overfitting`: the history's train and validation accuracies measure
    the same thing, so their gap is a sign of overfitting (not for a segmenter's)."""
    if trained.initial_loss is None or not trained.history or trained.initial_loss <= 0:
        return None
    start, end = trained.initial_loss, trained.history[-1].loss
    fall = (start - end) / start
    problem = None
    if fall < LOSS_FALL_FLOOR:
        moved = (f"fell only {fall:.1%}" if fall > 0 else
                 "did not fall" if fall == 0 else f"rose {-fall:.1%}")
        problem = f"the training loss {moved} ({start:.4f} → {end:.4f})"
    elif end >= prior:
        problem = (f"the training loss ended at {end:.4f}, no lower than {prior:.4f} (the loss "
                   "of answering every input with the class shares)")
    epochs = len(trained.history)
    best = trained.history[max(0, trained.best_epoch - 1)]
    gap = best.train_accuracy - best.val_accuracy if overfitting else None
    hint = problem and (f"after {epochs} epoch{'s' if epochs > 1 else ''} at learning rate "
                        f"{trained.learning_rate:g}, {problem}: the network barely learned; try "
                        f"{learning_rate_advice(trained)}, or more --epochs")
    return {"loss_start": start, "loss_end": end, "loss_fall": fall, "loss_prior": prior,
            "overfit_gap": gap,
            "hint": hint or (overfit_hint(trained, best, gap) if gap is not None else None)}


def overfit_hint(trained: TrainedModel, best, gap: float) -> str | None:
    """The levers against overfitting, when the best epoch's train accuracy runs more than
    OVERFIT_GAP above its validation accuracy."""
    if gap <= OVERFIT_GAP:
        return None
    dropout = trained.architecture.get("dropout")
    return (f"the network overfits: at its best epoch ({best.epoch}) train accuracy "
            f"{best.train_accuracy:.3f} is {gap:.3f} above validation accuracy "
            f"{best.val_accuracy:.3f}; try more --dropout"
            f"{f' (now {dropout:g})' if dropout is not None else ''}, more --weight_decay, a "
            "lower --patience, more data, or a smaller --arch")


def learning_rate_advice(trained: TrainedModel) -> str:
    from config import HF_LEARNING_RATE, LEARNING_RATE, is_hf_arch
    from ttc.tasks.registry import task_of_kind

    if is_hf_arch(trained.architecture.get("arch")):
        return (f"--lr_candidates {HF_LEARNING_RATE:g},5e-5,1e-4 (fine-tuning a transformer "
                f"usually works at {HF_LEARNING_RATE:g} to 1e-4)")
    from ttc.options.training import default_learning_rate

    default = default_learning_rate(trained.architecture.get("arch"),
                                    task_of_kind(trained.preprocessing["kind"]).name)
    return (f"--lr_candidates 1e-3,{LEARNING_RATE:g},1e-2 (a network trained from scratch "
            f"usually needs a learning rate around 1e-3; the default is {default:g})")


def teacher_comparison(baseline: TrainedModel, dataset: Dataset, student: TrainedModel,
                       enlarged: Dataset) -> dict:
    """Student accuracy without and with the teacher's data, and a plain verdict."""
    from ttc.nets.program import split_accuracy

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
                   teacher: dict | None = None, paths: BundlePaths | None = None) -> dict:
    """The bundle manifest as training knows it (bundle.new_manifest); export fills the rest."""
    from ttc.nets.models import input_spec

    return new_manifest(
        model_type=config.model_type, labels=trained.labels,
        input_spec=input_spec(trained.preprocessing), preprocessing=trained.preprocessing,
        architecture=trained.architecture,
        dataset={**dataset.options.to_manifest(), "given_splits": dataset.given_splits,
                 "counts": dataset.counts, "skipped_images": len(dataset.skipped),
                 "train_class_counts": class_counts(dataset.train.y, len(trained.labels)),
                 "columns": dataset.columns.to_manifest() if dataset.columns else None},
        training={"program": f"{type_of_program(dataset)} (dspy.Module)",
                  "optimizer": "WeightTrainer (dspy.teleprompt.Teleprompter): AdamW, " + (
                      "linear warm-up and decay, gradients clipped to norm 1"
                      if trained.architecture["name"] == "HFTextNet" else
                      "one-cycle" if config.lr_schedule == "one_cycle" else
                      "warm-up, stable, decay"),
                  "epochs": config.epochs, "batch_size": config.batch_size,
                  "learning_rate": config.learning_rate,
                  **regularisation_record(config, trained),
                  "train_augment": config.train_augment, "seed": config.seed,
                  "augment_transforms": (config.tta_transforms or "default")
                  if config.tta and config.train_augment else None,
                  **trained.report_section(), "teacher": teacher},
        calibration=trained.calibration) | compression_entry(trained, paths)


def type_of_program(dataset: Dataset) -> str:
    return {"mean_iou": "SegmenterProgram", "map": "DetectorProgram"}.get(scored_by(dataset),
                                                                          "ClassifierProgram")


def compression_entry(trained: TrainedModel, paths: BundlePaths | None) -> dict:
    """{"compression": ...} for a manifest whose network was compressed, else {}."""
    if not trained.compressed or paths is None:
        return {}
    from ttc.compress.variants import compression_draft

    return {"compression": compression_draft(trained.compressed, trained.fp32_record, paths)}


def regularisation_record(config: Config, trained: TrainedModel) -> dict:
    """The manifest's record of how the weights were regularised, and where the defaults came
    from."""
    chosen = config.regularisation(config.model_type, config.arch, config.model_def)
    return {"weight_decay": chosen.weight_decay, "dropout": trained.architecture.get("dropout"),
            "label_smoothing": chosen.label_smoothing, "max_norm": chosen.max_norm or None,
            "patience": config.patience, "lr_schedule": config.lr_schedule,
            "regularisation_source": chosen.source or None}


def class_counts(y, num_classes: int) -> list[int]:
    """Samples per class, in label order (the evaluation's majority-class baseline); for masks,
    pixels per class (void pixels, beyond the classes, left out)."""
    import numpy as np

    if getattr(y, "dtype", None) == object:  # a detector's: one (k, 5) box array per image
        flat = np.concatenate([np.asarray(b).reshape(-1, 5)[:, 0] for b in y] or [[]]
                              ).astype(np.int64)
        return np.bincount(flat[flat < num_classes], minlength=num_classes).tolist()
    flat = np.asarray(y, np.int64).ravel()
    return np.bincount(flat[flat < num_classes], minlength=num_classes).tolist()


def save_checkpoint(config: Config, trained: TrainedModel, dataset: Dataset,
                    paths: BundlePaths, teacher: dict | None = None) -> dict:
    """train.py alone: weights and a manifest without an ONNX graph (export.py adds it)."""
    from ttc.nets.models import save_weights, side_files

    manifest = build_manifest(config, trained, dataset, teacher, paths)
    record_weights(manifest, paths, save_weights(trained.net, paths.weights))
    for variant in trained.compressed:  # export.py rebuilds and exports them
        key, path = f"weights_{variant.name}", paths.variant_weights(variant.name)
        manifest["files"][key] = path.name
        manifest["files"]["sha256"][key] = save_weights(variant.net, path)
    # the bundle keeps the --model_def file (export and Tent rebuild from it) and an hf tokenizer
    for key, data in side_files(Manifest.from_dict(manifest)).items():
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
    from ttc.nets.program import set_torch_threads  # imports torch and dspy

    quiet_library_loggers()
    set_torch_threads(config.num_threads)

    def stages(report: dict) -> None:
        check_training_device(config)
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
