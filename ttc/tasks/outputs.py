"""What an image model's `--input` writes besides --output and --errors (a segmenter's mask
folder, the overlay folder, a detector's COCO images file), declared once: the type's own
batch inference writes there, and the path checks before any work (ttc/options/batch.py,
through outputs_beside) read the same rules. Plain paths, no imports beyond pathlib: the
options may read it without importing a model type's code."""
from __future__ import annotations

from pathlib import Path

BESIDE_OUTPUT = "--output (its"  # the key of a path the tool chose beside --output


def default_mask_dir(output: Path) -> Path:
    """Where the masks go unless --mask_dir says: OUTPUT's folder / OUTPUT-STEM_masks."""
    output = Path(output)
    return output.parent / f"{output.stem}_masks"


def overlay_folder(output: Path, mask_dir: Path | None = None) -> Path:
    """Where the overlays go: the mask folder's sibling OUTPUT-STEM_overlays (beside --output
    when the masks' folder is the default, and for a detector, which writes no masks)."""
    output = Path(output)
    return (Path(mask_dir).parent if mask_dir is not None else output.parent) \
        / f"{output.stem}_overlays"


def default_overlay_dir(output: Path) -> Path:
    """Where the overlays go with the default mask folder: OUTPUT's folder /
    OUTPUT-STEM_overlays."""
    return overlay_folder(output)


def images_json_path(output: Path) -> Path:
    """--output_format coco: where the images' ids, file names and sizes (and the categories)
    go: beside OUTPUT, OUTPUT-STEM_images.json."""
    output = Path(output)
    return output.parent / f"{output.stem}_images.json"


def outputs_beside(output: Path, *, masks: bool, mask_dir: Path | None, overlay: bool,
                   coco: bool) -> tuple[dict[str, Path], dict[str, Path]]:
    """What an image model's --input writes besides --output and --errors, for the path checks:
    (files, folders), each keyed as check_paths' paths are, by the flag that names it; those
    the tool chose beside --output are keyed `--output (its ...)`. `masks`: a segmenter's mask
    folder (`mask_dir`, else its default); `overlay`: the overlay folder; `coco`: a detector's
    COCO images file."""
    files, folders = {}, {}
    if coco:
        files[f"{BESIDE_OUTPUT} COCO images file)"] = images_json_path(output)
    if masks:
        if mask_dir is not None:
            folders["--mask_dir"] = Path(mask_dir)
        else:
            folders[f"{BESIDE_OUTPUT} mask folder)"] = default_mask_dir(output)
    if overlay:
        folders[f"{BESIDE_OUTPUT} overlay folder)"] = overlay_folder(output, mask_dir
                                                                     if masks else None)
    return files, folders
