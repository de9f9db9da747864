"""Run a model bundle with ONNX Runtime: accuracy, latency and throughput on held-out data.

    python inference.py --model runs/sms/model.onnx --dataset_path sms.tsv

evaluates the test split of --dataset_path, split as at training (a bundle trained on a built-in
data set such as builtin:digits needs no --dataset_path; a path the bundle records is never
read), with test-time augmentation, test-time training or iterative inference when asked; with
--input it predicts new data. The CLI parses, calls and prints: the test split's evaluation is
ttc/online/evaluate.py's, --input ttc/online/predict.py's, each handing the bundle to its model
type's part (Parts.test_split, Parts.new_input). This path imports neither torch nor dspy.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from ttc.reporting.run import run_with_report
from utils import LOG, exit_cli, run_cli


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "inference", "Evaluate a model bundle with ONNX Runtime on the test split of "
        "--dataset_path, split as at training (not needed for a bundle trained on a builtin: "
        "data set; a path the bundle records is never read): accuracy, latency p50/p95 and "
        "throughput; or predict new data with --input.",
        required=["output_model"], aliases={"output_model": ["--model"]},
        epilog="example:\n  python inference.py --model runs/digits/model.onnx --batch_size 64 "
               "--ep cpu --report_json runs/digits/inference.json")
    config = start_cli(parser, argv)
    # The inference stage (numpy, ONNX Runtime, the bundle's layers) only once the flags are good.
    from ttc.online.evaluate import run_on_bundle
    from ttc.online.predict import predict_new_data
    from ttc.online.predictor import check_bundle, input_variant
    from ttc.options.stages import InferenceOptions, view_of
    from ttc.serving.bundle import BundlePaths

    options = view_of(config, InferenceOptions)

    def graph(manifest) -> str:  # --fp16, --quantized, --variant: the bundle's file key
        return input_variant(manifest, options, fp16=config.fp16, quantized=config.quantized,
                             variant=config.variant)

    def stages(report: dict) -> None:
        paths = BundlePaths.from_model_path(config.output_model)
        manifest = check_bundle(options, paths, config.validate_tta)
        if config.input:
            predict_new_data(options, paths, graph(manifest), report)
            return
        from ttc.inputs.data import load_bundle_dataset, split_paths_of

        data = load_bundle_dataset(manifest, config.dataset_path,
                                   ("val", "test", "calibration") if config.tta else ("test",),
                                   not config.no_progress, split_paths_of(config),
                                   ", or --input PATH to predict new data")
        report["dataset"] = data.report_section()
        variant = graph(manifest)
        if variant != "onnx":
            verdict = manifest.variant(variant)
            if verdict and not verdict.used_for_inference:
                LOG.warning("using the %s graph as asked, although it was judged: %s", variant,
                            verdict.verdict)
        val = (data.val.x, data.val.y) if config.tta else None
        calibration = (data.calibration.x, data.calibration.y) if config.tta else None
        run_on_bundle(options, paths, variant, (data.test.x, data.test.y), val, report,
                      benchmark=config.benchmark, calibration=calibration)

    return run_with_report(config.report_options(), stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
