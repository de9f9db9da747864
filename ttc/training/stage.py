"""The training stage as pipeline.py and train.py run it: the device checked, the batch size
capped, the network trained (the model type's Parts.trainer, or Ray Train), a teacher's labels
compared, the temperature fitted (--calibrate), the compressed variants made (--prune, --qat),
the report's `train` section (health.py), and the manifest and weights train.py writes alone.
No torch at import: it loads with the first network trained."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ttc.inputs.data import Dataset
from ttc.training.health import class_counts, train_section
from ttc.serving.bundle import (BundlePaths, Manifest, manifest_text, new_manifest,
                                record_side_file, record_weights)
from ttc.tasks.registry import task_of_kind
from utils import LOG, atomic_write, atomic_write_text, sha256_of

if TYPE_CHECKING:
    import dspy

    from ttc.nets.training import TrainedModel
    from ttc.options.stages import TrainingOptions
    from ttc.options.training import TrainingFlags


def cap_batch_size(flags: TrainingFlags, dataset: Dataset) -> None:
    """A --batch_size above the training split's size trains on the whole split per step: say
    so once, and use the split's size everywhere (training, validation, timing). The CLI caps
    its whole Config before it copies out the stages' options, so that export, quantization
    and the benchmark take the capped value too (the report's settings, recorded before the
    stages run, keep the flag as given)."""
    samples = len(dataset.train)
    if flags.batch_size > samples > 0:
        LOG.warning("--batch_size %d is larger than the training split (%d samples); using %d",
                    flags.batch_size, samples, samples)
        flags.batch_size = samples


def check_training_device(options: TrainingOptions) -> None:
    """--device and --amp against what torch sees (a local run; a Ray run's workers check
    their own): exit 2 for a GPU that is not there, before any data is read where one is
    named."""
    if options.trains_on_ray():
        return
    from ttc.nets.device import precision_for, training_device

    precision_for(options.amp, training_device(options.device))


def train_stage(options: TrainingOptions, dataset: Dataset, report: dict,
                teacher_lm: dspy.BaseLM | None = None) -> tuple[TrainedModel, Dataset]:
    """Training as pipeline.py and train.py run it: with --teacher_lm, the teacher labels the
    unlabeled texts and the student is trained twice, without and with them, so the report can
    say what the teacher's labels bought. Returns the model to export and the data it saw.
    `teacher_lm` replaces the LM --teacher_lm names (tests pass dspy.utils.DummyLM)."""
    from ttc.tasks.registry import task_for

    check_training_device(options)
    train_network = task_for(options.model_type).part("trainer")
    if options.trains_on_ray():  # Ray Train (config.py refused the types it does not train)
        from ttc.distributed.driver import train_on_ray

        train_network = train_on_ray
    if options.compresses():  # a network with no path for --prune / --qat: before training
        from ttc.compress.variants import check_compressible

        check_compressible(options, dataset)
    if not options.teacher_lm:
        trained = train_network(options, dataset)
        report["train"] = train_section(trained, dataset)
        calibrate_network(options, trained, dataset, report)
        compress_stage(options, trained, dataset, report)
        return trained, dataset
    from ttc.nets.teacher import distill

    distilled = distill(options, dataset, teacher_lm)
    report["teacher"] = distilled.section
    LOG.info("student without the teacher's labels (%d training texts)", len(dataset.train))
    baseline = train_network(options, dataset)
    LOG.info("student with the teacher's labels (%d training texts)", len(distilled.dataset.train))
    trained = train_network(options, distilled.dataset)
    report["train"] = train_section(trained, distilled.dataset)
    report["teacher"].update(teacher_comparison(baseline, dataset, trained, distilled.dataset))
    calibrate_network(options, trained, distilled.dataset, report)
    compress_stage(options, trained, distilled.dataset, report)
    return trained, distilled.dataset


def compress_stage(options: TrainingOptions, trained: TrainedModel, dataset: Dataset,
                   report: dict) -> None:
    """--prune / --qat: the compressed variants of the trained network, fine-tuned (export
    exports and checks them, the gate judges them). In the report: train.compression."""
    if not options.compresses():
        return
    from ttc.compress.variants import compress_trained

    trained.compressed, trained.fp32_record = compress_trained(options, trained, dataset)
    report["train"]["compression"] = [
        {"name": v.name, "recipe": v.recipe, "params": v.params, "macs": v.macs,
         "channels": v.channels, "val_accuracy_torch": v.val_accuracy_torch,
         "seconds": v.seconds, "history": v.history} for v in trained.compressed]


def calibrate_network(options: TrainingOptions, trained: TrainedModel, dataset: Dataset,
                      report: dict) -> None:
    """--calibrate temperature: fit T on the calibration slice's logits (calibrate.py), rows
    that neither training nor any selection (candidate, epoch) saw; the manifest records it and
    export bakes it into every graph. In the report: train.calibration."""
    from ttc.testtime.calibrate import FITTED_ON, RULES, calibrate_scores, no_fit

    task = task_of_kind(dataset.preprocessing["kind"])
    slice_ = dataset.splits.get(FITTED_ON)
    if options.calibrate == "none":
        fit = no_fit("--calibrate none")
    elif task.uncalibrated:
        fit = no_fit(task.uncalibrated)
    elif slice_ is None or len(slice_) == 0:
        fit = no_fit(no_slice_reason(dataset))
        LOG.warning("calibration: %s", fit.note)
    else:
        logits, truth = task.part("validation_scores")(
            trained.net, slice_, dataset.preprocessing, options.batch_size, options.seed)
        fit = calibrate_scores(logits, truth, RULES[options.calibrate], options.seed)
        LOG.info("calibration: temperature %.4f%s (%s) fitted on %d %s of the calibration slice "
                 "with %d errors, NLL %.4f → %.4f, Brier %.4f → %.4f%s; %s: %s", fit.fitted,
                 " [%.3f, %.3f]" % tuple(fit.interval) if fit.interval else "", fit.method,
                 fit.samples, task.calibrated_on, fit.errors, fit.nll_before, fit.nll_after,
                 fit.brier_before, fit.brier_after, f"; {fit.note}" if fit.note else "",
                 "applied" if fit.applied else "not applied (T = 1)", fit.reason)
    trained.calibration = fit.manifest_entry()
    report["train"]["calibration"] = trained.calibration


def no_slice_reason(dataset: Dataset) -> str:
    """Why there is no calibration slice to fit a temperature on."""
    fraction = dataset.options.calibration_fraction
    if fraction <= 0:
        return ("--calibration_fraction 0 sets no calibration slice aside, and a temperature "
                "fitted on the validation split, which chose the epoch, would be biased: T = 1")
    return (f"--calibration_fraction {fraction:g} of {len(dataset.train)} training rows left "
            "the calibration slice empty: T = 1")


def validation_logits(net, split, preprocessing: dict, batch_size: int, seed: int):
    """Parts.validation_scores of a classifier: the validation logits and classes a temperature
    is fitted on, one row per sample."""
    from ttc.nets.dspy_program import split_logits

    return split_logits(net, split.x), split.y


def teacher_comparison(baseline: TrainedModel, dataset: Dataset, student: TrainedModel,
                       enlarged: Dataset) -> dict:
    """Student accuracy without and with the teacher's data, and a plain verdict."""
    from ttc.nets.dspy_program import split_accuracy

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


def build_manifest(options: TrainingOptions, trained: TrainedModel, dataset: Dataset,
                   teacher: dict | None = None, paths: BundlePaths | None = None) -> dict:
    """The bundle manifest as training knows it (bundle.new_manifest); export fills the rest."""
    from ttc.nets.models import input_spec

    return new_manifest(
        model_type=options.model_type, labels=trained.labels,
        input_spec=input_spec(trained.preprocessing), preprocessing=trained.preprocessing,
        architecture=trained.architecture,
        dataset={**dataset.options.to_manifest(), "given_splits": dataset.given_splits,
                 "counts": dataset.counts, "skipped_images": len(dataset.skipped),
                 "train_class_counts": class_counts(dataset.train.y, len(trained.labels)),
                 "columns": dataset.columns.to_manifest() if dataset.columns else None},
        training={"program": f"{program_name(dataset)} (dspy.Module)",
                  "optimizer": "WeightTrainer (dspy.teleprompt.Teleprompter): AdamW, " + (
                      "linear warm-up and decay, gradients clipped to norm 1"
                      if trained.architecture["name"] == "HFTextNet" else
                      "one-cycle" if options.lr_schedule == "one_cycle" else
                      "warm-up, stable, decay"),
                  "epochs": options.epochs, "batch_size": options.batch_size,
                  "learning_rate": options.learning_rate,
                  **regularisation_record(options, trained),
                  "train_augment": options.train_augment, "seed": options.seed,
                  "augment_transforms": trained_views(options.tta_transforms)
                  if options.tta and options.train_augment else None,
                  **trained.report_section(), "teacher": teacher},
        calibration=trained.calibration) | compression_entry(trained, paths)


def trained_views(transforms: str) -> str:
    """The views training drew from (ttc/testtime/tta.py build_transforms): --tta_transforms,
    of `auto:LIST` its LIST, and the model type's default for a bare `auto` or none."""
    from ttc.testtime.transforms import training_spec

    return training_spec(transforms).strip() or "default"


def program_name(dataset: Dataset) -> str:
    """The DSPy program that trained the network, as the manifest records it."""
    return task_of_kind(dataset.preprocessing["kind"]).program


def compression_entry(trained: TrainedModel, paths: BundlePaths | None) -> dict:
    """{"compression": ...} for a manifest whose network was compressed, else {}."""
    if not trained.compressed or paths is None:
        return {}
    from ttc.compress.variants import compression_draft

    return {"compression": compression_draft(trained.compressed, trained.fp32_record, paths)}


def regularisation_record(options: TrainingOptions, trained: TrainedModel) -> dict:
    """The manifest's record of how the weights were regularised, and where the defaults came
    from."""
    chosen = options.regularisation(options.model_type, options.arch, options.model_def)
    return {"weight_decay": chosen.weight_decay, "dropout": trained.architecture.get("dropout"),
            "label_smoothing": chosen.label_smoothing, "max_norm": chosen.max_norm or None,
            "patience": options.patience, "lr_schedule": options.lr_schedule,
            "regularisation_source": chosen.source or None}


def save_checkpoint(options: TrainingOptions, trained: TrainedModel, dataset: Dataset,
                    paths: BundlePaths, teacher: dict | None = None) -> dict:
    """train.py alone: weights and a manifest without an ONNX graph (export.py adds it)."""
    from ttc.nets.models import save_weights, side_files

    manifest = build_manifest(options, trained, dataset, teacher, paths)
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


def torch_variant(net, paths: BundlePaths):
    """PyTorch eager fp32 on the CPU, the baseline row of the benchmark table."""
    import torch

    from ttc.serving.stages import Variant
    from ttc.nets.models import WithProbabilities

    wrapper = WithProbabilities(net).eval()

    def predict(batch):
        with torch.no_grad():
            return wrapper(torch.from_numpy(batch))[1].numpy()

    return Variant("pytorch eager fp32", "torch cpu", paths.weights.stat().st_size, predict)


def train_ensemble_members(options: TrainingOptions, dataset: Dataset,
                           first: TrainedModel) -> list:
    """--ensemble_size N: N − 1 more networks on the same data, seeds --seed+1, ..., at the
    learning rate the candidate search chose for the first."""
    from dataclasses import replace

    from ttc.tasks.registry import task_for

    train_network = task_for(options.model_type).part("trainer")  # a classifier's: its own
    members = []
    for k in range(1, options.ensemble_size):
        LOG.info("ensemble member %d of %d (seed %d)", k + 1, options.ensemble_size,
                 options.seed + k)
        member = replace(options, seed=options.seed + k, learning_rate=first.learning_rate,
                         lr_candidates=None, num_candidates=1)
        members.append(train_network(member, dataset).net)
    return members
