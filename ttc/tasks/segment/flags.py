"""What a segmenter's flags must be, checked before any work (its Parts.flag_checks; exit 2
otherwise). No torch here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ttc.tasks.segment.views import check_segmenter_flags

if TYPE_CHECKING:
    from ttc.options.stages import FlagCheckOptions


def check_flags(options: FlagCheckOptions) -> None:
    """Its test-time compute (views.check_segmenter_flags). The folders --input writes its masks
    to are checked with the other paths (config.Config.validate_tta: its entry's `masks`)."""
    check_segmenter_flags(options)
