"""A segmenter's `--tta_transforms` read without torch (config.py validates it before any heavy
import; tta.py builds the views' modules from the result): `hflip`, `vflip`, `scale:F[,F...]`
(each F a factor in (0, 4] other than 1, e.g. `scale:0.75,1.25`). The identity view is implied
and always first."""
from __future__ import annotations

from utils import ConfigError

MAX_SCALE = 4.0
VIEW_NAMES = "hflip, vflip, scale:F[,F...] (0 < F <= 4)"
DEFAULT_VIEWS = "hflip"

ViewSpec = tuple[str, float | None]  # ("hflip", None), ("scale", 0.75)


def parse_view_specs(spec: str, task: str = "segmentation") -> list[ViewSpec]:
    """`hflip,vflip,scale:0.75,1.25` → [("identity", None), ("hflip", None), ("vflip", None),
    ("scale", 0.75), ("scale", 1.25)]. A bare number after a scale continues it. An empty
    spec is the default (DEFAULT_VIEWS). `task` names the model type's views in the errors
    (a detector's are these too: ttc/tasks/detect/tta.py)."""
    spec = spec or DEFAULT_VIEWS
    views: list[ViewSpec] = [("identity", None)]
    scaling = False
    for word in (w.strip() for w in spec.split(",")):
        if word in ("hflip", "vflip"):
            views.append((word, None))
            scaling = False
        elif word.startswith("scale:") or (scaling and word):
            views.append(("scale", _factor(word.removeprefix("scale:"), spec)))
            scaling = True
        elif word:
            raise ConfigError(f"--tta_transforms {spec!r}: {word!r} is not a {task} view",
                              f"use {VIEW_NAMES}")
    if len(views) == 1:
        raise ConfigError(f"--tta_transforms {spec!r} names no view", f"use {VIEW_NAMES}")
    return views


def check_segmenter_flags(config) -> None:
    """What a segmenter's test-time compute takes, before any work (exit 2 otherwise): TTA views
    of this module's kinds; test-time training by bn, episodic; --eval_shift with --ttt."""
    if config.tta or config.tta_transforms:
        parse_view_specs(config.tta_transforms)
    if config.ttt and config.ttt_guard == "reset":
        raise ConfigError("--ttt_guard reset watches a batch's class mix, which a segmenter's "
                          "batches do not have", "use --ttt_guard filter (EATA's pixel "
                          "filter for tent) or none")
    if config.ttt and config.ttt_mode != "episodic":
        raise ConfigError("--ttt_mode online: a segmenter adapts each batch on its own",
                          "use --ttt_mode episodic")
    if config.eval_shift and not config.ttt:
        raise ConfigError("--eval_shift measures a segmenter's mean IoU under each corruption "
                          "before and after test-time training", "add --ttt true")
    if config.eval_shift:
        from ttc.inputs.shifts import parse_shift_names

        parse_shift_names(config.eval_shift, "segmentation")


def views_text(views: list[ViewSpec]) -> str:
    """The views as the manifest and report name them (the identity left implicit)."""
    return ",".join(name if factor is None else f"{name}:{factor:g}"
                    for name, factor in views[1:])


def _factor(text: str, spec: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = float("nan")
    if not 0 < factor <= MAX_SCALE or factor == 1:
        raise ConfigError(f"--tta_transforms {spec!r}: scale {text!r} is not a factor in "
                          f"(0, {MAX_SCALE:g}] other than 1", "e.g. scale:0.75,1.25")
    return factor
