"""What a detector's test-time compute takes, checked before any work (exit 2 otherwise). No
torch here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from utils import ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import FlagCheckOptions


def detector_views(spec: str) -> str:
    """--tta_transforms for a detector (the segmenter's views: ttc/tasks/segment/views.py), or
    its default (the TASK entry's default_tta) when empty, as the manifest names them."""
    from ttc.tasks.detect import TASK
    from ttc.tasks.segment.views import parse_view_specs, views_text

    return views_text(parse_view_specs(spec or TASK.default_tta, task="detection"))


def check_detector_flags(options: FlagCheckOptions) -> None:
    """TTA views of the segmenter's kinds; test-time training by bn, episodic; --eval_shift
    with --ttt, of the photometric corruptions (a geometric one would move the objects off
    their boxes)."""
    if options.tta or options.tta_transforms:
        detector_views(options.tta_transforms)
        if options.opset < 18:  # ScatterElements' reduction "max" (fusion.py)
            raise ConfigError(f"--opset {options.opset}: a detector's TTA graph needs opset 18 "
                              "or later", "use the default --opset 18")
    if options.ttt and options.ttt_method != "bn":
        raise ConfigError(f"--ttt_method {options.ttt_method}: a detector adapts by bn only "
                          "(tent's entropy is a classifier's and a segmenter's)",
                          "use --ttt_method bn")
    if options.ttt and options.ttt_mode != "episodic":
        raise ConfigError("--ttt_mode online: a detector adapts each batch on its own",
                          "use --ttt_mode episodic")
    if options.eval_shift and not options.ttt:
        raise ConfigError("--eval_shift measures a detector's mAP under each corruption before "
                          "and after test-time training", "add --ttt true")
    if options.eval_shift:
        from ttc.inputs.shifts import parse_shift_names

        parse_shift_names(options.eval_shift, "detection")
    if options.input and (options.tta or options.ttt):
        raise ConfigError("--input runs a detector's model.onnx (or its int8 graph): --tta and "
                          "--ttt measure on the test split and do not apply to new images yet",
                          "drop --tta/--ttt with --input, or run them without --input")
