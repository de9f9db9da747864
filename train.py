"""Train a classifier: a torch network inside a DSPy program, trained by a DSPy Teleprompter.

    python train.py --dataset_path builtin:digits --output_model runs/digits/model.onnx

writes the weights (model.pt) and manifest (model.json) of the bundle; export.py then writes
model.onnx. pipeline.py runs both in one process. The stage itself is ttc/training/stage.py's.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from ttc.reporting.run import run_with_report
from utils import exit_cli, quiet_library_loggers, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "train", "Train a classifier and write its weights (PATH.pt) and manifest "
        "(PATH.json); export.py turns them into PATH.onnx.",
        required=["dataset_path", "output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits "
               "--output_model runs/digits/model.onnx --epochs 20")
    config = start_cli(parser, argv)
    config.validate_tta(config.model_type)
    # The stage's imports (numpy, pandas, then torch and DSPy) only once the flags are good.
    from ttc.inputs.data import DataOptions, load_dataset
    from ttc.options.stages import TrainingOptions, view_of
    from ttc.serving.bundle import BundlePaths
    from ttc.training.stage import (cap_batch_size, check_training_device, save_checkpoint,
                                    train_stage)
    from ttc.nets.training import set_torch_threads  # imports torch and dspy

    quiet_library_loggers()
    set_torch_threads(config.num_threads)

    def stages(report: dict) -> None:
        check_training_device(view_of(config, TrainingOptions))
        # With a teacher, the test split measures what its labels bought.
        splits = (("train", "val", "test", "calibration") if config.teacher_lm
                  else ("train", "val", "calibration"))
        dataset = load_dataset(DataOptions.from_config(config), splits=splits)
        report["dataset"] = dataset.report_section()
        cap_batch_size(config, dataset)  # before the view, as pipeline.py does
        options = view_of(config, TrainingOptions)
        trained, dataset = train_stage(options, dataset, report)
        save_checkpoint(options, trained, dataset,
                        BundlePaths.from_model_path(options.output_model), report.get("teacher"))

    return run_with_report(config.report_options(), stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
