"""Make faster variants of a bundle's fp32 graph (int8, fp16), validate and time each against
fp32 in the same process, and decide honestly whether inference should use it.

    python quantize.py --output_model runs/digits/model.onnx --quantize static [--fp16 true]

writes model.int8.onnx (and model.fp16.onnx) beside the bundle and records the figures and the
verdict in model.json. A variant that is slower than fp32 or loses more than --max_accuracy_drop
is kept on disk but not used (int8: unless --force_quantized true). fp16 is only used on a GPU
provider. The work is done in ttc/compress/quantization.py; this is its command line.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from ttc.reporting.run import run_with_report
from utils import exit_cli, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "quantize", "Quantize an exported bundle to int8 (model.int8.onnx), diagnose its layers, "
        "judge it on the validation split, report its test accuracy and time it against fp32.",
        required=["output_model"],
        epilog="examples:\n  python quantize.py --output_model runs/digits/model.onnx "
               "--quantize static --calibration_size 256\n"
               "  python quantize.py --output_model runs/sms/model.onnx --quantize static "
               "--quantize_ops all --quantize_exclude auto\n"
               "  python quantize.py --output_model runs/sms/model.onnx --diagnose true")
    config = start_cli(parser, argv)

    def stages(report: dict) -> None:
        from ttc.compress.quantization import diagnose_bundle, fp16_bundle, quantize_bundle
        from ttc.inputs.data import load_bundle_dataset, split_paths_of
        from ttc.options.stages import QuantizeOptions, view_of
        from ttc.serving.bundle import BundlePaths, read_manifest, require_onnx_in_bundle

        paths = BundlePaths.from_model_path(config.output_model)
        manifest = read_manifest(paths)

        def named_data(splits: tuple[str, ...]):  # the data the flags name, never the bundle
            return load_bundle_dataset(manifest, config.dataset_path, splits,
                                       not config.no_progress, split_paths_of(config))

        if config.diagnose:
            require_onnx_in_bundle(paths, manifest, "int8")  # before any data is read
            require_onnx_in_bundle(paths, manifest)  # and the fp32 graph it is compared with
            data = named_data(("train",))
            report["dataset"] = data.report_section()
            report["quantize"] = diagnose_bundle(view_of(config, QuantizeOptions), paths,
                                                 data.train.x)
            return
        data = named_data(("train", "val", "test"))
        report["dataset"] = data.report_section()
        val, test = (data.val.x, data.val.y), (data.test.x, data.test.y)
        if config.quantize == "none" and not config.fp16:
            config.quantize = "auto"
        options = view_of(config, QuantizeOptions)  # after: quantization reads that "auto"
        if options.quantize != "none":
            report["quantize"] = quantize_bundle(options, paths, data.train.x, val,
                                                 test).report_section()
        if options.fp16:
            report["fp16"] = fp16_bundle(options, paths, val, test).report_section()

    return run_with_report(config.report_options(), stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
