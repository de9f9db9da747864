"""A segmenter's (and a detector's) `--tta_transforms` read without torch (config.py validates it
before any heavy import; tta.py builds the views from the result). The names are the one TTA
vocabulary (ttc/testtime/transforms.py): every transform that can map a mask back, e.g. `hflip`,
`vflip`, `rot90`, `rot180`, `rot270`, `shift:PX`, `scale:F[,F...]` (F in (0, 4], not 1),
`brightness:D`, `contrast:F`. The identity view is implied and always first."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ttc.testtime.transforms import accepted, parse_transform_specs
from utils import ConfigError

if TYPE_CHECKING:
    from ttc.options.stages import FlagCheckOptions

DEFAULT_VIEWS = "hflip"  # the TASK entry's default_tta

ViewSpec = tuple[str, float | None]  # ("hflip", None), ("scale", 0.75)


def view_names(task: str = "segmentation") -> str:
    """The transforms a model type of this task takes, as its errors list them."""
    return ", ".join(n + (":X" if cls.meaning else "") for n, cls in accepted(task).items())


def parse_view_specs(spec: str, task: str = "segmentation") -> list[ViewSpec]:
    """`hflip,rot90,scale:0.75,1.25` → [("identity", None), ("hflip", None), ("rot90", None),
    ("scale", 0.75), ("scale", 1.25)]. A bare number after a scale continues it. An empty spec
    is the default (DEFAULT_VIEWS). `task` ("segmentation" or "detection", a model kind) says
    which transforms fit: those that can map its masks or boxes back (exit 2 otherwise, naming
    the ones it takes)."""
    entries = parse_transform_specs(spec, task, DEFAULT_VIEWS)
    if not entries:
        raise ConfigError(f"--tta_transforms {spec!r} names no view",
                          f"valid: {view_names(task)}")
    return [("identity", None), *entries]


def check_segmenter_flags(options: FlagCheckOptions) -> None:
    """What a segmenter's test-time compute takes, before any work (exit 2 otherwise): TTA views
    of this module's kinds; test-time training by bn, episodic; --eval_shift with --ttt."""
    if options.tta or options.tta_transforms:
        parse_view_specs(options.tta_transforms)
    if options.ttt and options.ttt_guard == "reset":
        raise ConfigError("--ttt_guard reset watches a batch's class mix, which a segmenter's "
                          "batches do not have", "use --ttt_guard filter (EATA's pixel "
                          "filter for tent) or none")
    if options.ttt and options.ttt_mode != "episodic":
        raise ConfigError("--ttt_mode online: a segmenter adapts each batch on its own",
                          "use --ttt_mode episodic")
    if options.eval_shift and not options.ttt:
        raise ConfigError("--eval_shift measures a segmenter's mean IoU under each corruption "
                          "before and after test-time training", "add --ttt true")
    if options.eval_shift:
        from ttc.inputs.shifts import parse_shift_names

        parse_shift_names(options.eval_shift, "segmentation")


def views_text(views: list[ViewSpec]) -> str:
    """The views as the manifest and report name them (the identity left implicit)."""
    return ",".join(name if factor is None else f"{name}:{factor:g}"
                    for name, factor in views[1:])
