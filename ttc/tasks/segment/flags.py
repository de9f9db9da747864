"""What a segmenter's flags must be, checked before any work (its Parts.flag_checks; exit 2
otherwise). No torch here."""
from __future__ import annotations

from ttc.tasks.segment.views import check_segmenter_flags


def check_flags(config) -> None:
    """Its test-time compute (views.check_segmenter_flags), and the folders --input writes its
    masks to (checked again once a bundle names a segmenter)."""
    check_segmenter_flags(config)
    config.check_input_folders(segmenter=True)
