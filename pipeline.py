"""Train → export → slim → validate → ONNX Runtime inference → report, in one command.

    python pipeline.py --model_type image_classifier --dataset_path builtin:digits \\
        --output_model runs/digits/model.onnx --report_json runs/digits/report.json

Logs and progress go to stderr; stdout carries only the final summary (or the JSON report with
--report_json -). Exit codes: 0 ok, 2 usage/config, 3 data, 4 export/validation, 5 runtime,
130 interrupted.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from ttc.reporting.run import preload_plots, run_with_report
from utils import ExportError, exit_cli, run_cli

EXAMPLE = """\
example (trains on scikit-learn's bundled 8x8 digits, no download):
  python pipeline.py --model_type image_classifier --dataset_path builtin:digits \\
      --output_model runs/digits/model.onnx --report_json runs/digits/report.json

  your own images, laid out as photos/<class name>/*.jpg:
  python pipeline.py --dataset_path photos --image_size 32 --epochs 30 \\
      --output_model runs/photos/model.onnx --report_json -

  texts in a headerless TSV with the label in column 0 and the text in column 1:
  python pipeline.py --model_type text_classifier --dataset_path sms.tsv \\
      --label_column 0 --text_column 1 --output_model runs/sms/model.onnx

  a CSV of features with a "label" column, or scikit-learn's bundled tables:
  python pipeline.py --model_type tabular_classifier --dataset_path builtin:wine \\
      --output_model runs/wine/model.onnx

exit codes: 0 ok, 2 usage or config error, 3 data error, 4 export or validation failure,
5 runtime or execution-provider failure, 130 interrupted"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "pipeline", "Train an image, text or tabular classifier, a semantic segmenter of images "
        "or an object detector, export it to a validated ONNX model bundle, and measure it with "
        "ONNX Runtime.",
        required=["dataset_path", "output_model"], epilog=EXAMPLE)
    config = start_cli(parser, argv)
    config.validate_tta(config.model_type)

    from ttc.inputs.data import DataOptions, load_dataset  # pandas and numpy, no torch
    from ttc.serving.bundle import BundlePaths

    paths = BundlePaths.from_model_path(config.output_model)

    def stages(report: dict) -> None:
        if config.device.startswith("cuda"):  # a GPU that is not there: before the data
            from ttc.options.stages import TrainingOptions, view_of
            from ttc.training.stage import check_training_device

            check_training_device(view_of(config, TrainingOptions))
        dataset = load_dataset(DataOptions.from_config(config))
        report["dataset"] = dataset.report_section()
        # Heavy imports only once the flags and the data are known to be good: a typo or a bad
        # file fails in a fraction of a second, not after seconds of importing torch and DSPy.
        from ttc.convert.bundle import export_bundle
        from ttc.convert.compressed import export_compressed
        from ttc.convert.failure import keep_trained_weights
        from ttc.online.evaluate import run_on_bundle
        from ttc.options.stages import InferenceOptions
        from ttc.compress.quantization import fp16_bundle, judge_compressed, quantize_bundle
        from ttc.options.stages import ExportOptions, QuantizeOptions, TrainingOptions, view_of
        from ttc.training.stage import (build_manifest, cap_batch_size, save_checkpoint,
                                        torch_variant, train_ensemble_members, train_stage)
        from ttc.nets.training import set_torch_threads  # imports torch and DSPy
        from utils import quiet_library_loggers

        quiet_library_loggers()  # after DSPy's import, which resets loggers
        set_torch_threads(config.num_threads)
        if config.plots_folder() is not None:
            preload_plots()
        cap_batch_size(config, dataset)  # before the views: every later stage takes the cap
        training = view_of(config, TrainingOptions)
        trained, dataset = train_stage(training, dataset, report)
        members = train_ensemble_members(training, dataset, trained)
        manifest = build_manifest(training, trained, dataset, report.get("teacher"), paths)
        exporting = view_of(config, ExportOptions)
        try:
            exported = export_bundle(exporting, trained.net, manifest, dataset.test.x,
                                     dataset.train.x, paths, members,
                                     (dataset.calibration.x, dataset.calibration.y))
        except ExportError as err:  # the training is kept, as train.py writes it, for export.py
            raise keep_trained_weights(err, exporting, paths, lambda kept: save_checkpoint(
                training, trained, dataset, kept, report.get("teacher"))) from err
        config.validate_atol = exported.atol  # resolved for the network
        report["export"] = exported.report_section()
        if trained.compressed:
            export_compressed(exporting, trained.compressed, paths, dataset.test.x,
                              dataset.train.x)
        variant, quantized = "onnx", None
        quantizing = view_of(config, QuantizeOptions)
        if config.quantize != "none":
            quantized = quantize_bundle(quantizing, paths, dataset.train.x,
                                        (dataset.val.x, dataset.val.y),
                                        (dataset.test.x, dataset.test.y))
            report["quantize"] = quantized.report_section()
            variant = "int8" if quantized.used_for_inference else "onnx"
        if trained.compressed:
            report["compression"] = judge_compressed(quantizing, paths,
                                                     (dataset.val.x, dataset.val.y),
                                                     (dataset.test.x, dataset.test.y), quantized)
            variant = report["compression"]["served"]
        if config.fp16:
            half = fp16_bundle(quantizing, paths, (dataset.val.x, dataset.val.y),
                               (dataset.test.x, dataset.test.y))
            report["fp16"] = half.report_section()
            variant = "fp16" if half.used_for_inference else variant
        several_variants = config.quantize != "none" or config.fp16 or bool(trained.compressed)
        run_on_bundle(view_of(config, InferenceOptions), paths, variant,
                      (dataset.test.x, dataset.test.y),
                      (dataset.val.x, dataset.val.y), report,
                      benchmark=config.benchmark or several_variants,
                      baseline=[torch_variant(trained.net, paths)],
                      calibration=(dataset.calibration.x, dataset.calibration.y))

    return run_with_report(config.report_options(), stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
