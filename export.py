"""Export a trained network to ONNX, slim it, check it, validate it numerically against PyTorch,
and write the model bundle (model.onnx, model.json, model.pt) atomically.

    python export.py --output_model runs/digits/model.onnx

reads the weights and manifest that train.py wrote beside that path (or that a pipeline.py run
whose export failed kept there). The work is the package's
(ttc/convert/bundle.py: export_saved_bundle; each model type exports through its
Parts.exporter); this is its command line.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from ttc.reporting.run import run_with_report
from utils import exit_cli, quiet_library_loggers, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "export", "Export the weights train.py wrote to ONNX, slim, check and validate them "
        "against PyTorch on held-out data, and complete the bundle.",
        required=["output_model"],
        epilog="example:\n  python train.py --dataset_path builtin:digits --output_model "
               "runs/digits/model.onnx\n  python export.py --output_model runs/digits/model.onnx")
    config = start_cli(parser, argv)
    import torch

    from ttc.convert.bundle import export_saved_bundle
    from ttc.convert.compressed import export_compressed
    from ttc.options.stages import ExportOptions, QuantizeOptions, view_of

    quiet_library_loggers()
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)

    def stages(report: dict) -> None:
        options = view_of(config, ExportOptions)
        done = export_saved_bundle(options, config.validate_tta)
        config.validate_atol = done.result.atol  # resolved for the bundle's network
        report["export"] = done.result.report_section()
        if done.compressed:
            from ttc.compress.quantization import judge_compressed

            export_compressed(options, done.compressed, done.paths, done.held_out, done.fallback)
            report["compression"] = judge_compressed(view_of(config, QuantizeOptions),
                                                     done.paths, done.val, done.test)

    return run_with_report(config.report_options(), stages)


if __name__ == "__main__":
    exit_cli(run_cli(main))
